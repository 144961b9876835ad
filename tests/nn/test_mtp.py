"""Multi-token prediction: shapes, causality, the combined objective, dropping the heads."""

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.nn.mtp import MTPConfig
from lmlab.nn.transformer import ModelConfig, Transformer
from lmlab.training.losses import LOSSES
from lmlab.training.objective import training_terms


def model_with(depth: int, moe=None, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=16, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "mha", "n_heads": 2}, block="prenorm", moe=moe,
                      mtp=MTPConfig(depth=depth, loss_weight=0.5))
    return Transformer(cfg, vocab_size=64)


def test_depth_d_logits_cover_positions_with_a_target_d_ahead():
    model = model_with(depth=3)
    ids = torch.randint(0, 64, (2, 12))
    out = model.forward_train(ids)
    assert [tuple(x.shape) for x in out.mtp_logits] == [(2, 11, 64), (2, 10, 64), (2, 9, 64)]
    torch.testing.assert_close(out.logits, model(ids))  # the main head is what inference runs


def test_depth_d_at_position_t_sees_tokens_up_to_t_plus_d_only():
    model = model_with(depth=2).eval()
    ids = torch.randint(0, 64, (1, 12))
    changed = ids.clone()
    changed[0, 8] = (ids[0, 8] + 1) % 64
    a, b = model.forward_train(ids), model.forward_train(changed)
    for d, (x, y) in enumerate(zip(a.mtp_logits, b.mtp_logits), start=1):
        differs = (x - y).abs().amax(dim=-1)[0] > 0
        assert not differs[: 8 - d].any() and differs[8 - d:].all(), d  # position t reads token t + d
    assert torch.equal(a.logits[0, :8], b.logits[0, :8])


def test_objective_adds_the_weighted_mean_of_depth_losses_and_moe_terms():
    model = model_with(depth=2, moe={"name": "topk", "n_experts": 4, "aux_loss_weight": 0.1, "z_loss_weight": 0.01})
    ids = torch.randint(0, 64, (2, 13))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    loss_fn = LOSSES.build("cross_entropy")
    out = model.forward_train(inputs)
    terms = training_terms(loss_fn, out, targets, model.mtp_loss_weight)
    ce = torch.nn.functional.cross_entropy
    depth2 = ce(out.mtp_logits[1].flatten(0, 1), targets[:, 2:].flatten())
    torch.testing.assert_close(terms["mtp_2_loss"], depth2)
    expected = (terms["lm_loss"] + 0.5 * (terms["mtp_1_loss"] + terms["mtp_2_loss"]) / 2
                + 0.1 * terms["moe_aux_loss"] + 0.01 * terms["router_z_loss"])
    torch.testing.assert_close(terms["loss"], expected)
    torch.testing.assert_close(terms["lm_loss"], ce(out.logits.flatten(0, 1), targets.flatten()))


def test_dense_objective_is_the_plain_loss():
    model = model_with(depth=0)
    ids = torch.randint(0, 64, (2, 9))
    terms = training_terms(LOSSES.build("cross_entropy"), model.forward_train(ids[:, :-1]), ids[:, 1:], 0.3)
    assert set(terms) == {"loss"}


def test_mtp_modules_can_be_dropped_for_inference():
    trained = model_with(depth=2)
    inference = model_with(depth=0, seed=1)
    state = {k: v for k, v in trained.state_dict().items() if not k.startswith("mtp_layers.")}
    inference.load_state_dict(state)  # strict: everything but the MTP modules
    ids = torch.randint(0, 64, (2, 10))
    torch.testing.assert_close(inference(ids), trained(ids))
    assert trained.num_parameters() > inference.num_parameters()


def test_negative_depth_is_rejected():
    with pytest.raises(ConfigError, match="model.mtp.depth and loss_weight must be >= 0"):
        model_with(depth=-1)
