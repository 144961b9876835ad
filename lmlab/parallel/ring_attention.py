"""Ring attention (Liu et al. 2023): softmax attention over a sequence split across ranks, written to be read.

    q, k, v = (zigzag_shard(t, rank, world, dim=2) for t in (q_full, k_full, v_full))   # (B, H, S / world, D)
    out = ring_attention(q, k, v, causal=True)              # this rank's rows of attention over the whole sequence
    full = zigzag_unshard(out, world, dim=2)                 # (a collective) the whole output, for checking

Each rank keeps its queries. The keys and values travel around the ring: at step t rank r holds the block
that started on rank r - t, attends its queries to it, and passes it on to rank r + 1, so after world_size
steps every query has seen every key while each rank held at most two key blocks at a time: the sequence,
not the model, is what gets split. The partial results of the blocks are merged as flash attention merges
its tiles: each keeps its row maxima and sums (a log-sum-exp), and the running output is rescaled when a
block raises a row's maximum.

Causal balance. With a causal mask, a rank holding the start of the sequence has little to do and one
holding the end has the most. So the sequence is cut into 2 x world_size chunks and rank r keeps chunks r
and 2 world_size - 1 - r (the zigzag layout): every rank then has the same number of (query, key) pairs to
compute. Masks come from the tokens' global positions, so any layout would be exact; this one is fast.

Backward runs the ring again: each rank recomputes its queries' scores against each passing block, from
the saved log-sum-exp, adds the block's contribution to its query gradient, and sends the block's key and
value gradients along with the block, so that they arrive back at the block's owner complete.

The blocks are multiplied in plain PyTorch (einsum): this is the algorithm, not a fused kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def zigzag_positions(length: int, rank: int, world: int, device=None) -> torch.Tensor:
    """Global positions of rank `rank`'s tokens of a `length`-token sequence in the zigzag layout."""
    if length % (2 * world):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x {world} equal chunks; "
                         f"use a length divisible by {2 * world}")
    chunk = length // (2 * world)
    first, second = rank * chunk, (2 * world - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s tokens of `x` (sequence along `dim`): chunks r and 2 world - 1 - r."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], rank, world, x.device))


def zigzag_unshard(local: torch.Tensor, world: int, dim: int = 1) -> torch.Tensor:
    """Every rank's zigzag shard put back in sequence order (a collective; not differentiable)."""
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    length = local.shape[dim] * world
    whole = torch.empty(*local.shape[:dim], length, *local.shape[dim + 1:], dtype=local.dtype, device=local.device)
    for rank, part in enumerate(parts):
        whole.index_copy_(dim, zigzag_positions(length, rank, world, local.device), part)
    return whole


def _pass_on(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Send each tensor to the next rank of the ring and receive the previous rank's."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    after, before = (rank + 1) % world, (rank - 1) % world
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]  # q, k, v may be views
    ops = [dist.P2POp(dist.isend, t.contiguous(), to_global(after), group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, to_global(before), group) for r in received]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> torch.Tensor | None:
    return (k_pos[None, :] <= q_pos[:, None]) if causal else None


def _precision(t: torch.Tensor) -> torch.dtype:
    """What the blocks are computed and merged in: float32 at least (float64 stays float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _block_scores(q, k, q_pos, k_pos, scale, causal):
    dtype = _precision(q)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.to(dtype), k.to(dtype)) * scale
    seen = _visible(q_pos, k_pos, causal)
    return scores if seen is None else scores.masked_fill(~seen, float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, scale: float, causal: bool, group):
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        length = positions.numel() * world
        dtype = _precision(q)
        out = torch.zeros(q.shape, dtype=dtype, device=q.device)
        row_max = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        row_sum = torch.zeros(q.shape[:-1], dtype=dtype, device=q.device)
        block_k, block_v = k, v
        for step in range(world):
            owner = (rank - step) % world  # the rank this key block started on
            k_pos = zigzag_positions(length, owner, world, q.device)
            scores = _block_scores(q, block_k, positions, k_pos, scale, causal)
            new_max = torch.maximum(row_max, scores.amax(-1))
            safe = torch.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing seen yet
            rescale = torch.exp(row_max - safe)
            weights = torch.exp(scores - safe[..., None])
            row_sum = row_sum * rescale + weights.sum(-1)
            out = out * rescale[..., None] + torch.einsum("bhqk,bhkd->bhqd", weights, block_v.to(dtype))
            row_max = new_max
            if step < world - 1:
                block_k, block_v = _pass_on([block_k, block_v], group)
        out = out / row_sum[..., None]
        lse = row_max + torch.log(row_sum)
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.scale, ctx.causal, ctx.group = scale, causal, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, positions = ctx.saved_tensors
        scale, causal, group = ctx.scale, ctx.causal, ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        length = positions.numel() * world
        dtype = _precision(q)
        grad_out = grad_out.to(dtype)
        delta = (grad_out * out).sum(-1)  # rowsum(dO * O): the softmax's backward term
        grad_q = torch.zeros(q.shape, dtype=dtype, device=q.device)
        block_k, block_v = k, v
        grad_k = torch.zeros(k.shape, dtype=dtype, device=k.device)
        grad_v = torch.zeros(v.shape, dtype=dtype, device=v.device)
        for step in range(world):
            owner = (rank - step) % world
            k_pos = zigzag_positions(length, owner, world, q.device)
            probs = torch.exp(_block_scores(q, block_k, positions, k_pos, scale, causal) - lse[..., None])
            grad_v += torch.einsum("bhqk,bhqd->bhkd", probs, grad_out)
            grad_scores = probs * (torch.einsum("bhqd,bhkd->bhqk", grad_out, block_v.to(dtype)) - delta[..., None])
            grad_q += torch.einsum("bhqk,bhkd->bhqd", grad_scores, block_k.to(dtype)) * scale
            grad_k += torch.einsum("bhqk,bhqd->bhkd", grad_scores, q.to(dtype)) * scale
            if step < world - 1:  # the block moves on with its gradients so far
                block_k, block_v, grad_k, grad_v = _pass_on([block_k, block_v, grad_k, grad_v], group)
            else:  # one more pass brings each block's gradients home to its owner
                grad_k, grad_v = _pass_on([grad_k, grad_v], group)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None,
                   group=None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys and values, all (batch, heads,
    tokens, head_dim) and in the zigzag layout of `zigzag_shard`; differentiable. GQA: repeat the key
    and value heads before calling."""
    if q.shape[:2] != k.shape[:2] or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: each rank's shards must "
                         "have the same batch, heads and tokens")
    world = dist.get_world_size(group)
    positions = zigzag_positions(q.shape[2] * world, dist.get_rank(group), world, q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, positions, scale, causal, group)
