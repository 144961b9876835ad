"""One decode step through a whole Llama layer stack in one persistent Triton kernel (a megakernel).

`decode_layers(x, weights, k_cache, v_cache, slots, start, cos, sin, eps, scale)` runs one new token per
sequence, x (batch, d_model), through every layer of a pre-norm RMSNorm / RoPE / softmax attention
(MHA, GQA, MQA) / SwiGLU stack whose weights are stacked per kind (`lmlab.inference.megakernel.StackedWeights`:
layer-major, q/k/v as one matrix, gate/up as one), writes each layer's new key and value at cache slot `slots[0]`, and
returns the last layer's output (before the final norm) in x's dtype.

Why one kernel: at batch 1 the ~400M model's compiled decode step launched 269 kernels (11 a layer),
and each cost 2.5-4 us in CUDA-graph replay whatever the bytes it read, so the step was bound by their
number, not by the 0.71 GB of weights (experiments/inference/). Here a persistent grid (up to
PROGRAMS_PER_SM programs per SM, never more than the GPU holds at once, or the barrier would wait forever)
walks the layers; each layer is five stages, and all programs meet at a grid-wide barrier (an atomic counter)
between stages:
  qkv        the q/k/v matmul of the RMS-normed rows (the norm's 1 / rms applied after the loop that also
             sums the squares), RoPE; q to scratch, k and v into the caches
  attention  flash-decoding over (sequence, kv head, key split); the last split of a (sequence, kv head) to
             finish (an atomic count) combines the splits into the attention output
  o_proj     the o_proj matmul, added into the residual stream
  gate/up    RMSNorm as in qkv, the gate and up matmuls, silu(gate) * up to scratch
  down       the down matmul, added into the residual stream
A program takes work items (tiles of 16 output rows over the full input width) round-robin. The
residual stream stays in float32 for the whole step.

Measured on an H200 (experiments/inference/README.md): the launches were not what cost the time. The layer stack
of the ~400M model takes 1.14 ms here at batch 1, persistent, and 1.19 ms as 120 launches, against 0.82 ms for the
whole compiled step. So `Engine(megakernel=True)` is opt-in: the matmul tiles keep too few weight bytes in flight.

`persistent=False` launches each (layer, stage) as a kernel of its own instead (no barrier): the same
code, for Triton's CPU interpreter (TRITON_INTERPRET=1 runs programs one after another, so a barrier
there would never open) and as the many-launch baseline.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from lmlab.kernels.decode_attention_triton import (INTERPRET, KEYS_PER_SPLIT, LOG2E, attend_key_range, key_split,
                                                   sm_count)

if TYPE_CHECKING:
    from lmlab.inference.megakernel import StackedWeights

N_STAGES = 5
SUPPORTED_HEAD_DIMS = (32, 64, 128)
BLOCK_K = 256  # input columns per loop step of the matmuls
NUM_WARPS, NUM_STAGES = 4, 3
# Programs per SM of the persistent grid (at most what the GPU keeps resident at once, or the barrier would hang).
# On an H200 (2026-12-02, experiments/inference/sweep_megakernel.py) 1 was fastest at batch 1, 2-3 at batch 32.
PROGRAMS_PER_SM = 1


@triton.jit
def _grid_barrier(Sync, target):
    """Arrive, then wait until the counter reaches `target`: every program's writes before the barrier are
    visible to every program after it (release on arrival, acquire on the read that sees the target)."""
    tl.debug_barrier()  # all of this program's stores are issued
    seen = tl.atomic_add(Sync, 1, sem="acq_rel", scope="gpu") + 1
    while seen < target:
        seen = tl.atomic_add(Sync, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _normed_matmul_pair(X, NormW, W, w_rows1, w_rows2, w_ok, rows, row_ok, d_model, eps,
                        BB: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """RMSNorm(X rows) @ W[w_rows1].T and @ W[w_rows2].T (BB, 16) each, in float32. The rows' 1 / rms is a
    factor of each output row, so it is applied after the loop that also sums the squares: one pass over X."""
    acc1 = tl.zeros((BB, 16), tl.float32)
    acc2 = tl.zeros((BB, 16), tl.float32)
    squares = tl.zeros((BB,), tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < d_model
        x = tl.load(X + rows[:, None] * d_model + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                    cache_modifier=".cg")
        gain = tl.load(NormW + ks, mask=k_ok, other=0.0)
        squares += tl.sum(x * x, 1)
        xg = (x * gain[None, :]).to(gain.dtype)
        ok = w_ok[:, None] & k_ok[None, :]
        w1 = tl.load(W + w_rows1[:, None] * d_model + ks[None, :], mask=ok, other=0.0)
        w2 = tl.load(W + w_rows2[:, None] * d_model + ks[None, :], mask=ok, other=0.0)
        acc1 = tl.dot(xg, tl.trans(w1), acc1, input_precision=PREC)
        acc2 = tl.dot(xg, tl.trans(w2), acc2, input_precision=PREC)
    inv_rms = tl.math.rsqrt(squares / d_model + eps)[:, None]
    # rounded to the weights' dtype, as the reference's matmuls round their outputs
    dt = W.dtype.element_ty
    return (acc1 * inv_rms).to(dt).to(tl.float32), (acc2 * inv_rms).to(dt).to(tl.float32)


@triton.jit
def _qkv_stage(X, NormW, W, Q, Kc, Vc, Cos, Sin, Slots, Start, rows, row_ok, pid, n_programs, eps,
               sc_b, sc_h, sc_l, d_model, n_heads, n_kv_heads,
               BB: tl.constexpr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_K: tl.constexpr,
               PREC: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    CHUNKS: tl.constexpr = HALF // 16
    slot = tl.load(Slots)
    pos = tl.maximum(slot - tl.load(Start + rows, mask=row_ok, other=0), 0)
    pairs = tl.arange(0, 16)
    for item in range(pid, (n_heads + 2 * n_kv_heads) * CHUNKS, n_programs):
        head = item // CHUNKS  # q heads, then k heads, then v heads
        freq = (item % CHUNKS) * 16 + pairs  # the rotation pairs this item computes
        if INTERLEAVED:
            first, second = 2 * freq, 2 * freq + 1
        else:
            first, second = freq, freq + HALF
        acc1, acc2 = _normed_matmul_pair(X, NormW, W, head * HEAD_DIM + first, head * HEAD_DIM + second,
                                         pairs < 16, rows, row_ok, d_model, eps, BB, BLOCK_K, PREC)
        cos = tl.load(Cos + pos[:, None] * HALF + freq[None, :], mask=row_ok[:, None], other=1.0)
        sin = tl.load(Sin + pos[:, None] * HALF + freq[None, :], mask=row_ok[:, None], other=0.0)
        rotated = head < n_heads + n_kv_heads
        out1 = tl.where(rotated, acc1 * cos - acc2 * sin, acc1)
        out2 = tl.where(rotated, acc2 * cos + acc1 * sin, acc2)
        ok = row_ok[:, None]
        q_at = Q + (rows[:, None] * n_heads + head) * HEAD_DIM
        tl.store(q_at + first[None, :], out1, mask=ok & (head < n_heads))
        tl.store(q_at + second[None, :], out2, mask=ok & (head < n_heads))
        kv_head = (head - n_heads) % n_kv_heads
        cache_at = rows[:, None] * sc_b + kv_head * sc_h + slot * sc_l
        is_k = (head >= n_heads) & (head < n_heads + n_kv_heads)
        tl.store(Kc + cache_at + first[None, :], out1.to(Kc.dtype.element_ty), mask=ok & is_k)
        tl.store(Kc + cache_at + second[None, :], out2.to(Kc.dtype.element_ty), mask=ok & is_k)
        is_v = head >= n_heads + n_kv_heads
        tl.store(Vc + cache_at + first[None, :], out1.to(Vc.dtype.element_ty), mask=ok & is_v)
        tl.store(Vc + cache_at + second[None, :], out2.to(Vc.dtype.element_ty), mask=ok & is_v)


@triton.jit
def _attention_stage(Q, Kc, Vc, PartO, PartL, Attn, Arrived, Slots, Start, layer, pid, n_programs, batch, n_heads,
                     n_kv_heads, n_split, sc_b, sc_h, sc_l, qk_scale,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_SPLIT: tl.constexpr, PREC: tl.constexpr):
    """Flash-decoding over (sequence, kv head, key split); the last split of a (sequence, kv head) to finish
    combines them into the attention output (Attn, batch x heads * head_dim), so no grid barrier is needed."""
    slot = tl.load(Slots)
    r = tl.arange(0, BLOCK_M)
    r_ok = r < GROUP
    dims = tl.arange(0, HEAD_DIM)
    splits = tl.arange(0, BLOCK_SPLIT)
    for item in range(pid, batch * n_kv_heads * n_split, n_programs):
        split = item % n_split
        bg = item // n_split  # (sequence, kv head)
        b = bg // n_kv_heads
        kv_head = bg % n_kv_heads
        head = kv_head * GROUP + r
        q = tl.load(Q + (b * n_heads + head)[:, None] * HEAD_DIM + dims[None, :], mask=r_ok[:, None], other=0.0,
                    cache_modifier=".cg")
        start = tl.load(Start + b)
        k_lo, k_hi = key_split(tl.minimum(start, slot), slot + 1, split, n_split, BLOCK_N)
        m_i, l_i, acc = attend_key_range(q.to(Kc.dtype.element_ty), Kc + b * sc_b + kv_head * sc_h,
                                         Vc + b * sc_b + kv_head * sc_h, sc_l, sc_l, k_lo, k_hi,
                                         tl.zeros((BLOCK_M,), tl.int64) + slot, start, qk_scale, 0,
                                         BLOCK_M, BLOCK_N, HEAD_DIM, False, PREC)
        part = (b * n_heads + head) * n_split
        tl.store(PartL + part + split, tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i)), mask=r_ok)
        tl.store(PartO + (part + split)[:, None] * HEAD_DIM + dims[None, :],
                 acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None], mask=r_ok[:, None])
        tl.debug_barrier()  # this program's partial results are all issued before it counts itself in
        arrived = tl.atomic_add(Arrived + bg, 1, sem="acq_rel", scope="gpu")  # counts up over the layers
        if arrived == (layer + 1) * n_split - 1:
            ok = r_ok[:, None] & (splits < n_split)[None, :]
            lse = tl.load(PartL + part[:, None] + splits[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
            top = tl.max(lse, 1)
            weight = tl.math.exp2(lse - tl.where(top == float("-inf"), 0.0, top)[:, None])
            weight = weight / tl.maximum(tl.sum(weight, 1), 1e-30)[:, None]
            parts = tl.load(PartO + (part[:, None] + splits[None, :])[:, :, None] * HEAD_DIM + dims[None, None, :],
                            mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            out = tl.sum(weight[:, :, None] * parts, 1)
            tl.store(Attn + (b * n_heads + head)[:, None] * HEAD_DIM + dims[None, :],
                     out.to(Attn.dtype.element_ty), mask=r_ok[:, None])


@triton.jit
def _matmul_add_stage(X, W, In, rows, row_ok, pid, n_programs, d_model, width,
                      BB: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """X[rows] += In[rows] @ W.T, W (d_model, width): o_proj over the attention output, down over the FFN's."""
    for item in range(pid, tl.cdiv(d_model, 16), n_programs):
        cols = item * 16 + tl.arange(0, 16)
        col_ok = cols < d_model
        acc = tl.zeros((BB, 16), tl.float32)
        for k0 in range(0, width, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < width
            a = tl.load(In + rows[:, None] * width + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                        cache_modifier=".cg")
            w = tl.load(W + cols[:, None] * width + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)
        at = X + rows[:, None] * d_model + cols[None, :]  # the residual stream stays float32
        ok = row_ok[:, None] & col_ok[None, :]
        tl.store(at, tl.load(at, mask=ok, other=0.0, cache_modifier=".cg") + acc, mask=ok)


@triton.jit
def _gate_up_stage(X, NormW, W, Act, rows, row_ok, pid, n_programs, eps, d_model, d_ff,
                   BB: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    for item in range(pid, tl.cdiv(d_ff, 16), n_programs):
        cols = item * 16 + tl.arange(0, 16)
        col_ok = cols < d_ff
        gate, up = _normed_matmul_pair(X, NormW, W, cols, d_ff + cols, col_ok, rows, row_ok, d_model, eps,
                                       BB, BLOCK_K, PREC)
        dt = Act.dtype.element_ty  # rounded where the reference rounds: silu, then the product
        act = (gate * tl.sigmoid(gate)).to(dt) * up.to(dt)
        tl.store(Act + rows[:, None] * d_ff + cols[None, :], act, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _layers_kernel(X, Wqkv, Wo, Wgu, Wd, Norm1, Norm2, Kc, Vc, Q, PartO, PartL, Attn, Arrived, Act, Cos, Sin, Slots,
                   Start, Sync, layer_lo, layer_hi, batch, d_model, d_ff, n_heads, n_kv_heads, n_split, eps, qk_scale,
                   sc_layer, sc_b, sc_h, sc_l,
                   STAGE: tl.constexpr, BB: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                   INTERLEAVED: tl.constexpr, PREC: tl.constexpr):
    """STAGE -1: every stage of layers [layer_lo, layer_hi) with grid barriers between them; else that stage only."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    rows = tl.arange(0, BB)
    row_ok = rows < batch
    qkv_rows = (n_heads + 2 * n_kv_heads) * HEAD_DIM
    width = n_heads * HEAD_DIM
    for layer in range(layer_lo, layer_hi):
        at = tl.cast(layer, tl.int64)
        arrivals = (layer - layer_lo) * 5 * n_programs  # every program's arrivals at the earlier layers' barriers
        kc, vc = Kc + at * sc_layer, Vc + at * sc_layer
        if STAGE < 0 or STAGE == 0:
            _qkv_stage(X, Norm1 + at * d_model, Wqkv + at * qkv_rows * d_model, Q, kc, vc, Cos, Sin, Slots, Start,
                       rows, row_ok, pid, n_programs, eps, sc_b, sc_h, sc_l, d_model, n_heads, n_kv_heads,
                       BB, HEAD_DIM, INTERLEAVED, BLOCK_K, PREC)
            if STAGE < 0:
                _grid_barrier(Sync, arrivals + 1 * n_programs)
        if STAGE < 0 or STAGE == 1:
            _attention_stage(Q, kc, vc, PartO, PartL, Attn, Arrived, Slots, Start, layer, pid, n_programs, batch,
                             n_heads, n_kv_heads, n_split, sc_b, sc_h, sc_l, qk_scale,
                             GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SPLIT, PREC)
            if STAGE < 0:
                _grid_barrier(Sync, arrivals + 2 * n_programs)
        if STAGE < 0 or STAGE == 2:
            _matmul_add_stage(X, Wo + at * d_model * width, Attn, rows, row_ok, pid, n_programs, d_model, width,
                              BB, BLOCK_K, PREC)
            if STAGE < 0:
                _grid_barrier(Sync, arrivals + 3 * n_programs)
        if STAGE < 0 or STAGE == 3:
            _gate_up_stage(X, Norm2 + at * d_model, Wgu + at * 2 * d_ff * d_model, Act, rows, row_ok, pid,
                           n_programs, eps, d_model, d_ff, BB, BLOCK_K, PREC)
            if STAGE < 0:
                _grid_barrier(Sync, arrivals + 4 * n_programs)
        if STAGE < 0 or STAGE == 4:
            _matmul_add_stage(X, Wd + at * d_model * d_ff, Act, rows, row_ok, pid, n_programs, d_model, d_ff,
                              BB, BLOCK_K, PREC)
            if STAGE < 0 and layer < layer_hi - 1:  # the kernel's end orders the last layer's writes
                _grid_barrier(Sync, arrivals + 5 * n_programs)


_RESIDENT: dict[tuple, int] = {}


def _resident_per_sm(args: tuple, shape: tuple, meta: dict) -> int:
    """How many programs of the persistent kernel one SM holds at once (registers, shared memory, threads)."""
    key = (args[0].device, args[1].dtype, *sorted(meta.items()))
    if key not in _RESIDENT:
        kernel = _layers_kernel.warmup(*args, 0, 1, *shape, grid=(1,), STAGE=-1, **meta)
        kernel._init_handles()
        props = torch.cuda.get_device_properties(args[0].device)
        threads = 32 * meta["num_warps"]
        regs = math.ceil(kernel.n_regs * 32 / 256) * 256 * meta["num_warps"]  # allocated per warp in 256s
        smem = max(kernel.metadata.shared, 1)
        _RESIDENT[key] = max(1, min(getattr(props, "regs_per_multiprocessor", 65536) // regs,
                                    getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // smem,
                                    props.max_threads_per_multi_processor // threads))
    return _RESIDENT[key]


def n_splits(batch: int, n_kv_heads: int, cache_len: int, programs: int) -> int:
    """Key-range splits per (sequence, kv head): at most one attention work item per program."""
    return max(1, min(programs // (batch * n_kv_heads), cache_len // KEYS_PER_SPLIT))


def unsupported(x: torch.Tensor, weights: StackedWeights, k_cache: torch.Tensor) -> str | None:
    """Why these shapes cannot run here (None: they can)."""
    if not INTERPRET and not x.is_cuda:
        return "x must be a CUDA tensor"
    if weights.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={weights.head_dim} (supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    if weights.n_heads % weights.n_kv_heads or weights.n_heads // weights.n_kv_heads > 64:
        return f"{weights.n_heads} query heads over {weights.n_kv_heads} kv heads"
    if x.shape[0] > 64:
        return f"batch {x.shape[0]} > 64 (the matmuls hold the whole batch in one tile)"
    if k_cache.stride(-1) != 1 or k_cache.dtype != weights.qkv.dtype:
        return "the caches need a contiguous head_dim and the weights' dtype"
    return None


def decode_layers(x: torch.Tensor, weights: StackedWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor, start: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  scale: float | None = None, persistent: bool = True) -> torch.Tensor:
    """x (batch, d_model) -> the last layer's output (batch, d_model); k_cache and v_cache
    (layers, batch, kv_heads, cache_len, head_dim) get each layer's new key and value at slots[0]. cos and sin:
    RoPE's tables (positions, head_dim / 2). scale: of the attention scores (None: 1 / sqrt(head_dim))."""
    problem = unsupported(x, weights, k_cache)
    if problem:
        raise ValueError(f"decode_layers: {problem}")
    scale = 1.0 / math.sqrt(weights.head_dim) if scale is None else float(scale)
    return _decode_layers_op(x, weights.qkv, weights.o, weights.gate_up, weights.down, weights.norm_attn,
                             weights.norm_ffn, k_cache, v_cache, slots, start, cos, sin, weights.n_heads,
                             weights.n_kv_heads, weights.rope_interleaved, eps, scale, persistent)


# A custom op, so torch.compile treats the launch as one opaque call (and a CUDA graph captures it).
@torch.library.custom_op("lmlab::decode_layers", mutates_args=("k_cache", "v_cache"))
def _decode_layers_op(x: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      norm_attn: torch.Tensor, norm_ffn: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor, start: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                      n_kv_heads: int, interleaved: bool, eps: float, scale: float, persistent: bool) -> torch.Tensor:
    batch, d_model = x.shape
    n_layers, cache_len, head_dim = k_cache.shape[0], k_cache.shape[3], k_cache.shape[4]
    group = n_heads // n_kv_heads
    d_ff = down.shape[2]
    programs = sm_count(x.device)
    split = n_splits(batch, n_kv_heads, cache_len, programs)
    f32 = dict(dtype=torch.float32, device=x.device)
    residual = x.to(torch.float32, copy=True)
    q = torch.empty(batch, n_heads, head_dim, **f32)
    part_out = torch.empty(batch, n_heads, split, head_dim, **f32)
    part_lse = torch.empty(batch, n_heads, split, **f32)
    attn = torch.empty(batch, n_heads * head_dim, dtype=x.dtype, device=x.device)
    arrived = torch.zeros(batch * n_kv_heads, dtype=torch.int32, device=x.device)
    act = torch.empty(batch, d_ff, dtype=x.dtype, device=x.device)
    sync = torch.zeros(1, dtype=torch.int32, device=x.device)
    args = (residual, qkv, o, gate_up, down, norm_attn, norm_ffn, k_cache, v_cache, q, part_out, part_lse, attn,
            arrived, act, cos, sin, slots, start, sync)
    meta = dict(BB=max(16, triton.next_power_of_2(batch)), HEAD_DIM=head_dim, GROUP=group,
                BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=32,
                BLOCK_SPLIT=triton.next_power_of_2(split), BLOCK_K=BLOCK_K, INTERLEAVED=interleaved,
                PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    shape = (batch, d_model, d_ff, n_heads, n_kv_heads, split, eps, scale * LOG2E,
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3))
    if persistent:
        programs *= min(PROGRAMS_PER_SM, _resident_per_sm(args, shape, meta))
        _layers_kernel[(programs,)](*args, 0, n_layers, *shape, STAGE=-1, **meta)
    else:
        for layer in range(n_layers):
            for stage in range(N_STAGES):
                _layers_kernel[(programs,)](*args, layer, layer + 1, *shape, STAGE=stage, **meta)
    return residual.to(x.dtype)


@_decode_layers_op.register_fake
def _(x, qkv, o, gate_up, down, norm_attn, norm_ffn, k_cache, v_cache, slots, start, cos, sin, n_heads, n_kv_heads,
      interleaved, eps, scale, persistent):
    return torch.empty_like(x)
