"""`lmlab bench parallel` on a tiny model: one row per strategy; ZeRO-1, FSDP2, lmlab's FSDP and tensor
parallelism halve the optimizer state per rank; a strategy that runs out of memory is a row saying so."""

import json

import pytest
import torch

from lmlab.parallel import bench
from lmlab.parallel.bench import main


@pytest.mark.slow  # eight process groups, one per strategy: about 90 s on 2 CPU cores
def test_bench_parallel_reports_every_strategy(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq", "16", "--batch", "4", "--steps", "3",
            "--strategies", "single", "ddp", "zero1", "fsdp", "zero3", "tp", "pp", "cp", "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in ("single", "ddp", "zero1", "fsdp", "zero3", "tp", "pp", "cp"))
    rows = json.loads(out.read_text())["strategies"]
    full = rows["single"]["optimizer_state_mb"][0]
    for sharded in ("zero1", "fsdp", "zero3"):
        assert abs(sum(rows[sharded]["optimizer_state_mb"]) - full) < 1e-6
        assert max(rows[sharded]["optimizer_state_mb"]) < 0.7 * full
    assert rows["ddp"]["optimizer_state_mb"] == [full, full]
    assert rows["single"]["comm_ms"] == [0.0] and all(min(rows[name]["comm_ms"]) > 0 for name in ("ddp", "fsdp", "tp"))
    # tensor parallelism splits every matrix and the vocabulary; only the norms' weights are held twice
    assert max(rows["tp"]["optimizer_state_mb"]) < 0.7 * full
    # a pipeline stage keeps only its layers: the embedding on the first, the head on the last
    assert max(rows["pp"]["optimizer_state_mb"]) < 0.7 * full and rows["pp"]["world_size"] == 2
    assert rows["cp"]["optimizer_state_mb"] == [full, full] and min(rows["cp"]["comm_ms"]) > 0  # whole weights


def test_bench_parallel_spreads_experts_over_the_ranks(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq", "16", "--batch", "4", "--steps", "3",
            "--experts", "4", "--top-k", "1", "--vocab", "64", "--strategies", "ddp", "ep", "--json", str(out)]
    assert main(args) == 0
    rows = json.loads(out.read_text())["strategies"]
    assert max(rows["ep"]["optimizer_state_mb"]) < 0.7 * rows["ddp"]["optimizer_state_mb"][0]  # half the experts
    assert min(rows["ep"]["comm_ms"]) > 0


TINY = {"d_model": 32, "n_layers": 1, "max_seq_len": 16, "norm": "rmsnorm", "ffn": "swiglu", "position": "rope",
        "attention": {"name": "mha", "n_heads": 2}, "block": "prenorm"}


def test_a_rank_out_of_memory_reports_it_instead_of_raising(monkeypatch):
    def too_big(model):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB\nmore details")

    monkeypatch.setitem(bench.STRATEGIES, "single", too_big)
    result = bench._bench_rank(0, 1, "single", TINY, 64, 2, 16, 3, "gloo", 2)
    assert result == {"out_of_memory": "CUDA out of memory. Tried to allocate 64.00 GiB"}


def test_single_runs_the_global_batch_in_micro_batches_of_one_ranks_share(monkeypatch):
    """Scaling compares equal work per GPU: `single` does all 4 sequences of each step as 2
    forwards of 2, what each of 2 ranks holds."""
    seen = []

    class Recorder(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            seen.append(ids.shape[0])
            return self.model(ids)

    plain = bench.STRATEGIES["single"]
    monkeypatch.setitem(bench.STRATEGIES, "single", lambda model: (Recorder(model), *plain(model)[1:]))
    result = bench._bench_rank(0, 1, "single", TINY, 64, 4, 16, 3, "gloo", 2)
    assert seen == [2, 2] * 4 and result["step_s"] > 0  # 3 timed steps, then 1 profiled for its communication


def test_strategies_that_ran_out_of_memory_are_rows_and_the_rest_still_run(monkeypatch):
    """The FSDP-fits case: single and ddp run out of memory, fsdp trains; no scaling efficiency
    without a single-process figure."""
    calls = []

    def fake_run_processes(fn, world, backend, args):
        calls.append(args[0])
        assert args[-1] == 1  # the micro-batch: the global batch of 2 over 2 ranks
        if args[0] in ("single", "ddp"):
            return [{"out_of_memory": "CUDA out of memory."}] * world
        return [{"step_s": 2.0, "peak_mb": 70_000.0, "optimizer_state_mb": 32_000.0, "comm_ms": 5.0}] * world

    monkeypatch.setattr(bench, "run_processes", fake_run_processes)
    result = bench.run(["single", "ddp", "fsdp"], 2, TINY, batch=2, seq=16, steps=3, vocab=64)
    assert calls == ["single", "ddp", "fsdp"]
    rows = result["strategies"]
    assert rows["single"] == {"world_size": 1, "out_of_memory": "CUDA out of memory."}
    assert rows["fsdp"]["tokens_per_s_per_rank"] == 2 * 16 / 2 / 2.0 and "scaling_efficiency" not in rows["fsdp"]
    text = bench.report(result)
    assert "single            1   out of memory: CUDA out of memory." in text
    assert "32000.0/32000.0" in text and "5.0/5.0" in text


def test_bare_command_runs_every_strategy_the_model_allows():
    assert "ep" not in bench.parse_args([]).strategies  # a dense model: nothing for expert parallelism to spread
    assert bench.parse_args([]).strategies == [name for name in bench.STRATEGIES if name != "ep"]
    assert "ep" in bench.parse_args(["--experts", "4"]).strategies
    with pytest.raises(SystemExit):
        bench.parse_args(["--strategies", "ep"])
