"""The Gluon kernels of lmlab's Hopper attention (`flash_gluon` launches them): forward, dQ and dK/dV.

Why Gluon: Triton 3.6 waits for every wgmma group as soon as it is issued (the shipped kernels' sm_90 PTX has
a `wgmma.wait_group 0` after each; experiments/kernels/attention_sass.py), so the tensor cores idle while the
exponentials run. Gluon, Triton's lower-level language, lets a kernel say when to wait. Each kernel here issues
block j's score products, then block j-1's accumulating product, waits for the former alone (wgmma groups
complete in order) and runs block j's softmax (or its gradient) on the CUDA cores while the tensor cores
compute the latter:
  forward  a query block resident; per key block S = Q K^T, then the previous block's O += P V
  dQ       a query block resident; per key block S and dP = dO V^T, then the previous block's dQ += dS K; it
           also stores delta = rowsum(dO * O) for the dK/dV kernel
  dK/dV    a key block resident; per query block (of every query head its kv head serves) S^T = K Q^T and
           dP^T = V dO^T, then the previous block's dV += P^T dO and dK += dS^T Q
That is the order in the PTX. ptxas 12.8 (Triton 3.6's) keeps it in the dQ kernel only: in the forward's and
the dK/dV kernel's sm_90a SASS it moves the loop's exponentials below the wait for the accumulating product
(none of their MUFU.EX2 between `WARPGROUP.DEPBAR.LE gsb0, 0x1` or `0x2` and `0x0`), seemingly to keep the
next P out of the registers that the product in flight reads. Passing P (and dS^T) through shared memory
instead keeps them above the wait, but measured slower at every setting (H100, 2026-12-06:
experiments/kernels/README.md), so the kernels keep the register operands.
The streamed tiles arrive by TMA in a ring of NUM_BUF slots: each tensor's block t+NUM_BUF loads into the slot
that its block t frees, as soon as the last wgmma reading it is done (the forward's K after its scores, before
the P V that reads V). With Q_IN_REGS, the forward loads its Q block into registers once, the A operand of every
Q K^T. A register written while a wgmma is in flight would make ptxas serialize every wgmma (warnings
C7514/C7515); in this order each is written after a wait that leaves nothing in flight, and the sm_90a SASS has
four `WARPGROUP.DEPBAR`s per kernel, not one per HGMMA. Programs follow `flash_triton._schedule`
(heaviest blocks first, heads in groups that share K/V in L2).

The tensors come as TMA descriptors over 2-D views of their storage: head h of batch b starts at row
b * RB + h * RH, column h * CH of each (`flash_gluon._Rows`); LSE, delta and the outputs are contiguous, and the
key-block kernels read LSE and delta by 1-D descriptors, beside their Q and dO blocks.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)


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
def _origin(b, h, RB, RH, CH):
    """(row, column) where head h of batch b starts in a tensor's 2-D view (`_Rows`)."""
    return b * RB + h * RH, h * CH


@gluon.jit
def _ring(a_desc, b_desc, NUM_BUF: gl.constexpr):
    """Shared memory for NUM_BUF blocks each of two tensors that TMA streams in, and an mbarrier per block and
    tensor, initialised (the kernel fences after its last initialisation)."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUF] + b_desc.block_shape, b_desc.layout)
    a_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    b_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(NUM_BUF):
        mbarrier.init(a_bars.index(slot), count=1)
        mbarrier.init(b_bars.index(slot), count=1)
    return a_smem, b_smem, a_bars, b_bars


@gluon.jit
def _resident_pair(a_desc, b_desc):
    """Shared memory for one block each of two tensors that stay for the whole program, and one mbarrier for
    both, initialised."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_shape, b_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    return a_smem, b_smem, bar


@gluon.jit
def _load_pair(a_desc, b_desc, a_smem, b_smem, bar, a_row, a_col, b_row, b_col):
    """Start the TMA copies of both tensors' blocks into a resident pair; `bar` completes its phase 0 once both
    have landed."""
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [a_row, a_col], bar, a_smem)
    tma.async_copy_global_to_shared(b_desc, [b_row, b_col], bar, b_smem)


