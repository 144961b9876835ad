"""Policy-gradient and preference losses against hand-computed values, forward and gradient; the SFT and
GRPO microbatch steps send gradient only through response tokens."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.alignment import (PREFERENCE_LOSSES, RL_LOSSES, compute_grpo_clip_loss, compute_naive_policy_gradient_loss,
                             compute_per_instance_dpo_loss, compute_policy_gradient_loss, grpo_microbatch_train_step,
                             sft_microbatch_train_step)
from lmlab.alignment.pg_losses import kl_k1, kl_k2, kl_k3
from lmlab.errors import ConfigError
from lmlab.nn import ModelConfig, Transformer
from lmlab.tokenizers import ByteTokenizer

LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
OLD = torch.tensor([[-1.2, -2.0, -0.1], [-0.1, -2.0, -1.5]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


def test_naive_policy_gradient_loss_and_its_gradient():
    logp = LOGP.clone().requires_grad_()
    loss = compute_naive_policy_gradient_loss(torch.tensor([[2.0], [-1.0]]), logp)
    torch.testing.assert_close(loss, torch.tensor([[2.0, 4.0, 1.0], [-0.1, -3.0, -1.0]]))
    loss.sum().backward()
    assert logp.grad.tolist() == [[-2.0] * 3, [1.0] * 3]


def test_grpo_clip_takes_the_pessimistic_term_and_clipped_tokens_send_no_gradient():
    logp = LOGP.clone().requires_grad_()
    adv = torch.tensor([[1.0], [-1.0]])
    loss, meta = compute_grpo_clip_loss(adv, logp, OLD, cliprange=0.2)
    ratio = (LOGP - OLD).exp()
    expected = torch.stack([-torch.minimum(ratio[0], ratio[0].clamp(0.8, 1.2)),
                            torch.maximum(ratio[1], ratio[1].clamp(0.8, 1.2))])
    torch.testing.assert_close(loss.detach(), expected)
    # Row 0 (A > 0): ratio e^0.2 > 1.2 at token 0 and e^-0.4 < 0.8 at token 2 (only the former is clipped);
    # row 1 (A < 0): ratio e^-1 < 0.8 at token 1 is clipped, e^0.5 > 1.2 at token 2 is not.
    assert meta["clipped"].tolist() == [[True, False, False], [False, True, False]]
    loss.sum().backward()
    assert logp.grad[0, 0] == 0 and logp.grad[1, 1] == 0 and logp.grad[0, 2] != 0 and logp.grad[1, 2] != 0


def test_policy_gradient_loss_reads_the_signal_of_its_type_under_either_name():
    rewards, adv = torch.tensor([[1.0], [0.0]]), torch.tensor([[0.5], [-0.5]])
    for name in ("no_baseline", "reinforce"):
        loss, _ = compute_policy_gradient_loss(LOGP, name, raw_rewards=rewards, advantages=adv)
        torch.testing.assert_close(loss, -rewards * LOGP)
    for name in ("reinforce_with_baseline", "reinforce_baseline"):
        loss, _ = compute_policy_gradient_loss(LOGP, name, raw_rewards=rewards, advantages=adv)
        torch.testing.assert_close(loss, -adv * LOGP)
    loss, _ = compute_policy_gradient_loss(LOGP, "grpo_clip", advantages=adv, old_log_probs=OLD, cliprange=0.1)
    torch.testing.assert_close(loss, compute_grpo_clip_loss(adv, LOGP, OLD, 0.1)[0])
    with pytest.raises(ValueError, match="needs advantages"):
        compute_policy_gradient_loss(LOGP, "grpo_clip", raw_rewards=rewards, old_log_probs=OLD)
    with pytest.raises(ConfigError, match="Did you mean 'grpo_clip'"):
        compute_policy_gradient_loss(LOGP, "grpo_clp", advantages=adv)


def test_grpo_reduces_per_response_and_dr_grpo_by_one_constant():
    adv = torch.tensor([[1.0], [-1.0]])
    per_token = compute_grpo_clip_loss(adv, LOGP, OLD, 0.2)[0]
    grpo = RL_LOSSES.build("grpo_clip").reduce(per_token, MASK)
    assert grpo.item() == pytest.approx(((per_token[0, :2].sum() / 2 + per_token[1].sum() / 3) / 2).item())
    dr = RL_LOSSES.build({"name": "dr_grpo", "max_tokens": 10}).reduce(per_token, MASK)
    assert dr.item() == pytest.approx(((per_token[0, :2].sum() + per_token[1].sum()) / 10 / 2).item())
    assert RL_LOSSES.build("dr_grpo").normalize_by_std is False and RL_LOSSES.build("grpo_clip").normalize_by_std


def test_kl_estimators_and_the_penalty_they_add():
    p, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_k1(p, ref).tolist() == [0.5, -1.0]
    assert kl_k2(p, ref).tolist() == [0.125, 0.5]
    assert kl_k3(p, ref).tolist() == pytest.approx([math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1])
    loss = RL_LOSSES.build({"name": "reinforce", "kl": "k3", "kl_coef": 0.1})
    with_kl, stats = loss.token_loss(LOGP, torch.ones(2), ref_log_probs=OLD)
    torch.testing.assert_close(with_kl, -LOGP + 0.1 * kl_k3(LOGP, OLD))
    torch.testing.assert_close(stats["kl"], kl_k3(LOGP, OLD))
    with pytest.raises(ValueError, match="reference policy's log-probs"):
        loss.token_loss(LOGP, torch.ones(2))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        RL_LOSSES.build({"name": "reinforce", "kl": "k4"})


def test_microbatch_steps_scale_by_accumulation_and_touch_only_response_tokens():
    logp = LOGP.clone().requires_grad_()
    loss, meta = sft_microbatch_train_step(logp, MASK, gradient_accumulation_steps=2, normalize_constant=4.0)
    assert loss.item() == pytest.approx(-(-3.0 / 4 + -4.1 / 4) / 2 / 2)
    assert logp.grad.tolist() == [[-1 / 16, -1 / 16, 0.0], [-1 / 16] * 3]  # batch 2, constant 4, 2 steps
    logp = LOGP.clone().requires_grad_()
    adv = torch.tensor([[2.0], [-1.0]])
    loss, _ = grpo_microbatch_train_step(logp, MASK, 4, "reinforce_with_baseline", advantages=adv)
    assert loss.item() == pytest.approx(((3.0 / 2 * 2) + (-4.1 / 3)) / 2 / 4)
    assert logp.grad[0, 2] == 0 and logp.grad[0, 0].item() == pytest.approx(-2 / 2 / 2 / 4)


def test_preference_losses_by_hand():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-10.0, -12.0, -11.0, -11.0))
    lc, lr = torch.tensor([4.0]), torch.tensor([8.0])
    margin = (-10 + 11) - (-12 + 11)  # 2
    assert PREFERENCE_LOSSES.build({"name": "dpo", "beta": 0.5})(pc, pr, rc, rr).item() == pytest.approx(
        -math.log(1 / (1 + math.exp(-0.5 * margin))))
    assert PREFERENCE_LOSSES.build("dpo")(pc, pc, rc, rc).item() == pytest.approx(math.log(2))  # zero margin
    assert PREFERENCE_LOSSES.build({"name": "ipo", "beta": 0.25})(pc, pr, rc, rr).item() == pytest.approx(0.0)
    norm = PREFERENCE_LOSSES.build({"name": "dpo_norm", "beta": 1.0})(pc, pr, rc, rr, lc, lr)
    assert norm.item() == pytest.approx(-math.log(1 / (1 + math.exp(-(1 / 4 + 1 / 8)))))
    simpo = PREFERENCE_LOSSES.build({"name": "simpo", "beta": 2.0, "gamma": 0.5})(pc, pr, None, None, lc, lr)
    assert simpo.item() == pytest.approx(-math.log(1 / (1 + math.exp(-(2.0 * (-10 / 4 + 12 / 8) - 0.5)))))
    with pytest.raises(ValueError, match="beta must be > 0"):
        PREFERENCE_LOSSES.build({"name": "dpo", "beta": 0.0})


def test_per_instance_dpo_loss_is_log2_against_itself_and_matches_summed_response_log_probs():
    torch.manual_seed(0)
    tokenizer = ByteTokenizer()
    cfg = ModelConfig(d_model=32, n_layers=1, max_seq_len=512, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "mha", "n_heads": 4}, block="prenorm")
    lm, ref = Transformer(cfg, tokenizer.vocab_size), Transformer(cfg, tokenizer.vocab_size)
    args = (tokenizer, 0.5, "Say hi.", "hi", "no")
    assert compute_per_instance_dpo_loss(lm, lm, *args).item() == pytest.approx(math.log(2), abs=1e-6)
    template = "Q: {prompt}\nA: {response}"
    loss = compute_per_instance_dpo_loss(lm, ref, *args, template=template)

    def full_sequence_log_prob(model, text):  # the whole sequence: the prompt's share cancels in the margin
        ids = torch.tensor([tokenizer.encode(text) + [tokenizer.eot_id]])
        return model(ids[:, :-1]).log_softmax(-1).gather(-1, ids[:, 1:, None]).sum()

    margin = sum(sign * (full_sequence_log_prob(lm, template.format(prompt="Say hi.", response=r))
                         - full_sequence_log_prob(ref, template.format(prompt="Say hi.", response=r)))
                 for sign, r in ((1, "hi"), (-1, "no")))
    assert loss.item() == pytest.approx(-torch.nn.functional.logsigmoid(0.5 * margin).item(), abs=1e-5)
    loss.backward()
    assert all(p.grad is None for p in ref.parameters()) and lm.embed_tokens.weight.grad is not None
