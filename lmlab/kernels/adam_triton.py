"""Multi-tensor fused Adam/AdamW in Triton: one launch updates a whole parameter group.

`adam_update_triton(params, grads, exp_avgs, exp_avg_sqs, steps, lr, betas, eps, weight_decay,
decoupled)` has the signature and arithmetic of lmlab's reference `adam_update` (lmlab.optim.adam):
optional decoupled decay of p, the L2 term otherwise, lerp of the first moment, the second
moment, bias-corrected step. Each element of p, grad and both moments is read once and p and the
moments are written once, computing in float32. The reference launches about eight elementwise
kernels per parameter; launching even one per parameter costs milliseconds of host time per step
at a few hundred parameters, which a training loop that syncs before the optimizer step (lmlab's
step guard) cannot hide.

One launch per combination of dtypes: each program updates BLOCK elements of one tensor, found in
a table of (tensor, offset) per block that depends only on the tensors' sizes and is cached on the
device. The tensors' addresses and per-tensor step sizes change every step (gradients are new
tensors after `zero_grad(set_to_none=True)`), so they go in a small table copied from pinned
memory without a sync. Tensors it cannot serve (not CUDA, not contiguous, not 16-byte aligned,
sharded DTensors) go to the reference.

With `round_keys`, bf16 tensors are written with stochastic rounding, drawing per element the same hash of its
position and the tensor's key as the reference (lmlab.optim.stochastic_rounding): five integer operations a draw
rather than a Philox generator's ~70, which would make this memory-bound update wait on the integer units.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict

import torch
import triton
import triton.language as tl

from lmlab.optim.adam import adam_update
from lmlab.optim.stochastic_rounding import int64_on_device

BLOCK = 4096


@triton.jit
def _mix32(x):
    """lmlab.optim.stochastic_rounding.mix32 on uint32 lanes (the products wrap as there)."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _store(ptr, x, offs, key, stream: tl.constexpr, mask, STOCHASTIC: tl.constexpr):
    """Store float32 `x` in `ptr`'s dtype: rounded to nearest, or stochastically into bf16 with `key`'s noise."""
    if STOCHASTIC and ptr.dtype.element_ty == tl.bfloat16:
        noise = _mix32(offs.to(tl.uint32) * 3 + stream + key) >> 16
        bits = (x.to(tl.uint32, bitcast=True) + noise) & 0xFFFF0000
        tl.store(ptr + offs, bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, n, step_size, bias2_sqrt, decay, l2, beta1, beta2, eps, key,
                MASKED: tl.constexpr, STOCHASTIC: tl.constexpr):
    # Unmasked for every block but a tensor's last: a mask built from a size loaded at run time has
    # no known alignment, which would make every load and store a scalar one.
    mask = offs < n if MASKED else None
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    p = p * decay  # 1 - lr * weight_decay for AdamW, 1 for Adam
    g = g + l2 * p  # weight_decay for Adam's L2 penalty, 0 for AdamW
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
    _store(p_ptr, p, offs, key, 0, mask, STOCHASTIC)  # the streams of lmlab.optim.stochastic_rounding
    _store(m_ptr, m, offs, key, 1, mask, STOCHASTIC)
    _store(v_ptr, v, offs, key, 2, mask, STOCHASTIC)


@triton.jit
def _adam_kernel(addrs_ptr, scalars_ptr, block_tensor_ptr, block_start_ptr, numels_ptr, n_tensors,
                 p_type, g_type, m_type, v_type, decay, l2, beta1, beta2, eps, BLOCK: tl.constexpr,
                 STOCHASTIC: tl.constexpr):
    # p_type..v_type are the first tensors of each list: only their pointer types are used, to turn
    # the table's int64 addresses into typed pointers.
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid)
    start = tl.multiple_of(tl.load(block_start_ptr + pid), BLOCK)
    offs = start + tl.arange(0, BLOCK)
    n = tl.load(numels_ptr + t)
    # Addresses loaded from memory carry no alignment facts; `_fusable` checked 16 bytes, and
    # saying so lets the loads and stores be 16-byte vectors.
    p_ptr = tl.multiple_of(tl.load(addrs_ptr + t).to(p_type.dtype), 16)
    g_ptr = tl.multiple_of(tl.load(addrs_ptr + n_tensors + t).to(g_type.dtype), 16)
    m_ptr = tl.multiple_of(tl.load(addrs_ptr + 2 * n_tensors + t).to(m_type.dtype), 16)
    v_ptr = tl.multiple_of(tl.load(addrs_ptr + 3 * n_tensors + t).to(v_type.dtype), 16)
    step_size = tl.load(scalars_ptr + t).to(tl.float32)  # lr / (1 - beta1^step)
    bias2_sqrt = tl.load(scalars_ptr + n_tensors + t).to(tl.float32)  # sqrt(1 - beta2^step)
    key = tl.load(addrs_ptr + 4 * n_tensors + t).to(tl.uint32) if STOCHASTIC else 0
    if start + BLOCK <= n:
        _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, n, step_size, bias2_sqrt, decay, l2, beta1, beta2, eps, key,
                    False, STOCHASTIC)
    else:
        _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, n, step_size, bias2_sqrt, decay, l2, beta1, beta2, eps, key,
                    True, STOCHASTIC)


