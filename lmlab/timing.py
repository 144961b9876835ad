"""Wall-clock timing for benchmarks: medians after warm-up, with CUDA work finished before each clock read."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync() -> None:
    """Wait for queued CUDA work (no-op without CUDA), so a clock read after it sees it done."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, object]:
    """Median seconds of `repeats` calls of `fn` after `warmup` calls, and the last call's result."""
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function, timed in turns (a, b, c, a, b, c, ...) so that a slow
    stretch of the machine hits every contender alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def under_profiler(fn: Callable[[], object], warmup: int) -> None:
    """Call `fn` `warmup` times (compiles, plans), then once between cudaProfilerStart and cudaProfilerStop, so that
    `ncu --profile-from-start off` or `nsys --capture-range=cudaProfilerApi` profiles that call alone."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def cold_gpu_medians(fns: dict, repeats: int, device: torch.device) -> dict:
    """Median GPU seconds of each CUDA function, timed in turns between CUDA events. Each call is preceded by a
    write of 256 MB, which empties the L2 cache (every call starts cold, as in training), and by a 1 ms spin of the
    GPU, during which the CPU queues the call: the events time the kernels, not the host's launch overhead in front
    of them (which a training step's queue hides, so picking by it picks wrong)."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
    events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(repeats)] for name in fns}
    torch.cuda.synchronize(device)
    for i in range(repeats):
        for name, fn in fns.items():
            begin, end = events[name][i]
            flush.zero_()
            torch.cuda._sleep(2_000_000)  # about 1 ms of clock cycles
            begin.record()
            fn()
            end.record()
    torch.cuda.synchronize(device)
    return {name: statistics.median(b.elapsed_time(e) for b, e in pairs) / 1e3 for name, pairs in events.items()}


def graph_replay_us(run: Callable[[], object], replays: int, warmup_calls: int = 3, skip: int = 0) -> float:
    """Median microseconds of a CUDA-graph replay of `run` (captured after `warmup_calls` eager calls), over
    `replays` replays less the first `skip`, each timed with CUDA events."""
    for _ in range(warmup_calls):
        run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[skip:])
