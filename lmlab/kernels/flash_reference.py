"""Tiled FlashAttention-2 in plain PyTorch: the reference the Triton attention kernel is tested against.

Shapes: q is (batch, heads, seq, head_dim) and k, v are (batch, kv_heads, seq, head_dim) with
heads divisible by kv_heads (GQA; kv_heads=1 is MQA). 3-D (batch, seq, head_dim) inputs are one head.
Scores are scaled by 1/sqrt(head_dim). Causal attention needs q_len == k_len (query i sees keys
j <= i); non-causal attention accepts any k_len.

The forward walks over key blocks with an online softmax and keeps only the output and the
per-row log-sum-exp (LSE); the backward recomputes each block's probabilities from the LSE, so
no seq x seq matrix is ever stored. Query heads are viewed as (kv_heads, group) and every einsum
contracts against the shared kv head, so K and V are never repeated in memory. Blocks are
computed in float32 (float64 for float64 inputs, so gradcheck is meaningful) and results are cast
back to the input dtype; the LSE stays in that accumulation dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch

BLOCK_Q = 64
BLOCK_K = 64


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() not in (3, 4):
        raise ValueError("q must be (batch, heads, seq, head_dim) or (batch, seq, head_dim); "
                         f"got shape {tuple(q.shape)}")
    if k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k and v must all be 3-D or all be 4-D; got {q.dim()}-D, {k.dim()}-D and {v.dim()}-D")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size; got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim; got {q.shape[-1]} and {k.shape[-1]}")
    if q.dim() == 4 and q.shape[1] % k.shape[1]:
        raise ValueError(f"n_heads={q.shape[1]} of q is not divisible by n_kv_heads={k.shape[1]} of k and v")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs q_len == k_len; got {q.shape[-2]} and {k.shape[-2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have one dtype; got {q.dtype}, {k.dtype} and {v.dtype}")


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, S, D) or (B, S, D) query-side tensor -> (B, Hkv, group, S, D), a view where possible."""
    if x.dim() == 3:
        return x[:, None, None]
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def _kv(x: torch.Tensor) -> torch.Tensor:
    return x[:, None] if x.dim() == 3 else x


def _causal_mask(i0: int, i1: int, j0: int, j1: int, device: torch.device) -> torch.Tensor | None:
    """True where key j > query i inside the (i0:i1, j0:j1) block; None if the block is fully visible."""
    if j1 - 1 <= i0:
        return None
    rows = torch.arange(i0, i1, device=device)
    cols = torch.arange(j0, j1, device=device)
    return cols[None, :] > rows[:, None]


def _key_end(causal: bool, i1: int, k_len: int) -> int:
    # Causal: keys past the block's last query are masked for every row, so skip them.
    return min(i1, k_len) if causal else k_len


def flash_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                              block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (q's shape and dtype) and per-row LSE (q's shape without head_dim).

    The forward pass only; differentiate through `FlashAttentionReference.apply` instead.
    """
    _check(q, k, v, causal)
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(q.shape[-1])
    kv_heads = _kv(k).shape[1]
    qg, kk, vv = _grouped(q, kv_heads), _kv(k), _kv(v)
    q_len, k_len = qg.shape[-2], kk.shape[-2]
    out = torch.empty(qg.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(qg.shape[:-1], dtype=acc, device=q.device)
    for i0 in range(0, q_len, block_q):
        i1 = min(i0 + block_q, q_len)
        qb = qg[..., i0:i1, :].to(acc)
        row_max = torch.full(qb.shape[:-1], -math.inf, dtype=acc, device=q.device)
        row_sum = torch.zeros(qb.shape[:-1], dtype=acc, device=q.device)
        o = torch.zeros(qb.shape, dtype=acc, device=q.device)
        for j0 in range(0, _key_end(causal, i1, k_len), block_k):
            j1 = min(j0 + block_k, k_len)
            s = torch.einsum("bhgqd,bhkd->bhgqk", qb, kk[..., j0:j1, :].to(acc)) * scale
            mask = _causal_mask(i0, i1, j0, j1, q.device) if causal else None
            if mask is not None:
                s = s.masked_fill(mask, -math.inf)
            # Every row sees key 0 in the first block, so row_max is finite from then on.
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            p = torch.exp(s - new_max[..., None])
            rescale = torch.exp(row_max - new_max)
            row_sum = row_sum * rescale + p.sum(dim=-1)
            o = o * rescale[..., None] + torch.einsum("bhgqk,bhkd->bhgqd", p, vv[..., j0:j1, :].to(acc))
            row_max = new_max
        out[..., i0:i1, :] = (o / row_sum[..., None]).to(q.dtype)
        lse[..., i0:i1] = row_max + torch.log(row_sum)
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              d_out: torch.Tensor, causal: bool, block_q: int, block_k: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 backward: P = exp(S - LSE), dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O))."""
    acc = lse.dtype
    scale = 1.0 / math.sqrt(q.shape[-1])
    kv_heads = _kv(k).shape[1]
    qg, kk, vv = _grouped(q, kv_heads), _kv(k), _kv(v)
    d_og = _grouped(d_out, kv_heads)
    lse_g = _grouped(lse[..., None], kv_heads)[..., 0]
    delta = (d_og.to(acc) * _grouped(out, kv_heads).to(acc)).sum(dim=-1)
    q_len, k_len = qg.shape[-2], kk.shape[-2]
    dq = torch.zeros(qg.shape, dtype=acc, device=q.device)
    dk = torch.zeros(kk.shape, dtype=acc, device=q.device)
    dv = torch.zeros(vv.shape, dtype=acc, device=q.device)
    for j0 in range(0, k_len, block_k):
        j1 = min(j0 + block_k, k_len)
        kb, vb = kk[..., j0:j1, :].to(acc), vv[..., j0:j1, :].to(acc)
        # Causal: queries before j0 see none of these keys.
        for i0 in range(j0 - j0 % block_q if causal else 0, q_len, block_q):
            i1 = min(i0 + block_q, q_len)
            qb, dob = qg[..., i0:i1, :].to(acc), d_og[..., i0:i1, :].to(acc)
            s = torch.einsum("bhgqd,bhkd->bhgqk", qb, kb) * scale
            mask = _causal_mask(i0, i1, j0, j1, q.device) if causal else None
            if mask is not None:
                s = s.masked_fill(mask, -math.inf)
            p = torch.exp(s - lse_g[..., i0:i1, None])
            dv[..., j0:j1, :] += torch.einsum("bhgqk,bhgqd->bhkd", p, dob)
            dp = torch.einsum("bhgqd,bhkd->bhgqk", dob, vb)
            ds = p * (dp - delta[..., i0:i1, None]) * scale
            dq[..., i0:i1, :] += torch.einsum("bhgqk,bhkd->bhgqd", ds, kb)
            dk[..., j0:j1, :] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qb)
    return dq.reshape(q.shape).to(q.dtype), dk.reshape(k.shape).to(k.dtype), dv.reshape(v.shape).to(v.dtype)


class FlashAttentionReference(torch.autograd.Function):
    """`FlashAttentionReference.apply(q, k, v, causal[, block_q, block_k])` -> attention output."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> torch.Tensor:
        out, lse = flash_attention_reference(q, k, v, causal, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, d_out, ctx.causal, ctx.block_q, ctx.block_k)
        return dq, dk, dv, None, None, None
