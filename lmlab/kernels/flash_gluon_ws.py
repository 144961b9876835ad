"""The Hopper attention kernels in FlashAttention-3's warp-specialized form: forward, dQ and dK/dV
(`flash_gluon` times them beside `flash_gluon_kernels`' one-warpgroup kernels and keeps the fastest).

Why: in the one-warpgroup forward, ptxas 12.8 puts the loop's exponentials after the wait for the P V product
(flash_gluon_kernels' docstring), so each warpgroup's softmax and its own matmuls take turns. Here a program
holds 128 rows (query rows in the forward and dQ, key rows in dK/dV) and three partitions:
  loader     one warp: the resident tiles' two 64-row halves, then each streamed block (K and V; in dK/dV Q, dO,
             LSE and delta) by TMA into a ring of NUM_BUF slots; a slot refills once both consumers have
             released it
  consumers  two warpgroups, one per 64-row half, each running the one-warpgroup kernel's loop on its rows
With PINGPONG the consumers take turns to issue each block's products (an mbarrier each, passed after issuing):
one warpgroup's softmax then runs while the tensor cores compute the other's products, whatever order ptxas
gives each warpgroup's own instructions (FlashAttention-3's inter-warpgroup overlap). Each streamed block is
read from shared memory by both consumers, once per 128 rows instead of once per 64, and the loader frees the
consumers' issue slots and registers of address arithmetic (`setmaxnreg`: consumers 240 registers a thread, the
loader 24).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from lmlab.kernels.flash_gluon_kernels import (_load_queries, _next_grads, _next_query_block, _operand, _origin,
                                               _products, _pv, _query_program, _query_stats, _ring, _schedule,
                                               _score_grad, _scores, _share_ds, _softmax, _softmax_grad, _store_dkdv,
                                               _updates, wgmma_layout)

ROWS_PER_CONSUMER = 64  # query rows per consumer warpgroup: a program takes twice as many
HALF = gl.constexpr(ROWS_PER_CONSUMER)
CONSUMER_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)
# Registers a thread at launch: two consumer warpgroups and the loader's (padded to a warpgroup) share an SM's
# 64K; setmaxnreg then moves the loader's share to the consumers: (2 * 240 + 24) / 3 = 168.
MAXNREG = 168


@gluon.jit
def _bars(n: gl.constexpr, count: gl.constexpr):
    """n mbarriers in shared memory, each completing a phase after `count` arrivals (and its expected bytes)."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def _load_halves(halves, half_bars, start):
    """Start the TMA copies of the resident tensors' two 64-row halves from row `start` of each (`halves`: (desc,
    smem, row, col) per tensor, the head's origin); half w of every tensor lands on `half_bars`' w-th mbarrier."""
    NBYTES: gl.constexpr = halves[0][0].block_type.nbytes * len(halves)
    for w in gl.static_range(2):
        mbarrier.expect(half_bars.index(w), NBYTES)
        for r in gl.static_range(len(halves)):
            desc, smem, row, col = halves[r]
            tma.async_copy_global_to_shared(desc, [row + start + w * HALF, col], half_bars.index(w), smem.index(w))


