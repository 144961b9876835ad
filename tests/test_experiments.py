"""Every named study in conf/experiment/ composes and trains for a couple of steps."""

from pathlib import Path

import pytest

from lmlab.cli.overrides import CONF_DIR
from lmlab.training import train

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def test_there_are_experiments():
    assert EXPERIMENTS


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_runs(name, make_cfg, tmp_path: Path):
    cfg = make_cfg([f"experiment={name}", "trainer.max_steps=2", "trainer.val_every=1", "trainer.val_batches=1",
                    "sched.warmup_steps=1", "data.batch_size=2", "trainer.progress_bar=false",
                    f"cache_dir={tmp_path / 'cache'}"])
    results = train(cfg, tmp_path / "run")
    assert results["val_loss"] < results["initial_val_loss"] + 1.0
