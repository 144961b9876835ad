"""The fused backward of lmlab's Hopper attention: dK, dV and dQ from one pass over the scores, as
FlashAttention-3 computes them (`flash_gluon.backward` launches them).

Two forms. `dkdvq_kernel`, one warpgroup a program over 64 keys, is slower than the two kernels at every shape
tried (1.25x their time at B1 H16 S16384 D64 on an H100, experiments/kernels/README.md, 2026-12-06), so
`flash_gluon` runs it only when asked for. `dkdvq_ws_kernel` is `flash_gluon_ws.dkdv_ws_kernel` (128 keys, two
consumer warpgroups and a loader warp) with a fourth partition, a warpgroup that forms each query block's dQ from
the dS^T both consumers leave in shared memory and reduces it, once per 128 keys: there 16% faster than the
fastest pair of kernels (2.658 ms against 3.166) and 15% faster than cuDNN's backward (3.110).

The two-kernel backward (`flash_gluon_kernels`' dQ, then dK/dV) computes S and dP twice: seven block matmuls
where five do. Here each key block's program also forms every query block's share of dQ, dS K, and adds it
into a float32 dQ with a TMA bulk reduction (`cp.reduce.async.bulk.tensor ... .add`): the TMA unit performs
the addition at the L2, so no program waits for another, as the atomics of a Triton kernel tried on
2026-12-03 made them do. Gluon 3.6 has no wrapper for that instruction; its builder has the operation
(`_tma_reduce_add`).

In `dkdvq_kernel`, per query block t of the ring, the loop issues block t's S^T = K Q^T and dP^T = V dO^T,
then block t-1's dV += P^T dO, dK += dS^T Q and dQ_{t-1} = dS K, waits for block t's scores alone and computes
its P^T and dS^T while the updates run. P^T and dS^T go to shared memory, two slots each (one written while the
other is read): no register operand stays alive across the updates, which is what lets head_dim 128 keep its
wgmmas overlapped (with registers for P^T ptxas serializes them there). dQ_{t-1} goes through a float32 buffer to its
reduction. `prepare_kernel` stores delta = rowsum(dO * O) and zeroes the float32 dQ first.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from lmlab.kernels.flash_gluon_kernels import (_first_query_block, _key_program, _load_queries, _next_query_block,
                                               _origin, _products, _query_stats, _release, _softmax_grad, _store_dkdv,
                                               wgmma_layout)
from lmlab.kernels.flash_gluon_ws import HALF, LOADER_REGS, _bars, _dkdv_consumer, _dkdv_loader, _key_ws_program

# Registers a thread of the warp-specialized fused kernel: its four warpgroups (two consumers, the dQ partition,
# the loader's warp padded to one) share an SM's 64K, 128 each at launch; setmaxnreg then moves them to the
# consumers: 2 * 208 + 72 + 24 = 4 * 128.
FUSED_WS_MAXNREG = 128
FUSED_CONSUMER_REGS = gl.constexpr(208)
DQ_REGS = gl.constexpr(72)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[the descriptor's block at coord] += src (shared memory): a TMA bulk reduction, awaited like a
    TMA store (`tma.store_wait`)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _swizzled(rows, cols, dtype):
    """The shared layout a wgmma reads a (rows, cols) operand from, either way round."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