@gluon.jit
def _load_tile(desc, smem, bars, row, col, t, end, NUM_BUF: gl.constexpr):
    """Start the TMA copy of one tensor's block of the ring's block t (at the given row) into slot t % NUM_BUF;
    none when t >= end. Block t is its slot's (t // NUM_BUF)-th load: its barrier's phase parity."""
    slot = t % NUM_BUF
    ok = t < end
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(desc, [row, col], bars.index(slot), smem.index(slot), pred=ok)


@gluon.jit
def _load_block(a_desc, b_desc, a_smem, b_smem, a_bars, b_bars, a_row, a_col, b_row, b_col, t, end,
                NUM_BUF: gl.constexpr):
    """Start the TMA copies of the ring's block t (both tensors' blocks at the given rows) into slot
    t % NUM_BUF; none when t >= end."""
    _load_tile(a_desc, a_smem, a_bars, a_row, a_col, t, end, NUM_BUF)
    _load_tile(b_desc, b_smem, b_bars, b_row, b_col, t, end, NUM_BUF)


@gluon.jit
def _query_program(K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, HEADS, GROUP, SEQ, N_SMS, BLOCK_M: gl.constexpr):
    """A query-block program (forward, dQ): its batch * heads index, batch, head and first query, and where its
    kv head's K and V start."""
    n_blocks = SEQ // BLOCK_M
    pid_m, bh = _schedule(n_blocks, gl.num_programs(0) // n_blocks, N_SMS, True)
    b = bh // HEADS
    h = bh % HEADS
    k_row, k_col = _origin(b, h // GROUP, K_RB, K_RH, K_CH)
    v_row, v_col = _origin(b, h // GROUP, V_RB, V_RH, V_CH)
    return bh, b, h, pid_m * BLOCK_M, k_row, k_col, v_row, v_col


@gluon.jit
def _load_keys(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_row, k_col, v_row, v_col, t, end,
               NUM_BUF: gl.constexpr):
    """Start loading key block t of a kv head (K and V from the given origins) as the ring's block t."""
    BLOCK_N: gl.constexpr = k_desc.block_shape[0]
    _load_block(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_row + t * BLOCK_N, k_col, v_row + t * BLOCK_N,
                v_col, t, end, NUM_BUF)


@gluon.jit
def _release(resident_bar, a_bars, b_bars, NUM_BUF: gl.constexpr):
    """Invalidate a kernel's mbarriers at its end: the resident tiles' and the ring's."""
    mbarrier.invalidate(resident_bar)
    for slot in gl.static_range(NUM_BUF):
        mbarrier.invalidate(a_bars.index(slot))
        mbarrier.invalidate(b_bars.index(slot))


@gluon.jit
def _products(x, y, a_smem, b_smem, a_bars, b_bars, t, layout: gl.constexpr, NUM_BUF: gl.constexpr):
    """Issue X A_t^T and Y B_t^T for the ring's block t once each has landed: two wgmma groups (X and Y in
    shared memory or registers). dK/dV: S^T = K Q^T and dP^T = V dO^T; dQ: S = Q K^T and dP = dO V^T."""
    slot = t % NUM_BUF
    phase = (t // NUM_BUF) & 1
    ROWS: gl.constexpr = x.shape[0]
    COLS: gl.constexpr = a_smem.shape[1]
    zero = gl.zeros([ROWS, COLS], gl.float32, layout)
    mbarrier.wait(a_bars.index(slot), phase)
    xa = warpgroup_mma(x, a_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
    mbarrier.wait(b_bars.index(slot), phase)
    yb = warpgroup_mma(y, b_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
    return xa, yb


@gluon.jit
def _scores(q, k_smem, k_bars, j, s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_BUF: gl.constexpr):
    """Issue key block j's Q K^T once its K has landed (Q in shared memory or registers): an asynchronous wgmma
    group."""
    slot = j % NUM_BUF
    mbarrier.wait(k_bars.index(slot), (j // NUM_BUF) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    return warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_i, j, start_m, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr,
             DTYPE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
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
    p = gl.convert_layout(p.to(DTYPE), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    return p, m_new, l_i, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))


@gluon.jit
def _pv(p, acc, v_smem, v_bars, j, NUM_BUF: gl.constexpr):
    """Issue block j's P V into the accumulator once its V has landed: an asynchronous wgmma group."""
    slot = j % NUM_BUF
    mbarrier.wait(v_bars.index(slot), (j // NUM_BUF) & 1)
    return warpgroup_mma(p, v_smem.index(slot), acc, is_async=True)


@gluon.jit
def forward_kernel(q_desc, k_desc, v_desc, o_desc, LSE, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, HEADS,
                   GROUP, SEQ, qk_scale, N_SMS, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, NUM_WARPS: gl.constexpr, Q_IN_REGS: gl.constexpr):
    s_layout: gl.constexpr = wgmma_layout(NUM_WARPS, BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(NUM_WARPS, HEAD_DIM)
    bh, b, h, start_m, k_row, k_col, v_row, v_col = _query_program(K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, HEADS, GROUP,
                                                                   SEQ, N_SMS, BLOCK_M)
    q_row, q_col = _origin(b, h, Q_RB, Q_RH, Q_CH)
    n_kv = (start_m + BLOCK_M) // BLOCK_N  # key blocks up to the diagonal's end

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_smem, v_smem, k_bars, v_bars = _ring(k_desc, v_desc, NUM_BUF)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row + start_m, q_col], q_bar, q_smem)
    for t in gl.static_range(NUM_BUF):
        _load_keys(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_row, k_col, v_row, v_col, t, n_kv, NUM_BUF)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    mbarrier.wait(q_bar, 0)
    if Q_IN_REGS:  # loaded once: each Q K^T then reads only K from shared memory
        q = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    else:
        q = q_smem
    # A K block is free once its Q K^T is done, a V block once its P V is: K's slots refill an iteration earlier
    # than V's, so the next Q K^T finds its K loaded (ncu, 2026-12-06: a fifth of the forward's stall samples
    # were waits for K when both refilled after P V).
    s = warpgroup_mma_wait(0, deps=[_scores(q, k_smem, k_bars, 0, s_layout, BLOCK_M, BLOCK_N, NUM_BUF)])
    _load_tile(k_desc, k_smem, k_bars, k_row + NUM_BUF * BLOCK_N, k_col, NUM_BUF, n_kv, NUM_BUF)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, 0, start_m, qk_scale, s_layout, o_layout, q_desc.dtype, BLOCK_M,
                                  BLOCK_N)
    for j in range(1, n_kv):
        s = _scores(q, k_smem, k_bars, j, s_layout, BLOCK_M, BLOCK_N, NUM_BUF)
        acc = _pv(p, acc, v_smem, v_bars, j - 1, NUM_BUF)
        s = warpgroup_mma_wait(1, deps=[s])
        _load_tile(k_desc, k_smem, k_bars, k_row + (j + NUM_BUF) * BLOCK_N, k_col, j + NUM_BUF, n_kv, NUM_BUF)
        p_next, m_i, l_i, alpha = _softmax(s, m_i, l_i, j, start_m, qk_scale, s_layout, o_layout, q_desc.dtype,
                                           BLOCK_M, BLOCK_N)
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])  # p: kept alive until its P V is done
        _load_tile(v_desc, v_smem, v_bars, v_row + (j - 1 + NUM_BUF) * BLOCK_N, v_col, j - 1 + NUM_BUF, n_kv,
                   NUM_BUF)
        acc = warpgroup_mma_init(acc * gl.expand_dims(alpha, 1))
        p = p_next
    acc = warpgroup_mma_wait(0, deps=[_pv(p, acc, v_smem, v_bars, n_kv - 1, NUM_BUF)])

    out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    q_smem.store(out.to(o_desc.dtype))  # Q is no longer read: its buffer stages O for the TMA store
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [bh * SEQ + start_m, 0], q_smem)
    offs = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    gl.store(LSE + bh.to(gl.int64) * SEQ + offs, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(0)
    _release(q_bar, k_bars, v_bars, NUM_BUF)


@gluon.jit
def _score_grad(s, dp, lse2, delta, j, start_m, qk_scale, s_layout: gl.constexpr, dq_layout: gl.constexpr,
                DTYPE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key block j's dS = P (dP - delta), P = exp(S - LSE) with the causal mask where the block reaches the
    diagonal, as the dQ wgmma's register operand."""
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    if j * BLOCK_N + BLOCK_N > start_m:
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), p, 0.0)
    ds = p * (dp - gl.expand_dims(delta, 1))
    return gl.convert_layout(ds.to(DTYPE), gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2))


@gluon.jit
def dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, O, LSE, DELTA, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH,
            V_RB, V_RH, V_CH, DO_RB, DO_RH, DO_CH, HEADS, GROUP, SEQ, qk_scale, scale, N_SMS,
            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
            NUM_WARPS: gl.constexpr):
    """dQ for one query block, and delta = rowsum(dO * O) for the dK/dV kernel (O, LSE, DELTA and dQ
    contiguous)."""
    s_layout: gl.constexpr = wgmma_layout(NUM_WARPS, BLOCK_N)
    dq_layout: gl.constexpr = wgmma_layout(NUM_WARPS, HEAD_DIM)
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    bh, b, h, start_m, k_row, k_col, v_row, v_col = _query_program(K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, HEADS, GROUP,
                                                                   SEQ, N_SMS, BLOCK_M)
    q_row, q_col = _origin(b, h, Q_RB, Q_RH, Q_CH)
    do_row, do_col = _origin(b, h, DO_RB, DO_RH, DO_CH)
    end = (start_m + BLOCK_M) // BLOCK_N  # key blocks up to the diagonal's end

    q_smem, do_smem, qdo_bar = _resident_pair(q_desc, do_desc)
    k_smem, v_smem, k_bars, v_bars = _ring(k_desc, v_desc, NUM_BUF)
    fence_async_shared()

    _load_pair(q_desc, do_desc, q_smem, do_smem, qdo_bar, q_row + start_m, q_col, do_row + start_m, do_col)
    for t in gl.static_range(NUM_BUF):
        _load_keys(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_row, k_col, v_row, v_col, t, end, NUM_BUF)

    # delta = rowsum(dO * O) while the tiles load, stored for the dK/dV kernel
    stat0 = bh.to(gl.int64) * SEQ
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows_layout))
    o = gl.load(O + (stat0 + gl.expand_dims(rows, 1)) * HEAD_DIM + gl.expand_dims(cols, 0))
    mbarrier.wait(qdo_bar, 0)
    delta = gl.sum(o.to(gl.float32) * do_smem.load(rows_layout).to(gl.float32), 1)
    gl.store(DELTA + stat0 + rows, delta)
    delta = gl.convert_layout(delta, gl.SliceLayout(1, s_layout))
    lse2 = gl.load(LSE + stat0 + start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)))
    lse2 = lse2 * 1.4426950408889634  # natural log -> base 2

    # A V block is free once its dP is done, a K block only once its dQ update is: V's slots refill an iteration
    # earlier than K's (as the forward's K).
    s, dp = _products(q_smem, do_smem, k_smem, v_smem, k_bars, v_bars, 0, s_layout, NUM_BUF)
    s, dp = warpgroup_mma_wait(0, deps=[s, dp])
    _load_tile(v_desc, v_smem, v_bars, v_row + NUM_BUF * BLOCK_N, v_col, NUM_BUF, end, NUM_BUF)
    ds = _score_grad(s, dp, lse2, delta, 0, start_m, qk_scale, s_layout, dq_layout, q_desc.dtype, BLOCK_M, BLOCK_N)
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout))
    for j in range(1, end):
        s, dp = _products(q_smem, do_smem, k_smem, v_smem, k_bars, v_bars, j, s_layout, NUM_BUF)
        dq = warpgroup_mma(ds, k_smem.index((j - 1) % NUM_BUF), dq, is_async=True)
        s, dp = warpgroup_mma_wait(1, deps=[s, dp])
        _load_tile(v_desc, v_smem, v_bars, v_row + (j + NUM_BUF) * BLOCK_N, v_col, j + NUM_BUF, end, NUM_BUF)
        ds_next = _score_grad(s, dp, lse2, delta, j, start_m, qk_scale, s_layout, dq_layout, q_desc.dtype, BLOCK_M,
                              BLOCK_N)
        dq, ds = warpgroup_mma_wait(0, deps=[dq, ds])  # ds: kept alive until its update is done
        _load_tile(k_desc, k_smem, k_bars, k_row + (j - 1 + NUM_BUF) * BLOCK_N, k_col, j - 1 + NUM_BUF, end,
                   NUM_BUF)
        dq = warpgroup_mma_init(dq)
        ds = ds_next
    dq = warpgroup_mma_wait(0, deps=[warpgroup_mma(ds, k_smem.index((end - 1) % NUM_BUF), dq, is_async=True)])

    q_smem.store((dq * scale).to(dq_desc.dtype))  # Q is no longer read: its buffer stages dQ for the TMA store
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [bh * SEQ + start_m, 0], q_smem)
    tma.store_wait(0)
    _release(qdo_bar, k_bars, v_bars, NUM_BUF)


