"""Codebooks: nearest-code search, straight-through gradients, loss values and the EMA update by hand,
dead-code restarts, usage statistics and the size-0 error."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.multimodal.codebook import CODEBOOKS, CodeUsage, usage_perplexity


def _as_grid(rows: list[list[float]]) -> torch.Tensor:
    """Vectors (N, D) as encoder outputs (1, D, 1, N)."""
    return torch.tensor(rows).t()[None, :, None, :].contiguous()


def _set_codes(codebook, vectors: list[list[float]]) -> None:
    with torch.no_grad():
        codebook.vectors.copy_(torch.tensor(vectors))
        if hasattr(codebook, "embed_sum"):  # the EMA's running sums start at the codes, counts at one
            codebook.embed_sum.copy_(torch.tensor(vectors))
            codebook.cluster_size.fill_(1.0)


@pytest.mark.parametrize("name", ["straight_through", "ema"])
def test_nearest_codes_and_forward_value(name):
    codebook = CODEBOOKS.build({"name": name, "size": 3, "dim": 2}).eval()
    _set_codes(codebook, [[0.0, 0.0], [1.0, 1.0], [-2.0, 0.0]])
    z = _as_grid([[0.1, -0.2], [0.9, 1.4], [-1.5, 0.3], [0.6, 0.6]])
    out = codebook(z)
    assert out.codes.flatten().tolist() == [0, 1, 2, 1]
    assert torch.equal(out.z_q, _as_grid([[0.0, 0.0], [1.0, 1.0], [-2.0, 0.0], [1.0, 1.0]]))


@pytest.mark.parametrize("name", ["straight_through", "ema"])
def test_straight_through_passes_the_gradient_to_the_encoder_unchanged(name):
    torch.manual_seed(0)
    codebook = CODEBOOKS.build({"name": name, "size": 4, "dim": 3, "beta": 0.0}).eval()
    z = torch.randn(2, 3, 2, 2, requires_grad=True)
    upstream = torch.randn(2, 3, 2, 2)
    (codebook(z).z_q * upstream).sum().backward()
    assert torch.equal(z.grad, upstream)


def test_straight_through_losses_by_hand_and_their_gradients():
    codebook = CODEBOOKS.build({"name": "straight_through", "size": 2, "dim": 2, "beta": 0.25})
    _set_codes(codebook, [[0.0, 0.0], [2.0, 2.0]])
    z = _as_grid([[0.5, -0.5], [1.5, 3.0]]).requires_grad_()
    out = codebook(z)
    # z - e: (0.5, -0.5) and (-0.5, 1.0); mean of the 4 squares = (0.25 + 0.25 + 0.25 + 1) / 4
    expected = 1.75 / 4
    assert out.terms["commitment"].item() == pytest.approx(expected)
    assert out.terms["codebook"].item() == pytest.approx(expected)
    assert out.loss.item() == pytest.approx(expected * 1.25)
    out.loss.backward()
    # the commitment term alone reaches z: d/dz beta * mean((z - e)^2) = beta * 2 (z - e) / 4
    assert torch.allclose(z.grad, 0.25 * 2 * _as_grid([[0.5, -0.5], [-0.5, 1.0]]) / 4)
    # the codebook term alone reaches the codes: d/de mean((e - z)^2) = 2 (e - z) / 4
    assert torch.allclose(codebook.embedding.grad, torch.tensor([[-0.5, 0.5], [0.5, -1.0]]) * 2 / 4)


def test_ema_commitment_loss_by_hand_and_no_gradient_to_the_codes():
    codebook = CODEBOOKS.build({"name": "ema", "size": 2, "dim": 2, "beta": 0.5}).eval()
    _set_codes(codebook, [[0.0, 0.0], [2.0, 2.0]])
    z = _as_grid([[0.5, -0.5], [1.5, 3.0]])
    out = codebook(z)
    assert out.terms["commitment"].item() == pytest.approx(1.75 / 4)
    assert out.loss.item() == pytest.approx(0.5 * 1.75 / 4)
    assert list(out.terms) == ["commitment"]
    assert not any(p.requires_grad for p in codebook.parameters())


def test_ema_update_by_hand():
    codebook = CODEBOOKS.build({"name": "ema", "size": 2, "dim": 1, "decay": 0.5, "epsilon": 0.1,
                                "restart_threshold": 0.0}).train()
    _set_codes(codebook, [[0.0], [10.0]])
    codebook(_as_grid([[1.0], [2.0], [9.0]]))  # codes 0, 0, 1: counts (2, 1), sums (3, 9)
    counts = [0.5 * 1 + 0.5 * 2, 0.5 * 1 + 0.5 * 1]  # (1.5, 1.0)
    sums = [0.5 * 0 + 0.5 * 3, 0.5 * 10 + 0.5 * 9]  # (1.5, 9.5)
    total = sum(counts)
    smoothed = [(n + 0.1) / (total + 2 * 0.1) * total for n in counts]
    assert codebook.cluster_size.tolist() == pytest.approx(counts)
    assert codebook.embed_sum.flatten().tolist() == pytest.approx(sums)
    assert codebook.embedding.flatten().tolist() == pytest.approx([s / n for s, n in zip(sums, smoothed)])


def test_ema_does_not_update_in_eval_mode():
    codebook = CODEBOOKS.build({"name": "ema", "size": 2, "dim": 1}).eval()
    before = codebook.embedding.clone()
    codebook(_as_grid([[1.0], [2.0]]))
    assert torch.equal(codebook.embedding, before)


def test_dead_codes_restart_at_batch_vectors():
    torch.manual_seed(0)
    codebook = CODEBOOKS.build({"name": "ema", "size": 3, "dim": 2, "decay": 0.5, "restart_threshold": 0.75}).train()
    _set_codes(codebook, [[0.0, 0.0], [50.0, 50.0], [-50.0, 50.0]])
    batch = [[0.1, 0.2], [0.3, -0.1], [-0.2, 0.1]]
    codebook(_as_grid(batch))  # all go to code 0; codes 1 and 2 fall to 0.5 < 0.75 and restart
    assert codebook.restarts == 2
    for k in (1, 2):
        assert codebook.embedding[k].tolist() in [pytest.approx(v) for v in batch]
        assert codebook.cluster_size[k].item() == 1.0
        assert torch.equal(codebook.embed_sum[k], codebook.embedding[k])
    assert codebook.embedding[0].tolist() != [0.0, 0.0]  # the used code moved toward its vectors


def test_usage_statistics():
    usage = CodeUsage(4)
    usage.update(torch.tensor([[0, 1], [0, 1]]))
    assert usage.fraction_used() == 0.5
    assert usage.perplexity() == pytest.approx(2.0)
    usage.update(torch.tensor([2, 3, 2, 3]))
    assert usage.fraction_used() == 1.0
    assert usage.perplexity() == pytest.approx(4.0)
    assert usage_perplexity(torch.tensor([5.0, 0.0, 0.0])) == pytest.approx(1.0)
    p = torch.tensor([3.0, 1.0]) / 4
    assert usage_perplexity(torch.tensor([3.0, 1.0])) == pytest.approx(math.exp(-(p * p.log()).sum().item()))
    assert math.isnan(usage_perplexity(torch.zeros(3)))


@pytest.mark.parametrize("name", ["straight_through", "ema"])
@pytest.mark.parametrize("size", [0, -3])
def test_codebook_size_must_be_positive(name, size):
    with pytest.raises(ConfigError, match=rf"codebook.size={size}: a codebook needs at least one code"):
        CODEBOOKS.build({"name": name, "size": size})


def test_bad_ema_settings_say_which():
    with pytest.raises(ConfigError, match="codebook.decay"):
        CODEBOOKS.build({"name": "ema", "decay": 1.0})
    with pytest.raises(ConfigError, match="codebook.epsilon"):
        CODEBOOKS.build({"name": "ema", "epsilon": 0.0})
