"""lmlab-compare's plots, from runs built in the test."""

from pathlib import Path

from lmlab.cli.compare import Run, plot, plot_expert_load


def _run(path: Path, overrides: dict, moe: bool) -> Run:
    scalars = {"val/loss": [(0, 5.0), (10, 4.0)]}
    if moe:
        for layer in ("layers.0", "layers.1"):
            for e in range(4):
                scalars[f"moe/{layer}/load/expert{e}"] = [(0, 0.25), (10, 0.1 + 0.1 * e)]
    return Run(path, overrides, scalars)


def test_expert_load_grid_is_written_for_moe_runs_only(tmp_path):
    runs = [_run(tmp_path / "0", {"model/moe": "topk"}, moe=True), _run(tmp_path / "1", {"model/moe": "null"}, moe=False)]
    png = plot_expert_load(runs, tmp_path / "expert_load.png")
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert plot_expert_load(runs[1:], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    assert plot(runs, tmp_path / "val_loss.png").stat().st_size > 10_000
