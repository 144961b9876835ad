"""Does a weight stream that runs ahead of the grid barriers lift a batch-1 decode step toward the bandwidth bound?

    python experiments/inference/stream_gemv_probe.py [--layers 24] [--repeats 20] [--chunk-kb 16] [--swizzle 128]
        [--ring-kb 160] [--warps 4] [--counters 1]
        [--variants NAME ...] [--json F]

The megakernel (lmlab.kernels.decode_layers_triton) reads each stage's weights only after the grid barrier that
opens the stage, so every barrier and every latency-bound stage (attention) leaves DRAM idle: its batch-1 step reads
at ~40% of the copy bandwidth (experiments/inference/README.md, "the megakernel's hardware counters"). Weights do
not depend on the activations, so a loader warp could stream them into a ring of shared memory through the
barriers, limited only by the ring's size. This probe measures that design on llama400m's matrix-vector chain
alone: per layer q/k/v (3072 x 1024), o_proj (1024 x 1024), gate/up (5632 x 1024) and down (1024 x 2816), each
stage's input the previous stage's output (its first K entries), with a grid barrier between every two stages
(one more a layer than the megakernel, which needs none before o_proj).

One Gluon program per SM: a loader warp TMA-copies the program's share of every stage's weight chunks (a TMA box:
rows of 256 columns unswizzled, or of the swizzle's width) into a ring of slots; the compute warps (--warps) wait at
each grid barrier, stage the input vector in shared memory, multiply each chunk as it lands and add each row block's
sum into the stage's float32 output with atomics. The variants (VARIANTS) differ in one thing each: whether the
loader also waits at the barriers (the megakernel's order of events), whether there are barriers or weights at all
(what the rest of the chain costs), whether outputs travel as tagged words instead of atomics and barriers, whether
the tensor cores do the products (bf16), and whether the compute warps only drain the stream (what it reaches alone,
with or without the barriers). bf16 and int8 weights (codes and a scale per row, chunks of the same bytes), each
against the device copy bandwidth measured in the same process, and checked against the same chain in float32 on the
host.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lmlab.inference.bench import copy_bandwidth
from lmlab.inference.quant.grid import INT8, round_to_nearest
from lmlab.kernels.flash_gluon_ws import _bars

D_MODEL, D_FF, QKV = 1024, 2816, 3072
STAGES = ((QKV, D_MODEL), (D_MODEL, D_MODEL), (2 * D_FF, D_MODEL), (D_MODEL, D_FF))  # (rows, columns)
MAX_WIDTH = 4096  # the widest input a stage may have
ACT_WIDTH = 2 * D_FF  # one row of float32 outputs per stage
# what the compute warps do with each chunk: multiply it in registers; on the tensor cores, each chunk's wgmmas
# waited for or one chunk's left in flight; or only wait for it and free its slot (no input, products or outputs:
# what the loader's stream alone reaches)
SCALAR, WGMMA_WAITED, WGMMA, DRAIN = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2), gl.constexpr(3)
SPREAD = gl.constexpr(64)  # int32s between a grid barrier's counters (--counters): 256 bytes, apart in L2
# SYNC: what a stage waits for (0: nothing) - every program's arrival at the grid barrier, or only the arrivals of
# its own group's programs (pid % --counters), a barrier of that group alone (the outputs are then wrong)
GRID, GROUPS = gl.constexpr(1), gl.constexpr(2)


@gluon.jit
def _wait_count(Sync, target):
    """Spin until Sync reaches target, reading it with acquire semantics."""
    seen = gl.atomic_add(Sync, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = gl.atomic_add(Sync, 0, sem="acquire", scope="gpu")


@gluon.jit
def _group_counter(Sync, pid, n_programs, COUNTERS: gl.constexpr):
    """This program's group (pid % COUNTERS): its counter (SPREAD int32s apart, after Sync) and how many programs
    it has."""
    group = pid % COUNTERS
    return Sync + SPREAD * (1 + group), (n_programs - group + COUNTERS - 1) // COUNTERS


@gluon.jit
def _arrive(Sync, pid, n_programs, arrivals, SYNC: gl.constexpr, COUNTERS: gl.constexpr):
    """Count this program in at the barrier (its `arrivals`-th), released: at its group's counter (GROUPS), at Sync
    (one counter), or through a tree: the program arrives at its group's counter, and the group's last arrival adds
    the group's size to Sync, so the arrivals queue at COUNTERS addresses, not one, and the waiters still read one
    counter."""
    gl.thread_barrier()  # every warp's writes are issued before the release
    counter, members = _group_counter(Sync, pid, n_programs, COUNTERS)
    if SYNC == GROUPS:
        gl.atomic_add(counter, 1, sem="release", scope="gpu")
    elif COUNTERS == 1:
        gl.atomic_add(Sync, 1, sem="release", scope="gpu")
    else:
        before = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if before + 1 == arrivals * members:  # acquired every member's release: pass them on in one
            gl.atomic_add(Sync, members, sem="release", scope="gpu")


@gluon.jit
def _await_stage(Sync, pid, n_programs, stage, SYNC: gl.constexpr, COUNTERS: gl.constexpr):
    """Before a stage: wait for every program's arrival at the grid barrier (GRID), or for those of this program's
    group (GROUPS), then hold every warp until the one that polled has seen it."""
    if SYNC and (stage > 0):
        if SYNC == GROUPS:
            counter, members = _group_counter(Sync, pid, n_programs, COUNTERS)
            _wait_count(counter, stage * members)
        else:
            _wait_count(Sync, stage * n_programs)
        gl.thread_barrier()


@gluon.jit
def _share(pid, n_programs, n_blocks, KC: gl.constexpr, WHOLE_ROWS: gl.constexpr):
    """This program's contiguous range of a stage's chunks (row-block-major, KC a row block): whole row blocks with
    WHOLE_ROWS, else an even split that may cut a row block between programs (whose sums then meet in atomics)."""
    if WHOLE_ROWS:
        start, end = pid * n_blocks // n_programs * KC, (pid + 1) * n_blocks // n_programs * KC
    else:
        start, end = pid * (n_blocks * KC) // n_programs, (pid + 1) * (n_blocks * KC) // n_programs
    return start, end


@gluon.jit
def _input(Row, K: gl.constexpr, layout: gl.constexpr):
    """The first K floats of a stage's row of Act (its input), zero-padded to a power of 2."""
    cols = gl.arange(0, triton.next_power_of_2(K), layout=layout)
    return gl.load(Row + cols, mask=cols < K, other=0.0)


