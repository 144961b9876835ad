"""Can a forward written in Gluon overlap the softmax with the tensor cores, as FlashAttention-3 does?

lmlab's Triton forward waits for each block's scores right after issuing them: Triton 3.6 keeps a
wgmma in flight across loop iterations only when its result is the next wgmma's accumulator, so
scores that the softmax reads never are (the shipped loop, rewritten to carry the next block's
scores from one iteration to the next, still compiled for sm_90 to a `wgmma.wait_group 0` right
after every Q K^T). Gluon, Triton's lower-level language, lets the kernel say when to wait. This forward
(causal, bf16, sm_90) takes FlashAttention-3's order: iteration j issues block j's scores, then block
j-1's P V, waits for the scores alone (wgmma groups complete in order) and runs block j's softmax
on the CUDA cores while the tensor cores compute P V; then it waits for P V and rescales. K and V
arrive by TMA in a ring of NUM_BUF slots, block j-1+NUM_BUF loading into the slot that block j-1
frees. Programs follow `flash_triton`'s schedule (heaviest query blocks first, heads in groups
that share K/V in L2).

The order matters to ptxas too: a register written while a wgmma is in flight (zeroing the next
scores, a new P over the one that P V reads, a copy of in-flight scores at a loop's back edge) makes
it serialize every wgmma (warnings C7514/C7515, a `WARPGROUP.DEPBAR` after each HGMMA in the SASS).
Compiled offline for sm_90a (`attention_sass.py`), this kernel has none and no spills (107 registers
at D64, 146 at D128: 128 x 64 tiles, 8 warps).

Each setting is timed beside the shipped Triton forward (autotuned) and SDPA (cuDNN), forward only,
medians with L2 emptied, at the training steps' and the issue's shapes; every output and LSE is
checked against SDPA and the shipped kernel first.

Probe limits: causal self-attention, as many K/V heads as query heads, sequence a multiple of 128,
head_dim 64 or 128, bf16, Hopper.

    python experiments/kernels/attention_gluon_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lmlab.kernels.bench import median_seconds
from lmlab.kernels.flash_triton import flash_attention_triton_forward


@gluon.constexpr_function
def wgmma_layout(num_warps, n):
    """Registers of a (rows, n) wgmma result: the warps stacked along the rows, 16 rows each."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _schedule(n_blocks, n_heads, N_SMS, HEAVY_LAST: gl.constexpr):
    """flash_triton._schedule for causal attention: (block, head) of this program, heaviest blocks first."""
    pid = gl.program_id(0)
    group = gl.minimum(gl.cdiv(4 * N_SMS, n_blocks + 1), n_heads)
    last = n_heads // group - 1
    first = gl.minimum(pid // (group * n_blocks), last) * group
    size = gl.where(first == last * group, n_heads - first, group)
    rest = pid - first * n_blocks
    block = rest // size
    if HEAVY_LAST:
        block = n_blocks - 1 - block
    return block, first + rest % size


@gluon.jit
def ring(a_desc, b_desc, NUM_BUF: gl.constexpr):
    """Shared memory for NUM_BUF blocks each of two tensors that TMA streams in (their descriptors' blocks), and an
    mbarrier per block and tensor, initialised (the kernel fences after its last initialisation)."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF, a_desc.block_shape[0], a_desc.block_shape[1]],
                                       a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUF, b_desc.block_shape[0], b_desc.block_shape[1]],
                                       b_desc.layout)
    a_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    b_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(NUM_BUF):
        mbarrier.init(a_bars.index(slot), count=1)
        mbarrier.init(b_bars.index(slot), count=1)
    return a_smem, b_smem, a_bars, b_bars


@gluon.jit
def resident_pair(a_desc, b_desc):
    """Shared memory for one block each of two tensors that stay for the whole program, and one mbarrier for both,
    initialised."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_shape, b_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    return a_smem, b_smem, bar


@gluon.jit
def load_pair(a_desc, b_desc, a_smem, b_smem, bar, row):
    """Start the TMA copies of both tensors' blocks at `row` into a resident pair; `bar` completes its phase 0
    once both have landed."""
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [row, 0], bar, a_smem)
    tma.async_copy_global_to_shared(b_desc, [row, 0], bar, b_smem)


