"""Launching the decode megakernel (`lmlab.kernels.decode_layers_triton`, whose docstring says how it works).

`decode_layers(x, weights, k_cache, v_cache, slots, start, cos, sin, eps, scale)` runs one new token per sequence
through every layer of a stack whose weights are stacked per kind (`lmlab.inference.megakernel.StackedWeights`):
x (batch, d_model), float32, is the residual stream, which it updates in place (the kernel's own buffer, so no cast
in or out is a launch of its own). It writes each layer's new key and value at cache slot `slots[0]`, and returns
the last layer's output (before the final norm) in the activations' dtype (the norms'). Weights quantized to int8 per
output row (`weights.scales`, lmlab.inference.quant's `int8`) are read as codes and scaled after each product; int4
weights (`weights.group_size`, two codes a byte, a scale and zero per group of input columns) at batch 1 likewise,
each group's products summed before its scale. `persistent=False` launches each (layer, stage) as a kernel of its
own (for Triton's CPU interpreter, and as the many-launch baseline; on a GPU at batch 1, q/k/v, attention and o_proj
share one launch where all its programs fit at once, STAGE_MERGE_ATTENTION); on sm_90 those launches form a
programmatic-dependent-launch chain, each stage's programs loading their first weights while the stage before runs
(STAGE_PDL; experiments/inference/README.md, 2026-12-07). `launch_plan` gives the scratch buffers and settings of a
step on any device; the module's settings below are what experiments/inference/sweep_megakernel.py sweeps.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch
import triton

from lmlab.inference.megakernel import MAX_GROUP, SUPPORTED_HEAD_DIMS, Megakernel, StackedWeights
from lmlab.kernels.decode_attention_triton import INTERPRET, KEYS_PER_SPLIT, LOG2E, sm_count
from lmlab.kernels.decode_layers_triton import layers_kernel

N_STAGES = 5
# Launch settings of the two paths, the fastest of experiments/inference/sweep_megakernel.py on an H200. Programs per
# SM: at most what the GPU keeps resident at once (checked at launch), or a grid barrier would wait forever.
# Tensor-core path (batch > 1): input columns per loop step, warps, programs per SM.
BLOCK_K, NUM_WARPS, PROGRAMS_PER_SM = 256, 4, 3
# Matrix-vector path (batch 1): weights per tile (a few rows over the whole input width, loaded whole; a program
# issues the next item's tiles before it reduces the current ones, so bytes stay in flight), warps, programs per SM.
GEMV_TILE_ELEMS, GEMV_NUM_WARPS, GEMV_PROGRAMS_PER_SM = 8192, 4, 2
# gate/up's items hold two tiles (a gate and an up row block), so at GEMV_TILE_ELEMS each they would be twice the
# other stages' items: its own size, for the sweep. At 4096, llama400m's 704 items spread over 264 programs, and the
# layer stack took 547 us against 599 us at 8192 (same process; experiments/inference/h200-2026-12-03c/)
GEMV_GATE_UP_TILE_ELEMS = 4096
# gate/up's first tiles issued before o_proj (whose items wait on attention) rather than as the program arrives at
# gate/up's barrier: the layer stack took 478.1 against 482.2 us (mean of slots 255 and 383, one process; issuing
# down's first tile before gate/up's barrier too was slower, 505.5 alone and 480.8 with this;
# experiments/inference/h200-2026-12-04d/5-*)
GEMV_GATE_UP_EARLY = True
# o_proj without a grid barrier: items of (head, output rows) wait on their kv head's attention splits and add into a
# float32 sum with atomics (else a barrier, then whole-row tiles as in down)
GEMV_O_PROJ_ON_COUNTERS = True
# Arrive at each grid barrier before issuing the next stage's first tile loads, then wait: the arrival's release
# fence need not wait for them (the timeline showed the barrier before q/k/v, whose 32 KB loads went first, taking
# twice the others: experiments/inference/h200-2026-12-04b/)
GEMV_ARRIVE_BEFORE_LOADS = True
# Input columns per chunk of a matrix-vector tile with at least GEMV_CHUNK_MIN_ROWS rows (others keep whole rows): one
# warp's threads across a chunk, so Triton lays the warps along the rows and each row's sum stays in its warp. On an
# H200 the layer stack took 487 us against 517-525 us with whole-row tiles (experiments/inference/h200-2026-12-04c/).
GEMV_CHUNK, GEMV_CHUNK_MIN_ROWS = 256, 4
# Programs ask L2 for their later gate/up and down items as they arrive at the stage's barrier (bulk prefetches):
# the swept setting
GEMV_PREFETCH_LATER = True
# Where those prefetches go, earlier: gate/up's later items with its first tiles, before o_proj (programs with no
# attention item then ask while attention runs); down's items, its first too, as a program arrives at gate/up's
# barrier (so they stream in under gate/up)
GEMV_PREFETCH_GATE_UP_EARLY, GEMV_PREFETCH_DOWN_EARLY = False, False
# o_proj's float32 sums start at a multiple of this many int32s into the counters' buffer: at 4, 16-byte aligned, so
# that Triton (which specializes each pointer on its alignment) loads them 16 bytes at a time. Every program reads the
# whole row of sums, so unaligned the same few L2 lines take four times the requests (likely why it mattered): at 1
# the layer stack took 468.2 against 430.0 us, 1,992 against 2,134 tokens/s (llama400m, batch 1, one process, in
# turns; experiments/inference/ab_megakernel_steps.py, h200-2026-12-04f/)
O_ACC_ALIGN = 4
# Quantized weights' gate/up tiles: at 8192, int8's carry the bytes of bf16's (half the items). Their other tiles
# keep bf16's element counts: twice the elements a thread converts and sums spilled registers in the sm_90 compile
# (llama400m int8: 116 bytes with this, 1,016 with o_proj's widened too, 2,764 with every tile widened;
# experiments/inference/megakernel_resources.py)
GEMV_QUANT_GATE_UP_TILE_ELEMS = 8192
# int4's warps per program on the matrix-vector path: its tiles' unpacking spills registers at 4 (220 bytes in the
# sm_90 compile); at 8 the llama400m int4 step made 1,280 tokens/s against 785 (one process, in turns; 1 program per
# SM at 4 warps: 1,181; experiments/inference/h200-2026-12-05/)
GEMV_INT4_NUM_WARPS = 8
# Stage by stage on CUDA (persistent=False): each launch after the step's first is a programmatic dependent launch
# (sm_90), so the next stage's programs start while this one runs, issue their first weight loads, and wait for it
# (`griddepcontrol.wait`) where the persistent kernel waits at a grid barrier; programs per SM of each launch. With
# STAGE_MERGE_ATTENTION, q/k/v, attention and o_proj share one launch whose o_proj items wait on counters (as in the
# persistent kernel): three launches a layer instead of five. On an H100, llama400m at batch 1, the stack took 475-476
# us against 480-482 for the persistent kernel and 495 unmerged; 607 at 1 program an SM, 812 with registers capped at
# 168 (spills) (one process each; experiments/inference/h100-2026-12-07b/).
STAGE_PDL, STAGE_PROGRAMS_PER_SM, STAGE_MERGE_ATTENTION = True, 2, True
GEMV_MAX_WIDTH = 8192  # wider inputs take the tensor-core path (a whole row per tile would not fit in registers)
NUM_STAGES = 3

_RESIDENT: dict[tuple, int] = {}
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


def _resident_per_sm(args: tuple, meta: dict) -> int:
    """How many programs of the persistent kernel (or of the stage launch that `meta`'s STAGE names) one SM holds at
    once, from the CUDA driver's occupancy calculator (registers, shared memory with its per-block reservation,
    threads), with the shared-memory carveout at its largest. Counting it by hand got it wrong: 2 x 114 KiB of shared
    memory fits 228 KiB only without the 1 KiB that each block reserves, so half the grid waited for an SM while the
    other half spun at the first barrier."""
    specialized = tuple((a == 1, a % 16 == 0) for a in args if type(a) is int)  # what Triton compiles a variant for
    key = (args[0].device, args[1].dtype, args[2].dtype, specialized, *sorted(meta.items()))
    if key not in _RESIDENT:
        kernel = layers_kernel.warmup(*args, grid=(1,), **{"STAGE": -1, **meta})  # the very kernel the launch runs
        kernel._init_handles()
        cuda = ctypes.CDLL("libcuda.so.1")
        function = ctypes.c_void_p(kernel.function)
        blocks = ctypes.c_int(0)
        for result in (cuda.cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100),
                       cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                           ctypes.byref(blocks), function, ctypes.c_int(32 * meta["num_warps"]),
                           ctypes.c_size_t(kernel.metadata.shared))):
            if result != 0:
                raise RuntimeError(f"decode_layers: the CUDA driver's occupancy query failed (CUresult {result})")
        if blocks.value < 1:
            raise RuntimeError("decode_layers: not one program of the persistent kernel fits an SM")
        _RESIDENT[key] = blocks.value
    return _RESIDENT[key]


def _tile_rows(width: int, elems: int, most: int = 1 << 16) -> int:
    """Rows of a matrix-vector tile over `width` (a power of two) input columns: about `elems` weights."""
    return max(1, min(most, elems // width))


def _chunk(width: int, rows: int, group_size: int) -> int:
    """Elements per chunk of a matrix-vector tile of `rows` rows over `width` (a power of two) columns: with int4
    weights (group_size > 0) a group's bytes; else GEMV_CHUNK columns where the tile has GEMV_CHUNK_MIN_ROWS rows or
    more, else the whole width."""
    if group_size:
        return group_size // 2
    return min(width, GEMV_CHUNK) if rows >= GEMV_CHUNK_MIN_ROWS else width


def _sm90(device: torch.device) -> bool:
    """Whether the device is sm_90 or later (the bulk L2 prefetch, programmatic dependent launch); a "meta" or CPU
    device is taken to be (the sm_90 compile of megakernel_resources.py; the interpreter never runs the persistent
    kernel that issues the prefetches, and the launch leaves PDL off there)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


