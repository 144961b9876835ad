"""Per-token log-probabilities of given labels and the entropy of the next-token distribution, from
any causal LM that returns logits (an lmlab Transformer, or a Hugging Face model's `.logits`)."""

from __future__ import annotations

import torch
from torch import nn


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) over the last dimension: logsumexp(z) - sum(p z), stable for any
    logit scale."""
    logits = logits.float()
    return torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)


def logits_of(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids)
    return out if torch.is_tensor(out) else out.logits


def get_response_log_probs(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                           return_token_entropy: bool = False, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """{"log_probs": log p(labels[b, t] | input_ids[b, :t+1]) (batch, seq)} and, when asked,
    {"token_entropy": the entropy of each position's next-token distribution}, both of softmax(logits /
    temperature): the distribution a rollout sampled from, so the policy gradient is on-policy at any
    temperature. Gathers the label's logit and subtracts the logsumexp, so no (batch, seq, vocab)
    log-softmax is materialised."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits_of(model, input_ids).float() / temperature
    out = {"log_probs": logits.gather(-1, labels[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)}
    if return_token_entropy:
        out["token_entropy"] = compute_entropy(logits)
    return out
