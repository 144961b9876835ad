"""Context parallelism: each rank holds a slice of every sequence, and attention runs as ring attention.

    apply_context_parallel(model, group)            # every attention layer: ring attention over `group`
    ids_shard = zigzag_shard(ids, rank, world)       # this rank's tokens (chunks r and 2W-1-r of 2W)
    logits = model(ids_shard, context_positions(ids.shape[1], group))

Everything but attention acts on each token alone, so it runs on the rank's slice unchanged; attention is
the one place tokens meet, and `lmlab.parallel.ring_attention` passes the key and value blocks around the
ring. Rotary positions come from the tokens' places in the whole sequence, which the caller passes as
`positions`. Activation memory per rank falls by the ring's size, so a context too long for one device's
memory trains on several. The ranks hold the same weights: average their gradients as data parallelism
does (each rank's loss is the mean over its tokens).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.attention import MultiHeadAttention
from lmlab.nn.positions import PositionEncoding
from lmlab.parallel.ring_attention import ring_attention, zigzag_positions, zigzag_shard


def problems(model: nn.Module) -> list[str]:
    """Why `model` cannot attend through the ring; empty if it can."""
    found = []
    if type(model.position).attn_bias is not PositionEncoding.attn_bias:
        found.append(f"model/position={type(model.position).__name__} biases the scores (ring attention has no bias)")
    for i, block in enumerate(model.blocks()):
        attn = block.self_attn
        if type(attn) is not MultiHeadAttention:
            found.append(f"layer {i}: attention {type(attn).__name__} (ring attention replaces mha's)")
        elif attn.window is not None or attn.softcap is not None:
            found.append(f"layer {i}: a sliding window or soft-capped scores (the ring computes plain causal attention)")
    return found


def _ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None, *, group,
          repeats: int) -> torch.Tensor:
    """The attention kernel's call signature, through the ring (GQA's key and value heads repeated first)."""
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    return ring_attention(q, k, v, causal=causal, scale=scale, group=group)


def apply_context_parallel(model: nn.Module, group=None) -> None:
    """Make every attention layer of `model` attend through the ring over `group` (see the module doc)."""
    found = problems(model)
    if found:
        raise ConfigError("context parallelism: " + "; ".join(found))
    for block in model.blocks():
        attn = block.self_attn
        attn.kernel = partial(_ring, group=group, repeats=attn.n_heads // attn.n_kv_heads)


def context_positions(length: int, group=None, device=None) -> torch.Tensor:
    """Positions in the whole sequence of this rank's zigzag slice of a `length`-token sequence."""
    return zigzag_positions(length, dist.get_rank(group), dist.get_world_size(group), device)


def context_slice(inputs: torch.Tensor, targets: torch.Tensor, group=None):
    """This rank's zigzag slice of a batch's rows (batch, seq): (inputs, targets, positions in the whole sequences)."""
    rank, world, length = dist.get_rank(group), dist.get_world_size(group), inputs.shape[1]
    inputs, targets = (zigzag_shard(t, rank, world, dim=1) for t in (inputs, targets))
    return inputs, targets, context_positions(length, group, inputs.device)
