"""The KV cache of top-k sparse attention (lmlab.nn.sparse_attention): MHA's keys and values per slot plus
the indexer's one key per slot.

Each new query scores every cached slot it may see (CacheState.allowed: not left padding, not past
itself, within the window) with the indexer, keeps its top-k, and attends over those k keys only, so a
decode step reads k keys and values however long the sequence, plus the small index keys of every slot.
Slots are addressed like KVCache's, so rolling back is free; a window only limits the candidates
(the cache keeps every slot rather than a ring).
"""

from __future__ import annotations

from lmlab.inference.cache import CacheState, KVCache, LayerCache, cache_for
from lmlab.nn.sparse_attention import TopKSparseAttention, select_top_k


class SparseKVCache(KVCache):
    def __init__(self, attn: TopKSparseAttention, state: CacheState, batch_size: int, max_len: int, device, dtype):
        super().__init__(attn, state, batch_size, max_len, device, dtype)
        self.tensors["index_k"] = self.tensors["k"].new_zeros(batch_size, max_len, attn.index_dim)

    def __call__(self, attn: TopKSparseAttention, x, position, positions):
        q, k, v = attn.project(x, position, positions)
        slots = self.state.slots
        keys, values, index_keys = self.tensors["k"], self.tensors["v"], self.tensors["index_k"]
        keys.index_copy_(2, slots, k)
        values.index_copy_(2, slots, v)
        index_keys.index_copy_(1, slots, attn.index_keys(x, positions))
        allowed = self.state.allowed(self.key_slots, attn.window)[:, 0]  # (B, S, max_len)
        index, valid = select_top_k(attn.index_scores(x, positions, index_keys), allowed, attn.top_k)
        bias = position.attn_bias(self.state.positions(), self.state.key_positions(self.key_slots))
        out, _ = attn.attend_selected(q, keys, values, index, valid, bias)
        return out


@cache_for(TopKSparseAttention)
def sparse_cache(attn, state, batch_size, max_len, device, dtype, lookahead: int = 0) -> LayerCache:
    return SparseKVCache(attn, state, batch_size, max_len, device, dtype)
