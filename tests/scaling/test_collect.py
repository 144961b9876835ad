"""`lmlab scaling collect` reads the runs of tiny lmlab-train jobs into a points table."""

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lmlab.cli.main import main
from lmlab.cli.compose import compose_config
from lmlab.nn.transformer import Transformer
from lmlab.scaling import read_points
from lmlab.training import train
from tests.conftest import TINY


def _job(folder: Path, overrides: list[str]) -> Path:
    """A run folder as Hydra leaves it (its composed config and overrides), trained for 10 steps."""
    cfg = compose_config([*TINY, f"cache_dir={folder.parent / 'cache'}", "logger=csv", "trainer.max_steps=10",
                          "trainer.val_every=5", *overrides])
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    OmegaConf.save(overrides, folder / ".hydra" / "overrides.yaml")
    train(cfg, folder)
    return folder


def test_collect_gives_n_d_c_and_the_budget_of_each_validation(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for i, width in enumerate((32, 64)):
        _job(sweep / str(i), [f"model.d_model={width}"])
    (sweep / "2" / ".hydra").mkdir(parents=True)  # a job that never logged: skipped
    OmegaConf.save(compose_config(TINY), sweep / "2" / ".hydra" / "config.yaml")
    cfg = compose_config([*TINY, "model.d_model=64"])
    model = Transformer(cfg.model, 320)
    tokens_per_step = 8 * 32
    budget = model.flops_per_token(32) * tokens_per_step * 10  # the 64-wide run's planned compute

    assert main(["scaling", "collect", str(sweep), "--out", str(tmp_path / "points.csv"),
                 "--budgets", f"1e3,{budget:.6g}"]) == 0
    assert "points of 2 runs" in capsys.readouterr().out
    points = read_points(tmp_path / "points.csv")
    wide = [p for p in points if p.run.startswith(str(sweep / "1"))]
    assert [p.d for p in wide] == [5 * tokens_per_step, 10 * tokens_per_step]  # validations after steps 5 and 10
    assert wide[0].n == model.num_parameters(exclude_embeddings=True) and wide[0].n_total == model.num_parameters()
    assert wide[-1].c == pytest.approx(model.flops_per_token(32) * 10 * tokens_per_step)
    assert wide[-1].budget == pytest.approx(budget, rel=1e-5) and math.isnan(wide[0].budget)  # the end spent it
    assert all(math.isnan(p.budget) for p in points if p not in wide)  # the narrow run: no budget within 10%
    assert len({p.n for p in points}) == 2


def test_collect_of_a_folder_without_runs_is_one_clear_error(tmp_path, capsys):
    assert main(["scaling", "collect", str(tmp_path), "--out", str(tmp_path / "points.csv")]) == 2
    assert "no run under" in capsys.readouterr().err and not (tmp_path / "points.csv").exists()
