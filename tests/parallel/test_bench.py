"""`lmlab bench parallel` on a tiny model: one row per strategy; ZeRO-1 halves the optimizer state per rank."""

import json

from lmlab.parallel.bench import main


def test_bench_parallel_reports_every_strategy(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq", "16", "--batch", "4", "--steps", "3",
            "--strategies", "single", "ddp", "zero1", "fsdp", "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in ("single", "ddp", "zero1", "fsdp"))
    rows = json.loads(out.read_text())["strategies"]
    full = rows["single"]["optimizer_state_mb"][0]
    for sharded in ("zero1", "fsdp"):
        assert abs(sum(rows[sharded]["optimizer_state_mb"]) - full) < 1e-6
        assert max(rows[sharded]["optimizer_state_mb"]) < 0.7 * full
    assert rows["ddp"]["optimizer_state_mb"] == [full, full]