@gluon.jit
def _loader(kv, halves, half_bars, start_m):
    """The loader partition of the query-block kernels: the resident tensors' two 64-row halves (`halves`: (desc,
    smem, row, col) each, both halves' mbarriers `half_bars`), then each key block's K and V (`kv`,
    `_key_stream`'s) as their slots free up."""
    k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, k_row, k_col, v_row, v_col, n_kv = kv
    NUM_BUF: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_shape[0]
    _load_halves(halves, half_bars, start_m)
    for t in range(n_kv):
        slot = t % NUM_BUF
        free = ((t // NUM_BUF) & 1) ^ 1  # a fresh mbarrier's "previous phase" counts as complete
        mbarrier.wait(k_free.index(slot), free)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + t * BLOCK_N, k_col], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_free.index(slot), free)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [v_row + t * BLOCK_N, v_col], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _key_stream(k_desc, v_desc, k_row, k_col, v_row, v_col, n_kv, NUM_BUF: gl.constexpr):
    """The query-block kernels' ring of streamed K and V blocks, with its mbarriers (a slot is ready once its
    block has landed, free once both consumers have released it), as the tuple `_loader` takes."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF] + k_desc.block_shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUF] + v_desc.block_shape, v_desc.layout)
    return (k_desc, v_desc, k_smem, v_smem, _bars(NUM_BUF, 1), _bars(NUM_BUF, 1), _bars(NUM_BUF, 2),
            _bars(NUM_BUF, 2), k_row, k_col, v_row, v_col, n_kv)


@gluon.jit
def _query_ws_program(q_desc, k_desc, v_desc, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, HEADS, GROUP, SEQ,
                      N_SMS, NUM_BUF: gl.constexpr):
    """A warp-specialized query-block program (forward, dQ): its batch * heads index, batch, head and first query,
    where its Q starts, shared memory for Q's two halves with their mbarriers, the ring of K and V blocks
    (`_key_stream`) and the consumers' turn mbarriers, initialised and fenced."""
    BLOCK_N: gl.constexpr = k_desc.block_shape[0]
    bh, b, h, start_m, k_row, k_col, v_row, v_col = _query_program(K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, HEADS, GROUP,
                                                                   SEQ, N_SMS, 2 * HALF)
    q_row, q_col = _origin(b, h, Q_RB, Q_RH, Q_CH)
    n_kv = (start_m + 2 * HALF) // BLOCK_N  # key blocks up to the diagonal's end
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_shape, q_desc.layout)
    half_bars = _bars(2, 1)
    kv = _key_stream(k_desc, v_desc, k_row, k_col, v_row, v_col, n_kv, NUM_BUF)
    turns = _bars(2, 1)
    fence_async_shared()
    return bh, b, h, start_m, q_row, q_col, q_smem, half_bars, kv, turns


@gluon.jit
def _take_turn(turns, wg: gl.constexpr, k, PINGPONG: gl.constexpr):
    """Wait until the other consumer has issued its products k times (WG 0) or k + 1 times (WG 1)."""
    if PINGPONG:
        mbarrier.wait(turns.index(wg), (k & 1) ^ (1 - wg))


@gluon.jit
def _pass_turn(turns, wg: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - wg), count=1)


