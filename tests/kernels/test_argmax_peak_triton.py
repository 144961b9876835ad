"""The greedy step's fused reduction (`argmax_peak`) against torch.argmax and the largest |logit|: ties, a padded
vocabulary's tail, non-finite logits, rows that are views, repeated launches (its per-row counts reset). Runs on
CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED),
                                reason="needs CUDA, or Triton's CPU interpreter (TRITON_INTERPRET=1)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected(logits: torch.Tensor, usable: int) -> tuple[torch.Tensor, torch.Tensor]:
    return logits[:, :usable].argmax(-1), torch.linalg.vector_norm(logits.float(), float("inf"), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab, usable", [(1, 5000, 5000), (3, 4097, 4000), (2, 300, 257)])
def test_equals_torch(rows, vocab, usable, dtype):
    from lmlab.kernels.argmax_peak_triton import argmax_peak

    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(rows, vocab + 7, generator=g).to(DEVICE, dtype)
    logits = wide[:, 3:3 + vocab]  # rows of a larger tensor: a stride that is not the width
    logits[0, usable - 1] = 50.0  # the last usable id wins row 0
    if usable < vocab:
        logits[-1, usable] = 100.0  # the padding's larger logit counts for the peak, not for the argmax
    for _ in range(3):  # the per-row counts are left at zero for the next launch
        peaks = torch.full((rows,), -1.0, device=DEVICE)
        tokens = argmax_peak(logits, usable, peaks)
        want_tokens, want_peaks = _expected(logits, usable)
        assert tokens.dtype == torch.long and tokens.tolist() == want_tokens.tolist()
        torch.testing.assert_close(peaks, want_peaks)


def test_ties_pick_the_lowest_id_across_chunks():
    from lmlab.kernels.argmax_peak_triton import CHUNK, argmax_peak

    logits = torch.zeros(2, 3 * CHUNK, device=DEVICE)
    logits[0, [CHUNK + 5, 2 * CHUNK + 1]] = 4.0  # a tie between two chunks
    logits[1, [CHUNK - 1, CHUNK]] = -0.5
    logits[1] -= 1.0  # row 1's maximum is the first id of all
    tokens = argmax_peak(logits, logits.shape[1], torch.empty(2, device=DEVICE))
    assert tokens.tolist() == [CHUNK + 5, 0] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_show_in_the_peak(bad):
    from lmlab.kernels.argmax_peak_triton import argmax_peak

    logits = torch.randn(2, 4100, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits[1, 4099] = bad
    peaks = torch.empty(2, device=DEVICE)
    argmax_peak(logits, 4100, peaks)
    assert torch.isfinite(peaks[0]) and not torch.isfinite(peaks[1])
    assert torch.isnan(peaks[1]) == (bad != bad)


def test_bad_arguments_are_refused():
    from lmlab.kernels.argmax_peak_triton import argmax_peak

    logits = torch.zeros(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match="usable=11"):
        argmax_peak(logits, 11, torch.empty(2, device=DEVICE))
    with pytest.raises(ValueError, match="peaks"):
        argmax_peak(logits, 10, torch.empty(3, device=DEVICE))


def test_finished_rows_take_token_zero_written_into_out():
    from lmlab.kernels.argmax_peak_triton import argmax_peak

    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = torch.full((3,), -1, dtype=torch.long, device=DEVICE)
    finished = torch.tensor([False, True, False], device=DEVICE)
    tokens = argmax_peak(logits, 3000, torch.zeros(3, device=DEVICE), finished, out)
    want = logits.argmax(-1).masked_fill(finished, 0)
    assert tokens.data_ptr() == out.data_ptr() and out.tolist() == want.tolist()
    with pytest.raises(ValueError, match="finished"):
        argmax_peak(logits, 3000, torch.zeros(3, device=DEVICE), finished.long())


def test_next_step_gets_the_tokens_and_its_slot_advances():
    from lmlab.kernels.argmax_peak_triton import argmax_peak

    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ids = torch.full((3, 2), -1, dtype=torch.long, device=DEVICE)  # a column: a strided view, as a step's input
    slot = torch.tensor([7], device=DEVICE)
    tokens = argmax_peak(logits, 5000, torch.zeros(3, device=DEVICE), next_step=(ids[:, 0], slot))
    assert ids[:, 0].tolist() == tokens.tolist() == logits.argmax(-1).tolist() and ids[:, 1].eq(-1).all()
    assert slot.item() == 8
    with pytest.raises(ValueError, match="next_step"):
        argmax_peak(logits, 5000, torch.zeros(3, device=DEVICE), next_step=(ids[:, 0], slot.int()))
