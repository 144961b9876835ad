"""The sweep generator: jobs that compose, spend their budget by lmlab's cost model, and (WSD) resume the
stable run's checkpoints."""

import math
import re
from pathlib import Path

import pytest
import torch

from lmlab.cli.compare import read_csv
from lmlab.cli.compose import compose_config
from lmlab.cli.info import cost_model
from lmlab.cli.main import main
from lmlab.errors import ConfigError
from lmlab.scaling.plan import CHINCHILLA, ShapeRule
from lmlab.scaling.sweep import isoflop_jobs, wsd_jobs
from lmlab.training import train
from tests.conftest import TINY

# The tiny run settings without its model shape, which the sweep sets.
BASE = [o for o in TINY if not o.startswith(("model.d_model", "model.n_layers", "model.attention.n_heads",
                                             "trainer.max_steps", "sched.warmup_steps"))] + ["model.vocab_size=320"]


def _planned(job) -> float:
    cfg = compose_config([*BASE, *(o for o in job.overrides if not o.startswith("ckpt_path="))])
    c = cost_model(cfg, 320)
    return c["flops_per_token"] * c["tokens_per_step"] * c["steps"]


@pytest.mark.parametrize("make", [isoflop_jobs, wsd_jobs])
def test_jobs_compose_and_spend_their_budget(make):
    cfg = compose_config(BASE)
    budgets = [3e11, 3e12]
    jobs = make(CHINCHILLA, budgets, 5, cfg, 320, rule=ShapeRule(aspect=32))
    for budget in budgets:
        sizes = {re.search(r"model.d_model=(\d+)", " ".join(j.overrides)).group(1) + str(j.overrides[1])
                 for j in jobs if j.budget == budget}
        assert len(sizes) >= 3
    for job in jobs:
        assert _planned(job) == pytest.approx(job.budget, rel=0.05)
        o = dict(o.split("=", 1) for o in job.overrides)
        assert 20 <= int(o["trainer.max_steps"]) // int(o["trainer.val_every"]) < 40  # about 20 validations a job


def test_wsd_decays_resume_checkpoints_that_the_stable_run_writes():
    jobs = wsd_jobs(CHINCHILLA, [3e11, 3e12], 4, compose_config(BASE), 320, rule=ShapeRule(aspect=32))
    stable = {j.name: dict(o.split("=", 1) for o in j.overrides) for j in jobs if j.after is None}
    for job in (j for j in jobs if j.after):
        o = dict(o.split("=", 1) for o in job.overrides)
        parent = stable[job.after]
        step = int(re.search(r"step(\d+)\.ckpt", o["ckpt_path"]).group(1))
        assert step == int(o["sched.decay_start"]) < int(o["trainer.max_steps"]) < int(parent["trainer.max_steps"])
        assert step % int(parent["trainer.checkpoint_every"]) == 0
        assert o["sched.warmup_steps"] == parent["sched.warmup_steps"]
        decay = 1 - step / int(o["trainer.max_steps"])
        assert decay == pytest.approx(0.2, abs=0.03)


