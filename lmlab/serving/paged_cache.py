"""Paged KV caches: each layer's keys and values in a pool of blocks, read through block tables.

A paged cache is made per layer by the factory registered for the layer's attention class,

    @paged_cache_for(MyAttention)
    def my_paged_cache(attn, batch, num_blocks, block_size, device, dtype) -> PagedLayerCache: ...

and, like the inference engine's caches, is called as `cache(attn, x, position, positions)` in place
of the attention: it writes the new tokens' keys and values into their slots and attends each query
over its own sequence's keys. All layers share one `PagedBatch`, which the runner refills before each
forward: the sequences of a step need not share lengths, positions or blocks.

Attention reads the pools by gathering each sequence's blocks (any device; the mask hides keys past a
query and, for sliding-window layers, before its window), or, for one new token per sequence on CUDA,
with the Triton paged flash-decoding kernel, which follows the block table itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from einops import rearrange

from lmlab.errors import ConfigError
from lmlab.inference.cache import mha_attend, plain_softmax, registered_for
from lmlab.nn.attention import MultiHeadAttention
from lmlab.nn.positions import PositionEncoding

PagedCacheFactory = Callable[..., "PagedLayerCache"]
PAGED_CACHE_FACTORIES: dict[type, PagedCacheFactory] = {}


def paged_cache_for(attention_cls: type) -> Callable[[PagedCacheFactory], PagedCacheFactory]:
    """Register the paged-cache factory of an attention class (subclasses inherit it)."""

    def decorator(factory: PagedCacheFactory) -> PagedCacheFactory:
        PAGED_CACHE_FACTORIES[attention_cls] = factory
        return factory

    return decorator


def paged_factory_for(attn: torch.nn.Module) -> PagedCacheFactory:
    if (factory := registered_for(PAGED_CACHE_FACTORIES, attn)) is not None:
        return factory
    raise ConfigError(f"attention {type(attn).__name__} has no paged KV cache, so lmlab's server cannot run it "
                      "(attention entries with one: " + ", ".join(sorted(c.__name__ for c in PAGED_CACHE_FACTORIES))
                      + "); register one with @lmlab.serving.paged_cache.paged_cache_for, or use `lmlab generate`")


@dataclass
class PagedBatch:
    """Where one forward's tokens go and what they see; refilled by the runner before each forward.
    Rows are sequences, right-padded to a common number of new tokens S."""

    slot_mapping: torch.Tensor  # (B, S) long: the pool slot each new token writes (padding: the null block)
    block_tables: torch.Tensor  # (B, max_blocks) int32: each row's blocks, enough for its longest context
    context_lens: torch.Tensor  # (B,) int32: keys each row has once this forward's tokens are written
    block_size: int
    # (q (B, H, D), k_pool, v_pool, block_tables, context_lens, scale, window) -> (B, H, D), for S = 1 on
    # CUDA (lmlab.kernels.paged_decode_attention_triton); None: the gather path
    attention_kernel: Callable | None = None

    def key_slots(self) -> torch.Tensor:
        """(B, L) the pool slot of each row's key positions 0..L-1, L = max_blocks * block_size."""
        offsets = torch.arange(self.block_size, device=self.block_tables.device)
        return (self.block_tables.long()[:, :, None] * self.block_size + offsets).flatten(1)


def paged_mask(positions: torch.Tensor, length: int, window: int | None, position: PositionEncoding,
               additive: bool, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1 or heads, S, L): query at position p sees key position k <= p (and p - k < window), with
    ALiBi's bias where the position scheme has one. Keys past a row's context are past its queries too."""
    keys = torch.arange(length, device=positions.device)
    allowed = keys[None, None, :] <= positions[:, :, None]
    if window is not None:
        allowed &= (positions[:, :, None] - keys[None, None, :]) < window
    allowed = allowed[:, None]
    bias = position.attn_bias(positions, keys.expand(positions.shape[0], length))
    if bias is None and not additive:
        return allowed
    base = torch.zeros((), dtype=dtype, device=allowed.device) if bias is None else bias.to(dtype)
    return base.masked_fill(~allowed, float("-inf"))


def _kernel_applies(attn: MultiHeadAttention, position: PositionEncoding, q: torch.Tensor, pool: torch.Tensor) -> bool:
    from lmlab.kernels.paged_decode_attention_triton import unsupported  # Triton is optional

    return plain_softmax(attn, position) and unsupported(q[:, :, 0], pool) is None


class PagedLayerCache:
    """Base of the paged caches: pools in `self.pools` (name -> (num_blocks, block_size, ...) tensor)."""

    def __init__(self, batch: PagedBatch):
        self.batch = batch
        self.pools: dict[str, torch.Tensor] = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pools.values())

    def copy_blocks(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copy whole blocks within the pools (copy-on-write of a shared block)."""
        for pool in self.pools.values():
            pool.index_copy_(0, destinations, pool.index_select(0, sources))

    def __call__(self, attn, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PagedKVCache(PagedLayerCache):
    """Keys and values of n_kv_heads per slot (GQA/MQA heads are never repeated)."""

    def __init__(self, attn: MultiHeadAttention, batch: PagedBatch, num_blocks: int, block_size: int, device, dtype):
        super().__init__(batch)
        shape = (num_blocks, block_size, attn.n_kv_heads, attn.head_dim)
        self.pools = {"k": torch.zeros(shape, device=device, dtype=dtype),
                      "v": torch.zeros(shape, device=device, dtype=dtype)}

    def __call__(self, attn, x, position, positions):
        q, k, v = attn.project(x, position, positions)
        batch, k_pool, v_pool = self.batch, self.pools["k"], self.pools["v"]
        slots = batch.slot_mapping.flatten()
        k_pool.flatten(0, 1).index_copy_(0, slots, rearrange(k, "b h s d -> (b s) h d"))
        v_pool.flatten(0, 1).index_copy_(0, slots, rearrange(v, "b h s d -> (b s) h d"))
        kernel = batch.attention_kernel
        if kernel is not None and q.shape[2] == 1 and _kernel_applies(attn, position, q, k_pool):
            out = kernel(q[:, :, 0], k_pool, v_pool, batch.block_tables, batch.context_lens, attn.score_scale,
                         attn.window)
            return attn.o_proj(rearrange(out, "b h d -> b 1 (h d)"))
        key_slots = batch.key_slots()
        keys = rearrange(k_pool.flatten(0, 1)[key_slots], "b l h d -> b h l d")
        values = rearrange(v_pool.flatten(0, 1)[key_slots], "b l h d -> b h l d")
        mask = paged_mask(positions, key_slots.shape[1], attn.window, position, attn.softcap is not None, q.dtype)
        return mha_attend(attn, q, keys, values, mask)


@paged_cache_for(MultiHeadAttention)
def mha_paged_cache(attn: MultiHeadAttention, batch: PagedBatch, num_blocks: int, block_size: int, device,
                    dtype) -> PagedLayerCache:
    return PagedKVCache(attn, batch, num_blocks, block_size, device, dtype)