@gluon.jit
def _query_stats(ring, t, i, st_layout: gl.constexpr, BLOCK_M: gl.constexpr, NUM_BUF: gl.constexpr):
    """The ring's block t (query block i): its positions, base-2 LSE and delta along the columns of S^T, read
    from the slot that TMA filled with its Q and dO (landed: `_products` waited for them)."""
    layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    slot = t % NUM_BUF
    cols = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=layout)
    return cols, ring[2].index(slot).load(layout) * 1.4426950408889634, ring[3].index(slot).load(layout)


@gluon.jit
def _softmax_grad(st, dpt, cols, lse2, delta, i, start_n, qk_scale, st_layout: gl.constexpr, DTYPE: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MAY_MASK: gl.constexpr = True):
    """Query block i's P^T and dS^T in DTYPE (the causal mask where the block reaches the diagonal). With
    MAY_MASK False the caller knows the block lies wholly below the diagonal, and no mask code is compiled:
    ptxas predicates a runtime branch around the mask instead of jumping over it, so its comparisons and
    selects would issue for every block (ncu, 2026-12-06: about a sixth of the dK/dV kernel's instructions)."""
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    if MAY_MASK:
        if i * BLOCK_M < start_n + BLOCK_N:
            rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))  # key positions
            pt = gl.where(gl.expand_dims(cols, 0) >= gl.expand_dims(rows, 1), pt, 0.0)
    dst = pt * (dpt - gl.expand_dims(delta, 0))
    return pt.to(DTYPE), dst.to(DTYPE)


