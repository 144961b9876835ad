"""What every Hydra console script of lmlab does around its jobs.

Before Hydra runs: check the config tree is there and compose every job's config once
(`lmlab.cli.compose.check_jobs`), so a misspelt name, key or value is one line on stderr and
exit status 2 before any job starts; so is a sweep job that fails the script's `check_job` (lmlab-train's:
the task's cross-field checks), named. While a job runs: a `ConfigError` is one line and exit status 2;
a `RunInterrupted` (Ctrl-C, SIGTERM) prints how to resume and exits with its status,
which also ends a sweep. In a sweep (-m) whose jobs run in this process, a job that fails writes
`error.txt` into its folder and the sweep goes on with the next job; at the end the failed jobs
are listed and the exit status is 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from lmlab.atomic import atomic_write_text
from lmlab.cli.compose import check_jobs
from lmlab.cli.overrides import CONF_DIR
from lmlab.errors import STOP_SIGNALS, ConfigError, RunInterrupted

ERROR_FILE = "error.txt"  # in a failed sweep job's folder; lmlab-compare lists such runs as failed

log = logging.getLogger(__name__)


def fail(prog: str, err: Exception) -> None:
    print(f"{prog}: error: {err}", file=sys.stderr)
    raise SystemExit(2)


def record_failure(err: Exception, output_dir: str | Path) -> str:
    """Write `error.txt` into the job's folder and log it: the one-line error first, then (for an error
    that is not a `ConfigError`) the traceback. Returns the one-line error."""
    if isinstance(err, ConfigError):
        text = str(err).strip() or type(err).__name__
    else:
        headline = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        text = f"{headline}\n{''.join(traceback.format_exception(err))}"
    line = text.strip().splitlines()[0]
    atomic_write_text(Path(output_dir) / ERROR_FILE, text.rstrip("\n") + "\n")
    log.error("job failed: %s", text)
    return line


def stop_if_signalled(prog: str, where: str) -> None:
    """End the sweep where a job took a stop signal too late to stop itself (in its last step or validation: it
    finished), with the signal's exit status, as a signal during a step does."""
    if STOP_SIGNALS:
        received = signal.Signals(STOP_SIGNALS[0])
        print(f"{prog}: {received.name} received while a job finished its last step; the sweep stops {where}",
              file=sys.stderr)
        raise SystemExit(128 + received.value)


def run_hydra_app(prog: str, config_name: str, job: Callable[[DictConfig, str], object], argv: list[str],
                  check_job: Callable[[DictConfig], object] | None = None) -> None:
    """Run `job(cfg, output_dir)` for each job Hydra composes from `argv` (one, or a sweep with -m), after
    `check_job(cfg)` on each job of a sweep (a single job's own checks run as it starts)."""
    if not (CONF_DIR / f"{config_name}.yaml").is_file():
        fail(prog, ConfigError(f"no config tree at {CONF_DIR}; install lmlab from its checkout with `pip install -e .`"))
    try:
        check_jobs(argv, config_name, check_job)
    except ConfigError as err:
        fail(prog, err)
    started: list[str] = []  # job folders
    failures: list[tuple[str, str]] = []  # (job folder, one-line error)
    this_process = os.getpid()

    sweeping: list[int] = []  # the sweep's job numbers, as they start (none for a single run)
    STOP_SIGNALS.clear()

    @hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")
    def _job(cfg: DictConfig):
        hydra_cfg = HydraConfig.get()
        output_dir = hydra_cfg.runtime.output_dir
        if hydra_cfg.mode == RunMode.MULTIRUN:
            sweeping.append(hydra_cfg.job.num)
            stop_if_signalled(prog, f"before job #{hydra_cfg.job.num}")
        started.append(output_dir)
        try:
            return job(cfg, output_dir)
        except RunInterrupted as stopped:
            print(stopped, file=sys.stderr)
            raise SystemExit(stopped.exit_code) from None
        except Exception as err:
            if hydra_cfg.mode != RunMode.MULTIRUN:
                if isinstance(err, ConfigError):
                    fail(prog, err)
                raise
            line = record_failure(err, output_dir)
            if os.getpid() != this_process:
                raise  # a launcher that runs jobs elsewhere (SLURM) reports the failure itself
            failures.append((output_dir, line))
            return None

    sys.argv = [prog, *argv]
    try:
        _job()
    finally:  # also when Ctrl-C ends the sweep
        if failures:
            lines = [f"{prog}: error: {len(failures)} of {len(started)} jobs failed (each folder has {ERROR_FILE}):"]
            print("\n".join(lines + [f"  {folder}: {line}" for folder, line in failures]), file=sys.stderr)
    if sweeping:
        stop_if_signalled(prog, "after its last job")
    if failures:
        raise SystemExit(1)