@gluon.jit
def load_block(a_desc, b_desc, a_smem, b_smem, a_bars, b_bars, row0, i, end, NUM_BUF: gl.constexpr):
    """Start the TMA copies of block i of both tensors (rows row0 + i * block rows) into ring slot i % NUM_BUF;
    none when i >= end. Block i is that slot's ((i - first) // NUM_BUF)-th load, where first is the ring's first
    block: its barriers' phase parity."""
    BLOCK: gl.constexpr = a_desc.block_shape[0]
    slot = i % NUM_BUF
    ok = i < end
    mbarrier.expect(a_bars.index(slot), a_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(a_desc, [row0 + i * BLOCK, 0], a_bars.index(slot), a_smem.index(slot), pred=ok)
    mbarrier.expect(b_bars.index(slot), b_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(b_desc, [row0 + i * BLOCK, 0], b_bars.index(slot), b_smem.index(slot), pred=ok)


@gluon.jit
def release(resident_bar, a_bars, b_bars, NUM_BUF: gl.constexpr):
    """Invalidate a kernel's mbarriers at its end: the resident tiles' and the ring's."""
    mbarrier.invalidate(resident_bar)
    for slot in gl.static_range(NUM_BUF):
        mbarrier.invalidate(a_bars.index(slot))
        mbarrier.invalidate(b_bars.index(slot))


@gluon.jit
def _scores(q_smem, k_smem, k_bars, j, s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_BUF: gl.constexpr):
    """Issue key block j's Q K^T once its K has landed: an asynchronous wgmma group."""
    slot = j % NUM_BUF
    mbarrier.wait(k_bars.index(slot), (j // NUM_BUF) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    return warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_i, j, start_m, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Block j's online-softmax step (the causal mask where the block reaches the diagonal): its P as the
    P V wgmma's register operand, the new row max and sum, and the factor that rescales the output."""
    if j * BLOCK_N + BLOCK_N > start_m:
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    p = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    return p, m_new, l_i, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))


@gluon.jit
def _pv(p, acc, v_smem, v_bars, j, NUM_BUF: gl.constexpr):
    """Issue block j's P V into the accumulator once its V has landed: an asynchronous wgmma group."""
    slot = j % NUM_BUF
    mbarrier.wait(v_bars.index(slot), (j // NUM_BUF) & 1)
    return warpgroup_mma(p, v_smem.index(slot), acc, is_async=True)


@gluon.jit
def _fwd(q_desc, k_desc, v_desc, o_desc, LSE, SEQ, qk_scale, N_SMS, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
         BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr):
    s_layout: gl.constexpr = wgmma_layout(NUM_WARPS, BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(NUM_WARPS, HEAD_DIM)
    n_blocks = SEQ // BLOCK_M
    pid_m, bh = _schedule(n_blocks, gl.num_programs(0) // n_blocks, N_SMS, True)
    start_m = pid_m * BLOCK_M
    row0 = bh * SEQ  # this head's first row in the (batch * heads * seq, head_dim) views
    n_kv = (start_m + BLOCK_M) // BLOCK_N  # key blocks up to the diagonal's end

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_smem, v_smem, k_bars, v_bars = ring(k_desc, v_desc, NUM_BUF)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + start_m, 0], q_bar, q_smem)
    for i in gl.static_range(NUM_BUF):
        load_block(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, row0, i, n_kv, NUM_BUF)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    mbarrier.wait(q_bar, 0)
    # FlashAttention-3's order: each iteration issues block j's scores, then block j-1's P V; it waits for
    # the scores alone (wgmma groups complete in order) and runs block j's softmax while the tensor cores
    # compute P V. Registers that the compiler writes while a wgmma is in flight (zeroing the next scores,
    # rescaling the output, a new P over the one P V reads) would make ptxas serialize every wgmma; in
    # this order each is written after a wait that leaves nothing in flight.
    s = warpgroup_mma_wait(0, deps=[_scores(q_smem, k_smem, k_bars, 0, s_layout, BLOCK_M, BLOCK_N, NUM_BUF)])
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, 0, start_m, qk_scale, s_layout, o_layout, BLOCK_M, BLOCK_N)
    for j in range(1, n_kv):
        s = _scores(q_smem, k_smem, k_bars, j, s_layout, BLOCK_M, BLOCK_N, NUM_BUF)
        acc = _pv(p, acc, v_smem, v_bars, j - 1, NUM_BUF)
        s = warpgroup_mma_wait(1, deps=[s])
        p_next, m_i, l_i, alpha = _softmax(s, m_i, l_i, j, start_m, qk_scale, s_layout, o_layout, BLOCK_M,
                                           BLOCK_N)
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])  # p: kept alive until its P V is done
        # block j-1's K and V are no longer read: its slot takes block j - 1 + NUM_BUF
        load_block(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, row0, j - 1 + NUM_BUF, n_kv, NUM_BUF)
        acc = warpgroup_mma_init(acc * gl.expand_dims(alpha, 1))
        p = p_next
    acc = warpgroup_mma_wait(0, deps=[_pv(p, acc, v_smem, v_bars, n_kv - 1, NUM_BUF)])

    out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    q_smem.store(out.to(o_desc.dtype))  # Q is no longer read: its buffer stages O for the TMA store
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0 + start_m, 0], q_smem)
    offs = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    gl.store(LSE + bh.to(gl.int64) * SEQ + offs, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(0)
    release(q_bar, k_bars, v_bars, NUM_BUF)


def descriptors(tensors_and_rows, head_dim: int) -> list:
    """TMA descriptors of contiguous (batch, heads, seq, head_dim) tensors as (rows, head_dim) views, each with
    its block's rows."""
    descs = []
    for t, rows in tensors_and_rows:
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)
        descs.append(TensorDescriptor.from_tensor(t.view(-1, head_dim), [rows, head_dim], layout))
    return descs


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int, block_n: int, num_buf: int,
                  warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of contiguous bf16 (batch, heads, seq, head_dim) q, k, v -> (out, lse)."""
    b, h, s, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    descs = descriptors(((q, block_m), (k, block_n), (v, block_n), (out, block_m)), d)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    _fwd[(s // block_m * b * h,)](*descs, lse, s, math.log2(math.e) / math.sqrt(d), sms, HEAD_DIM=d,
                                  BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=num_buf, NUM_WARPS=warps,
                                  num_warps=warps)
    return out, lse


SHAPES = [(16, 16, 2048, 64), (16, 16, 2048, 128), (4, 16, 4096, 128), (1, 16, 16384, 64)]


def shape_arg(text: str) -> tuple[int, int, int, int]:
    """--shapes B,H,S,D (a small one, say 1,2,512,64, checks a kernel in a second)."""
    b, h, s, d = (int(x) for x in text.split(","))
    return b, h, s, d


def worst(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, str]:
    """The largest absolute error, and where: (batch, head, row) of a (batch, heads, rows, ...) tensor. A mask, ring
    slot or barrier phase that is off shows as errors in whole blocks of rows."""
    err = (got.float() - expected.float()).abs()
    per_row = err.reshape(*err.shape[:3], -1).amax(-1)
    b, h, row = (int(i) for i in torch.unravel_index(per_row.argmax(), per_row.shape))
    return per_row.max().item(), f"b{b} h{h} row {row}"


def measure(name: str, fn, check, shape: str, flops: float, repeats: int, dev: torch.device) -> dict | None:
    """check(fn()) -> its error fields (the first two printed), then fn timed; a setting that fails to compile or
    launch is reported, not fatal."""
    try:
        errors = check(fn())
        seconds = median_seconds(fn, repeats, 3, dev)
    except Exception as exc:
        print(f"{shape} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
        return None
    row = {"shape": shape, "impl": name, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12, **errors}
    err, where = list(errors.values())[:2]
    print(f"{shape:20} {name:44} {row['ms']:7.3f} ms {row['tflops']:6.1f} TFLOP/s err {err:.1e} ({where})",
          flush=True)
    return row


SETTINGS = [(128, 64, 2, 8), (128, 64, 3, 8), (128, 128, 2, 8), (64, 64, 2, 4), (64, 64, 3, 4), (64, 32, 3, 4)]


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--shapes", type=shape_arg, nargs="+", default=SHAPES, help="B,H,S,D ...")
    return parser.parse_args()


def write_rows(path: str | None, dev: torch.device, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    dev = torch.device("cuda")
    rows = []
    for b, h, s, d in args.shapes:
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s * s * d / 2
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        expected_lse = flash_attention_triton_forward(q, k, v, True)[1]

        def check(result: tuple) -> dict:
            out, lse = result
            err, where = worst(out, expected)
            lse_err = 0.0 if lse is None else (lse - expected_lse).abs().max().item()
            return {"max_abs_err": err, "worst_at": where, "lse_max_abs_err": lse_err}

        candidates = {"sdpa": lambda: (F.scaled_dot_product_attention(q, k, v, is_causal=True), None),
                      "shipped, autotuned": lambda: flash_attention_triton_forward(q, k, v, True)}
        for setting in SETTINGS:
            candidates[f"gluon {setting}"] = lambda setting=setting: gluon_forward(q, k, v, *setting)
        measured = (measure(name, fn, check, f"B{b} H{h} S{s} D{d}", flops, args.repeats, dev)
                    for name, fn in candidates.items())
        rows += [row for row in measured if row is not None]
    write_rows(args.json, dev, rows)


if __name__ == "__main__":
    main()
