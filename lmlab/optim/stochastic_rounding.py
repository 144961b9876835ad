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

import functools
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


def _rounded_bits(flat: torch.Tensor, index: torch.Tensor, offset: torch.Tensor | int) -> torch.Tensor:
    """The float32 bits of float32 `flat` rounded stochastically to bf16 (low 16 bits zero), as int32; an element at
    `index` within its tensor draws hash(3 index + offset)."""
    noise = _mix32_tensor((index * 3 + offset) & MASK32) >> 16
    bits = flat.view(torch.int32).to(torch.int64) & MASK32
    bits = (bits + noise) & 0xFFFF0000
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def rounded_bits(flat: torch.Tensor, offset: int) -> torch.Tensor:
    """`_rounded_bits` of one 1-D float32 tensor: element i draws hash(3 i + offset), offset = stream + key."""
    return _rounded_bits(flat, torch.arange(flat.numel(), device=flat.device, dtype=torch.int64), offset)


PACK_ALIGN = 1024  # elements: tensors in a Float32Pack start at multiples of it, so each such block holds one tensor


def packed_rounded(flat: torch.Tensor, tensor_of_block: torch.Tensor, starts: torch.Tensor,
                   offsets: torch.Tensor) -> torch.Tensor:
    """bf16 of a Float32Pack's buffer, each tensor t in it (from starts[t]) rounded as `rounded_bits` rounds it alone
    with offsets[t]."""
    position = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    tensor = tensor_of_block[position // PACK_ALIGN]
    return _rounded_bits(flat, position - starts[tensor], offsets[tensor]).view(torch.float32).to(torch.bfloat16)


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


# `packed_rounded` in one call. Eager, its ~20 int64 operations move ~350 bytes an element: on a GPU that made a
# ~400M model's steps with bf16 weights ~4x slower than with float32 weights when the reference Adam ran (lmlab-train
# without `kernels=triton`); compiled, it reads 4 bytes and writes 2, with the same bits. A compiled call costs the
# host ~100 us, so Adam rounds a whole group's tensors, packed, in one (experiments/kernels/README.md).
_round = _Compiled(packed_rounded)


def int64_on_device(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`, copied through a pinned buffer of PyTorch's caching allocator so that
    the host does not wait for the device's queue (a plain copy waits for it) nor pins new memory (`pin_memory()`
    took 561 us of host time against 188: experiments/kernels/host_to_device_copies.py)."""
    host = torch.as_tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return torch.empty(host.shape, dtype=torch.int64, pin_memory=True).copy_(host).to(device, non_blocking=True)


@functools.lru_cache(maxsize=64)
def _layout(sizes: tuple[int, ...], device: torch.device) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """A Float32Pack of tensors of these sizes: its pieces (each tensor's elements, then its padding to the next
    multiple of PACK_ALIGN), where each tensor starts (and the pack's length, last), those starts on `device`, and
    which tensor each PACK_ALIGN block holds. Kept: an optimizer packs the same sizes every step."""
    pieces, starts = [], [0]
    for n in sizes:
        padded = -(-n // PACK_ALIGN) * PACK_ALIGN
        pieces += [n, padded - n]
        starts.append(starts[-1] + padded)
    blocks = torch.tensor(starts, dtype=torch.int64).diff() // PACK_ALIGN
    tensor_of_block = torch.repeat_interleave(torch.arange(len(sizes)), blocks)
    return pieces, starts, int64_on_device(starts[:-1], device), int64_on_device(tensor_of_block, device)


class Float32Pack:
    """`tensors`' values in float32, end to end in one buffer (each from a multiple of PACK_ALIGN), to be updated
    through `views` (one a tensor, in its shape) and rounded back to bf16 all in one call (`stochastic_round_`)."""

    def __init__(self, tensors: list[torch.Tensor]):
        device = tensors[0].device
        self.pieces, starts, self.starts, self.tensor_of_block = _layout(tuple(t.numel() for t in tensors), device)
        self.first = starts[:-1]
        self.flat = torch.empty(starts[-1], dtype=torch.float32, device=device)
        self.views = self._views(self.flat, tensors)
        torch._foreach_copy_(self.views, tensors)

    def stochastic_round_(self, dsts: list[torch.Tensor], offsets: list[int]) -> None:
        """Write the pack's first len(dsts) tensors into bfloat16 `dsts` (their shapes), each rounded stochastically
        with its offset (stream + key: element i draws hash(3 i + offset), as in `rounded_bits`)."""
        for dst, view in zip(dsts, self.views):
            if dst.dtype != torch.bfloat16 or dst.shape != view.shape:
                raise ValueError(f"stochastic_round_ rounds float32 to bfloat16 of the same shape, got {view.shape} "
                                 f"-> {dst.dtype} {tuple(dst.shape)}")
        end = self.first[len(dsts)] if len(dsts) < len(self.views) else self.flat.numel()
        rounded = _round(self.flat[:end], self.tensor_of_block[:end // PACK_ALIGN], self.starts,
                         int64_on_device(offsets, self.flat.device))
        torch._foreach_copy_(dsts, self._views(rounded, dsts))

    def _views(self, flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """The first len(like) tensors of a buffer laid out as this pack's, in like's shapes (one split and a view
        each: a host's cost per tensor counts, at hundreds of tensors a step)."""
        pieces = flat.split(self.pieces[:2 * len(like)])[::2]
        return [piece.view(t.shape) for piece, t in zip(pieces, like)]


@torch.no_grad()
def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, key: int, stream: int) -> torch.Tensor:
    """Write float32 `src` into bfloat16 `dst` (same shape), each element rounded up or down at random with the
    probabilities that make the rounding unbiased; `key` and `stream` choose the noise (see the module's doc)."""
    if dst.dtype != torch.bfloat16 or src.dtype != torch.float32:
        raise ValueError(f"stochastic_round_ rounds float32 to bfloat16, got {src.dtype} -> {dst.dtype}")
    Float32Pack([src]).stochastic_round_([dst], [stream + key])
    return dst


def nearest_rounded_parameters(optimizer: torch.optim.Optimizer) -> int:
    """How many elements of `optimizer`'s 16-bit parameters it writes rounded to nearest: those of groups that do
    not round stochastically (any optimizer but Adam's, or Adam's told not to) and every float16 one."""
    return sum(p.numel() for group in optimizer.param_groups for p in group["params"]
               if p.dtype in (torch.bfloat16, torch.float16)
               and not (p.dtype == torch.bfloat16 and group.get("stochastic_rounding")))
