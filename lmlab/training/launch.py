"""Starting a training job: in this process, or in one fresh process per device.

`lmlab-train parallel=ddp trainer.devices=2` on one machine checks everything and prepares the
tokenizer and token cache here, then spawns one new process per device (`run_processes`); each
runs `train` as one rank and the job returns rank 0's results. Fresh processes per job are what
make a Hydra multirun of distributed jobs work, and a rank that crashes ends the job with its
traceback. Under torchrun or SLURM (srun), which start the processes themselves, every process
runs `train` directly and Lightning reads its rank from the environment.
"""

from __future__ import annotations

import logging
import math
import os
import signal
from contextlib import contextmanager
from pathlib import Path

import torch.multiprocessing as mp

from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from omegaconf import DictConfig, OmegaConf

from lmlab.catalog import load_catalog
from lmlab.errors import ConfigError, RunInterrupted
from lmlab.parallel.launch import run_processes
from lmlab.parallel.strategies import PARALLEL
from lmlab.training.evaluation import eval_tasks
from lmlab.training.resume import resolve_auto_resume
from lmlab.training.run import check_parallel, load_data, preflight, train, uses_cuda

COLLECTIVE_TIMEOUT_S = 1800.0  # a rank stuck this long in one collective has lost its peers


def launched_externally() -> bool:
    return TorchElasticEnvironment.detect() or SLURMEnvironment.detect()


def launch(cfg: DictConfig, output_dir: str | Path) -> dict[str, float]:
    if not PARALLEL.build(cfg.parallel).distributed or launched_externally():
        return train(cfg, output_dir)  # this process is the job (or one rank of it); train checks everything
    cfg = resolve_auto_resume(cfg, Path(output_dir))  # once, so every rank resumes from the same checkpoint
    source, data_cfg = preflight(cfg)  # before any process starts
    parallel = check_parallel(cfg, data_cfg.batch_size)
    eval_tasks(cfg, parallel)  # e.g. a missing eval data path, or a strategy that leaves no rank the whole model
    if cfg.trainer.num_nodes > 1:
        raise ConfigError(f"trainer.num_nodes={cfg.trainer.num_nodes}: start one lmlab-train per node with torchrun "
                          "or srun (SLURM); lmlab starts processes on this machine only")
    load_data(cfg, source, data_cfg)  # train or tokenize once here, so the ranks find it all in the cache
    backend = parallel.backend_for(uses_cuda(cfg.trainer.accelerator))
    container = OmegaConf.to_container(cfg, resolve=True)
    with _signals_left_to_the_ranks():
        results = run_processes(_train_rank, cfg.trainer.devices, backend, args=(container, str(output_dir)),
                                timeout=COLLECTIVE_TIMEOUT_S, job_timeout=math.inf)
    if isinstance(results[0], RunInterrupted):
        raise results[0]
    return results[0]


@contextmanager
def _signals_left_to_the_ranks():
    """While the ranks run, they handle Ctrl-C and SIGTERM (save a checkpoint, then stop): Ctrl-C reaches
    them from the terminal directly, so this process ignores it; a SIGTERM sent to this process alone
    (a scheduler, `kill`) is passed on to them."""
    children = mp.active_children
    forward = lambda signum, frame: [os.kill(p.pid, signum) for p in children()]
    # A no-op handler rather than SIG_IGN, which the spawned ranks would inherit.
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, lambda signum, frame: None),
                signal.SIGTERM: signal.signal(signal.SIGTERM, forward)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _train_rank(rank: int, world_size: int, container: dict, output_dir: str) -> dict[str, float] | RunInterrupted:
    load_catalog(container.get("plugins", []))  # a fresh process: the config's plugins register again
    _log_like_the_job(rank, Path(output_dir))
    try:
        return train(OmegaConf.create(container), output_dir)
    except RunInterrupted as stopped:  # a planned stop, not a failure: returned for the parent to raise
        return stopped


def _log_like_the_job(rank: int, output_dir: Path) -> None:
    """A spawned rank has none of Hydra's logging set up: rank 0 logs as the job does, to the console
    and the job's train.log; the other ranks only warnings and errors."""
    handlers = [logging.StreamHandler()]
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)  # Hydra made it for lmlab-train; a direct call may not
        handlers.append(logging.FileHandler(output_dir / "train.log"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, handlers=handlers, force=True,
                        format=f"[%(asctime)s][%(name)s][%(levelname)s][rank {rank}] - %(message)s")
