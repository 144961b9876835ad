"""Stochastic rounding of float32 values to bfloat16, for optimizers that keep bf16 weights and moments.

A bf16 weight in [1, 2) moves only in steps of 2^-7. Rounded to nearest, an update smaller than half of that is
lost every step, so with bf16 weights (`trainer.precision=bf16-true`) a small learning rate trains nothing, and a
second moment that changes by (1 - beta2) = 0.1% a step never changes. Rounded stochastically, a value between two bf16
neighbours goes to the upper one with probability equal to its distance from the lower: the rounding is unbiased,
so small updates add up in expectation (Gupta et al. 2015; Zamirai et al. 2020, "Revisiting BFloat16 Training").

bf16 is the top half of float32's bits, so the rounding is integer arithmetic: add 16 random bits to the float32's
bits and cut the low half. The carry into the kept half happens with exactly that probability, and it carries
through the exponent where it should (the largest mantissa rounds up to the next power of two).

The random bits are a hash of the element's position and a key, not a generator's stream, so the Triton Adam
(lmlab.kernels.adam_triton) draws the very same bits with the same few integer operations and the reference here
is its exact twin. The key mixes the optimizer's seed, the tensor's index and its step, so every step draws anew
and a resumed run draws what the uninterrupted run would have.
"""

from __future__ import annotations

import warnings

import torch

MASK32 = 0xFFFFFFFF
# Which tensor of an update a stream rounds: its element i draws hash(3 i + stream + key).
PARAM, FIRST_MOMENT, SECOND_MOMENT = range(3)


def mix32(x: int) -> int:
    """A 32-bit integer hash with full avalanche ("lowbias32", from Chris Wellons' hash prospector)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def round_key(seed: int, index: int, step: int) -> int:
    """The key of tensor `index`'s rounding noise at `step` of an optimizer seeded with `seed`."""
    return mix32(mix32(mix32(seed) + index) + step)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 tensors holding 32-bit values, in 16-bit halves of c so no product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """`mix32` elementwise on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rounded_bits(flat: torch.Tensor, offset: int) -> torch.Tensor:
    """The float32 bits of 1-D float32 `flat` rounded stochastically to bf16 (low 16 bits zero), as int32; element i
    draws hash(3 i + offset), offset = stream + key."""
    position = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    noise = _mix32_tensor((position * 3 + offset) & MASK32) >> 16
    bits = flat.view(torch.int32).to(torch.int64) & MASK32
    bits = (bits + noise) & 0xFFFF0000
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


class _Compiled:
    """`fn` compiled by torch.compile (dynamic shapes) at its first call, not at import (importing torch's compiler
    takes seconds). Where torch.compile cannot build it (no compiler, say), it warns once and runs `fn` eagerly."""

    def __init__(self, fn):
        self.eager, self.fn = fn, None

    def __call__(self, *args):
        if self.fn is None:
            self.fn = torch.compile(self.eager, dynamic=True)
        try:
            return self.fn(*args)
        except Exception as err:  # noqa: BLE001 - any compile failure; the eager call below re-raises a real one
            if self.fn is self.eager:
                raise
            warnings.warn(f"{self.eager.__name__} runs eagerly (much slower): torch.compile failed: {err}",
                          stacklevel=2)
            self.fn = self.eager
            return self.eager(*args)


def rounded_bits_each(flats: tuple[torch.Tensor, ...], offsets: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """`rounded_bits` of each 1-D float32 tensor with its offset."""
    return tuple(rounded_bits(flat, offset) for flat, offset in zip(flats, offsets))


# `rounded_bits_each` in one call. Eager, rounded_bits' ~20 int64 operations move ~350 bytes an element: on a GPU
# that made a ~400M model's steps with bf16 weights ~4x slower than with float32 weights when the reference Adam ran
# (lmlab-train without `kernels=triton`); compiled, it reads 4 bytes and writes 4, with the same bits. A compiled
# call costs the host ~100 us, so an Adam step rounds a tensor's weights and moments in one
# (experiments/kernels/README.md).
_round = _Compiled(rounded_bits_each)


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, key: int, stream: int) -> torch.Tensor:
    """Write float32 `src` into bfloat16 `dst` (same shape), each element rounded up or down at random with the
    probabilities that make the rounding unbiased; `key` and `stream` choose the noise (see the module's doc)."""
    stochastic_round_each_([dst], [src], key, [stream])
    return dst


def stochastic_round_each_(dsts: list[torch.Tensor], srcs: list[torch.Tensor], key: int, streams: list[int]) -> None:
    """`stochastic_round_` of each (dst, src, stream), in one compiled call."""
    for dst, src in zip(dsts, srcs):
        if dst.dtype != torch.bfloat16 or src.dtype != torch.float32:
            raise ValueError(f"stochastic_round_ rounds float32 to bfloat16, got {src.dtype} -> {dst.dtype}")
    # one int for key and stream: torch.compile specializes ints that are 0 or 1, as a stream often is
    rounded = _round(tuple(src.detach().reshape(-1) for src in srcs), tuple(stream + key for stream in streams))
    for dst, bits in zip(dsts, rounded):
        dst.copy_(bits.view(torch.float32).view(dst.shape))  # exact: the low 16 bits are zero


def nearest_rounded_parameters(optimizer: torch.optim.Optimizer) -> int:
    """How many elements of `optimizer`'s 16-bit parameters it writes rounded to nearest: those of groups that do
    not round stochastically (any optimizer but Adam's, or Adam's told not to) and every float16 one."""
    return sum(p.numel() for group in optimizer.param_groups for p in group["params"]
               if p.dtype in (torch.bfloat16, torch.float16)
               and not (p.dtype == torch.bfloat16 and group.get("stochastic_rounding")))