@gluon.jit
def _consumer(kv, q_smem, q_bars, start_m, o_desc, turns, LSE, bh, SEQ, qk_scale, WG: gl.constexpr,
              PINGPONG: gl.constexpr):
    """A forward consumer partition: the one-warpgroup forward loop over its 64 query rows."""
    k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, k_row, k_col, v_row, v_col, n_kv = kv
    NUM_BUF: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_shape[1]
    s_layout: gl.constexpr = wgmma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(4, HEAD_DIM)
    first = start_m + WG * HALF
    q = q_smem.index(WG)

    m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
    acc = warpgroup_mma_init(gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout))
    mbarrier.wait(q_bars.index(WG), 0)
    _take_turn(turns, WG, 0, PINGPONG)
    s = _scores(q, k_smem, k_ready, 0, s_layout, HALF, BLOCK_N, NUM_BUF)
    _pass_turn(turns, WG, PINGPONG)
    s = warpgroup_mma_wait(0, deps=[s])
    mbarrier.arrive(k_free.index(0), count=1)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, 0, first, qk_scale, s_layout, o_layout, q_smem.dtype, HALF,
                                  BLOCK_N)
    for j in range(1, n_kv):
        _take_turn(turns, WG, j, PINGPONG)
        s = _scores(q, k_smem, k_ready, j, s_layout, HALF, BLOCK_N, NUM_BUF)
        acc = _pv(p, acc, v_smem, v_ready, j - 1, NUM_BUF)
        _pass_turn(turns, WG, PINGPONG)
        s = warpgroup_mma_wait(1, deps=[s])
        mbarrier.arrive(k_free.index(j % NUM_BUF), count=1)
        p_next, m_i, l_i, alpha = _softmax(s, m_i, l_i, j, first, qk_scale, s_layout, o_layout, q_smem.dtype,
                                           HALF, BLOCK_N)
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])
        mbarrier.arrive(v_free.index((j - 1) % NUM_BUF), count=1)
        acc = warpgroup_mma_init(acc * gl.expand_dims(alpha, 1))
        p = p_next
    acc = warpgroup_mma_wait(0, deps=[_pv(p, acc, v_smem, v_ready, n_kv - 1, NUM_BUF)])

    out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    q.store(out.to(o_desc.dtype))  # this half of Q is no longer read: it stages O for the TMA store
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [bh * SEQ + first, 0], q)
    offs = first + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    gl.store(LSE + bh.to(gl.int64) * SEQ + offs, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(0)


@gluon.jit
def forward_ws_kernel(q_desc, k_desc, v_desc, o_desc, LSE, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH,
                      HEADS, GROUP, SEQ, qk_scale, N_SMS, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                      NUM_BUF: gl.constexpr, PINGPONG: gl.constexpr):
    """Causal attention forward of one 128-row query block (q_desc and o_desc: blocks of 64 rows)."""
    bh, b, h, start_m, q_row, q_col, q_smem, q_bars, kv, turns = _query_ws_program(
        q_desc, k_desc, v_desc, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, HEADS, GROUP, SEQ, N_SMS,
        NUM_BUF)

    gl.warp_specialize([
        (_consumer, (kv, q_smem, q_bars, start_m, o_desc, turns, LSE, bh, SEQ, qk_scale, gl.constexpr(0), PINGPONG)),
        (_consumer, (kv, q_smem, q_bars, start_m, o_desc, turns, LSE, bh, SEQ, qk_scale, gl.constexpr(1), PINGPONG)),
        (_loader, (kv, ((q_desc, q_smem, q_row, q_col),), q_bars, start_m)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def _dq_consumer(kv, q_smem, do_smem, qdo_bars, start_m, dq_desc, turns, O, LSE, DELTA, bh, SEQ, qk_scale, scale,
                 WG: gl.constexpr, PINGPONG: gl.constexpr):
    """A dQ consumer partition: flash_gluon_kernels.dq_kernel's loop over its 64 query rows, and their delta."""
    k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, k_row, k_col, v_row, v_col, n_kv = kv
    NUM_BUF: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_shape[1]
    DTYPE: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = wgmma_layout(4, BLOCK_N)
    dq_layout: gl.constexpr = wgmma_layout(4, HEAD_DIM)
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    first = start_m + WG * HALF
    q = q_smem.index(WG)
    do = do_smem.index(WG)

    # delta = rowsum(dO * O) while the tiles load, stored for the dK/dV kernel
    stat0 = bh.to(gl.int64) * SEQ
    rows = first + gl.arange(0, HALF, layout=gl.SliceLayout(1, rows_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows_layout))
    o = gl.load(O + (stat0 + gl.expand_dims(rows, 1)) * HEAD_DIM + gl.expand_dims(cols, 0))
    mbarrier.wait(qdo_bars.index(WG), 0)
    delta = gl.sum(o.to(gl.float32) * do.load(rows_layout).to(gl.float32), 1)
    gl.store(DELTA + stat0 + rows, delta)
    delta = gl.convert_layout(delta, gl.SliceLayout(1, s_layout))
    lse2 = gl.load(LSE + stat0 + first + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout)))
    lse2 = lse2 * 1.4426950408889634  # natural log -> base 2

    # A V block is free once its dP is done, a K block only once its dQ update is.
    _take_turn(turns, WG, 0, PINGPONG)
    s, dp = _products(q, do, k_smem, v_smem, k_ready, v_ready, 0, s_layout, NUM_BUF)
    _pass_turn(turns, WG, PINGPONG)
    s, dp = warpgroup_mma_wait(0, deps=[s, dp])
    mbarrier.arrive(v_free.index(0), count=1)
    ds = _score_grad(s, dp, lse2, delta, 0, first, qk_scale, s_layout, dq_layout, DTYPE, HALF, BLOCK_N)
    dq = warpgroup_mma_init(gl.zeros([HALF, HEAD_DIM], gl.float32, dq_layout))
    for j in range(1, n_kv):
        _take_turn(turns, WG, j, PINGPONG)
        s, dp = _products(q, do, k_smem, v_smem, k_ready, v_ready, j, s_layout, NUM_BUF)
        dq = warpgroup_mma(ds, k_smem.index((j - 1) % NUM_BUF), dq, is_async=True)
        _pass_turn(turns, WG, PINGPONG)
        s, dp = warpgroup_mma_wait(1, deps=[s, dp])
        mbarrier.arrive(v_free.index(j % NUM_BUF), count=1)
        ds_next = _score_grad(s, dp, lse2, delta, j, first, qk_scale, s_layout, dq_layout, DTYPE, HALF, BLOCK_N)
        dq, ds = warpgroup_mma_wait(0, deps=[dq, ds])  # ds: kept alive until its update is done
        mbarrier.arrive(k_free.index((j - 1) % NUM_BUF), count=1)
        dq = warpgroup_mma_init(dq)
        ds = ds_next
    dq = warpgroup_mma_wait(0, deps=[warpgroup_mma(ds, k_smem.index((n_kv - 1) % NUM_BUF), dq, is_async=True)])

    q.store((dq * scale).to(dq_desc.dtype))  # this half of Q is no longer read: it stages dQ for the TMA store
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [bh * SEQ + first, 0], q)
    tma.store_wait(0)


@gluon.jit
def dq_ws_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, O, LSE, DELTA, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH,
                 V_RB, V_RH, V_CH, DO_RB, DO_RH, DO_CH, HEADS, GROUP, SEQ, qk_scale, scale, N_SMS,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, PINGPONG: gl.constexpr):
    """dQ of one 128-row query block (q, do and dq descriptors: blocks of 64 rows), and delta = rowsum(dO * O)
    for the dK/dV kernel (O, LSE, DELTA and dQ contiguous)."""
    bh, b, h, start_m, q_row, q_col, q_smem, qdo_bars, kv, turns = _query_ws_program(
        q_desc, k_desc, v_desc, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, HEADS, GROUP, SEQ, N_SMS,
        NUM_BUF)
    do_row, do_col = _origin(b, h, DO_RB, DO_RH, DO_CH)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, HALF, HEAD_DIM], do_desc.layout)

    gl.warp_specialize([
        (_dq_consumer, (kv, q_smem, do_smem, qdo_bars, start_m, dq_desc, turns, O, LSE, DELTA, bh, SEQ, qk_scale,
                        scale, gl.constexpr(0), PINGPONG)),
        (_dq_consumer, (kv, q_smem, do_smem, qdo_bars, start_m, dq_desc, turns, O, LSE, DELTA, bh, SEQ, qk_scale,
                        scale, gl.constexpr(1), PINGPONG)),
        (_loader, (kv, ((q_desc, q_smem, q_row, q_col), (do_desc, do_smem, do_row, do_col)), qdo_bars, start_m)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def _dkdv_loader(feed, GROUP: gl.constexpr, BLOCK_M: gl.constexpr):
    """The dK/dV loader partition: K's and V's halves once, then each query block's Q, dO, LSE and delta (every
    query head of the kv head in turn) as their slot frees up (`feed`: `_key_ws_program`'s)."""
    (descs, k_desc, v_desc, k_smem, v_smem, kv_bars, ring, free, Q_RB, Q_RH, Q_CH, DO_RB, DO_RH, DO_CH, k_row, k_col,
     v_row, v_col, b, hk, start_n, first, end, HEADS, SEQ) = feed
    NUM_BUF: gl.constexpr = ring[0].shape[0]
    _load_halves(((k_desc, k_smem, k_row, k_col), (v_desc, v_smem, v_row, v_col)), kv_bars, start_n)
    h = hk * GROUP
    i = first
    n_q_blocks = SEQ // BLOCK_M
    for t in range(end):
        mbarrier.wait(free.index(t % NUM_BUF), ((t // NUM_BUF) & 1) ^ 1)
        _load_queries(descs, ring, Q_RB, Q_RH, Q_CH, DO_RB, DO_RH, DO_CH, b, h, i, HEADS, SEQ, t, end, BLOCK_M,
                      NUM_BUF)
        h, i = _next_query_block(h, i, first, n_q_blocks, GROUP)


@gluon.jit
def _dq_done(share, t):
    """With `share` (`_share_ds`'s), wait until the dQ partition has read ring block t's dS^T and K."""
    if share is not None:
        N: gl.constexpr = share[0].shape[0]
        mbarrier.wait(share[2].index(t % N), (t // N) & 1)


@gluon.jit
def _dkdv_consumer(io, WG: gl.constexpr, GROUP: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
                   KV_IN_REGS: gl.constexpr, share):
    """A dK/dV consumer partition: flash_gluon_kernels.dkdv_kernel's loop for its 64 key rows (KV_IN_REGS: K
    and V as register operands, as there). The blocks of the ring that lie wholly above its rows' diagonal (the
    other consumer's first ones) come out masked to zero. With `share`, each block's dS^T also goes to the fused
    backward's dQ partition (`_share_ds`)."""
    (k_smem, v_smem, kv_bars, ring, free, turns, dk_desc, dv_desc, hk, bhk, start_n, first, end, qk_scale, scale,
     SEQ) = io
    NUM_BUF: gl.constexpr = ring[0].shape[0]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    DTYPE: gl.constexpr = k_smem.dtype
    st_layout: gl.constexpr = wgmma_layout(4, BLOCK_M)
    kv_layout: gl.constexpr = wgmma_layout(4, HEAD_DIM)
    q_smem, do_smem, q_bars, do_bars = ring[0], ring[1], ring[4], ring[5]
    mine = start_n + WG * HALF
    k = k_smem.index(WG)
    v = v_smem.index(WG)
    n_q_blocks = SEQ // BLOCK_M

    mbarrier.wait(kv_bars.index(WG), 0)
    if KV_IN_REGS:
        k = k.load(gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2))
        v = v.load(gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2))
    h = hk * GROUP
    i = first
    _take_turn(turns, WG, 0, PINGPONG)
    st, dpt = _products(k, v, q_smem, do_smem, q_bars, do_bars, 0, st_layout, NUM_BUF)
    _pass_turn(turns, WG, PINGPONG)
    cols, lse2, delta = _query_stats(ring, 0, i, st_layout, BLOCK_M, NUM_BUF)
    st, dpt = warpgroup_mma_wait(0, deps=[st, dpt])
    pt, dst = _softmax_grad(st, dpt, cols, lse2, delta, i, mine, qk_scale, st_layout, DTYPE, BLOCK_M, HALF)
    _share_ds(share, dst, 0)
    pt, dst = _operand(pt, kv_layout), _operand(dst, kv_layout)
    dv = warpgroup_mma_init(gl.zeros([HALF, HEAD_DIM], gl.float32, kv_layout))
    dk = warpgroup_mma_init(gl.zeros([HALF, HEAD_DIM], gl.float32, kv_layout))
    # The first N_DIAG blocks of each query head may reach either consumer's diagonal; the rest compile without
    # the mask (as dkdv_kernel's runs). The loop over the query heads is unrolled: as a runtime loop (GROUP > 1),
    # ptxas serialized every wgmma (C7513).
    N_DIAG: gl.constexpr = max(2 * HALF // BLOCK_M, 1)
    n_q = n_q_blocks - first
    for g in gl.static_range(GROUP):
        for run in gl.static_range(2):
            lo = gl.maximum(g * n_q + run * N_DIAG, 1)
            hi = g * n_q + N_DIAG if run == 0 else (g + 1) * n_q
            for t in range(lo, hi):
                h, i = _next_query_block(h, i, first, n_q_blocks, GROUP)
                _take_turn(turns, WG, t, PINGPONG)
                st_t, dpt_t = _products(k, v, q_smem, do_smem, q_bars, do_bars, t, st_layout, NUM_BUF)
                dv, dk = _updates(pt, dst, dv, dk, q_smem, do_smem, t - 1, NUM_BUF)
                _pass_turn(turns, WG, PINGPONG)
                pt_next, dst_next, dv, dk = _next_grads(st_t, dpt_t, dv, dk, pt, dst, ring, t, i, mine, qk_scale,
                                                        st_layout, kv_layout, HALF, run == 0, share)
                mbarrier.arrive(free.index((t - 1) % NUM_BUF), count=1)  # block t-1 is no longer read
                dv = warpgroup_mma_init(dv)
                dk = warpgroup_mma_init(dk)
                pt = pt_next
                dst = dst_next
    dv, dk = _updates(pt, dst, dv, dk, q_smem, do_smem, end - 1, NUM_BUF)
    dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
    _dq_done(share, end - 1)  # K's buffer stages dK next
    _store_dkdv(dk, dv, scale, k_smem.index(WG), v_smem.index(WG), dk_desc, dv_desc, bhk * SEQ + mine)


@gluon.jit
def _key_ws_program(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, Q_RB, Q_RH, Q_CH, K_RB,
                    K_RH, K_CH, V_RB, V_RH, V_CH, DO_RB, DO_RH, DO_CH, HEADS, GROUP, SEQ, qk_scale, scale, N_SMS,
                    BLOCK_M: gl.constexpr, NUM_BUF: gl.constexpr):
    """A warp-specialized key-block program (dK/dV, the fused backward): shared memory for K's and V's halves and
    the ring of Q, dO, LSE and delta blocks, with their mbarriers, initialised and fenced; returns what the
    consumers take (`io`), what the loader takes (`feed`), and the program's batch, kv head, first query block and
    number of ring blocks."""
    HEAD_DIM: gl.constexpr = k_desc.block_shape[1]
    n_blocks = SEQ // (2 * HALF)
    pid_n, bhk = _schedule(n_blocks, gl.num_programs(0) // n_blocks, N_SMS, False)
    kv_heads = HEADS // GROUP
    b = bhk // kv_heads
    hk = bhk % kv_heads
    start_n = pid_n * (2 * HALF)
    k_row, k_col = _origin(b, hk, K_RB, K_RH, K_CH)
    v_row, v_col = _origin(b, hk, V_RB, V_RH, V_CH)
    first = start_n // BLOCK_M  # queries before start_n see none of these keys
    end = GROUP * (SEQ // BLOCK_M - first)

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, HALF, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, HALF, HEAD_DIM], v_desc.layout)
    q_smem, do_smem, q_bars, do_bars = _ring(q_desc, do_desc, NUM_BUF)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF, BLOCK_M], delta_desc.layout)
    ring = (q_smem, do_smem, lse_smem, delta_smem, q_bars, do_bars)
    kv_bars = _bars(2, 1)
    free = _bars(NUM_BUF, 2)  # both consumers release each slot
    turns = _bars(2, 1)
    fence_async_shared()

    io = (k_smem, v_smem, kv_bars, ring, free, turns, dk_desc, dv_desc, hk, bhk, start_n, first, end, qk_scale, scale,
          SEQ)
    feed = ((q_desc, do_desc, lse_desc, delta_desc), k_desc, v_desc, k_smem, v_smem, kv_bars, ring, free, Q_RB, Q_RH,
            Q_CH, DO_RB, DO_RH, DO_CH, k_row, k_col, v_row, v_col, b, hk, start_n, first, end, HEADS, SEQ)
    return io, feed, (b, hk, first, end)


@gluon.jit
def dkdv_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, Q_RB, Q_RH, Q_CH, K_RB,
                   K_RH, K_CH, V_RB, V_RH, V_CH, DO_RB, DO_RH, DO_CH, HEADS, GROUP: gl.constexpr, SEQ, qk_scale,
                   scale, N_SMS, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, NUM_BUF: gl.constexpr,
                   PINGPONG: gl.constexpr, KV_IN_REGS: gl.constexpr):
    """dK and dV of one 128-row key block of one kv head (k, v, dk and dv descriptors: blocks of 64 rows), over
    the query blocks of every query head it serves; the loader streams them to two consumer warpgroups, one per
    64 key rows."""
    io, feed, _ = _key_ws_program(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, Q_RB,
                                  Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, DO_RB, DO_RH, DO_CH, HEADS, GROUP,
                                  SEQ, qk_scale, scale, N_SMS, BLOCK_M, NUM_BUF)
    gl.warp_specialize([
        (_dkdv_consumer, (io, gl.constexpr(0), GROUP, PINGPONG, BLOCK_M, KV_IN_REGS, None)),
        (_dkdv_consumer, (io, gl.constexpr(1), GROUP, PINGPONG, BLOCK_M, KV_IN_REGS, None)),
        (_dkdv_loader, (feed, GROUP, BLOCK_M)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
