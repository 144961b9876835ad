"""The generation state of linear attention: the running sums S = sum phi(k) v^T and z = sum phi(k)
per head, a fixed size whatever the length (see lmlab.nn.linear_attention).

A forward of several tokens (prefill, or a speculative step) combines the state with the chunk's own
causal part: y_i = phi(q_i) (S + sum_{j<=i in chunk} phi(k_j) v_j^T) / (...), then adds the chunk to
S and z. The sums are kept in float32 (they grow with the sequence). Padding keys are zeroed, so
left padding never enters the sums. The state cannot be rolled back (`rewindable` is False).
"""

from __future__ import annotations

import torch

from lmlab.inference.cache import CacheState, LayerCache, cache_for
from lmlab.nn.linear_attention import LinearAttention


class RecurrentState(LayerCache):
    rewindable = False

    def __init__(self, attn: LinearAttention, state: CacheState, batch_size: int, device):
        super().__init__(state)
        s, z = attn.init_state(batch_size, device=device, dtype=torch.float32)
        self.tensors = {"s": s, "z": z}

    def __call__(self, attn: LinearAttention, x, position, positions):
        q, k, v = (t.float() for t in attn._heads(x, position, positions))
        real = self.state.slots[None, :] >= self.state.start[:, None]  # (B, S)
        k = k * real[:, None, :, None]
        s, z = self.tensors["s"], self.tensors["z"]
        causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = (q @ k.transpose(-2, -1)).masked_fill(~causal, 0.0)
        num = q @ s + scores @ v
        den = (q * z[:, :, None]).sum(-1, keepdim=True) + scores.sum(-1, keepdim=True)
        s.add_(k.transpose(-2, -1) @ v)
        z.add_(k.sum(2))
        return attn._out(num.to(x.dtype), den.to(x.dtype))


@cache_for(LinearAttention)
def linear_state(attn, state, batch_size, max_len, device, dtype, lookahead: int = 0) -> LayerCache:
    return RecurrentState(attn, state, batch_size, device)
