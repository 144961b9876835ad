"""Grid-wide synchronisation inside a persistent Triton kernel (lmlab.kernels.decode_layers_triton): counters read
with acquire semantics, grid barriers on an atomic count, bulk L2 prefetches, and timeline stamps."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_until(Counter, target):
    """Spin until the counter reaches `target`, reading it with acquire semantics (an add of 0, which compiles to
    `ld.acquire.gpu`): every write released before the increments that reached it is then visible."""
    seen = tl.atomic_add(Counter, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(Counter, 0, sem="acquire", scope="gpu")


@triton.jit
def stamp(Stamp, TIMELINE: tl.constexpr):
    """With TIMELINE, store the GPU's global timer (ns) at Stamp: each program's stage boundaries, which say where
    the step's time goes (experiments/inference/timeline_megakernel.py)."""
    if TIMELINE:
        tl.store(Stamp, tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                                  is_pure=False, pack=1))


@triton.jit
def prefetch_l2(Start, n_bytes):
    """Ask the L2 cache for n_bytes from Start (16-byte aligned; a multiple of 16), waiting for nothing: each thread
    of the program issues one bulk prefetch of up to 4 KiB (the copy engine's `cp.async.bulk.prefetch.L2`, sm_90)."""
    base = tl.full([1], 0, tl.int64) + Start.to(tl.int64)  # the same in every thread
    size = tl.full([1], 0, tl.int32) + n_bytes
    tl.inline_asm_elementwise("""{
        .reg .pred p;
        .reg .u32 off, size;
        .reg .u64 at;
        mov.u32 off, %tid.x;
        shl.b32 off, off, 12;
        setp.lt.u32 p, off, $2;
        sub.u32 size, $2, off;
        min.u32 size, size, 4096;
        cvt.u64.u32 at, off;
        add.u64 at, at, $1;
        @p cp.async.bulk.prefetch.L2.global [at], size;
        mov.u32 $0, 0;
    }""", "=r,l,r", [base, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(W, first, n_rows, width, first_item, n_programs, TILE: tl.constexpr):
    """prefetch_l2 of a program's items first_item, first_item + n_programs, ... of a stage whose item i is rows
    [i * TILE, (i + 1) * TILE) of W (n_rows x width, row-major) and starts at row `first`: their tiles then load from
    L2."""
    BYTES: tl.constexpr = W.dtype.element_ty.primitive_bitwidth // 8
    for item in range(first_item, tl.cdiv(n_rows, TILE), n_programs):
        row = item * TILE
        prefetch_l2(W + (first + row) * width, (tl.minimum(n_rows - row, TILE) * width * BYTES).to(tl.int32))


@triton.jit
def barrier_arrive(Sync):
    """Count this program in at the grid barrier, released: its writes so far are visible to whoever sees the count."""
    tl.debug_barrier()  # all of this program's stores are issued
    tl.atomic_add(Sync, 1, sem="release", scope="gpu")


@triton.jit
def grid_barrier(Sync, target, ARRIVED: tl.constexpr):
    """Arrive (unless ARRIVED: the program already has), then wait until every program has (Sync[0] reaches
    `target`): every program's writes before the barrier are visible to every program after it."""
    if not ARRIVED:
        barrier_arrive(Sync)
    wait_until(Sync, target)
    tl.debug_barrier()


@triton.jit
def let_next_launch(PDL: tl.constexpr):
    """With PDL (a launch of a chain of kernels with programmatic dependent launch): let the next kernel of the chain
    start as soon as every program of this one has got here, so its programs issue their weight loads while this
    one runs (`griddepcontrol.launch_dependents`)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel of the chain has finished and its writes are visible
    (`griddepcontrol.wait`); what a program loads before this must not be written by a kernel still running."""
    if PDL:
        gdc_wait()
