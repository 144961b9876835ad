"""The generation state of Gated DeltaNet: per sequence, each head's fast-weight matrix S (d_k x d_v, float32)
and the last d_conv - 1 inputs of the q, k and v convolutions; a fixed size whatever the length (see
lmlab.nn.gated_deltanet).

A forward of several tokens (prefill) runs the chunked form from the saved S; one token (decode) runs the
recurrence. Left padding must not reach a sequence's state: at slots before its start the layer input is
zeroed (so the convolutions see the zeros a fresh sequence starts from) and g = 0, beta = 0 (alpha = 1 and no
write: S_t = S_{t-1}). The state cannot be rolled back (`rewindable` is False).
"""

from __future__ import annotations

import torch

from lmlab.inference.cache import CacheState, LayerCache, cache_for
from lmlab.nn.gated_deltanet import GatedDeltaNet, chunk_gated_delta_rule, recurrent_gated_delta_rule

CONV_STATES = ("q_conv", "k_conv", "v_conv")


class DeltaState(LayerCache):
    rewindable = False

    def __init__(self, attn: GatedDeltaNet, state: CacheState, batch_size: int, device, dtype):
        super().__init__(state)
        key_dim, value_dim = attn.n_heads * attn.head_dim, attn.n_heads * attn.head_v_dim
        self.tensors = {
            "state": torch.zeros(batch_size, attn.n_heads, attn.head_dim, attn.head_v_dim, device=device,
                                 dtype=torch.float32),
            **{name: torch.zeros(batch_size, channels, attn.d_conv - 1, device=device, dtype=dtype)
               for name, channels in zip(CONV_STATES, (key_dim, key_dim, value_dim))},
        }

    def __call__(self, attn: GatedDeltaNet, x, position, positions):
        real = (self.state.slots[None, :] >= self.state.start[:, None]).to(x.dtype)  # (B, S): 0 on padding
        x = x * real[..., None]
        inputs, conv_tails = attn.heads(x, tuple(self.tensors[name] for name in CONV_STATES))
        inputs = inputs._replace(g=inputs.g * real[:, None], beta=inputs.beta * real[:, None])
        if x.shape[1] == 1:
            o, s = recurrent_gated_delta_rule(*inputs, initial_state=self.tensors["state"])
        else:
            o, s = chunk_gated_delta_rule(*inputs, chunk_size=attn.chunk_size, initial_state=self.tensors["state"])
        self.tensors["state"].copy_(s)
        for name, tail in zip(CONV_STATES, conv_tails):
            self.tensors[name].copy_(tail)
        return attn.output(o, x)


@cache_for(GatedDeltaNet)
def delta_state(attn, state, batch_size, max_len, device, dtype, lookahead: int = 0) -> LayerCache:
    return DeltaState(attn, state, batch_size, device, dtype)
