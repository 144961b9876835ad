"""Executors: where a pipeline's tasks run, a registry (`lmlab list executor`, `executor=ray` on the command line).

Both answer `map(fn, tasks, desc)`: fn(*task) for every task, results in the tasks' order, with a progress bar.
fn is a module-level function, so both can ship it to another process by reference.

- `local` (default): a multiprocessing pool on this machine (`workers`, 0: every core); one worker runs inline.
- `ray`: Ray tasks, on a local Ray started by `ray.init()` or an existing cluster (`address=ray://host:10001` or
  `auto`); `pip install 'lmlab[ray]'`. On a cluster of several machines, the pipeline's output folder must be
  on storage they share: tasks read and write their shards there.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.registry import Registry

EXECUTORS = Registry("executor", group="executor", doc="where a data pipeline's tasks run")


def _call(fn_and_task: tuple[Callable, Sequence]) -> Any:
    fn, task = fn_and_task
    return fn(*task)


@EXECUTORS.register("local")
class LocalExecutor:
    """A multiprocessing pool on this machine (fork), `workers` processes; with one, tasks run in this process."""

    @dataclass
    class Config:
        workers: int = 0  # 0: os.cpu_count()

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()
        if self.cfg.workers < 0:
            raise ConfigError(f"executor.workers must be >= 0 (0: every core), got {self.cfg.workers}")
        self.workers = self.cfg.workers or os.cpu_count() or 1

    def map(self, fn: Callable, tasks: Sequence[Sequence], desc: str) -> list:
        bar = tqdm(total=len(tasks), desc=desc, unit="task", leave=False, disable=not tasks)
        workers = min(self.workers, len(tasks))
        if workers <= 1:
            results = []
            for task in tasks:
                results.append(fn(*task))
                bar.update()
        else:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                results = []
                for result in pool.imap(_call, [(fn, task) for task in tasks]):
                    results.append(result)
                    bar.update()
        bar.close()
        return results


@EXECUTORS.register("ray")
class RayExecutor:
    """Ray tasks, one per pipeline task: a local Ray (`ray.init()`) or a running cluster at `address`."""

    @dataclass
    class Config:
        address: str | None = None  # None: start a local Ray; "auto" or ray://host:10001: join a cluster
        num_cpus: int | None = None  # of a local Ray (None: every core)
        cpus_per_task: float = 1.0

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()
        at_least("executor", self.cfg, 1, "num_cpus")
        if not self.cfg.cpus_per_task > 0:
            raise ConfigError(f"executor.cpus_per_task must be > 0, got {self.cfg.cpus_per_task}")
        if importlib.util.find_spec("ray") is None:
            raise ConfigError("executor=ray needs Ray: pip install 'lmlab[ray]'")

    def _ray(self):
        import ray

        if not ray.is_initialized():
            if self.cfg.address:
                ray.init(address=self.cfg.address, log_to_driver=False)
            else:
                ray.init(num_cpus=self.cfg.num_cpus, include_dashboard=False, log_to_driver=False)
        return ray

    def map(self, fn: Callable, tasks: Sequence[Sequence], desc: str) -> list:
        if not tasks:
            return []
        ray = self._ray()
        remote = ray.remote(num_cpus=self.cfg.cpus_per_task)(fn)
        refs = [remote.remote(*task) for task in tasks]
        pending = list(refs)
        with tqdm(total=len(refs), desc=desc, unit="task", leave=False) as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                bar.update(len(done))
        return ray.get(refs)
