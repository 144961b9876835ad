"""KV caches: what each attention entry keeps between generation steps, and the protocol they share.

A cache is made per layer by the factory registered for the layer's attention class,

    @cache_for(MyAttention)
    def my_cache(attn, state, batch_size, max_len, device, dtype, lookahead=0) -> LayerCache: ...

and is called as `cache(attn, x, position, positions)` in place of `attn(x, position, positions)`:
it attends the new tokens `x` over everything cached so far and stores what later steps need.
So a new attention entry gets generation by registering its cache; the engine never changes.

All caches of a model share one `CacheState`: the cache slots this forward's tokens go to (the same
for every sequence, because prompts are left-padded to a common length) and each sequence's first
real slot (its padding ends there). Buffers are preallocated and written in place with tensor
indices, so the decode step has static shapes and can be compiled and captured in a CUDA graph.
Rolling back (speculative decoding) is free for slot-addressed caches: a later step rewrites a
slot before any query at or after it reads it, and keys past the current query are masked.
`lookahead` is how many slots one forward may write and then roll back (a ring buffer keeps that
many more).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange

from lmlab.errors import ConfigError
from lmlab.nn.attention import MultiHeadAttention, softcapped_attention
from lmlab.nn.positions import PositionEncoding, RoPE

CacheFactory = Callable[..., "LayerCache"]
CACHE_FACTORIES: dict[type, CacheFactory] = {}


def cache_for(attention_cls: type) -> Callable[[CacheFactory], CacheFactory]:
    """Register the cache factory of an attention class (subclasses inherit it)."""

    def decorator(factory: CacheFactory) -> CacheFactory:
        CACHE_FACTORIES[attention_cls] = factory
        return factory

    return decorator


def registered_for(table: dict[type, CacheFactory], attn: torch.nn.Module) -> CacheFactory | None:
    """The factory registered for the attention's class or its nearest base class, or None."""
    return next((table[cls] for cls in type(attn).__mro__ if cls in table), None)


def factory_for(attn: torch.nn.Module) -> CacheFactory:
    if (factory := registered_for(CACHE_FACTORIES, attn)) is not None:
        return factory
    raise ConfigError(f"attention {type(attn).__name__} has no KV cache, so it cannot generate; register one with "
                      "@lmlab.inference.cache.cache_for")


@dataclass
class CacheState:
    """Shared by every layer's cache during one forward."""

    slots: torch.Tensor  # (S,) long: the cache slots of this forward's tokens, the same for all sequences
    start: torch.Tensor  # (B,) long: each sequence's first real slot (left padding fills the slots before)
    # (q, k_cache, v_cache, slots, start, scale, window) -> out: attention over slot-addressed caches with
    # this mask computed inside (lmlab.kernels.decode_attention_triton); None: SDPA with the mask built here
    attention_kernel: Callable | None = None
    # Each K/V-owning attention's cache as the caches are made (the latest loop's): CLA layers read it
    by_attention: dict = field(default_factory=dict)

    @classmethod
    def empty(cls, batch_size: int, device) -> CacheState:
        """Before any forward: one slot, and no left padding."""
        return cls(slots=torch.zeros(1, dtype=torch.long, device=device),
                   start=torch.zeros(batch_size, dtype=torch.long, device=device))

    def positions(self) -> torch.Tensor:
        """(B, S) position of each new token within its own sequence (0 on padding)."""
        return (self.slots[None, :] - self.start[:, None]).clamp_min(0)

    def key_positions(self, key_slots: torch.Tensor) -> torch.Tensor:
        return (key_slots[None, :] - self.start[:, None]).clamp_min(0)

    def allowed(self, key_slots: torch.Tensor, window: int | None) -> torch.Tensor:
        """(B, 1, S, K) bool: query slot q sees key slot k when start <= k <= q (and q - k < window).
        A padding query also sees itself, so that no softmax row is empty."""
        q, k = self.slots[:, None], key_slots[None, :]
        seen = (k <= q) & (k >= 0)
        if window is not None:
            seen &= (q - k) < window
        seen = seen[None] & (k[None] >= self.start[:, None, None])
        return (seen | (k == q)[None])[:, None]


