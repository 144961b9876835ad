"""lmlab-compare finds runs whatever their logger wrote locally, and lists the failed jobs of a sweep."""

import re
from pathlib import Path

from omegaconf import OmegaConf
from torch.utils.tensorboard import SummaryWriter

from lmlab.cli.compare import find_runs, main
from lmlab.cli.compare_over import group_curves, group_runs
from lmlab.training import train


def _cells(table: str) -> list[list[str]]:
    """A markdown table's cells, row by row (an escaped "\\|" stays in its cell), without the rule line."""
    rows = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in table.splitlines()]
    return [rows[0], *rows[2:]]


def _job(folder: Path, overrides: list[str]) -> Path:
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(overrides, folder / ".hydra" / "overrides.yaml")
    return folder


def test_csv_tensorboard_mlflow_and_failed_jobs_in_one_table(make_cfg, tiny_overrides, tmp_path, capsys):
    sweep = tmp_path / "sweep"
    csv_run = _job(sweep / "0", ["logger=csv"])
    results = train(make_cfg([*tiny_overrides, "logger=csv", "trainer.max_steps=10", "trainer.val_every=5"]), csv_run)

    failed = _job(sweep / "1", ["logger=tensorboard"])
    (failed / "error.txt").write_text("alibi needs attention that adds a bias | softmax\nTraceback ...\n")

    named = _job(sweep / "2", ["logger=tensorboard"])  # a sweep's run writes into tb/<its overrides>/
    with SummaryWriter(named / "tb" / "model.norm=layernorm") as events:
        for step, loss in [(5, 4.0), (10, 3.5)]:
            events.add_scalar("val/loss", loss, step)

    metrics = _job(sweep / "3", ["logger=mlflow"]) / "mlruns" / "1" / "0123abcd" / "metrics"
    (metrics / "val").mkdir(parents=True)
    (metrics / "val" / "loss").write_text("1700000000000 3.25 5\n1700000000001 3.0 10\n")

    assert main([str(sweep)]) == 0
    header, *cells = _cells(capsys.readouterr().out.split("\n\n")[0])
    assert header == ["run", "logger", "train/loss", "val/loss", "val/bpb", "tokens/s", "failed"]
    assert [c[0] for c in cells] == ["0", "1", "2", "3"]
    assert cells[0][2:5] == [f"{results['train_loss']:.4f}", f"{results['val_loss']:.4f}", f"{results['val_bpb']:.4f}"]
    assert cells[1][3] == "-" and cells[1][-1] == "alibi needs attention that adds a bias \\| softmax"
    assert (cells[2][3], cells[3][3]) == ("3.5000", "3.0000") and cells[0][-1] == ""
    assert "epoch" not in find_runs(sweep)[0].scalars
    assert (sweep / "val_loss.png").stat().st_size > 10_000 and (sweep / "comparison.md").is_file()


def test_only_failed_jobs_are_listed_with_exit_status_0_and_no_plot(tmp_path, capsys):
    (_job(tmp_path / "0", ["model/position=alibi"]) / "error.txt").write_text("alibi cannot be used here\n")
    _job(tmp_path / "1", ["model/position=rope"])  # no logs, no error: not a run (yet)
    assert main([str(tmp_path)]) == 0
    assert _cells(capsys.readouterr().out.split("\n\n")[0]) == [
        ["run", "model/position", "train/loss", "val/loss", "val/bpb", "tokens/s", "failed"],
        ["0", "alibi", "-", "-", "-", "-", "alibi cannot be used here"]]
    assert not (tmp_path / "val_loss.png").exists()


def test_over_seed_makes_one_row_and_one_mean_curve_per_setting(tmp_path, capsys):
    finals = {("bf16-mixed", "0"): 2.0, ("bf16-mixed", "1"): 2.2, ("bf16-true", "0"): 3.0, ("bf16-true", "1"): 3.4}
    for i, ((precision, seed), loss) in enumerate(finals.items()):
        run = _job(tmp_path / str(i), [f"trainer.precision={precision}", f"seed={seed}"])
        with SummaryWriter(run / "tb") as events:
            for step, value in [(5, loss + 1), (10, loss)]:
                events.add_scalar("val/loss", value, step)
    (_job(tmp_path / "4", ["trainer.precision=bf16-true", "seed=2"]) / "error.txt").write_text("out of memory\n")

    assert main([str(tmp_path), "--over", "seed"]) == 0
    header, *cells = _cells(capsys.readouterr().out.split("\n\n")[0])
    assert header == ["trainer.precision", "runs", "train/loss", "val/loss", "val/bpb",
                      "val/loss less the first's, same seed", "tokens/s", "failed"]
    # mean ± sample standard deviation of the final values; the failed run counts, but has no value; paired by
    # seed, bf16-true's runs are 1.0 and 1.2 above bf16-mixed's
    assert cells == [["bf16-mixed", "2", "-", "2.1000 ± 0.1414", "-", "+0.0000 ± 0.0000", "-", "0"],
                     ["bf16-true", "3", "-", "3.2000 ± 0.2828", "-", "+1.1000 ± 0.1414", "-", "1"]]
    assert (tmp_path / "val_loss.png").stat().st_size > 10_000
    # the plot's lower panel: each run less the first setting's run of the same seed
    curves = group_curves(group_runs(find_runs(tmp_path), ["seed"]), ["seed"], "val/loss")
    mixed, true = curves["trainer.precision=bf16-mixed"], curves["trainer.precision=bf16-true"]
    steps, differences = true.less(mixed)
    assert steps == [5, 10] and [[round(d, 4) for d in ds] for ds in differences] == [[1.0, 1.2], [1.0, 1.2]]

    assert main([str(tmp_path), "--over", "model.d_model"]) == 2
    error = capsys.readouterr().err
    assert "--over model.d_model: no run sets it; the runs' overrides: seed, trainer.precision" in error
