"""loss.fused_head: the loss projects the hidden states itself and gives what the logits' loss gives."""

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference.quant.qat import QATS
from lmlab.nn.mtp import MTPConfig
from lmlab.nn.transformer import ModelConfig, Transformer
from lmlab.training import train
from lmlab.training.losses import LOSSES
from lmlab.training.objective import takes_hidden, training_terms


def model_with(softcap: float | None, multiplier: float, tied: bool) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=16, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "mha", "n_heads": 2}, block="prenorm",
                      mtp=MTPConfig(depth=2, loss_weight=0.5), logit_softcap=softcap, tie_embeddings=tied)
    model = Transformer(cfg, vocab_size=96)
    model.output_multiplier = multiplier  # as muP sets it
    return model


@pytest.mark.parametrize("softcap, multiplier, tied", [(None, 1.0, False), (5.0, 0.5, True)])
def test_fused_terms_and_gradients_equal_the_logits_path(softcap, multiplier, tied):
    """Every term (the main head, both MTP depths, label smoothing, z-loss) and every parameter's gradient."""
    model = model_with(softcap, multiplier, tied)
    ids = torch.randint(0, 96, (3, 13))
    ids[0, 5] = -100  # an ignored target
    inputs, targets = ids[:, :-1].clamp(min=0), ids[:, 1:]
    settings = {"name": "cross_entropy", "label_smoothing": 0.1, "z_loss": 1e-3}
    plain, fused = LOSSES.build(settings), LOSSES.build({**settings, "fused_head": True})
    assert not takes_hidden(plain) and takes_hidden(fused)

    def terms_and_grads(loss_fn):
        model.zero_grad()
        output = model.forward_train(inputs, logits=not takes_hidden(loss_fn))
        assert (output.logits is None) == takes_hidden(loss_fn)
        terms = training_terms(loss_fn, output, targets, model.mtp_loss_weight)
        terms["loss"].backward()
        return terms, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    (want, want_grads), (got, got_grads) = terms_and_grads(plain), terms_and_grads(fused)
    assert set(got) == set(want) >= {"loss", "lm_loss", "ce", "z_loss", "mtp_1_loss", "mtp_2_loss"}
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)
    assert set(got_grads) == set(want_grads)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_a_head_that_fake_quantises_cannot_fuse():
    model = model_with(None, 1.0, False)
    QATS.build({"name": "int8", "quantize_head": True}).install(model)
    with pytest.raises(ConfigError, match="qat.quantize_head=false or loss.fused_head=false"):
        model.output_head()


@pytest.mark.parametrize("extra, match", [
    (["qat=int8"], "lm_head is a FakeQuantLinear"),
    (["parallel=fsdp", "trainer.devices=2"], "parallel=fsdp shards the weights"),
])
def test_bad_combinations_fail_before_training(make_cfg, tiny_overrides, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        train(make_cfg([*tiny_overrides, "loss.fused_head=true", *extra]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_fused_head_run_ends_where_the_logits_run_does(make_cfg, tiny_overrides, tmp_path):
    steps = [*tiny_overrides, "trainer.max_steps=15", "loss.z_loss=1e-3"]
    plain = train(make_cfg(steps), tmp_path / "plain")
    fused = train(make_cfg([*steps, "loss.fused_head=true"]), tmp_path / "fused")
    assert fused["val_loss"] < fused["initial_val_loss"] - 0.5
    assert fused["val_loss"] == pytest.approx(plain["val_loss"], abs=1e-3)
