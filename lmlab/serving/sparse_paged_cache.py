"""The paged KV cache of top-k sparse attention (lmlab.nn.sparse_attention): MHA's paged keys and values
plus a pool of the indexer's keys. Each query scores its row's keys up to its own position (within the
window) with the indexer, keeps its top-k and attends over those only. Registered for the subclass so
that it does not inherit MHA's paged cache, which would attend to every key."""

from __future__ import annotations

from einops import rearrange

from lmlab.nn.sparse_attention import TopKSparseAttention, select_top_k
from lmlab.serving.paged_cache import PagedBatch, PagedKVCache, PagedLayerCache, paged_cache_for, paged_mask


class SparsePagedCache(PagedKVCache):
    def __init__(self, attn: TopKSparseAttention, batch: PagedBatch, num_blocks: int, block_size: int, device,
                 dtype):
        super().__init__(attn, batch, num_blocks, block_size, device, dtype)
        self.pools["index_k"] = self.pools["k"].new_zeros(num_blocks, block_size, attn.index_dim)

    def __call__(self, attn: TopKSparseAttention, x, position, positions):
        q, k, v = attn.project(x, position, positions)
        slots = self.batch.slot_mapping.flatten()
        pools = {name: pool.flatten(0, 1) for name, pool in self.pools.items()}  # (slots, ...) views
        pools["k"].index_copy_(0, slots, rearrange(k, "b h s d -> (b s) h d"))
        pools["v"].index_copy_(0, slots, rearrange(v, "b h s d -> (b s) h d"))
        pools["index_k"].index_copy_(0, slots, attn.index_keys(x, positions).flatten(0, 1))
        key_slots = self.batch.key_slots()  # (B, L): each row's keys in position order
        keys, values = (rearrange(pools[name][key_slots], "b l h d -> b h l d") for name in ("k", "v"))
        # ALiBi's bias where a key is allowed, -inf where it is not
        mask = paged_mask(positions, key_slots.shape[1], attn.window, position, True, q.dtype)
        scores = attn.index_scores(x, positions, pools["index_k"][key_slots])
        index, valid = select_top_k(scores, mask[:, 0].isfinite(), attn.top_k)
        out, _ = attn.attend_selected(q, keys, values, index, valid, mask)
        return out


@paged_cache_for(TopKSparseAttention)
def sparse_paged_cache(attn, batch, num_blocks, block_size, device, dtype) -> PagedLayerCache:
    return SparsePagedCache(attn, batch, num_blocks, block_size, device, dtype)