def _fusable(*tensors: torch.Tensor) -> bool:
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cuda and t.is_contiguous()
               and t.data_ptr() % 16 == 0 for t in tensors)


@functools.lru_cache(maxsize=16)
def _block_table(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tensor index, first element) of every BLOCK-element block of the tensors, and their sizes."""
    sizes = torch.tensor(numels, dtype=torch.int64)
    blocks = (sizes + BLOCK - 1) // BLOCK
    tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), blocks)
    first_block = torch.cumsum(blocks, 0) - blocks
    start = (torch.arange(int(blocks.sum()), dtype=torch.int64) - first_block[tensor.long()]) * BLOCK
    return tensor.to(device), start.to(device), sizes.to(device)


def _step_table(tensors: list[list[torch.Tensor]], steps: list[int], lr: float, betas: tuple[float, float],
                keys: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Device int64 addresses (p, then grads, then m, then v; then the rounding keys, if any) and float64 (step
    sizes, then bias corrections), copied so the host does not wait for the GPU (`int64_on_device`)."""
    beta1, beta2 = betas
    addrs = [t.data_ptr() for column in tensors for t in column] + keys
    scalars = [lr / (1 - beta1**s) for s in steps] + [math.sqrt(1 - beta2**s) for s in steps]
    host = torch.cat([torch.tensor(addrs, dtype=torch.int64), torch.tensor(scalars, dtype=torch.float64).view(torch.int64)])
    table = int64_on_device(host, device)
    return table[:len(addrs)], table[len(addrs):].view(torch.float64)


def adam_update_triton(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], steps: list[int], lr: float, betas: tuple[float, float],
                       eps: float, weight_decay: float, decoupled: bool, round_keys: list[int] | None = None) -> None:
    launches: dict[tuple, list[int]] = defaultdict(list)
    rest = []
    for i, tensors in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if _fusable(*tensors):
            launches[(tensors[0].device, *(t.dtype for t in tensors))].append(i)
        else:
            rest.append(i)
    beta1, beta2 = betas
    for (device, *dtypes), index in launches.items():
        columns = [[column[i] for i in index] for column in (params, grads, exp_avgs, exp_avg_sqs)]
        block_tensor, block_start, numels = _block_table(tuple(params[i].numel() for i in index), device)
        if not block_tensor.numel():  # only empty tensors: nothing to launch
            continue
        stochastic = round_keys is not None and torch.bfloat16 in (dtypes[0], *dtypes[2:])
        keys = [round_keys[i] for i in index] if stochastic else []
        addrs, scalars = _step_table(columns, [steps[i] for i in index], lr, betas, keys, device)
        _adam_kernel[(block_tensor.numel(),)](
            addrs, scalars, block_tensor, block_start, numels, len(index), *(column[0] for column in columns),
            1.0 - lr * weight_decay if decoupled else 1.0, 0.0 if decoupled else weight_decay,
            beta1, beta2, eps, BLOCK=BLOCK, STOCHASTIC=stochastic, num_warps=8)
    if rest:
        adam_update(*([column[i] for i in rest] for column in (params, grads, exp_avgs, exp_avg_sqs)),
                    [steps[i] for i in rest], lr, betas, eps, weight_decay, decoupled,
                    None if round_keys is None else [round_keys[i] for i in rest])