@gluon.jit
def _operand(x, acc_layout: gl.constexpr):
    """x as the register operand A of a wgmma whose accumulator has acc_layout."""
    return gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))


@gluon.jit
def _updates(pt, dst, dv, dk, q_smem, do_smem, t, NUM_BUF: gl.constexpr):
    """Issue dV += P^T dO and dK += dS^T Q for the ring's block t: two wgmma groups."""
    slot = t % NUM_BUF
    dv = warpgroup_mma(pt, do_smem.index(slot), dv, is_async=True)
    dk = warpgroup_mma(dst, q_smem.index(slot), dk, is_async=True)
    return dv, dk


@gluon.jit
def _query_block(t, first, n_q, hk, GROUP: gl.constexpr):
    """The dK/dV ring's block t, as (query head, query block): the group's query heads in turn, each from query
    block `first` on (n_q blocks). The loop steps with `_next_query_block` instead: no division per block."""
    if GROUP == 1:
        h = hk
        i = first + t
    else:
        g = t // n_q
        h = hk * GROUP + g
        i = first + t - g * n_q
    return h, i


@gluon.jit
def _next_query_block(h, i, first, n_blocks, GROUP: gl.constexpr):
    """The block after query block i of query head h: the next, or the next head's first. With one query head
    per kv head, h stays one value, so what derives from it (its rows, LSE and delta) leaves the loop."""
    if GROUP == 1:
        h_next = h
        i_next = i + 1
    else:
        wrap = i + 1 == n_blocks
        h_next = gl.where(wrap, h + 1, h)
        i_next = gl.where(wrap, first, i + 1)
    return h_next, i_next


