"""Preference batches (identical pairs skipped and counted, DPO through sequence log-probs, a reference
of another vocabulary refused), the reward model's Bradley-Terry loss at the last token, PPO's clipped
value loss."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.alignment import (PREFERENCE_LOSSES, RL_LOSSES, PreferencePair, ScalarHead, bradley_terry_loss,
                             last_token_scores, preference_loss, preference_tensors)
from lmlab.alignment.preference import sequence_log_probs
from lmlab.alignment.tokens import full_sequences
from lmlab.nn import ModelConfig, Transformer
from lmlab.tokenizers import ByteTokenizer

PAIRS = [PreferencePair("Q: 1+1?\nA:", " 2", " 3"), PreferencePair("Q: hi\nA:", " hello", " hello"),
         PreferencePair("Q: sky?\nA:", " blue", " green!")]


def _model(seed: int, vocab: int = 257) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, n_layers=1, max_seq_len=64, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "mha", "n_heads": 4}, block="prenorm")
    return Transformer(cfg, vocab_size=vocab)


def test_preference_tensors_skip_identical_pairs_and_end_each_response():
    tokenizer = ByteTokenizer()
    chosen, rejected, skipped = preference_tensors(PAIRS, tokenizer)
    assert skipped == 1 and chosen["input_ids"].shape[0] == rejected["input_ids"].shape[0] == 2
    assert chosen["response_mask"].sum(-1).tolist() == [3, 6]  # " 2" + end-of-text, " blue" + end-of-text
    last = chosen["labels"][0][chosen["response_mask"][0]].tolist()
    assert last == [*b" 2", tokenizer.eot_id]
    with pytest.raises(ValueError, match="all 1 preference pairs have identical"):
        preference_tensors(PAIRS[1:2], tokenizer)


def test_dpo_over_a_batch_equals_the_loss_of_its_sequence_log_probs():
    policy, reference = _model(0), _model(1)
    chosen, rejected, _ = preference_tensors(PAIRS, ByteTokenizer())
    loss = PREFERENCE_LOSSES.build({"name": "dpo", "beta": 0.5})
    value, metrics = preference_loss(policy, reference, chosen, rejected, loss)
    (pc, _), (pr, _) = sequence_log_probs(policy, chosen), sequence_log_probs(policy, rejected)
    (rc, _), (rr, _) = sequence_log_probs(reference, chosen), sequence_log_probs(reference, rejected)
    margin = (pc - rc) - (pr - rr)
    assert value.item() == pytest.approx((-torch.nn.functional.logsigmoid(0.5 * margin)).mean().item(), rel=1e-5)
    assert metrics["reward_accuracy"] == (margin > 0).float().mean().item()
    value.backward()
    assert policy.embed_tokens.weight.grad is not None and reference.embed_tokens.weight.grad is None
    same, _ = preference_loss(policy, policy, chosen, rejected, loss)
    assert same.item() == pytest.approx(math.log(2), abs=1e-6)  # the policy against itself: zero margin
    simpo, _ = preference_loss(policy, None, chosen, rejected, PREFERENCE_LOSSES.build("simpo"))
    assert math.isfinite(simpo.item())
    with pytest.raises(ValueError, match="needs a reference model"):
        preference_loss(policy, None, chosen, rejected, loss)
    with pytest.raises(ValueError, match="vocabulary of 512 ids, the policy 320"):
        preference_loss(policy, _model(2, vocab=500), chosen, rejected, loss)


def test_reward_model_scores_the_last_real_token_and_learns_a_preference():
    model = ScalarHead(_model(0))
    ids = torch.randint(0, 257, (2, 6))
    assert model(ids).abs().sum() == 0  # a fresh head scores 0
    scores = torch.arange(12.0).view(2, 6)
    assert last_token_scores(scores, torch.tensor([6, 2])).tolist() == [5.0, 7.0]
    with pytest.raises(ValueError, match="lengths must be in 1..6"):
        last_token_scores(scores, torch.tensor([0, 2]))
    assert bradley_terry_loss(torch.tensor([1.0]), torch.tensor([1.0])).item() == pytest.approx(math.log(2))
    chosen, rejected, _ = preference_tensors(PAIRS, ByteTokenizer())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sequences = [full_sequences(side) for side in (chosen, rejected)]
    assert sequences[0][1].tolist() == [len(b"Q: 1+1?\nA: 2") + 1, len(b"Q: sky?\nA: blue") + 1]
    for _ in range(20):
        sides = [last_token_scores(model(ids), lengths) for ids, lengths in sequences]
        loss = bradley_terry_loss(*sides).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1


def test_ppo_clips_the_value_loss_around_the_rollout_estimate():
    ppo = RL_LOSSES.build({"name": "ppo", "cliprange_value": 0.5, "vf_coef": 1.0})
    values, old, returns = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 1.0]])
    mask = torch.tensor([[1, 0]])
    # Token 0: unclipped (2 - 3)^2 = 1, clipped value 0.5 gives (0.5 - 3)^2 = 6.25; the larger counts.
    assert ppo.value_loss(values, old, returns, mask).item() == pytest.approx(0.5 * 6.25)
    per_token_adv = torch.tensor([[1.0, -1.0, 0.5]])
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    loss, _ = ppo.token_loss(logp, per_token_adv, logp)  # ratio 1: the loss is -A per token
    assert loss.tolist() == [[-1.0, 1.0, -0.5]]
