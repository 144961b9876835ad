"""One on-policy RL step, functional: rollouts on lmlab's engine (G samples per prompt), rewards and
group-normalised advantages, then one or more optimizer passes over the rollout batch with an `rl_loss`
entry (the clipped ratio compares with the log-probs at rollout time).

    batch = rollout(policy, tokenizer, prompts, truths, REWARDS.build("r1_zero"), group_size=8,
                    sampler=SAMPLERS.build({"name": "temperature", "temperature": 1.0}), max_new_tokens=256,
                    normalize_by_std=loss.normalize_by_std)
    metrics = policy_update(policy, optimizer, batch, loss, epochs=1, micro_batch_size=16)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lmlab.alignment.logprobs import get_response_log_probs
from lmlab.alignment.masked import masked_mean
from lmlab.alignment.pg_losses import PolicyGradientLoss
from lmlab.alignment.rewards import compute_group_normalized_rewards
from lmlab.alignment.tokens import encode, eos_id, pad_id, sequences_to_tensors
from lmlab.inference.engine import Engine


@dataclass
class RolloutBatch:
    texts: list[str]  # each response, decoded
    tensors: dict[str, torch.Tensor]  # input_ids, labels, response_mask (sequences_to_tensors)
    old_log_probs: torch.Tensor  # (batch, seq): the policy's at rollout time
    raw_rewards: torch.Tensor  # (batch,)
    advantages: torch.Tensor  # (batch,)
    metrics: dict[str, float]
    temperature: float = 1.0  # of the sampling distribution, which every log-prob of the update is taken of


def rollout(policy: nn.Module, tokenizer, prompts: Sequence[str], ground_truths: Sequence[str],
            reward: Callable[[str, str], dict[str, float]], group_size: int, sampler, max_new_tokens: int,
            stop_strings: Sequence[str] = (), normalize_by_std: bool = True, advantage_eps: float = 1e-6,
            engine: Engine | None = None) -> RolloutBatch:
    """`group_size` responses to each prompt from the policy (through `engine`, or a fresh eager one),
    scored by `reward(response, ground_truth)`; leaves the policy in the training mode it had."""
    if len(prompts) != len(ground_truths):
        raise ValueError(f"{len(prompts)} prompts but {len(ground_truths)} ground truths")
    was_training = policy.training
    policy.eval()  # no dropout while sampling (an engine kept across steps finds the policy training)
    engine = engine or Engine(policy)
    prompt_ids = [encode(tokenizer, p, special_tokens=True) for p in prompts for _ in range(group_size)]
    eot = eos_id(tokenizer)
    # The engine's caches hold the weights' dtype: generate outside any autocast (a bf16-mixed training
    # step's); the rollout log-probs below follow it, as the update's forward will.
    with torch.autocast(engine.device.type, enabled=False):
        out = engine.generate(prompt_ids, sampler, max_new_tokens, stop_token_ids=[] if eot is None else [eot],
                              stop_strings=stop_strings, tokenizer=tokenizer, include_stop_str_in_output=True)
    policy.train(was_training)
    truths = [t for t in ground_truths for _ in range(group_size)]
    if hasattr(reward, "score_batch"):  # a learned reward reads the prompt too, in batches (reward=reward_model)
        scored = iter(reward.score_batch([p for p in prompts for _ in range(group_size)], out.texts,
                                         device=next(policy.parameters()).device))
        reward = lambda response, truth: next(scored)  # noqa: E731 - the scores in the rollout's order
    advantages, raw, metrics = compute_group_normalized_rewards(reward, out.texts, truths, group_size,
                                                                advantage_eps, normalize_by_std)
    # A response that ended on the stop token keeps it, so the policy learns to end its answer. One that
    # ended on a stop string keeps the string's tokens (and its text, which the reward reads: a closing
    # "</answer>" as the stop) and gets no stop token, which it never sampled.
    responses = [t if stop is None else [*t, stop] for t, stop in zip(out.tokens, out.stop_tokens)]
    tensors = sequences_to_tensors(prompt_ids, responses, pad_id(tokenizer))
    device = next(policy.parameters()).device
    tensors = {k: v.to(device) for k, v in tensors.items()}
    temperature = 1.0 if sampler.greedy else sampler.cfg.temperature
    with torch.no_grad():
        old = get_response_log_probs(policy, tensors["input_ids"], tensors["labels"],
                                     temperature=temperature)["log_probs"]
    lengths = torch.tensor([float(len(r)) for r in responses])
    correct = raw > 0
    metrics |= {"response_length": lengths.mean().item(),
                "response_length_correct": lengths[correct].mean().item() if correct.any() else math.nan,
                "response_length_incorrect": lengths[~correct].mean().item() if (~correct).any() else math.nan,
                "accuracy": correct.float().mean().item()}
    return RolloutBatch(out.texts, tensors, old, raw.to(device), advantages.to(device), metrics, temperature)


def policy_update(policy: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, loss: PolicyGradientLoss,
                  epochs: int = 1, micro_batch_size: int | None = None, grad_clip: float = 1.0,
                  ref_log_probs: torch.Tensor | None = None,
                  extra_loss: Callable[[slice], torch.Tensor] | None = None,
                  backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
                  parameters: Sequence[nn.Parameter] | None = None) -> dict[str, float]:
    """`epochs` passes over the rollout batch, one optimizer step per pass, its micro-batches accumulated
    (each scaled by its share of the batch). `extra_loss(rows)` adds a term per micro-batch (PPO's value
    loss); `backward` is Lightning's manual_backward in a LightningModule; the gradient norm is clipped
    over `parameters` (default: the policy's). Returns the last pass's loss, entropy, clip fraction, KL
    and gradient norm (and `extra_loss` when given)."""
    size = batch.old_log_probs.shape[0]
    micro = micro_batch_size or size
    if size % micro:
        raise ValueError(f"micro_batch_size={micro} does not divide the rollout batch of {size}")
    signal = loss.signal(batch.raw_rewards, batch.advantages)
    policy.train()
    for _ in range(epochs):
        totals: dict[str, float] = {"loss": 0.0, "entropy": 0.0, "clip_fraction": 0.0, "kl": 0.0, "approx_kl": 0.0}
        for start in range(0, size, micro):
            rows = slice(start, start + micro)
            t = {k: v[rows] for k, v in batch.tensors.items()}
            out = get_response_log_probs(policy, t["input_ids"], t["labels"], return_token_entropy=True,
                                         temperature=batch.temperature)
            ref = None if ref_log_probs is None else ref_log_probs[rows]
            per_token, stats = loss.token_loss(out["log_probs"], signal[rows], batch.old_log_probs[rows], ref)
            # How far the policy has moved from the rollout's (0 on the first pass: a check of the ratio's baseline).
            totals["approx_kl"] += masked_mean(batch.old_log_probs[rows] - out["log_probs"].detach(),
                                               t["response_mask"]).item() * micro / size
            scaled = loss.reduce(per_token, t["response_mask"]) * (micro / size)
            totals["loss"] += scaled.item()
            if extra_loss is not None:
                extra = extra_loss(rows) * (micro / size)
                totals["extra_loss"] = totals.get("extra_loss", 0.0) + extra.item()
                scaled = scaled + extra
            backward(scaled)
            mask = t["response_mask"]
            totals["entropy"] += masked_mean(out["token_entropy"].detach(), mask).item() * micro / size
            if "clipped" in stats:
                totals["clip_fraction"] += masked_mean(stats["clipped"].float(), mask).item() * micro / size
            if "kl" in stats:
                totals["kl"] += masked_mean(stats["kl"], mask).item() * micro / size
        clipped = list(policy.parameters()) if parameters is None else parameters
        grad_norm = torch.nn.utils.clip_grad_norm_(clipped, grad_clip if grad_clip > 0 else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {**totals, "grad_norm": grad_norm.item()}
