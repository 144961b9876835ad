"""From rewards to advantages: group normalisation (GRPO: G responses per prompt, each compared with its
group) and generalised advantage estimation (PPO: per token, from a value head)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def compute_group_normalized_rewards(reward_fn: Callable[[str, str], dict[str, float]],
                                     rollout_responses: Sequence[str], repeated_ground_truths: Sequence[str],
                                     group_size: int, advantage_eps: float = 1e-6,
                                     normalize_by_std: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Score each response with `reward_fn(response, ground_truth)` (a dict holding "reward", and any other
    components), then subtract its group's mean, and with `normalize_by_std` divide by the group's
    (unbiased) std + eps. Responses come in consecutive groups of `group_size`, one group per prompt.

    Returns (advantages, raw rewards), both (rollout batch,), and metadata: the mean of every reward
    component and the reward's std, min and max."""
    if len(rollout_responses) != len(repeated_ground_truths):
        raise ValueError(f"{len(rollout_responses)} responses but {len(repeated_ground_truths)} ground truths")
    if group_size < 1 or len(rollout_responses) % group_size:
        raise ValueError(f"group_size={group_size} does not divide the rollout batch of {len(rollout_responses)}")
    scores = [reward_fn(r, g) for r, g in zip(rollout_responses, repeated_ground_truths)]
    raw = torch.tensor([float(s["reward"]) for s in scores])
    groups = raw.view(-1, group_size)
    advantages = groups - groups.mean(-1, keepdim=True)
    if normalize_by_std:
        advantages = advantages / (groups.std(-1, keepdim=True) + advantage_eps)
    metadata = {f"{key}_mean": sum(float(s[key]) for s in scores) / len(scores) for key in scores[0]}
    metadata |= {"reward_std": raw.std().item() if len(raw) > 1 else 0.0, "reward_min": raw.min().item(),
                 "reward_max": raw.max().item()}
    return advantages.flatten(), raw, metadata


def generalized_advantage_estimation(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                                     gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) over the masked tokens of each row (batch, seq): delta_t = r_t +
    gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, with V and A zero after a row's last masked
    token. Returns (advantages, returns = advantages + values), zero outside the mask."""
    mask = mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(values)
    next_value = next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        advantages[:, t] = advantage
        # A masked position passes on what follows it unchanged, so padding inside a row is skipped.
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        next_advantage = torch.where(mask[:, t] > 0, advantage, next_advantage)
    return advantages, (advantages + values) * mask