@gluon.jit
def _in_chunks(x_smem, staged, COLS: gl.constexpr):
    """A stage's input stored in shared memory, viewed as (chunk, COLS) once every warp has stored its part."""
    x_smem.slice(0, staged.shape[0]).store(staged)
    gl.thread_barrier()
    return x_smem._reinterpret(gl.float32, [x_smem.shape[0] // COLS, COLS], x_smem.layout)


@gluon.jit
def _tagged_input(Row, tag, K: gl.constexpr, layout: gl.constexpr):
    """The first K words of a row of (tag << 32 | float32 bits) words, read again until every one carries `tag`:
    a value and its flag arrive in one 8-byte store, so no fence or counter stands between producer and reader."""
    cols = gl.arange(0, triton.next_power_of_2(K), layout=layout)
    words = gl.load(Row + cols, mask=cols < K, other=0, volatile=True)
    while gl.sum((((words >> 32).to(gl.int32) != tag) & (cols < K)).to(gl.int32), 0) > 0:
        words = gl.load(Row + cols, mask=cols < K, other=0, volatile=True)
    return words.to(gl.int32).to(gl.float32, bitcast=True)


@gluon.jit
def _load_stage(desc, ring, ready, free, i, layer, Sync, target, pid, n_programs, N: gl.constexpr,
                K: gl.constexpr, RUN_AHEAD: gl.constexpr, WEIGHTS: gl.constexpr, TAGGED: gl.constexpr):
    """Copy this program's chunks of one stage of one layer into the ring, each as a slot frees (after the
    stage's grid barrier unless RUN_AHEAD); returns the running chunk count."""
    ROWS: gl.constexpr = desc.block_shape[0]
    COLS: gl.constexpr = desc.block_shape[1]
    KC: gl.constexpr = K // COLS
    NUM_BUF: gl.constexpr = ring.shape[0]
    if not RUN_AHEAD:
        _wait_count(Sync, target)
    start, end = _share(pid, n_programs, (N // ROWS) * WEIGHTS, KC, TAGGED)
    for t in range(start, end):
        slot = i % NUM_BUF
        mbarrier.wait(free.index(slot), ((i // NUM_BUF) & 1) ^ 1)  # a fresh mbarrier's previous phase is done
        mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [layer * N + (t // KC) * ROWS, (t % KC) * COLS], ready.index(slot),
                                        ring.index(slot))
        i += 1
    return i


@gluon.jit
def _loader(descs, ring, ready, free, Sync, layers, pid, n_programs, NS: gl.constexpr, KS: gl.constexpr,
            RUN_AHEAD: gl.constexpr, WEIGHTS: gl.constexpr, TAGGED: gl.constexpr):
    i = 0
    for layer in range(layers):
        for s in gl.static_range(4):
            target = (layer * 4 + s) * n_programs
            i = _load_stage(descs[s], ring, ready, free, i, layer, Sync, target, pid, n_programs, NS[s], KS[s],
                            RUN_AHEAD, WEIGHTS, TAGGED)


@gluon.jit
def _compute_stage(desc, Scales, ring, ready, free, x_smem, i, layer, Act, Sync, stage, pid, n_programs,
                   N: gl.constexpr, K: gl.constexpr, ACT_WIDTH: gl.constexpr, SYNC: gl.constexpr,
                   WEIGHTS: gl.constexpr, TAGGED: gl.constexpr, COUNTERS: gl.constexpr):
    """One stage in the compute warps: wait for its input, multiply this program's chunks by it as they land and
    add (or store, TAGGED) each row block's sums; returns the running chunk count."""
    ROWS: gl.constexpr = desc.block_shape[0]
    COLS: gl.constexpr = desc.block_shape[1]
    KC: gl.constexpr = K // COLS
    NUM_BUF: gl.constexpr = ring.shape[0]
    VEC: gl.constexpr = 128 // desc.dtype.primitive_bitwidth  # 16 bytes a thread: 8 bf16 or 16 int8 weights
    LANES: gl.constexpr = COLS // VEC  # lanes across a chunk's row: each row's sum stays in its warp
    w_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES, LANES], [gl.num_warps(), 1], [1, 0])
    x_layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    rows_layout: gl.constexpr = gl.SliceLayout(1, w_layout)

    # the stage's input, staged in shared memory as (chunk, COLS)
    if TAGGED:
        staged = _tagged_input(Act + stage * ACT_WIDTH, stage, K, x_layout)
    else:
        _await_stage(Sync, pid, n_programs, stage, SYNC, COUNTERS)
        staged = _input(Act + stage * ACT_WIDTH, K, x_layout)
    x_chunks = _in_chunks(x_smem, staged, COLS)

    out = Act + (stage + 1) * ACT_WIDTH
    start, end = _share(pid, n_programs, (N // ROWS) * WEIGHTS, KC, TAGGED)
    acc = gl.zeros([ROWS, COLS], gl.float32, w_layout)  # products, summed over the row block's chunks
    for t in range(start, end):
        slot = i % NUM_BUF
        mbarrier.wait(ready.index(slot), (i // NUM_BUF) & 1)
        w = ring.index(slot).load(w_layout).to(gl.float32)
        x = x_chunks.index(t % KC).load(gl.SliceLayout(0, w_layout))
        gl.thread_barrier()  # every warp has read the slot before the loader may refill it
        mbarrier.arrive(free.index(slot), count=1)
        acc += w * gl.expand_dims(x, 0)
        i += 1
        if (t % KC == KC - 1) | (t == end - 1):  # the row block's last chunk here: add its sums
            sums = gl.sum(acc, 1)
            rows = layer * N + (t // KC) * ROWS + gl.arange(0, ROWS, layout=rows_layout)
            if Scales is not None:
                sums = sums * gl.load(Scales + rows)
            outs = out + (t // KC) * ROWS + gl.arange(0, ROWS, layout=rows_layout)
            if TAGGED:  # whole rows: each value is final, stored with its stage's tag
                bits = sums.to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF
                gl.store(outs, bits | ((stage + 1).to(gl.int64) << 32))
            else:
                gl.atomic_add(outs, sums, sem="relaxed")
            acc = gl.zeros([ROWS, COLS], gl.float32, w_layout)
    if TAGGED and not WEIGHTS:  # no products, but the next stage still waits for its rows' tags
        tagged_zero = gl.zeros([ROWS], gl.int64, rows_layout) | ((stage + 1).to(gl.int64) << 32)
        for block in range(pid * (N // ROWS) // n_programs, (pid + 1) * (N // ROWS) // n_programs):
            gl.store(out + block * ROWS + gl.arange(0, ROWS, layout=rows_layout), tagged_zero)
    if not TAGGED:
        _arrive(Sync, pid, n_programs, stage + 1, SYNC, COUNTERS)
    return i


@gluon.jit
def _mma_stage(desc, ring, ready, free, x_smem, b_smem, i, layer, Act, Sync, stage, pid, n_programs, N: gl.constexpr,
               K: gl.constexpr, ACT_WIDTH: gl.constexpr, SYNC: gl.constexpr, IN_FLIGHT: gl.constexpr,
               COUNTERS: gl.constexpr):
    """_compute_stage on the tensor cores (bf16 weights): each chunk is a wgmma's A operand straight from the ring
    and the input chunk a (COLS, 8) B operand (the input in every column), so the warps issue a few instructions a
    chunk instead of converting and multiplying every weight. The input is read once into x_smem (float32) and only
    the B chunks of this program's columns are built from it; IN_FLIGHT wgmma groups stay in flight, their slots
    freed as each completes."""
    WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = desc.block_shape[0]
    COLS: gl.constexpr = desc.block_shape[1]
    KC: gl.constexpr = K // COLS
    NUM_BUF: gl.constexpr = ring.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                          instr_shape=[16, 8, 16])
    b_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, WARPS], [1, 0])
    x_layout: gl.constexpr = gl.BlockedLayout([4], [32], [WARPS], [0])
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)

    _await_stage(Sync, pid, n_programs, stage, SYNC, COUNTERS)
    x_chunks = _in_chunks(x_smem, _input(Act + stage * ACT_WIDTH, K, x_layout), COLS)
    start, end = _share(pid, n_programs, N // ROWS, KC, False)
    for t in range(start, gl.minimum(end, start + KC)):  # B chunks (8, COLS), K-major, of this program's columns
        x = gl.expand_dims(x_chunks.index(t % KC).load(gl.SliceLayout(0, b_layout)), 0)
        b_smem.index(t % KC).store((x + gl.zeros([8, COLS], gl.float32, b_layout)).to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()

    out = Act + (stage + 1) * ACT_WIDTH
    first_column = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, acc_layout)), 0) == 0
    acc = gl.zeros([ROWS, 8], gl.float32, acc_layout)
    for t in range(start, end):
        slot = i % NUM_BUF
        mbarrier.wait(ready.index(slot), (i // NUM_BUF) & 1)
        # a row block's first chunk here starts its sums afresh (use_acc, not a zeroed accumulator, which would
        # make ptxas wait for the wgmmas in flight)
        acc = warpgroup_mma(ring.index(slot), b_smem.index(t % KC).permute((1, 0)), acc,
                            use_acc=(t % KC != 0) & (t != start), is_async=True)
        acc = warpgroup_mma_wait(IN_FLIGHT, deps=[acc])
        if IN_FLIGHT:  # the previous chunk's wgmmas are done: its slot may refill
            if t > start:
                mbarrier.arrive(free.index((i - 1) % NUM_BUF), count=1)
        else:
            mbarrier.arrive(free.index(slot), count=1)
        i += 1
        if (t % KC == KC - 1) | (t == end - 1):  # the row block's last chunk here: add its sums
            acc = warpgroup_mma_wait(0, deps=[acc])
            outs = out + (t // KC) * ROWS + gl.arange(0, ROWS, layout=rows_layout)
            gl.atomic_add(outs, gl.sum(gl.where(first_column, acc, 0.0), 1), sem="relaxed")
    if IN_FLIGHT and end > start:
        mbarrier.arrive(free.index((i - 1) % NUM_BUF), count=1)
    _arrive(Sync, pid, n_programs, stage + 1, SYNC, COUNTERS)
    return i


@gluon.jit
def _drain_stage(desc, ring, ready, free, i, Sync, stage, pid, n_programs, N: gl.constexpr, K: gl.constexpr,
                 SYNC: gl.constexpr, COUNTERS: gl.constexpr):
    """Wait for each of this program's chunks of a stage and free its slot at once; with SYNC, between the
    stage's grid barriers (no input, products or outputs: what the stream and the barriers cost together)."""
    ROWS: gl.constexpr = desc.block_shape[0]
    KC: gl.constexpr = K // desc.block_shape[1]
    NUM_BUF: gl.constexpr = ring.shape[0]
    _await_stage(Sync, pid, n_programs, stage, SYNC, COUNTERS)
    start, end = _share(pid, n_programs, N // ROWS, KC, False)
    for t in range(start, end):
        mbarrier.wait(ready.index(i % NUM_BUF), (i // NUM_BUF) & 1)
        mbarrier.arrive(free.index(i % NUM_BUF), count=1)
        i += 1
    if SYNC:
        _arrive(Sync, pid, n_programs, stage + 1, SYNC, COUNTERS)
    return i


@gluon.jit
def _compute(descs, scales, ring, ready, free, x_smem, b_smem, Act, Sync, layers, pid, n_programs,
             NS: gl.constexpr, KS: gl.constexpr, ACT_WIDTH: gl.constexpr, SYNC: gl.constexpr, WEIGHTS: gl.constexpr,
             TAGGED: gl.constexpr, CONSUMER: gl.constexpr, COUNTERS: gl.constexpr):
    i = 0
    for layer in range(layers):
        for s in gl.static_range(4):
            if CONSUMER == DRAIN:
                i = _drain_stage(descs[s], ring, ready, free, i, Sync, layer * 4 + s, pid, n_programs, NS[s], KS[s],
                                 SYNC, COUNTERS)
            elif CONSUMER != SCALAR:
                i = _mma_stage(descs[s], ring, ready, free, x_smem, b_smem, i, layer, Act, Sync, layer * 4 + s, pid,
                               n_programs, NS[s], KS[s], ACT_WIDTH, SYNC, CONSUMER - WGMMA_WAITED,
                               COUNTERS)
            else:
                i = _compute_stage(descs[s], scales[s], ring, ready, free, x_smem, i, layer, Act, Sync,
                                   layer * 4 + s, pid, n_programs, NS[s], KS[s], ACT_WIDTH, SYNC, WEIGHTS, TAGGED,
                                   COUNTERS)


@gluon.jit
def stream_kernel(d0, d1, d2, d3, S0, S1, S2, S3, Act, Sync, layers, NS: gl.constexpr, KS: gl.constexpr,
                  ACT_WIDTH: gl.constexpr, MAX_WIDTH: gl.constexpr, NUM_BUF: gl.constexpr, RUN_AHEAD: gl.constexpr,
                  SYNC: gl.constexpr, WEIGHTS: gl.constexpr, TAGGED: gl.constexpr, CONSUMER: gl.constexpr,
                  COUNTERS: gl.constexpr):
    pid = gl.program_id(0)
    n_programs = gl.num_programs(0)
    ring = gl.allocate_shared_memory(d0.dtype, [NUM_BUF] + d0.block_shape, d0.layout)
    ready, free = _bars(NUM_BUF, 1), _bars(NUM_BUF, 1)
    x_smem = gl.allocate_shared_memory(gl.float32, [MAX_WIDTH], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if (CONSUMER == WGMMA) | (CONSUMER == WGMMA_WAITED):  # the input as B operands, an (8, COLS) block per chunk
        COLS: gl.constexpr = d0.block_shape[1]
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [MAX_WIDTH // COLS, 8, COLS],
                                           gl.NVMMASharedLayout.get_default_for([8, COLS], gl.bfloat16))
    else:
        b_smem = x_smem  # unused
    fence_async_shared()
    descs = (d0, d1, d2, d3)
    gl.warp_specialize([
        (_compute, (descs, (S0, S1, S2, S3), ring, ready, free, x_smem, b_smem, Act, Sync, layers, pid, n_programs,
                    NS, KS, ACT_WIDTH, SYNC, WEIGHTS, TAGGED, CONSUMER, COUNTERS)),
        (_loader, (descs, ring, ready, free, Sync, layers, pid, n_programs, NS, KS, RUN_AHEAD, WEIGHTS, TAGGED)),
    ], [1], [40])


class Chain:
    """llama400m's matrix-vector chain in one dtype: weights stacked per stage over the layers (int8: codes and a
    float32 scale per row), their TMA descriptors for chunks of `chunk_bytes`, and the float32 reference of one
    step."""

    def __init__(self, layers: int, dtype: torch.dtype, chunk_bytes: int, swizzle: int, generator: torch.Generator):
        self.layers, self.dtype, self.chunk_bytes, self.swizzle = layers, dtype, chunk_bytes, swizzle
        size = torch.empty((), dtype=dtype).element_size()
        # unswizzled: rows of 256 columns (a TMA box's widest); swizzled: rows of the swizzle's width, which a box
        # may not exceed
        cols = swizzle // size if swizzle else 256
        rows = chunk_bytes // (cols * size)
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8 * size, rank=2)
        self.weights, self.scales, self.descs = [], [], []
        for n, k in STAGES:
            w = torch.randn(layers * n, k, generator=generator) / k ** 0.5
            if dtype == torch.int8:
                codes, scale, _ = round_to_nearest(w, INT8, k, None, 0.0)  # one group a row: per channel
                self.weights.append(codes.to(torch.int8).cuda())
                self.scales.append(scale[:, 0].cuda())
            else:
                self.weights.append(w.to(dtype).cuda())
                self.scales.append(None)
            self.descs.append(TensorDescriptor.from_tensor(self.weights[-1], [rows, cols], layout))
        self.nbytes = sum(w.numel() * w.element_size() for w in self.weights)

    def dequantized(self, s: int) -> torch.Tensor:
        w = self.weights[s].float()
        return w if self.scales[s] is None else w * self.scales[s][:, None]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        for layer in range(self.layers):
            for s, (n, k) in enumerate(STAGES):
                x = self.dequantized(s)[layer * n:(layer + 1) * n] @ x[:k]
        return x


# name: (the loader runs ahead of the barriers, what programs wait for (SYNC), weights streamed, tagged words, what
# the compute warps do with a chunk). Without
# barriers the outputs are wrong (a stage may read its input before it is written): those rows time the rest of the
# chain. Tagged: each program owns whole row blocks and stores each output with its stage's tag in one 8-byte word,
# which the next stage reads until every tag is there (no atomics, no fence, no counter). Tensor cores (bf16 only):
# a wgmma per chunk (_mma_stage). Stream only: the loader's stream drained as it lands, with or without barriers.
# Group barriers: each program waits only for its group's (pid % --counters) programs, a stand-in for barriers of
# thread-block clusters (through L2, not distributed shared memory).
VARIANTS = {
    "megakernel order": (False, GRID.value, True, False, SCALAR.value),
    "stream ahead": (True, GRID.value, True, False, SCALAR.value),
    "no barriers": (True, 0, True, False, SCALAR.value),
    "barriers, no weights": (True, GRID.value, False, False, SCALAR.value),
    "neither": (True, 0, False, False, SCALAR.value),  # each stage's input staging, output atomics, release
    "tagged": (True, 0, True, True, SCALAR.value),
    "tagged, no weights": (True, 0, False, True, SCALAR.value),
    "stream ahead, tensor cores": (True, GRID.value, True, False, WGMMA.value),
    "stream ahead, tensor cores, each waited": (True, GRID.value, True, False, WGMMA_WAITED.value),
    "no barriers, tensor cores": (True, 0, True, False, WGMMA.value),
    "stream only": (True, 0, True, False, DRAIN.value),
    "barriers, stream only": (True, GRID.value, True, False, DRAIN.value),
    "group barriers, no weights": (True, GROUPS.value, False, False, SCALAR.value),
    "group barriers, stream only": (True, GROUPS.value, True, False, DRAIN.value),
}


def time_chain(chain: Chain, x0: torch.Tensor, ring_bytes: int, variant: str, repeats: int, warps: int,
               counters: int) -> dict:
    run_ahead, sync, weights, tagged, consumer = VARIANTS[variant]
    n_programs = torch.cuda.get_device_properties(0).multi_processor_count
    num_buf = ring_bytes // chain.chunk_bytes
    act = torch.zeros(chain.layers * 4 + 1, ACT_WIDTH, device="cuda", dtype=torch.int64 if tagged else torch.float32)
    # tagged: the input's words carry tag 0; every later row starts all zeros, so no tag it waits for (1 and up)
    first = x0.view(torch.int32).to(torch.int64) & 0xFFFFFFFF if tagged else x0
    sync_count = torch.zeros((counters + 1) * SPREAD.value, dtype=torch.int32, device="cuda")
    times = []
    for r in range(repeats + 3):
        act.zero_()
        act[0, :D_MODEL] = first
        sync_count.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        stream_kernel[(n_programs,)](
            *chain.descs, *chain.scales, act, sync_count, chain.layers, tuple(n for n, _ in STAGES),
            tuple(k for _, k in STAGES), ACT_WIDTH, MAX_WIDTH, num_buf, run_ahead, sync, int(weights), tagged,
            consumer, counters, num_warps=warps)
        end.record()
        end.synchronize()
        if r >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    out = act[-1, :D_MODEL]
    if tagged:
        out = (out & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    expected = chain.reference(x0)
    error = ((out - expected).norm() / expected.norm()).item()
    us = statistics.median(times)
    return {"dtype": str(chain.dtype).removeprefix("torch."), "chunk_bytes": chain.chunk_bytes,
            "swizzle": chain.swizzle, "num_buf": num_buf, "warps": warps, "counters": counters,
            "variant": variant, "us": us,
            "min_us": min(times), "max_us": max(times), "weight_bytes": chain.nbytes, "relative_error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--chunk-kb", type=int, nargs="+", default=[16], help="bytes a ring slot holds")
    parser.add_argument("--swizzle", type=int, nargs="+", default=[128], help="bytes (0: rows of 256 columns)")
    parser.add_argument("--ring-kb", type=int, default=160, help="the ring's shared memory")
    parser.add_argument("--warps", type=int, nargs="+", default=[4], help="compute warps a program")
    parser.add_argument("--counters", type=int, nargs="+", default=[1],
                        help="counters a grid barrier's arrivals spread over (powers of 2)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME")
    parser.add_argument("--json")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(D_MODEL, generator=generator).cuda()
    bandwidth = copy_bandwidth(torch.device("cuda"), repeats=args.repeats)  # issue 17's roofline's
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, triton {triton.__version__}")
    rows = []
    for dtype in (torch.bfloat16, torch.int8):
        for chunk_kb, swizzle in itertools.product(args.chunk_kb, args.swizzle):
            chain = Chain(args.layers, dtype, chunk_kb * 1024, swizzle, generator)
            bound = chain.nbytes / bandwidth * 1e6
            rows_a_chunk = chain.descs[0].block_shape[0]
            for warps, variant, counters in itertools.product(args.warps, args.variants, args.counters):
                # the tensor cores take bf16, and a wgmma's rows are 16 a warp; counters serve barriers only
                tensor_cores = VARIANTS[variant][4] in (WGMMA.value, WGMMA_WAITED.value)
                if tensor_cores and (dtype != torch.bfloat16 or rows_a_chunk < 16 * warps):
                    continue
                if counters > 1 and not VARIANTS[variant][1]:
                    continue
                row = time_chain(chain, x0, args.ring_kb * 1024, variant, args.repeats, warps, counters)
                row["of_copy_bound"] = bound / row["us"]
                rows.append(row)
                print(f"{row['dtype']:>8}, {chunk_kb:2d} KB chunks, swizzle {swizzle:3d}, {row['num_buf']:2d} slots, "
                      f"{warps:2d} warps, {counters:2d} counters, {variant:21}: {row['us']:6.1f} us "
                      f"(range {row['min_us']:.1f}-{row['max_us']:.1f}), "
                      f"{row['of_copy_bound']:4.0%} of the copy bound ({bound:.1f} us for {chain.nbytes / 1e6:.0f} "
                      f"MB), relative error {row['relative_error']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