@gluon.jit
def _load_query_tile(desc, stats_desc, smem, stats_smem, bars, row, col, stat, t, end, NUM_BUF: gl.constexpr):
    """Start the TMA copies of a query-row block (Q or dO) and of its rows' statistics (LSE or delta) as the
    ring's block t into slot t % NUM_BUF, both on the slot's mbarrier; none when t >= end."""
    slot = t % NUM_BUF
    ok = t < end
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes + stats_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(desc, [row, col], bars.index(slot), smem.index(slot), pred=ok)
    tma.async_copy_global_to_shared(stats_desc, [stat], bars.index(slot), stats_smem.index(slot), pred=ok)


@gluon.jit
def _load_queries(descs, ring, Q_RB, Q_RH, Q_CH, DO_RB, DO_RH, DO_CH, b, h, i, HEADS, SEQ, t, end,
                  BLOCK_M: gl.constexpr, NUM_BUF: gl.constexpr):
    """Start loading Q with LSE and dO with delta of query block i of query head h as the ring's block t; none
    when t >= end. descs: the (Q, dO, LSE, delta) descriptors, ring: `_key_program`'s."""
    q_row, q_col = _origin(b, h, Q_RB, Q_RH, Q_CH)
    do_row, do_col = _origin(b, h, DO_RB, DO_RH, DO_CH)
    stat = (b * HEADS + h) * SEQ + i * BLOCK_M
    _load_query_tile(descs[0], descs[2], ring[0], ring[2], ring[4], q_row + i * BLOCK_M, q_col, stat, t, end,
                     NUM_BUF)
    _load_query_tile(descs[1], descs[3], ring[1], ring[3], ring[5], do_row + i * BLOCK_M, do_col, stat, t, end,
                     NUM_BUF)


