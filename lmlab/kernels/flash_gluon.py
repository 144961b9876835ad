"""Causal attention on Hopper written in Gluon: FlashAttention-3's overlap of the softmax with the tensor cores.

`flash_triton` takes this path on sm_90 GPUs for causal self-attention in bfloat16 or float16 with head_dim 64
or 128 and a sequence length that is a multiple of 128 (`applies`); every other call runs its Triton kernels.

The kernels (`flash_gluon_kernels`) overlap the softmax with the tensor cores as FlashAttention-3 does,
which Triton's own compiler does not on sm_90; `flash_gluon_ws` has FlashAttention-3's warp-specialized forward, dQ
and dK/dV (a TMA loader warp and two consumer warpgroups over 128 rows), the fastest at head_dim 128. This module picks
and launches them.

Inputs are read where they lie: a (batch, heads, seq, head_dim) tensor whose rows sit at a fixed stride (a
contiguous one, or a "b s (h d) -> b h s d" view of a projection, even of a fused one) is a 2-D TMA
descriptor over its storage, and head h of batch b starts at row b * rb + h * rh, column h * ch (`_Rows`).
Outputs (out, lse, dq, dk, dv) are contiguous, as the Triton kernels' are.

The tile settings (BLOCK_M, BLOCK_N, NUM_BUF, warps; the forward's also whether Q is a register operand) are timed
on the first call per (dtype, head_dim, seq, group) and the fastest kept: the forward's alone, the backward's as
(dQ, dK/dV) pairs of whole backwards. The dQ candidates include the Triton dQ kernel (`backward`'s triton_dq),
which was the fastest pair's at B1 H16 S16384 D64 on an H100 (experiments/kernels/README.md). Beside the pairs
runs FlashAttention-3's fused backward (`flash_gluon_fused`: dQ reduced from the dK/dV pass by TMA, five block
matmuls instead of seven) in its warp-specialized form, up to WS_MAX_GROUP query heads a kv head: at head_dim 64
it beat every pair by 16% (H100, 2026-12-06). The fused kernel's one-warpgroup form measured slower than the
pairs; it runs only when asked.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lmlab.kernels.flash_gluon_fused import FUSED_WS_MAXNREG, dkdvq_kernel, dkdvq_ws_kernel, prepare_kernel
from lmlab.kernels.flash_gluon_kernels import dkdv_kernel, dq_kernel, forward_kernel
from lmlab.kernels.flash_gluon_ws import MAXNREG, ROWS_PER_CONSUMER, dkdv_ws_kernel, dq_ws_kernel, forward_ws_kernel
from lmlab.kernels.flash_triton import _sm_count
from lmlab.timing import cold_gpu_medians

HEAD_DIMS = (64, 128)
SEQ_MULTIPLE = 128  # every setting's blocks divide the sequence: no ragged blocks to mask
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_LOG2E = math.log2(math.e)

Setting = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, NUM_BUF, num_warps)
FwdSetting = tuple[int, int, int, int, bool]  # and Q_IN_REGS: Q as the register operand of each Q K^T
DkdvSetting = tuple[int, int, int, int, bool]  # and KV_IN_REGS
# The fastest few of the probes' sweeps (experiments/kernels/attention_gluon_probe.py and _bwd_probe.py) at
# B16 H16 S2048 D64/D128, B4 H16 S4096 D128 and B1 H16 S16384 D64 on an H100. Q in registers made 64 x 64 tiles
# 1-3% faster (2026-12-06); the dQ kernel's resident tiles in registers made no setting the fastest.
FWD_SETTINGS: tuple[FwdSetting, ...] = ((128, 64, 3, 8, False), (64, 64, 2, 4, True), (64, 64, 3, 4, True))


@dataclass(frozen=True)
class WsSetting:
    """A setting of a warp-specialized query-block kernel (`flash_gluon_ws`, forward or dQ; 128 query rows a
    program): rows per key block, ring slots, and whether its two consumer warpgroups take turns to issue their
    products."""

    block_n: int
    num_buf: int
    pingpong: bool


# The fastest at B4 H16 S4096 D128, B16 H16 S2048 D128 and B1 H16 S16384 D64 on an H100 (2026-12-06: 64-row key
# blocks, at either head_dim, and a third slot were slower).
FWD_WS_SETTINGS: dict[int, tuple[WsSetting, ...]] = {d: (WsSetting(128, 2, True), WsSetting(128, 2, False))
                                                     for d in HEAD_DIMS}


@dataclass(frozen=True)
class DkdvWsSetting:
    """A setting of the warp-specialized dK/dV kernel (`flash_gluon_ws`; 128 key rows a program): rows per
    streamed query block, ring slots, whether its two consumer warpgroups take turns, and whether K and V are
    their register operands."""

    block_m: int
    num_buf: int
    pingpong: bool
    kv_in_regs: bool = False


# Compiled offline for sm_90a with wgmmas overlapped, up to WS_MAX_GROUP query heads a kv head (at head_dim 128,
# 64-row query blocks spill and serialize them, and so does K/V in registers; at 64 that spills 8-16 bytes a
# thread). On an H100 (2026-12-06) the head_dim-128 ones were the fastest dK/dV at B4 H16 S4096 D128, 2-3% ahead
# of dkdv_kernel's best, and two slots 25% slower; at head_dim 64 none beat dkdv_kernel's (64, 64, 4, 4, True) at
# B1 H16 S16384.
DKDV_WS_SETTINGS: dict[int, tuple[DkdvWsSetting, ...]] = {
    64: (DkdvWsSetting(64, 3, True), DkdvWsSetting(64, 3, True, True), DkdvWsSetting(64, 4, True, True)),
    128: (DkdvWsSetting(32, 3, True), DkdvWsSetting(32, 3, False), DkdvWsSetting(32, 4, True))}
DQ_SETTINGS: tuple[Setting, ...] = ((64, 64, 3, 4), (64, 64, 2, 4), (128, 64, 3, 8))
# The warp-specialized dQ's: at head_dim 128 (64, 3, ping-pong) made the backward 7% faster at B4 H16 S4096 (H100,
# 2026-12-06: 1.478 ms against 1.593 with dq_kernel's best; two slots were slower, 128-row key blocks spill); at 64
# each setting tried ran 8-23% slower than the Triton dQ at B1 H16 S16384, so there are none.
DQ_WS_SETTINGS: dict[int, tuple[WsSetting, ...]] = {64: (), 128: (WsSetting(64, 3, True), WsSetting(64, 3, False))}
# dK/dV: with KV_IN_REGS (K and V as the register operands of S^T and dP^T) only at head_dim 64, where it keeps
# its wgmmas overlapped without spilling; at 128 ptxas serializes them (experiments/kernels/attention_sass.py).
# (64, 64, 4, 4, True) was the fastest at B1 H16 S16384 D64 once LSE and delta came by TMA (H100, 2026-12-06).
_DKDV_TILES = ((64, 64, 2, 4), (64, 64, 3, 4), (32, 64, 3, 4), (32, 64, 4, 4))
DKDV_SETTINGS: dict[int, tuple[DkdvSetting, ...]] = {
    64: tuple((*t, False) for t in _DKDV_TILES) + ((64, 64, 3, 4, True), (64, 64, 4, 4, True)),
    128: tuple((*t, False) for t in _DKDV_TILES)}
# The fused backward's (opt-in: `backward`'s fused_setting), per head_dim: compiled for sm_90a, these keep the
# wgmmas overlapped; all but head_dim 128's hold their registers without spilling (it spills 288 bytes a thread);
# the others need more shared memory than a block has, or ptxas serializes their wgmmas
# (experiments/kernels/attention_sass.py).
FUSED_SETTINGS: dict[int, tuple[Setting, ...]] = {64: ((64, 64, 2, 4), (64, 128, 2, 8), (64, 128, 3, 8)),
                                                  128: ((64, 128, 2, 8),)}
# The warp-specialized fused backward's (`flash_gluon_fused.dkdvq_ws_kernel`, timed beside the pairs). Compiled for
# sm_90a without GQA these keep the wgmmas overlapped, spilling 112-132 bytes a thread at head_dim 64 and 12-20 at
# 128 (at a group of 4: 724 and 60); with K and V in registers ptxas serializes them (C7512).
FUSED_WS_SETTINGS: dict[int, tuple[DkdvWsSetting, ...]] = {
    64: (DkdvWsSetting(64, 3, True), DkdvWsSetting(64, 3, False), DkdvWsSetting(64, 4, True)),
    128: (DkdvWsSetting(32, 3, True), DkdvWsSetting(32, 3, False), DkdvWsSetting(32, 4, True))}
# The warp-specialized dK/dV and fused kernels unroll their loop over the query heads of a kv head (GROUP of them):
# as a runtime loop ptxas serialized their wgmmas (C7513). Up to 4 heads they compile overlapped; at 8 the dK/dV
# kernel's are serialized again, so larger groups leave them out. At 4 (H100, 2026-12-06, B4 H16 S4096 D128 and
# B1 H16 S16384 D64, KV4) they made the backward 6% and 21% faster than the picks without them.
WS_MAX_GROUP = 4
_PREPARE_ROWS = 64  # rows per program of the fused backward's delta and zeroing
# LSE's and delta's blocks in shared memory: one row of BLOCK_M float32s, unswizzled (TMA swizzles rows of at
# most the swizzle's width; nothing reads them as a wgmma operand)
STATS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def applies(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """Whether these 4-D inputs take the Gluon kernels (on NVIDIA's sm_90 only: ROCm's MI200 also reads 9.0)."""
    return (q.is_cuda and causal and q.dtype in _GL_DTYPES and q.shape[-1] in HEAD_DIMS
            and q.shape[2] == k.shape[2] and q.shape[2] % SEQ_MULTIPLE == 0
            and torch.version.hip is None and torch.cuda.get_device_capability(q.device) == (9, 0))


@dataclass(frozen=True)
class _Rows:
    """A (batch, heads, seq, head_dim) tensor as a 2-D (rows, columns) view of its storage at its row stride:
    head h of batch b starts at row b * rb + h * rh, column h * ch. A contiguous tensor has rb = heads * seq,
    rh = seq, ch = 0; a "b s (h d) -> b h s d" view has rb = seq, rh = 0, ch = its head stride; an expanded
    (stride 0) axis has 0."""

    view: torch.Tensor
    rb: int
    rh: int
    ch: int

    @classmethod
    def of(cls, t: torch.Tensor) -> _Rows:
        """t's view, or a contiguous copy's where its strides fit none (TMA also needs 16-byte aligned rows
        and start: a contiguous t that starts off alignment is copied too)."""
        rows = cls._fit(t)
        return rows if rows is not None else cls._fit(t.clone(memory_format=torch.contiguous_format))

    @classmethod
    def _fit(cls, t: torch.Tensor) -> _Rows | None:
        batch, heads, seq, dim = t.shape
        sb, sh, r, sd = t.stride()
        if sd != 1 or r % 8 or t.data_ptr() % 16 or (batch > 1 and sb % r):
            return None
        rb = sb // r if batch > 1 else 0
        if heads == 1 or sh % r == 0:
            rh, ch = (sh // r if heads > 1 else 0), 0
        elif sh % 8 == 0 and (heads - 1) * sh + dim <= r:  # heads side by side in a row
            rh, ch = 0, sh
        else:
            return None
        return cls(t.as_strided(((batch - 1) * rb + (heads - 1) * rh + seq, (heads - 1) * ch + dim), (r, 1)),
                   rb, rh, ch)

    def descriptor(self, block_rows: int, dim: int) -> TensorDescriptor:
        layout = gl.NVMMASharedLayout.get_default_for([block_rows, dim], _GL_DTYPES[self.view.dtype])
        return TensorDescriptor.from_tensor(self.view, [block_rows, dim], layout)

    @property
    def origin(self) -> tuple[int, int, int]:
        return self.rb, self.rh, self.ch


_FASTEST: dict[tuple, object] = {}
_PICK_REPEATS = 9  # timed calls of each candidate setting


def _fastest(key: tuple, launches: dict[object, Callable[[], None]]) -> Callable[[], None]:
    """The launch that ran fastest when first timed for `key`: medians of GPU time from a cold L2, the candidates
    in turns (`lmlab.timing.cold_gpu_medians`). Triton's do_bench, used before, also timed the host's launch
    overhead, which a training step hides; it picked a backward pair 4% slower than the best (H100,
    2026-12-06). A setting that needs more shared memory than the GPU has is skipped."""
    if key not in _FASTEST:
        runnable = {}
        for name, launch in launches.items():
            try:
                launch()  # compiles
                runnable[name] = launch
            except triton.runtime.errors.OutOfResources:
                continue
        for _ in range(2):  # warm-up: the GPU's clocks ramp
            for launch in runnable.values():
                launch()
        seconds = cold_gpu_medians(runnable, _PICK_REPEATS, torch.cuda.current_device())
        _FASTEST[key] = min(seconds, key=seconds.get)
    return launches[_FASTEST[key]]


def _in_turn(*launches: Callable[[], None]) -> None:
    for launch in launches:
        launch()


def _grid(seq: int, block: int, heads: int) -> tuple[int]:
    return (seq // block * heads,)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            setting: FwdSetting | WsSetting | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of 4-D q (batch, heads, seq, head_dim) and k, v (batch, kv_heads, seq, head_dim) that
    `applies` to -> (out, lse): out contiguous in q's dtype, lse float32 (batch, heads, seq) in natural log.
    `setting` picks the kernel and its tiles; by default the fastest of FWD_SETTINGS and FWD_WS_SETTINGS."""
    batch, heads, seq, dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    qr, kr, vr, outr = (_Rows.of(t) for t in (q, k, v, out))
    group = heads // k.shape[1]

    def launch(block_m: int, block_n: int, num_buf: int, warps: int, q_in_regs: bool) -> None:
        forward_kernel[_grid(seq, block_m, batch * heads)](
            qr.descriptor(block_m, dim), kr.descriptor(block_n, dim), vr.descriptor(block_n, dim),
            outr.descriptor(block_m, dim), lse, *qr.origin, *kr.origin, *vr.origin, heads, group, seq,
            scale * _LOG2E, _sm_count(q.device), HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=num_buf,
            NUM_WARPS=warps, Q_IN_REGS=q_in_regs, num_warps=warps)

    def launch_ws(ws: WsSetting) -> None:
        forward_ws_kernel[_grid(seq, 2 * ROWS_PER_CONSUMER, batch * heads)](
            qr.descriptor(ROWS_PER_CONSUMER, dim), kr.descriptor(ws.block_n, dim), vr.descriptor(ws.block_n, dim),
            outr.descriptor(ROWS_PER_CONSUMER, dim), lse, *qr.origin, *kr.origin, *vr.origin, heads, group, seq,
            scale * _LOG2E, _sm_count(q.device), HEAD_DIM=dim, BLOCK_N=ws.block_n, NUM_BUF=ws.num_buf,
            PINGPONG=ws.pingpong, num_warps=4, maxnreg=MAXNREG)

    def launch_at(s: FwdSetting | WsSetting) -> Callable[[], None]:
        return functools.partial(launch_ws, s) if isinstance(s, WsSetting) else functools.partial(launch, *s)

    if setting:
        launch_at(setting)()
    else:
        candidates = (*FWD_SETTINGS, *FWD_WS_SETTINGS[dim])
        _fastest(("fwd", q.dtype, dim, seq, group), {s: launch_at(s) for s in candidates})()
    return out, lse


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             d_out: torch.Tensor, scale: float,
             triton_dq: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
             dq_setting: Setting | WsSetting | str | None = None,
             dkdv_setting: DkdvSetting | DkdvWsSetting | None = None,
             fused_setting: Setting | DkdvWsSetting | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`forward`'s gradients: (dq, dk, dv), contiguous, in q's dtype. Two kernels: dQ (which stores delta =
    rowsum(dO * O)), then dK/dV, at the pair of DQ_SETTINGS + DQ_WS_SETTINGS and DKDV_SETTINGS +
    DKDV_WS_SETTINGS whose whole backward ran fastest (timed on the first call per (dtype, head_dim, seq, group))
    unless `dq_setting` / `dkdv_setting` pin them; unpinned, the warp-specialized fused backward at
    FUSED_WS_SETTINGS runs in that race too (named ("fused", setting)). The warp-specialized dK/dV and fused
    kernels are candidates only where a kv head serves at most WS_MAX_GROUP query heads.
    `triton_dq(dq, delta)`, when given, fills both with flash_triton's dQ kernel: one more dQ candidate, named
    "triton" (dq_setting may name it). `fused_setting` runs a fused kernel (`flash_gluon_fused`) instead: the
    warp-specialized one at a DkdvWsSetting, the one-warpgroup one at a Setting (slower than the two kernels at
    every shape measured, experiments/kernels/README.md, 2026-12-06, so never timed by default)."""
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    out, lse = out.contiguous(), lse.contiguous()
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    delta = torch.empty_like(lse)
    qr, kr, vr, dor, dqr, dkr, dvr = (_Rows.of(t) for t in (q, k, v, d_out, dq, dk, dv))

    def stats(block_m: int) -> tuple[TensorDescriptor, TensorDescriptor]:
        """LSE's and delta's descriptors for the key-block kernels, which read them by TMA beside Q and dO."""
        return tuple(TensorDescriptor.from_tensor(t.view(-1), [block_m], STATS_LAYOUT) for t in (lse, delta))
    origins = (*qr.origin, *kr.origin, *vr.origin, *dor.origin, heads, group, seq, scale * _LOG2E, scale,
               _sm_count(q.device))

    def launch_dq(block_m: int, block_n: int, num_buf: int, warps: int) -> None:
        dq_kernel[_grid(seq, block_m, batch * heads)](
            qr.descriptor(block_m, dim), kr.descriptor(block_n, dim), vr.descriptor(block_n, dim),
            dor.descriptor(block_m, dim), dqr.descriptor(block_m, dim), out, lse, delta, *origins,
            HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=num_buf, NUM_WARPS=warps, num_warps=warps)

    def launch_dq_ws(ws: WsSetting) -> None:
        dq_ws_kernel[_grid(seq, 2 * ROWS_PER_CONSUMER, batch * heads)](
            qr.descriptor(ROWS_PER_CONSUMER, dim), kr.descriptor(ws.block_n, dim), vr.descriptor(ws.block_n, dim),
            dor.descriptor(ROWS_PER_CONSUMER, dim), dqr.descriptor(ROWS_PER_CONSUMER, dim), out, lse, delta,
            *origins, HEAD_DIM=dim, BLOCK_N=ws.block_n, NUM_BUF=ws.num_buf, PINGPONG=ws.pingpong, num_warps=4,
            maxnreg=MAXNREG)

    def dq_at(s: Setting | WsSetting) -> Callable[[], None]:
        return functools.partial(launch_dq_ws, s) if isinstance(s, WsSetting) else functools.partial(launch_dq, *s)

    def launch_dkdv(block_m: int, block_n: int, num_buf: int, warps: int, kv_in_regs: bool) -> None:
        dkdv_kernel[_grid(seq, block_n, batch * kv_heads)](
            qr.descriptor(block_m, dim), kr.descriptor(block_n, dim), vr.descriptor(block_n, dim),
            dor.descriptor(block_m, dim), dkr.descriptor(block_n, dim), dvr.descriptor(block_n, dim),
            *stats(block_m), *origins, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=num_buf,
            NUM_WARPS=warps, KV_IN_REGS=kv_in_regs, num_warps=warps)

    def launch_dkdv_ws(ws: DkdvWsSetting) -> None:
        dkdv_ws_kernel[_grid(seq, 2 * ROWS_PER_CONSUMER, batch * kv_heads)](
            qr.descriptor(ws.block_m, dim), kr.descriptor(ROWS_PER_CONSUMER, dim),
            vr.descriptor(ROWS_PER_CONSUMER, dim), dor.descriptor(ws.block_m, dim),
            dkr.descriptor(ROWS_PER_CONSUMER, dim), dvr.descriptor(ROWS_PER_CONSUMER, dim), *stats(ws.block_m),
            *origins, HEAD_DIM=dim, BLOCK_M=ws.block_m, NUM_BUF=ws.num_buf, PINGPONG=ws.pingpong,
            KV_IN_REGS=ws.kv_in_regs, num_warps=4, maxnreg=MAXNREG)

    def dkdv_at(s: DkdvSetting | DkdvWsSetting) -> Callable[[], None]:
        return (functools.partial(launch_dkdv_ws, s) if isinstance(s, DkdvWsSetting)
                else functools.partial(launch_dkdv, *s))

    def launch_fused(s: Setting | DkdvWsSetting) -> None:
        """The fused backward: delta and a zeroed float32 dQ, the kernel at setting s (the warp-specialized one at
        a DkdvWsSetting), then dQ in q's dtype."""
        acc = torch.empty(batch * heads * seq, dim, dtype=torch.float32, device=q.device)  # dQ, reduced into
        prepare_kernel[(batch * heads * seq // _PREPARE_ROWS,)](
            out, dor.view, delta, acc, *dor.origin, dor.view.stride(0), heads, seq, HEAD_DIM=dim,
            BLOCK=_PREPARE_ROWS, NUM_WARPS=4, num_warps=4)
        block_m = s.block_m if isinstance(s, DkdvWsSetting) else s[0]
        acc_desc = TensorDescriptor.from_tensor(
            acc, [block_m, dim], gl.NVMMASharedLayout.get_default_for([block_m, dim], gl.float32))
        if isinstance(s, DkdvWsSetting):
            dkdvq_ws_kernel[_grid(seq, 2 * ROWS_PER_CONSUMER, batch * kv_heads)](
                qr.descriptor(block_m, dim), kr.descriptor(ROWS_PER_CONSUMER, dim),
                vr.descriptor(ROWS_PER_CONSUMER, dim), dor.descriptor(block_m, dim),
                dkr.descriptor(ROWS_PER_CONSUMER, dim), dvr.descriptor(ROWS_PER_CONSUMER, dim), acc_desc,
                *stats(block_m), *origins, HEAD_DIM=dim, BLOCK_M=block_m, NUM_BUF=s.num_buf, PINGPONG=s.pingpong,
                KV_IN_REGS=s.kv_in_regs, num_warps=4, maxnreg=FUSED_WS_MAXNREG)
        else:
            _, block_n, num_buf, warps = s
            dkdvq_kernel[_grid(seq, block_n, batch * kv_heads)](
                qr.descriptor(block_m, dim), kr.descriptor(block_n, dim), vr.descriptor(block_n, dim),
                dor.descriptor(block_m, dim), dkr.descriptor(block_n, dim), dvr.descriptor(block_n, dim), acc_desc,
                *stats(block_m), *origins, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=num_buf,
                NUM_WARPS=warps, num_warps=warps)
        dq.copy_(acc.view(dq.shape))

    if fused_setting is not None:
        launch_fused(fused_setting)
        return dq, dk, dv

    dq_launches: dict[object, Callable[[], None]] = {s: dq_at(s) for s in (*DQ_SETTINGS, *DQ_WS_SETTINGS[dim])}
    if triton_dq is not None:
        dq_launches["triton"] = functools.partial(triton_dq, dq, delta)
    if dq_setting is not None:
        dq_launches = {dq_setting: dq_launches.get(dq_setting) or dq_at(dq_setting)}
    warp_specialized = group <= WS_MAX_GROUP
    dkdv_settings = ((dkdv_setting,) if dkdv_setting
                     else (*DKDV_SETTINGS[dim], *(DKDV_WS_SETTINGS[dim] if warp_specialized else ())))
    # Timed as whole backwards, pairs of settings: the dQ kernel timed alone ranked its candidates otherwise
    # than in the backward it belongs to (2026-12-06, H100: the pick took 3.697 ms where the best pair took 3.519).
    pairs = {(name, setting): functools.partial(_in_turn, dq_launches[name], dkdv_at(setting))
             for name in dq_launches for setting in dkdv_settings}
    if dq_setting is None and dkdv_setting is None and warp_specialized:
        pairs.update({("fused", s): functools.partial(launch_fused, s) for s in FUSED_WS_SETTINGS[dim]})
    if len(pairs) == 1:
        next(iter(pairs.values()))()
    else:
        _fastest(("bwd", q.dtype, dim, seq, group, *dq_launches, dkdv_setting), pairs)()
    return dq, dk, dv
