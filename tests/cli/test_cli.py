"""The console scripts, run in fresh processes exactly as a user runs them."""

import os
import textwrap

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lmlab.cli.compare import find_runs
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_multirun_two_jobs_then_compare(tiny_overrides, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(["lmlab-train", "-m", "model/norm=rmsnorm,layernorm", *tiny_overrides, f"hydra.sweep.dir={sweep}"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    for job, norm in zip(jobs, ["rmsnorm", "layernorm"]):
        tb = EventAccumulator(str(sweep / job / "tb" / f"model.norm={norm}"))  # TensorBoard's run: 0/tb/model.norm=...
        tb.Reload()
        assert {"train/loss", "val/loss", "val/bpb", "val/ppl", "lr", "perf/tokens_per_s"} <= set(tb.Tags()["scalars"])
        assert tb.PluginTagToContent("hparams")  # the HParams tab has this run

    # Each job starts clean: job 1 of the sweep equals the same config run alone in a new process.
    single = tmp_path / "single"
    proc = run_cli(["lmlab-train", "model/norm=layernorm", *tiny_overrides, f"hydra.run.dir={single}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (alone,) = find_runs(single)
    swept = {r.overrides["model/norm"]: r for r in find_runs(sweep)}
    assert swept["layernorm"].final("val/loss") == alone.final("val/loss")
    assert swept["rmsnorm"].final("val/loss") != alone.final("val/loss")

    proc = run_cli(["lmlab-compare", str(sweep)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    header, _, *rows = proc.stdout.splitlines()[:4]
    assert "model/norm" in header and "val/bpb" in header and "tokens/s" in header
    assert "rmsnorm" in rows[0] and "layernorm" in rows[1]
    assert (sweep / "val_loss.png").stat().st_size > 10_000 and (sweep / "comparison.md").is_file()


def test_plugin_norm_selected_from_command_line(tiny_overrides, tmp_path):
    plugin_dir = tmp_path / "my_plugins"
    plugin_dir.mkdir()
    (plugin_dir / "scaled_norm.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        import torch
        from torch import nn
        from lmlab.nn import NORMS

        @NORMS.register("scalenorm")
        class ScaleNorm(nn.Module):
            """ScaleNorm: one learned scale over the L2-normalised vector."""
            @dataclass
            class Config:
                eps: float = 1e-5
            def __init__(self, dim, cfg):
                super().__init__()
                self.g = nn.Parameter(torch.tensor(dim ** 0.5))
                self.eps = cfg.eps
            def forward(self, x):
                print("SCALENORM_USED", flush=True) if not hasattr(self, "_seen") else None
                self._seen = True
                return self.g * x / x.norm(dim=-1, keepdim=True).clamp_min(self.eps)
    '''))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_dir), os.environ.get("PYTHONPATH")]))}
    args = ["lmlab-train", "plugins=[scaled_norm]", "model/norm=scalenorm", "model.norm.eps=1e-4",
            *tiny_overrides, "trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_cli(args, cwd=tmp_path, env_extra=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SCALENORM_USED" in proc.stdout
    assert "name: scalenorm" in (tmp_path / "run" / ".hydra" / "config.yaml").read_text()

    listed = run_cli(["lmlab", "list", "norm", "--plugin", "scaled_norm"], cwd=tmp_path, env_extra=env)
    assert "scalenorm" in listed.stdout and "eps: float = 1e-05" in listed.stdout


def test_unknown_choice_names_the_closest_entry_and_exits_2(tmp_path):
    proc = run_cli(["lmlab-train", "model/norm=rmsnrom"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "unknown choice for config group 'model/norm' 'rmsnrom'. Did you mean 'rmsnorm'?" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "outputs").exists()
    sweep = run_cli(["lmlab-train", "-m", "model/ffn=swiglu,gelux"], cwd=tmp_path)
    assert sweep.returncode == 2 and "Did you mean 'gelu'?" in sweep.stderr
    missing = run_cli(["lmlab-train", "plugins=[not_a_module_anywhere]"], cwd=tmp_path)
    assert missing.returncode == 2 and "plugin module 'not_a_module_anywhere' was not found" in missing.stderr


@pytest.mark.parametrize("args, message", [
    (["+model/nrom=layernorm"], "unknown config group 'model/nrom'. Did you mean 'model/norm'?"),
    (["-m", "optim.lr=1e-3,2e-3", "optim.lrr=1e-3"], "unknown key 'optim.lrr'. Did you mean 'optim.lr'?"),
])
def test_unknown_group_or_key_exits_2_with_one_line_before_any_job(tmp_path, args, message):
    proc = run_cli(["lmlab-train", *args], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"lmlab-train: error: {message}")
    assert not (tmp_path / "outputs").exists()


def test_a_sweep_job_that_fails_its_checks_stops_the_sweep_before_any_job(tiny_overrides, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(["lmlab-train", "-m", "model/position=rope,alibi,nope", "model/attention=linear", *tiny_overrides,
                    "trainer.max_steps=6", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("lmlab-train: error: job #1 (model/position=alibi): model/position=alibi adds a bias")
    assert not sweep.exists()


def test_a_failed_sweep_job_is_recorded_and_the_sweep_goes_on(tiny_overrides, tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "1" / "tb").mkdir(parents=True)
    (sweep / "1" / "tb" / "events").write_text("")  # an earlier run's: job 1 fails as it starts, in its folder
    proc = run_cli(["lmlab-train", "-m", "seed=0,1,2", *tiny_overrides, "trainer.max_steps=6",
                    f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (sweep / "1" / "error.txt").read_text().startswith(f"{sweep / '1'} already holds a run (tb/)")
    assert (sweep / "0" / "checkpoints" / "last.ckpt").is_file() and (sweep / "2" / "checkpoints" / "last.ckpt").is_file()
    assert "1 of 3 jobs failed" in proc.stderr and f"  {sweep / '1'}: {sweep / '1'} already holds" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_value_exits_2_with_one_message(tiny_overrides, tmp_path):
    proc = run_cli(["lmlab-train", *tiny_overrides, "data.context_length=64"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("lmlab-train: error: data.context_length=64 is larger")


def test_lmlab_list_all_and_one_group(tmp_path):
    everything = run_cli(["lmlab", "list"], cwd=tmp_path).stdout
    for group in ("norm", "ffn", "position", "attention", "block", "tokenizer", "data", "optim", "sched", "loss"):
        assert f"\n{group}  (config group" in f"\n{everything}"
    one = run_cli(["lmlab", "list", "model/norm"], cwd=tmp_path)
    assert one.stdout.startswith("norm  (config group 'model/norm'") and "rmsnorm" in one.stdout
    assert "ffn" not in one.stdout
    bad = run_cli(["lmlab", "list", "nrom"], cwd=tmp_path)
    assert bad.returncode == 2 and "Did you mean 'norm'?" in bad.stderr
