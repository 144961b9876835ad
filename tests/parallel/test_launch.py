"""run_processes: results in rank order, and a rank that fails (raises, crashes, hangs) ends the job
with its cause in the parent instead of hanging it."""

import os
import queue
import re
import time

import pytest
import torch
import torch.distributed as dist

from lmlab.parallel import RankFailedError, launch, run_processes


def _sum_of_ranks(rank: int, world_size: int, offset: int) -> tuple[int, int, float]:
    t = torch.tensor([rank + offset], dtype=torch.float32)
    dist.all_reduce(t)
    return rank, world_size, t.item()


def _raises_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError(f"boom on rank 1 at {time.time()}")
    dist.barrier()  # rank 0 waits for a peer that never arrives


def _exits_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)  # no exception, no report: as a crash in native code looks to the parent
    dist.barrier()


def _mismatched_collectives(rank: int, world_size: int) -> None:
    dist.all_reduce(torch.zeros(4 if rank == 0 else 64))  # gloo aborts the process that notices


def _sleeps(rank: int, world_size: int) -> None:
    time.sleep(600)


def test_results_come_back_in_rank_order():
    assert run_processes(_sum_of_ranks, 2, args=(1,), timeout=120) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_a_rank_that_raises_ends_the_job_with_its_traceback():
    with pytest.raises(RankFailedError, match="rank 1 of 2 failed") as info:
        run_processes(_raises_on_rank_1, 2, timeout=120)
    raised_at = float(re.search(r"ValueError: boom on rank 1 at ([\d.]+)", info.value.details)[1])
    assert time.time() - raised_at < 5  # seconds from the raise to the parent's error, not the timeout
    assert info.value.rank == 1 and "in _raises_on_rank_1" in info.value.details


@pytest.mark.parametrize("fn", [_exits_on_rank_1, _mismatched_collectives])
def test_a_rank_that_dies_without_a_traceback_is_named(fn):
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"without a Python traceback") as info:
        run_processes(fn, 2, timeout=120)
    assert time.monotonic() - start < 60  # start-up included; far from the timeout
    if fn is _exits_on_rank_1:
        assert info.value.rank == 1 and "exited with code 3" in str(info.value)
    else:
        assert "killed by SIGABRT" in str(info.value)


def test_a_job_past_its_timeout_is_terminated():
    # long enough that both ranks join the group before it (joining is bounded by the same timeout)
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\] of 2 gave no result within 8 s"):
        run_processes(_sleeps, 2, timeout=8)


def test_bad_arguments_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        run_processes(_sleeps, 2, backend="mpi")
    with pytest.raises(ValueError, match="world_size"):
        run_processes(_sleeps, 0)


def test_a_peer_that_exited_cleanly_with_its_report_still_queued_is_not_blamed():
    """The race CI once hit: rank 1 raised, rank 0 reported its own (echo) failure and exited 0, and
    the parent had not read that report yet. Rank 1 is the cause, not a 'silent' rank 0."""

    class Exited:
        exitcode = 0

        def join(self, timeout=None):
            pass

    results = queue.Queue()
    results.put((0, False, "RuntimeError: connection closed by peer"))
    error = launch._failure([Exited(), Exited()], results, {1: (False, "ValueError: boom")}, 2)
    assert error.rank == 1 and "boom" in error.details
