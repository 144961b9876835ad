"""An end-to-end GRPO run on a tiny model: rollouts on the engine, group-normalised rewards, clipped
updates; the mean reward of a trivially learnable task rises within a fixed number of steps."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.alignment import RL_LOSSES
from lmlab.alignment.grpo import policy_update, rollout
from lmlab.inference.samplers import SAMPLERS
from lmlab.nn import ModelConfig, Transformer
from lmlab.tokenizers import ByteTokenizer


def _reward(response: str, truth: str) -> dict[str, float]:
    """The share of the response's characters that are ASCII letters (a fifth of a random model's bytes)."""
    return {"reward": sum(c.isascii() and c.isalpha() for c in response) / max(len(response), 1)}


def _policy() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=1, max_seq_len=32, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "mha", "n_heads": 4}, block="prenorm")
    return Transformer(cfg, vocab_size=ByteTokenizer().vocab_size)  # padded to 320: rollouts sample the first 257


@pytest.mark.parametrize("loss_name", ["grpo_clip", "dr_grpo"])
def test_grpo_raises_the_mean_reward_of_a_learnable_task(loss_name):
    policy, tokenizer = _policy(), ByteTokenizer()
    loss = RL_LOSSES.build(loss_name)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-2)
    sampler = SAMPLERS.build({"name": "temperature", "temperature": 1.0})
    rewards = []
    for _ in range(12):
        batch = rollout(policy, tokenizer, ["x:", "y:"], ["a", "a"], _reward, group_size=8, sampler=sampler,
                        max_new_tokens=4, normalize_by_std=loss.normalize_by_std)
        assert batch.tensors["input_ids"].shape[0] == 16 and policy.training
        metrics = policy_update(policy, optimizer, batch, loss, epochs=2, micro_batch_size=8)
        assert 0 <= metrics["clip_fraction"] <= 1 and math.isfinite(metrics["grad_norm"])
        rewards.append(batch.metrics["reward_mean"])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_rollout_scores_each_response_and_keeps_the_rollout_log_probs(temperature):
    policy, tokenizer = _policy(), ByteTokenizer()
    batch = rollout(policy, tokenizer, ["q"], ["a"], _reward, group_size=4,
                    sampler=SAMPLERS.build({"name": "temperature", "temperature": temperature}), max_new_tokens=3)
    assert len(batch.texts) == 4 and batch.raw_rewards.shape == batch.advantages.shape == (4,)
    mask = batch.tensors["response_mask"]
    assert mask.sum(-1).tolist() == [3] * 4  # no end-of-text token in this tokenizer: every response runs to the limit
    with torch.no_grad():
        logits = (policy(batch.tensors["input_ids"]) / temperature).log_softmax(-1)  # what was sampled from
    expected = logits.gather(-1, batch.tensors["labels"][..., None]).squeeze(-1)
    torch.testing.assert_close(batch.old_log_probs[mask], expected[mask])
    assert batch.metrics["accuracy"] == (batch.raw_rewards > 0).float().mean().item()
    policy.train()  # the update's forward (autograd on, unfused) scores what the rollout's scored: ratio 1
    first = policy_update(policy, torch.optim.SGD(policy.parameters(), lr=0.1), batch, RL_LOSSES.build("grpo_clip"))
    assert abs(first["approx_kl"]) < 1e-6 and first["clip_fraction"] == 0
    with pytest.raises(ValueError, match="micro_batch_size=3 does not divide the rollout batch of 4"):
        policy_update(policy, torch.optim.SGD(policy.parameters(), lr=0.1), batch, RL_LOSSES.build("grpo_clip"),
                      micro_batch_size=3)


def test_a_stop_string_ending_keeps_its_tokens_and_gets_no_unsampled_stop_token():
    policy, tokenizer = _policy(), ByteTokenizer()
    # Greedy from this policy; the first two generated characters become the stop string.
    greedy = SAMPLERS.build("greedy")
    first = rollout(policy, tokenizer, ["q"], ["a"], _reward, group_size=1, sampler=greedy, max_new_tokens=3,
                    normalize_by_std=False)
    sampled = first.tensors["labels"][0, first.tensors["response_mask"][0]].tolist()
    stop = tokenizer.decode(sampled[:2])
    batch = rollout(policy, tokenizer, ["q"], ["a"], _reward, group_size=1, sampler=greedy, max_new_tokens=3,
                    stop_strings=[stop], normalize_by_std=False)
    response = batch.tensors["labels"][0, batch.tensors["response_mask"][0]].tolist()
    assert response == sampled[:2] and batch.texts == [stop]  # the reward sees the stop string
