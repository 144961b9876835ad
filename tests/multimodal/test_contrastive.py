"""Contrastive losses against hand computations, gradients to the temperature and bias, and the
all-gather path in 2 gloo processes equal to one process on the global batch."""

import math

import pytest
import torch
from lmlab.errors import ConfigError
from lmlab.multimodal.contrastive import CONTRASTIVE_LOSSES, gather_rows
from lmlab.parallel import run_processes

# Unit vectors, so the cosine similarities are easy to write down: image.text^T = [[1, .6], [0, .8]].
IMAGE = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
TEXT = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=torch.float64)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_clip_loss_by_hand_and_gradient_to_the_temperature():
    loss_fn = CONTRASTIVE_LOSSES.build({"name": "clip", "init_scale": 2.0}).double()
    out = loss_fn(IMAGE * 3, TEXT)  # scaled inputs: the loss normalises them
    # logits image->text = 2 * [[1, .6], [0, .8]]; text->image = its transpose. Each row of two logits with the
    # target first: -log softmax = softplus(other - target).
    rows = [(2.0, 1.2), (1.6, 0.0), (2.0, 0.0), (1.6, 1.2)]  # (target logit, other logit): i2t rows, t2i rows
    expected = (sum(softplus(o - t) for t, o in rows[:2]) / 2 + sum(softplus(o - t) for t, o in rows[2:]) / 2) / 2
    assert out["loss"].item() == pytest.approx(expected, rel=1e-7)
    assert out["logit_scale"].item() == pytest.approx(2.0)
    out["loss"].backward()
    # d/dt' with logits = exp(t') c: each row's softplus(s (c_o - c_t)) gives sigmoid(.) * s (c_o - c_t)
    d_scale = sum(sigmoid(o - t) * (o - t) for t, o in rows) / 4
    assert loss_fn.log_scale.grad.item() == pytest.approx(d_scale, rel=1e-7)


def test_siglip_loss_by_hand_and_gradients_to_temperature_and_bias():
    loss_fn = CONTRASTIVE_LOSSES.build({"name": "siglip", "init_scale": 2.0, "init_bias": -1.0}).double()
    out = loss_fn(IMAGE, TEXT)
    logits = [[2 * 1 - 1, 2 * 0.6 - 1], [2 * 0 - 1, 2 * 0.8 - 1]]
    z = [[1, -1], [-1, 1]]
    pairs = [(z[i][j], logits[i][j]) for i in range(2) for j in range(2)]
    expected = sum(softplus(-zij * lij) for zij, lij in pairs) / 2  # -log sigmoid(x) = softplus(-x), over batch 2
    assert out["loss"].item() == pytest.approx(expected, rel=1e-7)
    out["loss"].backward()
    d_bias = sum(-zij * sigmoid(-zij * lij) for zij, lij in pairs) / 2
    d_scale = sum(-zij * sigmoid(-zij * lij) * (lij + 1) for zij, lij in pairs) / 2  # (l - b) = s * cosine
    assert loss_fn.bias.grad.item() == pytest.approx(d_bias, rel=1e-7)
    assert loss_fn.log_scale.grad.item() == pytest.approx(d_scale, rel=1e-7)


def test_defaults_follow_the_papers_and_the_scale_is_capped():
    clip, siglip = CONTRASTIVE_LOSSES.build("clip"), CONTRASTIVE_LOSSES.build("siglip")
    assert clip.scale().item() == pytest.approx(1 / 0.07, rel=1e-6)
    assert siglip.scale().item() == pytest.approx(10.0, rel=1e-6) and siglip.bias.item() == -10.0
    with torch.no_grad():
        clip.log_scale.fill_(10.0)
    assert clip.scale().item() == pytest.approx(100.0, rel=1e-6)
    frozen = CONTRASTIVE_LOSSES.build({"name": "clip", "learn_scale": False})
    assert not frozen.log_scale.requires_grad


def test_bad_input_says_what_is_wrong():
    with pytest.raises(ConfigError, match="init_scale"):
        CONTRASTIVE_LOSSES.build({"name": "siglip", "init_scale": 0.0})
    with pytest.raises(ValueError, match="both be"):
        CONTRASTIVE_LOSSES.build("clip")(torch.randn(3, 4), torch.randn(2, 4))


def test_matching_pairs_score_lower_than_shuffled_ones():
    torch.manual_seed(0)
    emb = torch.randn(8, 16)
    for name in ("clip", "siglip"):
        loss_fn = CONTRASTIVE_LOSSES.build(name)
        assert loss_fn(emb, emb + 0.01 * torch.randn(8, 16))["loss"] < loss_fn(emb, emb.roll(1, 0))["loss"]


def test_gather_rows_is_the_identity_in_one_process():
    x = torch.randn(3, 2)
    gathered, offset = gather_rows(x)
    assert gathered is x and offset == 0


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(6, 5, generator=g, dtype=torch.float64)


def _rank(rank: int, world_size: int) -> dict:
    images, texts = _global_batch()
    rows = slice(rank * 3, (rank + 1) * 3)
    out = {}
    for name in ("clip", "siglip"):
        loss_fn = CONTRASTIVE_LOSSES.build({"name": name, "init_scale": 3.0}).double()
        image, text = images[rows].clone().requires_grad_(), texts[rows].clone().requires_grad_()
        loss = loss_fn(image, text)["loss"]
        loss.backward()
        out[name] = (loss.detach(), image.grad, text.grad, loss_fn.log_scale.grad)
    return out


def test_all_gather_in_two_processes_equals_one_process_on_the_global_batch():
    ranks = run_processes(_rank, 2, timeout=60)
    images, texts = _global_batch()
    for name in ("clip", "siglip"):
        loss_fn = CONTRASTIVE_LOSSES.build({"name": name, "init_scale": 3.0}).double()
        image, text = images.clone().requires_grad_(), texts.clone().requires_grad_()
        loss = loss_fn(image, text)["loss"]
        loss.backward()
        # DDP averages over ranks: the mean of the ranks' losses and gradients is the global batch's.
        local = [r[name] for r in ranks]
        assert torch.stack([r[0] for r in local]).mean().item() == pytest.approx(loss.item(), rel=1e-7)
        torch.testing.assert_close(torch.cat([r[1] for r in local]) / 2, image.grad)
        torch.testing.assert_close(torch.cat([r[2] for r in local]) / 2, text.grad)
        torch.testing.assert_close(torch.stack([r[3] for r in local]).mean(), loss_fn.log_scale.grad)