@gluon.jit
def _key_program(descs, k_desc, v_desc, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, DO_RB, DO_RH,
                 DO_CH, HEADS, GROUP: gl.constexpr, SEQ, N_SMS, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 NUM_BUF: gl.constexpr):
    """A key-block program (dK/dV, fused backward): its kv head's batch and index, its batch * kv heads index,
    first key, first query block and its ring's length (the query blocks of every query head it serves), the
    last ring block whose load it started, and its shared memory: K and V resident (landed on return), and the
    ring of streamed query blocks, (Q, dO, LSE, delta, Q's mbarriers, dO's mbarriers), the first NUM_BUF blocks
    on their way. descs: the (Q, dO, LSE, delta) descriptors.

    LSE and delta come by TMA beside Q and dO, NUM_BUF blocks ahead, rather than by loads in the loop: those had
    the loop wait for memory after its score products (ncu, 2026-12-06: ~5% of the dK/dV kernel's stall samples
    at B1 H16 S16384 D64)."""
    n_blocks = SEQ // BLOCK_N
    pid_n, bhk = _schedule(n_blocks, gl.num_programs(0) // n_blocks, N_SMS, False)
    kv_heads = HEADS // GROUP
    b = bhk // kv_heads
    hk = bhk % kv_heads
    start_n = pid_n * BLOCK_N
    k_row, k_col = _origin(b, hk, K_RB, K_RH, K_CH)
    v_row, v_col = _origin(b, hk, V_RB, V_RH, V_CH)
    first = start_n // BLOCK_M  # queries before start_n see none of these keys
    n_q = SEQ // BLOCK_M - first
    end = GROUP * n_q

    k_smem, v_smem, kv_bar = _resident_pair(k_desc, v_desc)
    q_smem, do_smem, q_bars, do_bars = _ring(descs[0], descs[1], NUM_BUF)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF, BLOCK_M], descs[2].layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF, BLOCK_M], descs[3].layout)
    ring = (q_smem, do_smem, lse_smem, delta_smem, q_bars, do_bars)
    fence_async_shared()

    _load_pair(k_desc, v_desc, k_smem, v_smem, kv_bar, k_row + start_n, k_col, v_row + start_n, v_col)
    for t in gl.static_range(NUM_BUF):
        h_load, i_load = _query_block(t, first, n_q, hk, GROUP)
        _load_queries(descs, ring, Q_RB, Q_RH, Q_CH, DO_RB, DO_RH, DO_CH, b, h_load, i_load, HEADS, SEQ, t, end,
                      BLOCK_M, NUM_BUF)
    mbarrier.wait(kv_bar, 0)
    return b, hk, bhk, start_n, first, end, h_load, i_load, k_smem, v_smem, kv_bar, ring


