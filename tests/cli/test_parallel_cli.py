"""Distributed jobs from the command line, in fresh processes as a user runs them."""

import pytest

from lmlab.cli.compare import find_runs
from tests.conftest import run_cli

pytestmark = pytest.mark.slow

SHORT = ["trainer.max_steps=6", "trainer.val_every=6", "sched.warmup_steps=1"]


def test_multirun_of_two_ddp_jobs_with_two_processes_each(tiny_overrides, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(["lmlab-train", "-m", "parallel=ddp,bucketed_ddp", "trainer.devices=2", *tiny_overrides, *SHORT,
                    f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r.overrides["parallel"]: r for r in find_runs(sweep)}
    assert set(runs) == {"ddp", "bucketed_ddp"}
    for run in runs.values():
        assert (run.path / "checkpoints" / "last.ckpt").is_file()
    # Same global batches and the same averaged gradients: the two strategies train the same model.
    assert runs["ddp"].final("val/loss") == pytest.approx(runs["bucketed_ddp"].final("val/loss"), abs=1e-4)


def test_a_crashing_rank_ends_the_job_with_its_traceback(tiny_overrides, tmp_path):
    plugin = tmp_path / "crash_on_rank1.py"
    plugin.write_text(
        "import os\n"
        "from lmlab.training.losses import LOSSES, CrossEntropy\n\n"
        "@LOSSES.register('crash_on_rank1')\n"
        "class CrashOnRank1(CrossEntropy):\n"
        "    '''Cross-entropy that fails on rank 1.'''\n"
        "    class Config(CrossEntropy.Config):\n"
        "        pass\n\n"
        "    def forward(self, logits, targets):\n"
        "        if os.environ.get('RANK') == '1':\n"
        "            raise RuntimeError('rank 1 went wrong on purpose')\n"
        "        return super().forward(logits, targets)\n")
    proc = run_cli(["lmlab-train", "parallel=ddp", "trainer.devices=2", "plugins=[crash_on_rank1]",
                    "loss=crash_on_rank1", *tiny_overrides, *SHORT, f"hydra.run.dir={tmp_path / 'run'}"],
                   cwd=tmp_path, env_extra={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode != 0
    assert "rank 1 of 2 failed" in proc.stderr and "rank 1 went wrong on purpose" in proc.stderr
