"""Ctrl-C on lmlab-train: a checkpoint, exit status 130 and a command that resumes the run."""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY, run_cli

pytestmark = pytest.mark.slow


def test_ctrl_c_saves_and_prints_the_command_that_resumes_in_place(tmp_path):
    run = tmp_path / "run"
    args = [*TINY, "trainer.max_steps=2000", "trainer.log_every=1", f"cache_dir={tmp_path / 'cache'}",
            f"hydra.run.dir={run}"]
    script = Path(sys.executable).parent / "lmlab-train"
    proc = subprocess.Popen([str(script), *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not (run / "train.log").is_file() or "step 3/2000" not in (run / "train.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "stopped by SIGINT after step" in stderr and "Traceback" not in stderr
    command = stderr.split("resume with:\n", 1)[1].strip().splitlines()[0]
    assert "ckpt_path=auto" in command and f"hydra.run.dir={run}" in command
    resume = shlex.split(command)
    assert resume[0] == "lmlab-train"
    finished = run_cli([*resume, "trainer.max_steps=12"], cwd=tmp_path)  # a shorter goal, to finish quickly
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "resuming from" in finished.stdout + finished.stderr