@gluon.jit
def _first_query_block(k, v, ring, hk, GROUP: gl.constexpr, first, start_n, qk_scale, st_layout: gl.constexpr,
                       DTYPE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr):
    """A key-block program's first ring block on its own (nothing to overlap yet): its query head and block, its
    P^T and dS^T."""
    h = hk * GROUP
    i = first
    st, dpt = _products(k, v, ring[0], ring[1], ring[4], ring[5], 0, st_layout, NUM_BUF)
    cols, lse2, delta = _query_stats(ring, 0, i, st_layout, BLOCK_M, NUM_BUF)
    st, dpt = warpgroup_mma_wait(0, deps=[st, dpt])
    pt, dst = _softmax_grad(st, dpt, cols, lse2, delta, i, start_n, qk_scale, st_layout, DTYPE, BLOCK_M, BLOCK_N)
    return h, i, pt, dst


@gluon.jit
def _share_ds(share, dst, t):
    """With `share` (the fused warp-specialized backward's: this consumer's rows of N dS^T slots, and their ready
    and free mbarriers), put ring block t's dS^T in slot t % N for the dQ partition, once that has read block
    t-N's; without, nothing."""
    if share is not None:
        ds_smem, ready, free = share
        N: gl.constexpr = ds_smem.shape[0]
        slot = t % N
        mbarrier.wait(free.index(slot), ((t // N) & 1) ^ 1)  # a fresh mbarrier's "previous phase" counts as complete
        ds_smem.index(slot).store(dst)
        fence_async_shared()
        mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def _next_grads(st, dpt, dv, dk, pt, dst, ring, t, i, start_n, qk_scale, st_layout: gl.constexpr,
                kv_layout: gl.constexpr, BLOCK_N: gl.constexpr, MAY_MASK: gl.constexpr, share=None):
    """The dK/dV loop's step after issuing ring block t's S^T and dP^T (query block i) and block t-1's updates:
    once the former are done, block t's P^T and dS^T as the next updates' register operands, computed while the
    updates run (dS^T also shared, `_share_ds`); then the wait for those. Returns (P^T, dS^T, dV, dK)."""
    NUM_BUF: gl.constexpr = ring[0].shape[0]
    BLOCK_M: gl.constexpr = ring[0].shape[1]
    cols, lse2, delta = _query_stats(ring, t, i, st_layout, BLOCK_M, NUM_BUF)
    st, dpt = warpgroup_mma_wait(2, deps=[st, dpt])
    pt_next, dst_next = _softmax_grad(st, dpt, cols, lse2, delta, i, start_n, qk_scale, st_layout, ring[0].dtype,
                                      BLOCK_M, BLOCK_N, MAY_MASK)
    _share_ds(share, dst_next, t)
    pt_next, dst_next = _operand(pt_next, kv_layout), _operand(dst_next, kv_layout)
    dv, dk, pt, dst = warpgroup_mma_wait(0, deps=[dv, dk, pt, dst])  # pt, dst: alive until their updates are done
    return pt_next, dst_next, dv, dk


@gluon.jit
def dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, Q_RB, Q_RH, Q_CH, K_RB,
                K_RH, K_CH, V_RB, V_RH, V_CH, DO_RB, DO_RH, DO_CH, HEADS, GROUP: gl.constexpr, SEQ, qk_scale, scale,
                N_SMS, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
                NUM_WARPS: gl.constexpr, KV_IN_REGS: gl.constexpr):
    """dK and dV for one key block of one kv head, over the query blocks of every query head it serves (LSE and
    delta as 1-D descriptors over contiguous (batch, heads, seq) tensors; dK and dV contiguous). KV_IN_REGS: K
    and V as the register operands of S^T and dP^T, loaded once, so those wgmmas read only Q or dO from shared
    memory."""
    st_layout: gl.constexpr = wgmma_layout(NUM_WARPS, BLOCK_M)
    kv_layout: gl.constexpr = wgmma_layout(NUM_WARPS, HEAD_DIM)
    descs = (q_desc, do_desc, lse_desc, delta_desc)
    b, hk, bhk, start_n, first, end, h_load, i_load, k_smem, v_smem, kv_bar, ring = _key_program(
        descs, k_desc, v_desc, Q_RB, Q_RH, Q_CH, K_RB, K_RH, K_CH, V_RB, V_RH, V_CH, DO_RB, DO_RH, DO_CH, HEADS,
        GROUP, SEQ, N_SMS, BLOCK_M, BLOCK_N, NUM_BUF)
    q_smem, do_smem, q_bars, do_bars = ring[0], ring[1], ring[4], ring[5]
    n_q_blocks = SEQ // BLOCK_M
    if KV_IN_REGS:
        k = k_smem.load(gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2))
        v = v_smem.load(gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2))
    else:
        k = k_smem
        v = v_smem

    h, i, pt, dst = _first_query_block(k, v, ring, hk, GROUP, first, start_n, qk_scale, st_layout, q_desc.dtype,
                                       BLOCK_M, BLOCK_N, NUM_BUF)
    pt, dst = _operand(pt, kv_layout), _operand(dst, kv_layout)
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    # Then block t's S^T and dP^T, block t-1's updates, a wait for the former alone, block t's P^T and dS^T
    # while the updates run. Each register written while a wgmma is in flight is a new one (the previous
    # P^T and dS^T stay alive until their updates are waited for), so ptxas has no reason to serialize.
    # (ptxas 12.8 moves the exponentials below the wait for the updates all the same: see the module's
    # docstring.)
    # Each query head's blocks come in two runs: the first N_DIAG reach the diagonal and may need the mask,
    # the rest lie below it and compile without (the loop body twice, MAY_MASK a constant in each).
    N_DIAG: gl.constexpr = max(BLOCK_N // BLOCK_M, 1)
    n_q = n_q_blocks - first
    for g in range(GROUP):
        for run in gl.static_range(2):
            lo = gl.maximum(g * n_q + run * N_DIAG, 1)  # ring block 0 was the first, on its own
            hi = g * n_q + N_DIAG if run == 0 else (g + 1) * n_q
            for t in range(lo, hi):
                h, i = _next_query_block(h, i, first, n_q_blocks, GROUP)
                st_t, dpt_t = _products(k, v, q_smem, do_smem, q_bars, do_bars, t, st_layout, NUM_BUF)
                dv, dk = _updates(pt, dst, dv, dk, q_smem, do_smem, t - 1, NUM_BUF)
                pt_next, dst_next, dv, dk = _next_grads(st_t, dpt_t, dv, dk, pt, dst, ring, t, i, start_n, qk_scale,
                                                        st_layout, kv_layout, BLOCK_N, run == 0)
                # block t-1's Q, dO and statistics are no longer read: its slot takes block t - 1 + NUM_BUF
                h_load, i_load = _next_query_block(h_load, i_load, first, n_q_blocks, GROUP)
                _load_queries(descs, ring, Q_RB, Q_RH, Q_CH, DO_RB, DO_RH, DO_CH, b, h_load, i_load, HEADS, SEQ,
                              t - 1 + NUM_BUF, end, BLOCK_M, NUM_BUF)
                dv = warpgroup_mma_init(dv)
                dk = warpgroup_mma_init(dk)
                pt = pt_next
                dst = dst_next
    dv, dk = _updates(pt, dst, dv, dk, q_smem, do_smem, end - 1, NUM_BUF)
    dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])

    _store_dkdv(dk, dv, scale, k_smem, v_smem, dk_desc, dv_desc, bhk * SEQ + start_n)
    _release(kv_bar, q_bars, do_bars, NUM_BUF)


@gluon.jit
def _store_dkdv(dk, dv, scale, k_smem, v_smem, dk_desc, dv_desc, row):
    """Store a key block's dK (times scale) and dV at `row` of their contiguous 2-D views, through K's and V's
    buffers (no longer read), and wait for every TMA store and reduction of the program."""
    k_smem.store((dk * scale).to(dk_desc.dtype))
    v_smem.store(dv.to(dv_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [row, 0], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [row, 0], v_smem)
    tma.store_wait(0)