def n_splits(batch: int, n_kv_heads: int, cache_len: int, programs: int) -> int:
    """Key-range splits per (sequence, kv head): at most one attention work item per program."""
    return max(1, min(programs // (batch * n_kv_heads), cache_len // KEYS_PER_SPLIT))


def unsupported(x: torch.Tensor, weights: StackedWeights, k_cache: torch.Tensor) -> str | None:
    """Why these shapes cannot run here (None: they can)."""
    if not INTERPRET and not x.is_cuda:
        return "x must be a CUDA tensor"
    if weights.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={weights.head_dim} (supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    if weights.n_heads % weights.n_kv_heads or weights.n_heads // weights.n_kv_heads > MAX_GROUP:
        return f"{weights.n_heads} query heads over {weights.n_kv_heads} kv heads"
    if x.dtype != torch.float32:
        return f"x is {x.dtype}; it must be the float32 residual stream (updated in place)"
    if x.shape[0] > Megakernel.MAX_BATCH:
        return f"batch {x.shape[0]} > {Megakernel.MAX_BATCH} (the matmuls hold the whole batch in one tile)"
    if k_cache.stride(-1) != 1 or k_cache.dtype != weights.dtype:
        return "the caches need a contiguous head_dim and the activations' dtype"
    kinds = {w.dtype for w in (weights.qkv, weights.o, weights.gate_up, weights.down)}
    expected = {weights.dtype} if weights.scales is None else {torch.uint8 if weights.group_size else torch.int8}
    if kinds != expected:
        return (f"weights of {', '.join(sorted(map(str, kinds)))} "
                f"{'with' if weights.scales is not None else 'without'} scales (int8 and int4 codes take scales)")
    return None


def decode_layers(x: torch.Tensor, weights: StackedWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor, start: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  scale: float | None = None, persistent: bool = True) -> torch.Tensor:
    """x (batch, d_model), the float32 residual stream, updated in place -> the last layer's output (batch, d_model)
    in the weights' dtype; k_cache and v_cache
    (layers, batch, kv_heads, cache_len, head_dim) get each layer's new key and value at slots[0]. cos and sin:
    RoPE's tables (positions, head_dim / 2). scale: of the attention scores (None: 1 / sqrt(head_dim))."""
    problem = unsupported(x, weights, k_cache)
    if problem:
        raise ValueError(f"decode_layers: {problem}")
    scale = 1.0 / math.sqrt(weights.head_dim) if scale is None else float(scale)
    return _decode_layers_op(x, weights.qkv, weights.o, weights.gate_up, weights.down, weights.scales,
                             weights.group_size, weights.norm_attn, weights.norm_ffn, k_cache, v_cache, slots, start,
                             cos, sin, weights.n_heads, weights.n_kv_heads, weights.rope_interleaved, eps, scale,
                             persistent)


# A custom op, so torch.compile treats the launch as one opaque call (and a CUDA graph captures it). Inductor passes it
# the buffer that its embedding kernel wrote x to, cast to float32 there: no copy of its own.
@torch.library.custom_op("lmlab::decode_layers", mutates_args=("x", "k_cache", "v_cache"))
def _decode_layers_op(x: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      scales: torch.Tensor | None, group_size: int, norm_attn: torch.Tensor, norm_ffn: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int, interleaved: bool,
                      eps: float, scale: float, persistent: bool) -> torch.Tensor:
    programs = sm_count(x.device)
    plan = launch_plan(x, qkv, o, gate_up, down, scales, norm_attn, norm_ffn, k_cache, v_cache, slots, start, cos, sin,
                       n_heads, n_kv_heads, interleaved, eps, scale, programs, group_size)
    if persistent:
        args = (*plan.args, 0, k_cache.shape[0], *plan.shape)
        layers_kernel[(persistent_programs(plan, args),)](*args, STAGE=-1, **plan.meta)
    else:
        on_gpu = x.is_cuda and not INTERPRET
        pdl = STAGE_PDL and on_gpu and _sm90(x.device)
        meta = {**plan.meta, "PDL": pdl}
        # merged, attention's items wait on q/k/v's inside one launch: every program must be resident at once
        merged = (STAGE_MERGE_ATTENTION and plan.meta["SPLIT_O"] and on_gpu and STAGE_PROGRAMS_PER_SM
                  <= _resident_per_sm((*plan.args, 0, 1, *plan.shape), {**meta, "STAGE": 0, "LAST": 2}))
        launches = ((0, 2), (3, 3), (4, 4)) if merged else tuple((stage, stage) for stage in range(N_STAGES))
        for layer in range(k_cache.shape[0]):
            for first, last in launches:
                chained = pdl and (layer, first) != (0, 0)  # the first waits for the step's earlier kernels in full
                layers_kernel[(programs * STAGE_PROGRAMS_PER_SM,)](*plan.args, layer, layer + 1, *plan.shape,
                                                                   launch_pdl=chained,
                                                                   **{**meta, "STAGE": first, "LAST": last})
    return plan.args[1]  # written by the last layer


@dataclass
class LaunchPlan:
    """What `layers_kernel` is launched with: its tensors (the float32 residual stream first, the output in the
    activations' dtype, then the weights and their scales, the norms, caches and scratch), its scalars after
    (layer_lo, layer_hi), its compile-time settings, and the programs per SM wanted (fewer where fewer fit)."""

    args: tuple
    shape: tuple
    meta: dict
    programs_per_sm: int


def persistent_programs(plan: LaunchPlan, args: tuple) -> int:
    """Programs of the persistent launch with these arguments: the plan's per SM, or fewer where fewer fit."""
    return sm_count(args[0].device) * min(plan.programs_per_sm, _resident_per_sm(args, plan.meta))


def launch_plan(x, qkv, o, gate_up, down, scales, norm_attn, norm_ffn, k_cache, v_cache, slots, start, cos, sin,
                n_heads: int, n_kv_heads: int, interleaved: bool, eps: float, scale: float, programs: int,
                group_size: int = 0) -> LaunchPlan:
    """The scratch buffers and settings of one decode step on `programs` SMs, x being the float32 residual stream that
    the launch updates in place, `scales` None or the quantized weights' (int8: per row; int4, group_size > 0: per
    group, as StackedWeights keeps them) (any device, "meta" included:
    experiments/inference/megakernel_resources.py compiles from it without a GPU)."""
    batch, d_model = x.shape
    n_layers, cache_len, head_dim = k_cache.shape[0], k_cache.shape[3], k_cache.shape[4]
    group = n_heads // n_kv_heads
    pack = 2 if group_size else 1  # codes per byte; int4's tiles count bytes, their chunks are its groups
    d_ff = down.shape[2] * pack
    kp_model, kp_attn, kp_ff = (triton.next_power_of_2(w) for w in (d_model, n_heads * head_dim, d_ff))
    gemv = batch == 1 and max(kp_model, kp_attn, kp_ff) <= GEMV_MAX_WIDTH
    split = n_splits(batch, n_kv_heads, cache_len, programs)
    f32 = dict(dtype=torch.float32, device=x.device)
    dtype = norm_attn.dtype  # the activations'
    int8 = scales is not None and not group_size
    if group_size and not gemv:
        raise ValueError("decode_layers: int4 weights run at batch 1 with inputs of at most GEMV_MAX_WIDTH columns")
    out = torch.empty(batch, d_model, dtype=dtype, device=x.device)
    q = torch.empty(batch, n_heads, head_dim, **f32)
    part_out = torch.empty(batch, n_heads, split, head_dim, **f32)
    part_lse = torch.empty(batch, n_heads, split, **f32)
    attn = torch.empty(batch, n_heads * head_dim, dtype=dtype, device=x.device)
    act = torch.empty(batch, d_ff, dtype=dtype, device=x.device)
    split_o = gemv and GEMV_O_PROJ_ON_COUNTERS and not group_size  # int4's o_proj: whole rows, after a barrier
    # Zeroed in one fill: the counters (the grid barrier's, each kv head's finished q/k/v items, each (sequence, kv
    # head)'s finished attention splits) and, on the matrix-vector path, each layer's o_proj sums (float32 zeros)
    counters = 1 + n_kv_heads + batch * n_kv_heads
    sums = -(-counters // O_ACC_ALIGN) * O_ACC_ALIGN
    sync = torch.zeros(sums + (n_layers * d_model if gemv else 0), dtype=torch.int32, device=x.device)
    arrived, o_acc = sync[1 + n_kv_heads:counters], sync[sums:].view(torch.float32)
    args = (x, out, qkv, o, gate_up, down, norm_attn if scales is None else scales, norm_attn, norm_ffn, k_cache,
            v_cache, q, part_out, part_lse, attn, arrived, act, cos, sin, slots, start, sync, o_acc, sync)  # no Times
    tiles = dict(T_QKV=_tile_rows(kp_model, GEMV_TILE_ELEMS, head_dim // 2) if gemv else 16,
                 T_O=_tile_rows(head_dim if split_o else kp_attn, GEMV_TILE_ELEMS),
                 T_GU=_tile_rows(kp_model, GEMV_QUANT_GATE_UP_TILE_ELEMS if scales is not None
                                 else GEMV_GATE_UP_TILE_ELEMS),
                 T_D=_tile_rows(kp_ff, GEMV_TILE_ELEMS))
    meta = dict(BB=1 if gemv else max(16, triton.next_power_of_2(batch)), HEAD_DIM=head_dim, GROUP=group,
                BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=32,
                BLOCK_SPLIT=triton.next_power_of_2(split), BLOCK_K=BLOCK_K, INTERLEAVED=interleaved,
                PREC="ieee" if dtype == torch.float32 else "tf32", num_stages=NUM_STAGES,
                num_warps=(GEMV_INT4_NUM_WARPS if group_size else GEMV_NUM_WARPS) if gemv else NUM_WARPS,
                GEMV=gemv, KP_MODEL=kp_model // pack, KP_ATTN=kp_attn // pack, KP_FF=kp_ff // pack,
                C_MODEL=_chunk(kp_model, min(tiles["T_QKV"], tiles["T_GU"]), group_size),
                C_ATTN=_chunk(kp_attn, tiles["T_O"], group_size), C_FF=_chunk(kp_ff, tiles["T_D"], group_size),
                **tiles, SPLIT_O=split_o,
                PREFETCH=gemv and GEMV_PREFETCH_LATER and _sm90(x.device),
                ARRIVE_FIRST=gemv and GEMV_ARRIVE_BEFORE_LOADS, GATE_UP_EARLY=gemv and GEMV_GATE_UP_EARLY,
                PREFETCH_GU_EARLY=GEMV_PREFETCH_GATE_UP_EARLY, PREFETCH_DOWN_EARLY=GEMV_PREFETCH_DOWN_EARLY,
                TIMELINE=False, INT8=int8, GROUP4=group_size, PDL=False, LAST=N_STAGES - 1)
    shape = (batch, d_model, d_ff, n_heads, n_kv_heads, split, eps, scale * LOG2E,
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3))
    return LaunchPlan(args, shape, meta, GEMV_PROGRAMS_PER_SM if gemv else PROGRAMS_PER_SM)


def plan_on_meta(batch: int, layers: int, d_model: int, heads: int, kv_heads: int, head_dim: int, d_ff: int,
                 cache_len: int, dtype: torch.dtype, programs: int = 132, quant: str = "none",
                 group_size: int = 128) -> LaunchPlan:
    """`launch_plan` of a stack of these sizes (quant: "int8" per row, "int4" per group of `group_size`) with every
    tensor on the "meta" device: what a launch would get, worked out without a GPU or memory
    (experiments/inference/megakernel_resources.py compiles from it)."""
    meta = dict(device="meta", dtype=dtype)
    shapes = (((heads + 2 * kv_heads) * head_dim, d_model), (d_model, heads * head_dim), (2 * d_ff, d_model),
              (d_model, d_ff))
    codes = {"none": (dtype, 1, 0), "int8": (torch.int8, 1, 0), "int4": (torch.uint8, 2, group_size)}
    code_dtype, pack, group = codes[quant]
    w = [torch.empty(layers, rows, cols // pack, device="meta", dtype=code_dtype) for rows, cols in shapes]
    per_layer = sum(rows * (2 * cols // group if group else 1) for rows, cols in shapes)
    scales = None if quant == "none" else torch.empty(layers, per_layer, **meta)
    norms = [torch.empty(layers, d_model, **meta) for _ in range(2)]
    k, v = (torch.empty(layers, batch, kv_heads, cache_len, head_dim, **meta) for _ in range(2))
    rope = [torch.empty(cache_len, head_dim // 2, device="meta") for _ in range(2)]
    slots, start = torch.empty(1, dtype=torch.long, device="meta"), torch.empty(batch, dtype=torch.long, device="meta")
    residual = torch.empty(batch, d_model, device="meta")
    return launch_plan(residual, *w, scales, *norms, k, v, slots, start, *rope, heads, kv_heads, False, 1e-5,
                       head_dim ** -0.5, programs, group)


@_decode_layers_op.register_fake
def _(x, qkv, o, gate_up, down, scales, group_size, norm_attn, norm_ffn, k_cache, v_cache, slots, start, cos, sin,
      n_heads, n_kv_heads, interleaved, eps, scale, persistent):
    return torch.empty_like(x, dtype=norm_attn.dtype)
