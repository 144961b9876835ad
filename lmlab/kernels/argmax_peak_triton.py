"""Greedy decoding's per-step reduction in one pass over the logits: the argmax and the finite check together.

`argmax_peak(logits, usable, peaks)` returns each row's argmax over the ids below `usable` (a padded vocabulary's
tail is never picked; the lowest id on a tie, as torch.argmax) and writes each row's largest |logit| over all ids
into `peaks` (NaN or inf where any logit is not finite: generation's check that names the step). With `finished`,
rows marked there take token 0 (generation's finished sequences), and `out` receives the tokens. With `next_step`
(ids, slot), the tokens are also written into ids, the next decode step's input, and slot is advanced by one: the
bookkeeping of a CUDA graph of greedy steps (lmlab.inference.greedy_steps) in this launch instead of two more.

Why a kernel: at batch 1 the step's two ATen reductions over 50,304 float32 logits (torch.argmax and
torch.linalg.vector_norm) took ~11 us of GPU time each on an H200, ~4% of a megakernel decode step
(experiments/inference/h200-2026-12-04b/). Here a row is cut into CHUNK-wide pieces, one program each, that read
their piece once and reduce it; the last program of a row to finish (an atomic count, reset by that program for the
next call) combines the pieces. One launch, no host sync. With TRITON_INTERPRET=1 it runs on CPU tensors through
Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK, NUM_WARPS = 2048, 4
_WORKSPACE: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@triton.jit
def _argmax_peak_kernel(Logits, Tokens, Peaks, Finished, NextIds, Slot, PartMax, PartArg, PartPeak, Done, vocab, usable,
                        stride, next_stride, n_chunks, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                        FINISHED: tl.constexpr, NEXT_STEP: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row * stride + ids, mask=ids < vocab, other=0.0).to(tl.float32)
    nan = tl.sum((x != x).to(tl.int32), 0) > 0  # tl.max would skip NaNs; the check must see them
    peak = tl.where(nan, float("nan"), tl.max(tl.abs(x), 0))
    best, at = tl.max(tl.where(ids < usable, x, float("-inf")), 0, return_indices=True,
                      return_indices_tie_break_left=True)
    part = row * n_chunks + chunk
    tl.store(PartMax + part, best)
    tl.store(PartArg + part, chunk * CHUNK + at)
    tl.store(PartPeak + part, peak)
    tl.debug_barrier()  # the partial results are issued before this program counts itself in
    if tl.atomic_add(Done + row, 1, sem="acq_rel", scope="gpu") == n_chunks - 1:
        parts = tl.arange(0, CHUNKS)
        ok = parts < n_chunks
        at_row = row * n_chunks + parts
        bests = tl.load(PartMax + at_row, mask=ok, other=float("-inf"), cache_modifier=".cg")
        args = tl.load(PartArg + at_row, mask=ok, other=vocab, cache_modifier=".cg")
        peaks = tl.load(PartPeak + at_row, mask=ok, other=0.0, cache_modifier=".cg")
        top = tl.max(bests, 0)
        token = tl.min(tl.where(ok & (bests == top), args, vocab), 0).to(tl.int64)
        if FINISHED:
            token = tl.where(tl.load(Finished + row) != 0, 0, token)
        tl.store(Tokens + row, token)
        if NEXT_STEP:
            tl.store(NextIds + row * next_stride, token)
            if row == 0:  # one program: nothing else reads the slot in this launch
                tl.store(Slot, tl.load(Slot) + 1)
        any_nan = tl.sum((peaks != peaks).to(tl.int32), 0) > 0
        tl.store(Peaks + row, tl.where(any_nan, float("nan"), tl.max(peaks, 0)))
        tl.store(Done + row, 0)  # ready for the next call


def _workspace(rows: int, n_chunks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each piece's (largest logit, its id, largest |logit|) and each row's count of finished pieces (zeros, and
    left at zero by every launch), kept per shape and device."""
    key = (rows, n_chunks, device)
    if key not in _WORKSPACE:
        f32 = dict(dtype=torch.float32, device=device)
        _WORKSPACE[key] = (torch.empty(2, rows, n_chunks, **f32), torch.empty(rows, n_chunks, dtype=torch.int32,
                                                                            device=device),
                           torch.zeros(rows, dtype=torch.int32, device=device))
    return _WORKSPACE[key]


def argmax_peak(logits: torch.Tensor, usable: int, peaks: torch.Tensor, finished: torch.Tensor | None = None,
                out: torch.Tensor | None = None,
                next_step: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """logits (B, V) -> the argmax of each row over ids < usable, (B,) int64 (in `out` where given; 0 in the rows
    that `finished` (B,) bool marks); peaks (B,) float32 gets each row's largest |logit| over all V ids. next_step:
    (ids (B,) int64, any stride, slot (1,) int64) that also get the tokens and one more."""
    rows, vocab = logits.shape
    if not 0 < usable <= vocab:
        raise ValueError(f"argmax_peak: usable={usable} must be in [1, {vocab}] (the logits' vocabulary)")
    if logits.stride(-1) != 1 or peaks.shape != (rows,) or peaks.dtype != torch.float32:
        raise ValueError("argmax_peak: the logits need contiguous rows and peaks a (rows,) float32 tensor")
    n_chunks = triton.cdiv(vocab, CHUNK)
    parts, args, done = _workspace(rows, n_chunks, logits.device)
    for name, given, dtype in (("finished", finished, torch.bool), ("out", out, torch.long)):
        if given is not None and (given.shape != (rows,) or given.dtype != dtype or not given.is_contiguous()):
            raise ValueError(f"argmax_peak: {name} must be a contiguous (rows,) {dtype} tensor")
    if next_step is not None:
        ids, slot = next_step
        if ids.shape != (rows,) or ids.dtype != torch.long or slot.shape != (1,) or slot.dtype != torch.long:
            raise ValueError("argmax_peak: next_step must be (ids, slot): a (rows,) and a (1,) int64 tensor")
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device) if out is None else out
    ids, slot = (tokens, tokens) if next_step is None else next_step
    _argmax_peak_kernel[(rows, n_chunks)](logits, tokens, peaks, tokens if finished is None else finished, ids, slot,
                                          parts[0], args, parts[1], done, vocab, usable, logits.stride(0),
                                          ids.stride(0), n_chunks, CHUNK=CHUNK, CHUNKS=triton.next_power_of_2(n_chunks),
                                          FINISHED=finished is not None, NEXT_STEP=next_step is not None,
                                          num_warps=NUM_WARPS)
    return tokens