@gluon.constexpr_function
def _dq_layout(num_warps, rows, cols):
    """Registers of a query block's (rows, cols) dQ share: warpgroups stacked along the rows while the rows
    last (64 each), side by side along the columns after (8 warps, 64 queries: two halves of head_dim)."""
    along_rows = min(num_warps, rows // 16)
    along_cols = num_warps // along_rows
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[along_rows, along_cols],
                                     instr_shape=[16, cols // along_cols, 16])


@gluon.jit
def prepare_kernel(O, DO, DELTA, DQ, DO_RB, DO_RH, DO_CH, DO_STRIDE, HEADS, SEQ, HEAD_DIM: gl.constexpr,
                   BLOCK: gl.constexpr, NUM_WARPS: gl.constexpr):
    """delta = rowsum(dO * O) and a zeroed float32 dQ for BLOCK rows of one (batch, head): O, DELTA and DQ
    contiguous, dO in its 2-D view (`flash_gluon._Rows`, row stride DO_STRIDE)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    n_blocks = SEQ // BLOCK
    bh = gl.program_id(0) // n_blocks
    start = gl.program_id(0) % n_blocks * BLOCK
    do_row, do_col = _origin(bh // HEADS, bh % HEADS, DO_RB, DO_RH, DO_CH)
    rows = start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout)), 0)
    stat = bh.to(gl.int64) * SEQ + rows
    o = gl.load(O + gl.expand_dims(stat, 1) * HEAD_DIM + cols)
    do = gl.load(DO + gl.expand_dims((do_row + rows).to(gl.int64), 1) * DO_STRIDE + do_col + cols)
    gl.store(DELTA + stat, gl.sum(o.to(gl.float32) * do.to(gl.float32), 1))
    gl.store(DQ + gl.expand_dims(stat, 1) * HEAD_DIM + cols, gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout))


@gluon.jit
def _add_dq(dq, scale, dq_smem, dq_desc, row):
    """Add dq * scale into the float32 dQ at `row`, staged in dq_smem once the previous reduction has read it."""
    tma.store_wait(0)
    dq_smem.store(dq * scale)
    fence_async_shared()
    _tma_reduce_add(dq_desc, [row, 0], dq_smem)


@gluon.jit
def _updates(p_smem, ds_smem, dv, dk, dq, q_smem, do_smem, k_smem, t, NUM_BUF: gl.constexpr):
    """Issue the ring's block t's dV += P^T dO, dK += dS^T Q and dQ_t = dS K (P^T and dS^T from their slots
    t % 2): three wgmma groups."""
    slot = t % NUM_BUF
    ds = ds_smem.index(t % 2)
    dv = warpgroup_mma(p_smem.index(t % 2), do_smem.index(slot), dv, is_async=True)
    dk = warpgroup_mma(ds, q_smem.index(slot), dk, is_async=True)
    dq = warpgroup_mma(ds.permute((1, 0)), k_smem, dq, use_acc=False, is_async=True)
    return dv, dk, dq


@gluon.jit
def dkdvq_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc, Q_RB, Q_RH,
                 Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, DO_RB, DO_RH, DO_CH, HEADS, GROUP: gl.constexpr, SEQ,
                 qk_scale, scale, N_SMS, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr):
    """dK and dV for one key block of one kv head, and its share of dQ for every query block of the query heads
    it serves, added into the float32 dQ (zeroed by `prepare_kernel`; LSE and delta as 1-D descriptors over
    contiguous (batch, heads, seq) tensors; dK, dV and dQ contiguous)."""
    st_layout: gl.constexpr = wgmma_layout(NUM_WARPS, BLOCK_M)
    kv_layout: gl.constexpr = wgmma_layout(NUM_WARPS, HEAD_DIM)
    descs = (q_desc, do_desc, lse_desc, delta_desc)
    b, hk, bhk, start_n, first, end, h_load, i_load, k_smem, v_smem, kv_bar, ring = _key_program(
        descs, k_desc, v_desc, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, DO_RB, DO_RH, DO_CH, HEADS,
        GROUP, SEQ, N_SMS, BLOCK_M, BLOCK_N, NUM_BUF)
    q_smem, do_smem, q_bars, do_bars = ring[0], ring[1], ring[4], ring[5]
    n_q_blocks = SEQ // BLOCK_M
    pds_layout: gl.constexpr = _swizzled(BLOCK_N, BLOCK_M, q_desc.dtype)
    p_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], pds_layout)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], pds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, dq_desc.block_shape, dq_desc.layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, _dq_layout(NUM_WARPS, BLOCK_M, HEAD_DIM))

    h, i, pt, dst = _first_query_block(k_smem, v_smem, ring, hk, GROUP, first, start_n, qk_scale, st_layout,
                                       q_desc.dtype, BLOCK_M, BLOCK_N, NUM_BUF)
    p_smem.index(0).store(pt)
    ds_smem.index(0).store(dst)
    fence_async_shared()
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    for t in range(1, end):
        h_prev = h
        i_prev = i
        h, i = _next_query_block(h, i, first, n_q_blocks, GROUP)
        st, dpt = _products(k_smem, v_smem, q_smem, do_smem, q_bars, do_bars, t, st_layout, NUM_BUF)
        dv, dk, dq = _updates(p_smem, ds_smem, dv, dk, dq_zero, q_smem, do_smem, k_smem, t - 1, NUM_BUF)
        cols, lse2, delta = _query_stats(ring, t, i, st_layout, BLOCK_M, NUM_BUF)
        st, dpt = warpgroup_mma_wait(3, deps=[st, dpt])
        pt, dst = _softmax_grad(st, dpt, cols, lse2, delta, i, start_n, qk_scale, st_layout, q_desc.dtype,
                                BLOCK_M, BLOCK_N)
        p_smem.index(t % 2).store(pt)  # the updates in flight read the other slots
        ds_smem.index(t % 2).store(dst)
        dv, dk, dq = warpgroup_mma_wait(0, deps=[dv, dk, dq])
        _add_dq(dq, scale, dq_smem, dq_desc, (b * HEADS + h_prev) * SEQ + i_prev * BLOCK_M)
        # block t-1's Q, dO and statistics are no longer read: its slot takes block t - 1 + NUM_BUF
        h_load, i_load = _next_query_block(h_load, i_load, first, n_q_blocks, GROUP)
        _load_queries(descs, ring, Q_RB, Q_RH, Q_CH, DO_RB, DO_RH, DO_CH, b, h_load, i_load, HEADS, SEQ,
                      t - 1 + NUM_BUF, end, BLOCK_M, NUM_BUF)
        dv = warpgroup_mma_init(dv)
        dk = warpgroup_mma_init(dk)
    dv, dk, dq = _updates(p_smem, ds_smem, dv, dk, dq_zero, q_smem, do_smem, k_smem, end - 1, NUM_BUF)
    dv, dk, dq = warpgroup_mma_wait(0, deps=[dv, dk, dq])
    _add_dq(dq, scale, dq_smem, dq_desc, (b * HEADS + h) * SEQ + i * BLOCK_M)
    _store_dkdv(dk, dv, scale, k_smem, v_smem, dk_desc, dv_desc, bhk * SEQ + start_n)
    _release(kv_bar, q_bars, do_bars, NUM_BUF)


@gluon.jit
def _dq_partition(k_smem, ds_halves, ready, free, dq_smem, dq_desc, b, hk, first, end, HEADS, SEQ, scale,
                  GROUP: gl.constexpr):
    """The warp-specialized fused kernel's dQ warpgroup: per ring block, once both consumers have put their rows
    of its dS^T in its slot, dQ_t = dS K over all 128 keys (a wgmma per consumer's 64), added (times scale) into
    the float32 dQ through one of two staging buffers."""
    BLOCK_M: gl.constexpr = ds_halves[0].shape[2]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    SWAP: gl.constexpr = BLOCK_M < 64  # a wgmma's M is 64 at least: form dQ^T = K^T dS^T instead
    if SWAP:
        zero = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, wgmma_layout(4, BLOCK_M))
    else:
        zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, wgmma_layout(4, HEAD_DIM))
    h = hk * GROUP
    i = first
    n_q_blocks = SEQ // BLOCK_M
    N_DS: gl.constexpr = ds_halves[0].shape[0]
    for t in range(end):
        slot = t % N_DS
        mbarrier.wait(ready.index(slot), (t // N_DS) & 1)
        if SWAP:
            dq = warpgroup_mma(k_smem.index(0).permute((1, 0)), ds_halves[0].index(slot), zero, use_acc=False,
                               is_async=True)
            dq = warpgroup_mma(k_smem.index(1).permute((1, 0)), ds_halves[1].index(slot), dq, is_async=True)
            dq = gl.permute(warpgroup_mma_wait(0, deps=[dq]), [1, 0])
        else:
            dq = warpgroup_mma(ds_halves[0].index(slot).permute((1, 0)), k_smem.index(0), zero, use_acc=False,
                               is_async=True)
            dq = warpgroup_mma(ds_halves[1].index(slot).permute((1, 0)), k_smem.index(1), dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=[dq])
        mbarrier.arrive(free.index(slot), count=1)
        tma.store_wait(1)  # the reduction that read this staging buffer two blocks ago is done
        staged = dq_smem.index(t % 2)
        staged.store(dq * scale)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [(b * HEADS + h) * SEQ + i * BLOCK_M, 0], staged)
        h, i = _next_query_block(h, i, first, n_q_blocks, GROUP)
    tma.store_wait(0)


@gluon.jit
def dkdvq_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc, Q_RB, Q_RH,
                    Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, DO_RB, DO_RH, DO_CH, HEADS, GROUP: gl.constexpr, SEQ,
                    qk_scale, scale, N_SMS, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, NUM_BUF: gl.constexpr,
                    PINGPONG: gl.constexpr, KV_IN_REGS: gl.constexpr):
    """The fused backward in warp-specialized form: `flash_gluon_ws.dkdv_ws_kernel`'s program (128 key rows, two
    consumer warpgroups, the loader), whose consumers also put each query block's dS^T in shared memory, and a
    fourth partition that forms that block's dQ from it over all 128 keys and adds it into the float32 dQ (zeroed
    by `prepare_kernel`): one reduction per 128 keys, half the one-warpgroup kernel's."""
    io, feed, where = _key_ws_program(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH,
        V_RB, V_RH, V_CH, DO_RB, DO_RH, DO_CH, HEADS, GROUP, SEQ, qk_scale, scale, N_SMS, BLOCK_M, NUM_BUF)
    b, hk, first, end = where
    ds_layout: gl.constexpr = _swizzled(HALF, BLOCK_M, q_desc.dtype)
    # two dS^T slots: as many as the ring's measured no faster (H100, 2026-12-06) and spilled more
    ds_halves = (gl.allocate_shared_memory(q_desc.dtype, [2, HALF, BLOCK_M], ds_layout),
                 gl.allocate_shared_memory(q_desc.dtype, [2, HALF, BLOCK_M], ds_layout))
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_shape, dq_desc.layout)
    ready = _bars(2, 2)  # both consumers' rows of a block's dS^T are in
    free = _bars(2, 1)  # the dQ partition has read them
    fence_async_shared()
    gl.warp_specialize([
        (_dkdv_consumer, (io, gl.constexpr(0), GROUP, PINGPONG, BLOCK_M, KV_IN_REGS, (ds_halves[0], ready, free))),
        (_dkdv_consumer, (io, gl.constexpr(1), GROUP, PINGPONG, BLOCK_M, KV_IN_REGS, (ds_halves[1], ready, free))),
        (_dq_partition, (io[0], ds_halves, ready, free, dq_smem, dq_desc, b, hk, first, end, HEADS, SEQ, scale,
                         GROUP)),
        (_dkdv_loader, (feed, GROUP, BLOCK_M)),
    ], [4, 4, 1], [FUSED_CONSUMER_REGS, DQ_REGS, LOADER_REGS])
