"""`lmlab bench kernels`: each Triton kernel against its references, with a roofline verdict.

    lmlab bench kernels [--only rms_norm,attention] [--repeats 30] [--graphs] [--json kernels.json]

For every case (an operation at a fixed shape, bf16) the forward pass and forward+backward are
timed for the Triton kernel, the plain-PyTorch reference, the reference under torch.compile, and
the operation PyTorch ships where there is one (F.rms_norm; for attention SDPA as dispatched and,
on a GPU, pinned to its flash and cuDNN backends, and compiled FlexAttention). An implementation
that raises (a backend this GPU lacks) is reported and left out. Times are medians of
`--repeats` runs bracketed by CUDA events, after warm-up, each from a cold L2 cache (see
`median_seconds`). Each row reports achieved TFLOP/s and
GB/s over the ideal traffic (every input read once, every output written once), the arithmetic
intensity (FLOP per byte of that traffic) and, against the detected GPU's bf16 peak and memory
bandwidth, whether the operation is memory- or compute-bound and what fraction of its roofline
the run attains. Speed-ups are against the case's baseline: F.rms_norm for RMSNorm, SDPA for
attention, the eager reference otherwise. On a GPU the run also times a device-to-device copy and
reports each row's traffic as a fraction of that measured bandwidth (`of copy`), and the most memory
one call holds above its inputs (`peak MiB`). `--graphs` replays
each call from a CUDA graph, so no Python or launch time can reach the timed span.

Without CUDA the Triton rows are skipped, the references run on the CPU at small sizes and no
roofline is drawn (the peaks are unknown).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmlab.kernels.chunked_cross_entropy import linear_cross_entropy
from lmlab.kernels.flash_reference import FlashAttentionReference
from lmlab.kernels.registry import triton_unavailable
from lmlab.nn.ffn import swiglu
from lmlab.nn.norms import add_rms_norm, rms_norm
from lmlab.timing import cold_gpu_medians, median_time
from lmlab.training.hardware import peak_bandwidth, peak_flops
from lmlab.training.losses import cross_entropy

BF16 = 2  # bytes per element


@dataclass
class Case:
    """One operation at one shape: its inputs, implementations and ideal cost."""

    op: str
    shape: str
    inputs: Callable[[], list[torch.Tensor]]  # fresh leaf tensors, floating ones requiring grad
    impls: dict[str, Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]]  # name -> fn(*inputs) -> output(s)
    baseline: str
    flops: tuple[float, float]  # forward, backward
    bytes: tuple[float, float]  # forward, backward (ideal traffic)


def _leaf(*shape: int, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.bfloat16) * scale).requires_grad_()


def _triton_impls() -> dict[str, Callable]:
    """The Triton kernels by operation, or nothing where they cannot run."""
    if triton_unavailable():
        return {}
    from lmlab.kernels.cross_entropy_triton import cross_entropy_triton
    from lmlab.kernels.flash_triton import FlashAttentionTriton
    from lmlab.kernels.rmsnorm_triton import add_rms_norm_triton, rms_norm_triton
    from lmlab.kernels.swiglu_triton import swiglu_triton

    return {"rms_norm": lambda x, w: rms_norm_triton(x, w, 1e-6),
            "add_rms_norm": lambda x, r, w: add_rms_norm_triton(x, r, w, 1e-6),
            "attention": lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True),
            "swiglu": swiglu_triton,
            "cross_entropy": lambda logits, t: cross_entropy_triton(logits, t)[0]}


def _impls(op: str, reference: Callable | None, extra: dict[str, Callable], compile: bool,
           triton: dict[str, Callable]) -> dict[str, Callable]:
    impls = {}
    if op in triton:
        impls["triton"] = triton[op]
    if reference is not None:
        impls["reference"] = reference
        if compile:
            impls["reference+compile"] = torch.compile(reference)
    return {**impls, **extra}


def _sdpa_with(backend: SDPBackend | None) -> Callable:
    """Causal SDPA, on PyTorch's own choice of backend or pinned to `backend`."""
    def run(q, k, v):
        with sdpa_kernel(backend) if backend is not None else nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def _flex_causal() -> Callable:
    """FlexAttention (compiled, as it must be to be fast) with a causal block mask made once per shape."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend = torch.compile(flex_attention)
    masks = {}

    def run(q, k, v):
        key = (q.shape[-2], k.shape[-2], q.device)
        if key not in masks:
            masks[key] = create_block_mask(lambda b, h, i, j: j <= i, None, None, *key)
        return attend(q, k, v, block_mask=masks[key])
    return run


def _attention_peers(gpu: bool) -> dict[str, Callable]:
    """SDPA as dispatched (the baseline) and, on a GPU, pinned to its flash and cuDNN backends, and FlexAttention."""
    peers = {"sdpa": _sdpa_with(None)}
    if gpu:
        peers |= {"sdpa-flash": _sdpa_with(SDPBackend.FLASH_ATTENTION),
                  "sdpa-cudnn": _sdpa_with(SDPBackend.CUDNN_ATTENTION), "flex": _flex_causal()}
    return peers


def cases(device: torch.device, compile: bool) -> list[Case]:
    """The benchmark's shapes: the issue's targets on a GPU, small ones on a CPU."""
    big = device.type == "cuda"
    triton = _triton_impls()
    out = []

    n, d = (16384, 4096) if big else (1024, 512)
    out.append(Case(
        "rms_norm", f"{n}x{d}",
        lambda n=n, d=d: [_leaf(n, d, device=device), _leaf(d, device=device)],
        _impls("rms_norm", lambda x, w: rms_norm(x, w, 1e-6),
               {"F.rms_norm": lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6)}, compile, triton),
        "F.rms_norm",
        flops=(4 * n * d, 8 * n * d), bytes=(2 * n * d * BF16, 3 * n * d * BF16)))
    # The pre-norm block's residual add fused in: forward reads x, r and writes s, y; backward reads s, dy,
    # ds and writes dx (the same gradient for x and r). The sum and the norm both reach the loss.
    out.append(Case(
        "add_rms_norm", f"{n}x{d}",
        lambda n=n, d=d: [_leaf(n, d, device=device), _leaf(n, d, device=device), _leaf(d, device=device)],
        _impls("add_rms_norm", lambda x, r, w: add_rms_norm(x, r, w, 1e-6), {}, compile, triton),
        "reference+compile" if compile else "reference",
        flops=(5 * n * d, 9 * n * d), bytes=(4 * n * d * BF16, 4 * n * d * BF16)))

    shapes = [(4, 16, 4096, 128), (1, 16, 16384, 64)] if big else [(1, 2, 256, 64)]
    for b, h, s, hd in shapes:
        fwd = 4 * b * h * s * s * hd / 2  # causal: half the score matrix
        io = b * h * s * hd * BF16
        out.append(Case(
            "attention", f"B{b} H{h} S{s} D{hd} causal",
            lambda b=b, h=h, s=s, hd=hd: [_leaf(b, h, s, hd, device=device) for _ in range(3)],
            # The tiled PyTorch reference loops over blocks in Python: timed at the CPU's small size only.
            _impls("attention", None if big else lambda q, k, v: FlashAttentionReference.apply(q, k, v, True),
                   _attention_peers(big), compile, triton),
            "sdpa",
            flops=(fwd, 2.5 * fwd), bytes=(4 * io, 8 * io)))

    n, f = (32768, 2816) if big else (1024, 512)
    out.append(Case(
        "swiglu", f"{n}x{f}",
        lambda n=n, f=f: [_leaf(n, f, device=device), _leaf(n, f, device=device)],
        _impls("swiglu", swiglu, {}, compile, triton), "reference",
        flops=(5 * n * f, 10 * n * f), bytes=(3 * n * f * BF16, 5 * n * f * BF16)))

    # The output projection with the loss: materialised logits against the fused, tiled kernel (no (n, v) tensor).
    n, d, v = (32768, 1024, 50304) if big else (512, 64, 4096)
    out.append(Case(
        "linear_cross_entropy", f"{n}x{d}x{v}",
        lambda n=n, d=d, v=v: [_leaf(n, d, device=device), _leaf(v, d, device=device, scale=d ** -0.5),
                               torch.randint(0, v, (n,), device=device)],
        _impls("linear_cross_entropy", lambda h, w, t: cross_entropy(F.linear(h, w), t, -100, 0.0, False)[0],
               {"fused": lambda h, w, t: linear_cross_entropy(h, w, t)[0]}, compile, triton),
        "reference",
        flops=(2 * n * d * v, 4 * n * d * v), bytes=((n + v) * d * BF16, 2 * (n + v) * d * BF16)))

    n, v = (32768, 50304) if big else (512, 4096)
    out.append(Case(
        "cross_entropy", f"{n}x{v}",
        lambda n=n, v=v: [_leaf(n, v, device=device, scale=4.0), torch.randint(0, v, (n,), device=device)],
        _impls("cross_entropy", lambda logits, t: cross_entropy(logits, t, -100, 0.0, False)[0], {}, compile, triton),
        "reference",
        flops=(4 * n * v, 4 * n * v), bytes=(n * v * BF16, 2 * n * v * BF16)))
    return out


def _graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """fn captured in a CUDA graph (after the warm-up it has had): replaying it launches one graph."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # capture wants the allocator to have seen the calls on a side stream
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_seconds(nbytes: int, repeats: int, device: torch.device) -> float:
    """Median time of a device-to-device copy of `nbytes` (read once, written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return median_seconds(lambda: dst.copy_(src), repeats, 5, device)


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int, device: torch.device,
                   graphs: bool = False) -> float:
    """Median time of `fn`: its GPU time between CUDA events on a GPU, the wall clock on a CPU.

    The warm-up lasts at least `warmup` calls and 50 ms, so the GPU's clocks have ramped up. On a
    GPU each timed call starts with L2 empty, and the events time the kernels, not the Python launch
    overhead in front of them (`lmlab.timing.cold_gpu_medians`). `graphs`: each timed call replays
    fn from a CUDA graph.
    """
    start, calls = time.perf_counter(), 0
    while calls < warmup or time.perf_counter() - start < 0.05:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        calls += 1
    if device.type != "cuda":
        return median_time(fn, repeats, warmup=0)[0]
    if graphs:
        fn = _graphed(fn, device)
    return cold_gpu_medians({"fn": fn}, repeats, device)["fn"]


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """The most memory one call of `fn` holds above what was allocated before it (GPU only; None on a CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _forward(impl: Callable, inputs: list[torch.Tensor]) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return impl(*inputs)
    return run


def _forward_backward(impl: Callable, inputs: list[torch.Tensor]) -> Callable[[], object]:
    """A call that runs impl and back-propagates ones from every output it returns.

    The gradients are returned (`autograd.grad`), not accumulated into the inputs' `.grad`: a leaf's
    accumulation copies a gradient that another input also receives (add + RMSNorm gives x and the
    residual one dx), traffic that the same op inside a model does not have.
    """
    leaves = [t for t in inputs if t.requires_grad]
    grads = None

    def run():
        nonlocal grads
        out = impl(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        grads = [torch.ones_like(o) for o in outs] if grads is None else grads
        return torch.autograd.grad(outs, leaves, grads)
    return run


def measure(case: Case, repeats: int, warmup: int, device: torch.device, graphs: bool = False,
            copy_bandwidth: float | None = None) -> list[dict]:
    """The case's rows; `copy_bandwidth` (bytes/s of a device copy measured in the same run) adds each
    row's traffic as a fraction of it."""
    flops_peak, bandwidth = peak_flops(device), peak_bandwidth(device)
    inputs = case.inputs()
    rows = []
    for pass_name, make, flops, nbytes in (("fwd", _forward, case.flops[0], case.bytes[0]),
                                           ("fwd+bwd", _forward_backward, sum(case.flops), sum(case.bytes))):
        times, peaks = {}, {}
        for name, impl in case.impls.items():
            call = make(impl, inputs)
            try:
                times[name] = median_seconds(call, repeats, warmup, device, graphs)
            except RuntimeError as err:  # e.g. an SDPA backend this GPU, build or shape lacks
                print(f"{case.op} {case.shape} {pass_name}: {name} skipped ({str(err).splitlines()[0]})",
                      file=sys.stderr)
                continue
            peaks[name] = peak_bytes(call, device)
        for name, seconds in times.items():
            intensity = flops / nbytes
            row = {"op": case.op, "shape": case.shape, "pass": pass_name, "impl": name, "ms": seconds * 1e3,
                   "tflops": flops / seconds / 1e12, "gbps": nbytes / seconds / 1e9, "flop_per_byte": intensity,
                   "speedup": times[case.baseline] / seconds if case.baseline in times else None,
                   "bound": None, "roofline_fraction": None,
                   "of_copy": nbytes / seconds / copy_bandwidth if copy_bandwidth else None,
                   "peak_mib": peaks[name] / 2**20 if peaks[name] is not None else None}
            if flops_peak and bandwidth:
                row["bound"] = "compute" if intensity > flops_peak / bandwidth else "memory"
                row["roofline_fraction"] = flops / seconds / min(flops_peak, intensity * bandwidth)
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    header = (f"{'op':<20} {'shape':<26} {'pass':<8} {'impl':<18} {'ms':>9} {'TFLOP/s':>8} {'GB/s':>8} "
              f"{'FLOP/B':>7} {'bound':>8} {'roofline':>9} {'of copy':>8} {'speed-up':>9} {'peak MiB':>9}")
    lines = [header]
    for r in rows:
        bound = r["bound"] or "-"
        roof = f"{r['roofline_fraction']:.0%}" if r["roofline_fraction"] is not None else "-"
        speed = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        of_copy = f"{r['of_copy']:.0%}" if r.get("of_copy") is not None else "-"
        peak = f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else "-"
        lines.append(f"{r['op']:<20} {r['shape']:<26} {r['pass']:<8} {r['impl']:<18} {r['ms']:>9.3f} "
                     f"{r['tflops']:>8.1f} {r['gbps']:>8.0f} {r['flop_per_byte']:>7.1f} {bound:>8} {roof:>9} "
                     f"{of_copy:>8} {speed:>9} {peak:>9}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmlab bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated operations (default: all)")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs per implementation (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first (default 5)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile'd references")
    parser.add_argument("--graphs", action="store_true", help="replay each timed call from a CUDA graph (GPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 1:
        parser.error("--repeats and --warmup must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    selected = cases(device, compile=not args.no_compile)
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {c.op for c in selected})
        if unknown:
            parser.error(f"unknown operation(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(dict.fromkeys(c.op for c in selected))}")
        selected = [c for c in selected if c.op in wanted]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    missing = triton_unavailable()
    print(f"lmlab bench kernels on {name}" + (f" (Triton rows skipped: {missing})" if missing else ""))
    copy_bandwidth = None
    if device.type == "cuda":
        copy_bytes = 256 * 2**20
        copy_bandwidth = 2 * copy_bytes / copy_seconds(copy_bytes, args.repeats, device)
        print(f"device copy of {copy_bytes >> 20} MiB: {copy_bandwidth / 1e9:.0f} GB/s (read + write)")
    rows = []
    for case in selected:
        print(f"timing {case.op} {case.shape} ...", file=sys.stderr, flush=True)
        rows += measure(case, args.repeats, args.warmup, device, args.graphs and device.type == "cuda", copy_bandwidth)
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"device": name, "torch": torch.__version__, "graphs": args.graphs,
                                         "copy_gbps": copy_bandwidth and copy_bandwidth / 1e9, "rows": rows}, indent=2))
    return 0
