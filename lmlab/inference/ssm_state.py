"""The generation state of Mamba-2 (lmlab.nn.mamba2): per sequence, the last d_conv - 1 inputs of the causal
convolution and the (heads x head_dim x d_state) SSM state, a fixed size whatever the length.

A forward of several tokens (a prefill chunk, a speculative verification) runs the chunked scan from the
saved state; one token (decoding) runs one recurrence step. The SSM state is kept in float32. Left padding
(slots before a sequence's start) gets a zero conv input and dt = 0, so it leaves the state as if it were
absent. The state cannot be rolled back (`rewindable` is False).
"""

from __future__ import annotations


from lmlab.inference.cache import CacheState, LayerCache, cache_for
from lmlab.nn.mamba2 import Mamba2, Mamba2State


class SSMState(LayerCache):
    rewindable = False

    def __init__(self, attn: Mamba2, state: CacheState, batch_size: int, device, dtype):
        super().__init__(state)
        conv, ssm = attn.init_state(batch_size, device=device, dtype=dtype)
        self.tensors = {"conv": conv, "ssm": ssm}

    def __call__(self, attn: Mamba2, x, position, positions):
        real = self.state.slots[None, :] >= self.state.start[:, None]  # (B, S)
        out, new = attn.forward_with_state(x, Mamba2State(self.tensors["conv"], self.tensors["ssm"]), real)
        self.tensors["conv"].copy_(new.conv)  # in place: a captured CUDA graph keeps reading these buffers
        self.tensors["ssm"].copy_(new.ssm)
        return out


@cache_for(Mamba2)
def ssm_state(attn, state, batch_size, max_len, device, dtype, lookahead: int = 0) -> LayerCache:
    return SSMState(attn, state, batch_size, device, dtype)