def test_a_wsd_decay_runs_from_the_stable_runs_checkpoint(tmp_path, monkeypatch):
    # budgets a test trains in seconds, too small for a parabola's 3 sizes: this test is about resuming
    monkeypatch.setattr("lmlab.scaling.sweep.MIN_STEPS", 5)
    monkeypatch.setattr("lmlab.scaling.sweep._check_budget", lambda *args: None)
    jobs = wsd_jobs(CHINCHILLA, [3e9, 1.2e10], 4, compose_config(BASE), 320, rule=ShapeRule(aspect=32))
    name = min((j for j in jobs if j.after), key=lambda j: j.flops).after  # the smallest model's stable run
    stable = next(j for j in jobs if j.name == name)
    decay = next(j for j in jobs if j.after == name)
    base = [*BASE, f"cache_dir={tmp_path / 'cache'}", "logger=csv"]
    train(compose_config([*base, *stable.overrides]), tmp_path / stable.name)
    overrides = [o.replace("@RUN@", str(tmp_path)) for o in decay.overrides]
    results = train(compose_config([*base, *overrides]), tmp_path / decay.name)
    settings = dict(o.split("=", 1) for o in decay.overrides)
    ended = torch.load(tmp_path / decay.name / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ended["global_step"] == int(settings["trainer.max_steps"]) and math.isfinite(results["val_loss"])
    logged = read_csv(next((tmp_path / decay.name).rglob("metrics.csv")))["train/loss"]
    assert logged[0][0] >= int(settings["sched.decay_start"])  # it resumed the stable run rather than starting over


def test_too_small_a_budget_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="give 0 distinct lmlab model.*too small for the smallest model"):
        isoflop_jobs(CHINCHILLA, [1e6], 5, compose_config(BASE), 320)
    # models exist, but a large batch leaves the larger ones too few steps: the advice names the batch
    with pytest.raises(ConfigError, match="2 of the 3 models would train fewer steps: .* lower data.batch_size"):
        isoflop_jobs(CHINCHILLA, [3e11], 5, compose_config([*BASE, "data.batch_size=512"]), 320)
    assert main(["scaling", "sweep", "budgets=[3e11,1e12,3e12]", "n_sizes=5", "aspect=32", f"out={tmp_path}",
                 *BASE]) == 0
    script = (tmp_path / "sweep.sh").read_text()
    commands = [line.strip() for line in script.splitlines() if line.strip().startswith("lmlab-train ")]
    assert len(commands) == len(re.findall(r"^\S+\s+\S+ FLOPs", capsys.readouterr().out, re.M)) == 12
    assert all("hydra.run.dir=" in line and "model.d_model=" in line for line in commands)
    assert "lmlab scaling collect" in script


@pytest.mark.parametrize("parallel", [1, 3])
def test_the_script_runs_every_chain_in_order_and_reports_a_failure(tmp_path, parallel):
    """A stand-in lmlab-train records each job's folder; the one named in FAIL fails."""
    import os
    import subprocess

    from lmlab.scaling.sweep import script

    jobs = wsd_jobs(CHINCHILLA, [3e11, 3e12], 4, compose_config(BASE), 320, rule=ShapeRule(aspect=32))
    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin" / "lmlab-train"
    stub.write_text('#!/usr/bin/env bash\nfor a in "$@"; do case $a in hydra.run.dir=*) dir=${a#*=};; esac; done\n'
                    'sleep 0.05; echo "$dir" >> "$RECORD"; [ "$dir" != "$FAIL" ]\n')
    stub.chmod(0o755)
    (tmp_path / "sweep.sh").write_text(script(jobs, tmp_path / "out", [], parallel))
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "RECORD": str(tmp_path / "ran"), "FAIL": ""}
    assert subprocess.run(["bash", str(tmp_path / "sweep.sh")], env=env, capture_output=True).returncode == 0
    ran = [Path(line).relative_to(tmp_path / "out").as_posix() for line in (tmp_path / "ran").read_text().split()]
    assert sorted(ran) == sorted(j.name for j in jobs)
    for job in (j for j in jobs if j.after):
        assert ran.index(job.after) < ran.index(job.name)  # a decay after the stable run it resumes
    if parallel == 1:  # the costliest chain first: the largest budget's stable run of the most steps
        first = max((j for j in jobs if j.after is None), key=lambda j: (j.budget, j.steps))
        assert ran[0] == first.name
    (tmp_path / "ran").unlink()
    env["FAIL"] = str(tmp_path / "out" / jobs[0].name)  # a stable run fails: its decays do not run
    assert subprocess.run(["bash", str(tmp_path / "sweep.sh")], env=env, capture_output=True).returncode == 1
    ran = (tmp_path / "ran").read_text().split()
    assert not any(j.after == jobs[0].name and str(tmp_path / "out" / j.name) in ran for j in jobs)
