"""The KV cache of multi-head latent attention (DeepSeek-V2): per token only the normalised latent
(kv_lora_rank) and the one shared rotated rope key (qk_rope_head_dim) are stored.

Decoding uses the absorbed form: kv_b_proj's key half is folded into the query
(q_nope . W_uk c = (W_uk^T q_nope) . c) and its value half is applied after attention
(sum_j p_j W_uv c_j = W_uv sum_j p_j c_j), so per-head keys and values are never rebuilt. Attention
then is multi-query attention with keys [c, k_rope] and values c, which SDPA runs as GQA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from lmlab.inference.cache import CacheState, LayerCache, cache_for, score_mask
from lmlab.nn.mla import MultiHeadLatentAttention


class LatentCache(LayerCache):
    def __init__(self, attn: MultiHeadLatentAttention, state: CacheState, batch_size: int, max_len: int, device,
                 dtype):
        super().__init__(state)
        self.tensors = {"latent": torch.zeros(batch_size, 1, max_len, attn.kv_lora_rank, device=device, dtype=dtype),
                        "k_rope": torch.zeros(batch_size, 1, max_len, attn.rope_dim, device=device, dtype=dtype)}
        self.key_slots = torch.arange(max_len, device=device)

    def __call__(self, attn: MultiHeadLatentAttention, x, position, positions):
        q = rearrange(attn._queries(x), "b s (h d) -> b h s d", h=attn.n_heads)
        q_nope, q_rope = q.split([attn.nope_dim, attn.rope_dim], dim=-1)
        latent, k_rope = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, attn.rope_dim], dim=-1)
        q_rope, k_rope = position.rotate(q_rope, k_rope[:, None], positions)
        cached_latent, cached_rope = self.tensors["latent"], self.tensors["k_rope"]
        cached_latent.index_copy_(2, self.state.slots, attn.kv_a_layernorm(latent)[:, None])
        cached_rope.index_copy_(2, self.state.slots, k_rope)

        w_kv = attn.kv_b_proj.weight.view(attn.n_heads, attn.nope_dim + attn.v_dim, attn.kv_lora_rank)
        w_uk, w_uv = w_kv.split([attn.nope_dim, attn.v_dim], dim=1)
        q_latent = torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk)
        mask = score_mask(self.state, self.key_slots, None, position, False, q.dtype)
        out = F.scaled_dot_product_attention(
            torch.cat([q_latent, q_rope], dim=-1), torch.cat([cached_latent, cached_rope], dim=-1), cached_latent,
            attn_mask=mask, scale=attn.qk_head_dim ** -0.5, enable_gqa=True)
        out = torch.einsum("bhsr,hvr->bhsv", out, w_uv)
        return attn.o_proj(rearrange(out, "b h s d -> b s (h d)"))


@cache_for(MultiHeadLatentAttention)
def mla_cache(attn, state, batch_size, max_len, device, dtype, lookahead: int = 0) -> LayerCache:
    return LatentCache(attn, state, batch_size, max_len, device, dtype)