def score_mask(state: CacheState, key_slots: torch.Tensor, window: int | None, position: PositionEncoding,
               additive: bool, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask over the cached keys: bool, or additive (with ALiBi's bias) where needed."""
    allowed = state.allowed(key_slots, window)
    bias = position.attn_bias(state.positions(), state.key_positions(key_slots))
    if bias is None and not additive:
        return allowed
    base = torch.zeros((), dtype=dtype, device=allowed.device) if bias is None else bias.to(dtype)
    return base.masked_fill(~allowed, float("-inf"))


class LayerCache:
    """Base of the per-layer caches: its tensors live in `self.tensors` (name -> tensor). `rewindable`:
    whether moving the write slot back undoes the later tokens (false for recurrent states)."""

    rewindable = True

    def __init__(self, state: CacheState):
        self.state = state
        self.tensors: dict[str, torch.Tensor] = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def reset(self) -> None:
        """Forget every sequence (a new generation starts)."""
        for t in self.tensors.values():
            t.zero_()

    def copy_from(self, other: LayerCache, index: torch.Tensor) -> None:
        """Hold sequences `index` of `other`, the same layer's cache for another batch (tensors are batch-first)."""
        for name, t in self.tensors.items():
            t.copy_(other.tensors[name].index_select(0, index))

    def __call__(self, attn, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def mha_attend(attn: MultiHeadAttention, q, k, v, mask: torch.Tensor) -> torch.Tensor:
    """Attention of q over cached keys and values under `mask` (SDPA, or soft-capped), then o_proj."""
    if attn.softcap is not None:
        out = softcapped_attention(q, k, v, mask, attn.softcap, attn.score_scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.score_scale,
                                             enable_gqa=attn.n_kv_heads != attn.n_heads)
    return attn.o_proj(rearrange(out, "b h s d -> b s (h d)"))


def plain_softmax(attn: MultiHeadAttention, position: PositionEncoding) -> bool:
    """Whether the layer's attention is what the decode kernels compute: softmax with no soft-capping and
    no position bias."""
    return attn.softcap is None and type(position).attn_bias is PositionEncoding.attn_bias


def _kernel_applies(attn: MultiHeadAttention, position: PositionEncoding, q: torch.Tensor, keys: torch.Tensor) -> bool:
    """The decode-attention kernel runs a few new tokens (decode, speculative verification; prefill
    keeps SDPA)."""
    from lmlab.kernels.decode_attention_triton import unsupported  # here: Triton is optional, and only set kernels need it

    return plain_softmax(attn, position) and unsupported(q, keys) is None


def kernel_rotary(position: PositionEncoding):
    """What the decode kernel needs to rotate like `position`: None (no rotation), RoPE's (cos, sin, interleaved),
    or False where it cannot (a rotation of another kind)."""
    rotate = type(position).rotate
    if rotate is PositionEncoding.rotate:
        return None
    if rotate is RoPE.rotate:
        return position.cos, position.sin, position.layout == "interleaved"
    return False


class KVCache(LayerCache):
    """Keys and values of every slot, n_kv_heads of them (GQA/MQA heads are never repeated)."""

    def __init__(self, attn: MultiHeadAttention, state: CacheState, batch_size: int, max_len: int, device, dtype):
        super().__init__(state)
        shape = (batch_size, attn.n_kv_heads, max_len, attn.head_dim)
        self.tensors = {"k": torch.zeros(shape, device=device, dtype=dtype),
                        "v": torch.zeros(shape, device=device, dtype=dtype)}
        self.key_slots = torch.arange(max_len, device=device)

    def __call__(self, attn, x, position, positions):
        q, k, v = attn.unrotated(x)
        kernel, rotary = self.state.attention_kernel, kernel_rotary(position)
        if (kernel is not None and rotary is not False and not attn.shares_kv
                and _kernel_applies(attn, position, q, self.tensors["k"])):
            # the kernel rotates q and k and stores k and v: no launches of their own
            out = kernel(q, self.tensors["k"], self.tensors["v"], self.state.slots, self.state.start, attn.score_scale,
                         attn.window, new_keys=k, new_values=v, rotary=rotary)
            return attn.o_proj(rearrange(out, "b h s d -> b s (h d)"))
        q, k, v = attn.rotated(q, k, v, position, positions)
        self.tensors["k"].index_copy_(2, self.state.slots, k)
        self.tensors["v"].index_copy_(2, self.state.slots, v)
        return self.attend(attn, position, q)

    def attend(self, attn, position, q: torch.Tensor) -> torch.Tensor:
        """q over every cached key up to its slot, then attn's o_proj."""
        keys, values = self.tensors["k"], self.tensors["v"]
        kernel = self.state.attention_kernel
        if kernel is not None and _kernel_applies(attn, position, q, keys):
            out = kernel(q, keys, values, self.state.slots, self.state.start, attn.score_scale, attn.window)
            return attn.o_proj(rearrange(out, "b h s d -> b s (h d)"))
        mask = score_mask(self.state, self.key_slots, attn.window, position, attn.softcap is not None, q.dtype)
        return mha_attend(attn, q, keys, values, mask)


class SlidingKVCache(LayerCache):
    """A ring buffer for a sliding-window layer: its memory is the window (plus the slots a speculative
    step may roll back), whatever the sequence length. `ring_slots` says which slot each entry holds."""

    def __init__(self, attn: MultiHeadAttention, state: CacheState, batch_size: int, size: int, device, dtype):
        super().__init__(state)
        shape = (batch_size, attn.n_kv_heads, size, attn.head_dim)
        self.size = size
        self.tensors = {"k": torch.zeros(shape, device=device, dtype=dtype),
                        "v": torch.zeros(shape, device=device, dtype=dtype)}
        self.ring_slots = torch.full((size,), -1, device=device)

    def reset(self) -> None:
        super().reset()
        self.ring_slots.fill_(-1)

    def copy_from(self, other: LayerCache, index: torch.Tensor) -> None:
        super().copy_from(other, index)
        self.ring_slots.copy_(other.ring_slots)  # which slot each entry holds: the same for every sequence

    def __call__(self, attn, x, position, positions):
        q, k, v = attn.project(x, position, positions)
        slots = self.state.slots
        # Attend over the ring and the new tokens together, then store the newest `size` of them.
        keys = torch.cat([self.tensors["k"], k], dim=2)
        values = torch.cat([self.tensors["v"], v], dim=2)
        # Entries at or past this forward's first slot were rolled back (speculative decoding): hide them.
        key_slots = torch.cat([self.ring_slots.masked_fill(self.ring_slots >= slots[0], -1), slots])
        self.view = (keys, values, key_slots)  # what this forward attends over, for CLA layers reading this one
        out = self.attend(attn, position, q)
        newest = slice(-self.size, None)
        index = slots[newest] % self.size
        self.tensors["k"].index_copy_(2, index, k[:, :, newest])
        self.tensors["v"].index_copy_(2, index, v[:, :, newest])
        self.ring_slots.index_copy_(0, index, slots[newest])
        return out

    def attend(self, attn, position, q: torch.Tensor) -> torch.Tensor:
        """q over the ring and this forward's new keys (as they were before the ring was written)."""
        keys, values, key_slots = self.view
        mask = score_mask(self.state, key_slots, attn.window, position, attn.softcap is not None, q.dtype)
        return mha_attend(attn, q, keys, values, mask)


class SharedKVCache(LayerCache):
    """A CLA layer's cache: nothing of its own; its queries attend over the cache of the layer whose keys and
    values it reads, which ran just before on the same tokens."""

    def __init__(self, source: LayerCache):
        super().__init__(source.state)
        self.source = source

    def __call__(self, attn, x, position, positions):
        q, _, _ = attn.project(x, position, positions)
        return self.source.attend(attn, position, q)


@cache_for(MultiHeadAttention)
def mha_cache(attn: MultiHeadAttention, state: CacheState, batch_size: int, max_len: int, device, dtype,
              lookahead: int = 0) -> LayerCache:
    """A ring of window + lookahead slots for a local layer whose window is shorter than the generation,
    else every slot; a CLA layer reads the cache of the layer whose keys and values it shares."""
    if not attn.causal:
        raise ValueError("a bidirectional attention layer (causal=false, an encoder's) cannot generate token by token")
    if attn.kv_source is not None:
        return SharedKVCache(state.by_attention[attn.kv_source])
    if attn.window is not None and attn.window + lookahead < max_len:
        cache = SlidingKVCache(attn, state, batch_size, attn.window + lookahead, device, dtype)
    else:
        cache = KVCache(attn, state, batch_size, max_len, device, dtype)
    state.by_attention[attn] = cache
    return cache
