"""Run a function in several processes that form one torch.distributed group, and fail loudly.

    results = run_processes(fn, world_size=2)   # fn(rank, world_size, *args) in each process

Each rank is a fresh process (spawn, never fork: a forked copy of a parent that has started
torch's thread pools can deadlock). The parent waits for every rank's return value. If any rank
raises, the parent terminates the others, which may be blocked in a collective that will never
complete, and raises `RankFailedError` carrying that rank's traceback text. A rank that dies
without a traceback (gloo aborts a process whose collectives do not match its peers', a segfault,
`os._exit`) is named as the cause instead, and a job that outlives `timeout` raises TimeoutError.
So a crash ends the job with its cause instead of hanging.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The device each backend communicates from: gloo works on CPU tensors, NCCL on CUDA tensors.
DEVICE_OF_BACKEND = {"gloo": "cpu", "nccl": "cuda"}


class RankFailedError(RuntimeError):
    """A rank of `run_processes` raised or died; the message holds its traceback."""

    def __init__(self, rank: int, world_size: int, details: str):
        super().__init__(f"rank {rank} of {world_size} failed:\n{details}")
        self.rank = rank
        self.details = details


def free_port() -> int:
    """A TCP port that is free now (the OS picks it), for the rendezvous of one job."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_for(backend: str, rank: int) -> torch.device:
    """The device a rank computes and communicates on: its own GPU under NCCL, else the CPU."""
    if backend not in DEVICE_OF_BACKEND:
        raise ValueError(f"unknown backend '{backend}'; use one of: {', '.join(DEVICE_OF_BACKEND)}")
    return torch.device("cuda", rank) if DEVICE_OF_BACKEND[backend] == "cuda" else torch.device("cpu")


def _worker(rank: int, world_size: int, backend: str, port: int, timeout: float, results: Any,
            fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    try:
        device = device_for(backend, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # ranks share the CPU: each taking every core would oversubscribe it world_size times
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        # Plain pickle copies tensors by value; torch's queue pickler would share their memory,
        # which the parent could only read while this process is still alive.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    # Flush the message before tearing the group down: peers notice this rank leaving only after
    # that, so the first failure the parent reads is the cause, not its echo in the other ranks.
    results.close()
    results.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()


def _stop(processes: Sequence[mp.Process]) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def run_processes(fn: Callable[..., Any], world_size: int, backend: str = "gloo", args: tuple = (),
                  timeout: float = 600.0, job_timeout: float | None = None) -> list[Any]:
    """Call `fn(rank, world_size, *args)` in `world_size` processes of one process group; return
    their results in rank order.

    `fn` and `args` must be picklable (a module-level function, not a lambda), and so must the
    results. Under NCCL rank r uses GPU r. `timeout` (seconds) bounds each collective and, unless
    `job_timeout` says otherwise (None: `timeout`; math.inf: no bound), the whole job.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    device_for(backend, 0)  # an unknown backend fails here, before any process starts
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    processes = [ctx.Process(target=_worker, args=(rank, world_size, backend, port, timeout, results, fn, args),
                             name=f"lmlab-rank{rank}") for rank in range(world_size)]
    reports: dict[int, tuple[bool, Any]] = {}  # rank -> (succeeded, pickled result or traceback text)
    start = time.monotonic()
    deadline = start + (timeout if job_timeout is None else job_timeout)
    try:
        for p in processes:
            p.start()
        while len(reports) < world_size:
            _read_reports(results, reports, wait=0.2)
            if any(not ok for ok, _ in reports.values()) or _ended_silently(processes, results, reports):
                raise _failure(processes, results, reports, world_size)
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(reports))
                raise TimeoutError(f"run_processes: rank(s) {missing} of {world_size} gave no result within "
                                   f"{deadline - start:g} s; all ranks were terminated")
        for p in processes:  # every rank has reported; give each a moment to exit cleanly
            p.join(timeout=min(max(1.0, deadline - time.monotonic()), 60.0))
    finally:
        _stop(processes)
    return [pickle.loads(reports[rank][1]) for rank in range(world_size)]


def _read_reports(results: Any, reports: dict[int, tuple[bool, Any]], wait: float) -> None:
    """Read the reports that are there, waiting up to `wait` seconds for the first."""
    try:
        while True:
            rank, ok, payload = results.get(timeout=wait)
            reports[rank] = (ok, payload)
            wait = 0.01
    except queue.Empty:
        pass


def _unreported_exits(processes: Sequence[mp.Process], reports: dict[int, tuple[bool, Any]]) -> list[int]:
    # Exit code 0 is a worker that returned through `_worker`, which reports first: its report is
    # still in the queue, not missing.
    return [rank for rank, p in enumerate(processes) if rank not in reports and p.exitcode not in (None, 0)]


def _ended_silently(processes: Sequence[mp.Process], results: Any, reports: dict[int, tuple[bool, Any]]) -> bool:
    """Whether a rank's process ended without reporting (a crash in native code, a signal, `os._exit`)."""
    if not _unreported_exits(processes, reports):
        return False
    _read_reports(results, reports, wait=1.0)  # it may have reported just before exiting
    return bool(_unreported_exits(processes, reports))


def _exit_text(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def _failure(processes: Sequence[mp.Process], results: Any, reports: dict[int, tuple[bool, Any]],
             world_size: int) -> RankFailedError:
    """The error for the rank most likely to have caused the failure.

    A rank that crashes outside Python (gloo aborts the process on a mismatched collective) reports
    nothing, and its peers then fail with "connection reset": so a rank that ended silently is named
    as the cause, with the first traceback that followed.
    """
    for p in processes:  # the crashed rank may still be exiting as its peers' errors arrive
        p.join(timeout=0.5 / len(processes))
    _read_reports(results, reports, wait=0.1)  # reports sent while they exited
    failed = [(rank, text) for rank, (ok, text) in reports.items() if not ok]
    silent = _unreported_exits(processes, reports)
    if not silent:
        rank, text = failed[0]
        return RankFailedError(rank, world_size, text)
    rank = silent[0]
    details = (f"the process {_exit_text(processes[rank].exitcode)} without a Python traceback (a crash in native "
               "code, such as a gloo or NCCL abort on mismatched collectives, a signal, or os._exit); "
               "what it printed is on stderr above")
    if failed:
        details += f"\n\nrank {failed[0][0]} failed after it:\n{failed[0][1]}"
    return RankFailedError(rank, world_size, details)
