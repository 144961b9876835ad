"""Preference losses (registry `pref_loss`) on sequence log-probs of a chosen and a rejected response,
and the per-instance DPO loss of two language models on one preference pair.

Inputs are per example (batch,): the policy's and the frozen reference's summed log-probs of each
response's tokens, and each response's token count (for the length-normalised entries).

    loss = PREFERENCE_LOSSES.build({"name": "dpo", "beta": 0.1})
    per_example = loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_len, rejected_len)

    chosen, rejected, skipped = preference_tensors(pairs, tokenizer)   # pairs with identical responses: skipped
    value, metrics = preference_loss(policy, reference, chosen, rejected, loss)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.alignment.logprobs import get_response_log_probs
from lmlab.alignment.masked import masked_sum
from lmlab.alignment.tokens import encode, eos_id, pad_id, sequences_to_tensors
from lmlab.registry import Registry

PREFERENCE_LOSSES = Registry("pref_loss", group="pref_loss", doc="preference losses: DPO, IPO, SimPO")

# The Alpaca instruction format, the CS336 assignment's SFT and DPO template.
ALPACA_TEMPLATE = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{prompt}\n\n### Response:\n{response}")


def _margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected) -> torch.Tensor:
    """How much more the policy prefers the chosen response than the reference does (log-ratio margin)."""
    return (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)


@dataclass
class BetaConfig:
    beta: float = 0.1

    def __post_init__(self):
        if self.beta <= 0:
            raise ValueError(f"pref_loss.beta must be > 0, got {self.beta}")


@PREFERENCE_LOSSES.register("dpo")
class DPO(nn.Module):
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * margin of the policy over the reference)."""

    Config = BetaConfig
    needs_reference = True

    def __init__(self, cfg: BetaConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_len=None, rejected_len=None):
        return -F.logsigmoid(self.cfg.beta * _margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected))


@PREFERENCE_LOSSES.register("dpo_norm")
class LengthNormalizedDPO(DPO):
    """DPO on per-token log-ratios: each response's log-ratio divided by its length, so a long response
    is not preferred for its length alone."""

    Config = BetaConfig

    def forward(self, policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_len=None, rejected_len=None):
        chosen = (policy_chosen - ref_chosen) / chosen_len
        rejected = (policy_rejected - ref_rejected) / rejected_len
        return -F.logsigmoid(self.cfg.beta * (chosen - rejected))


@PREFERENCE_LOSSES.register("ipo")
class IPO(DPO):
    """IPO (Azar et al. 2023): (margin - 1 / (2 beta))^2, a squared loss that stops pushing once the margin
    reaches its target, where DPO's keeps growing it (overfitting deterministic preferences)."""

    Config = BetaConfig

    def forward(self, policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_len=None, rejected_len=None):
        return (_margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected) - 1 / (2 * self.cfg.beta)) ** 2


@PREFERENCE_LOSSES.register("simpo")
class SimPO(DPO):
    """SimPO (Meng et al. 2024): no reference model; -log sigmoid(beta * (mean log-prob of chosen - of
    rejected) - gamma), gamma a target reward margin."""

    needs_reference = False

    @dataclass
    class Config(BetaConfig):
        beta: float = 2.0
        gamma: float = 0.5

    def forward(self, policy_chosen, policy_rejected, ref_chosen=None, ref_rejected=None, chosen_len=None,
                rejected_len=None):
        reward_gap = policy_chosen / chosen_len - policy_rejected / rejected_len
        return -F.logsigmoid(self.cfg.beta * reward_gap - self.cfg.gamma)


@dataclass(frozen=True)
class PreferencePair:
    prompt: str  # the history, already formatted (e.g. by a chat template's render with a generation prompt)
    chosen: str
    rejected: str


def end_of_text(tokenizer) -> int:
    eos = eos_id(tokenizer)
    if eos is None:
        raise ValueError("preference training appends an end-of-sequence token to each response; this "
                         "tokenizer has none")
    return eos


def preference_tensors(pairs: Sequence[PreferencePair],
                       tokenizer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """The chosen and the rejected sequences (prompt + response + end-of-sequence) as
    `sequences_to_tensors` lays them out, and how many pairs were skipped because both responses were
    the same (they carry no preference, and DPO's loss on them is a constant log 2)."""
    kept = [p for p in pairs if p.chosen != p.rejected]
    if not kept:
        raise ValueError(f"all {len(pairs)} preference pairs have identical chosen and rejected responses")
    prompts = [encode(tokenizer, p.prompt, special_tokens=True) for p in kept]
    sides = [ended_sequences(prompts, [getattr(p, side) for p in kept], tokenizer) for side in ("chosen", "rejected")]
    return sides[0], sides[1], len(pairs) - len(kept)


def ended_sequences(prompt_ids: Sequence[Sequence[int]], responses: Sequence[str], tokenizer) -> dict[str, torch.Tensor]:
    """Each prompt + response + end-of-sequence as `sequences_to_tensors` lays them out: what preference
    training scores, and what a reward model trained on it reads."""
    eos = end_of_text(tokenizer)
    return sequences_to_tensors(prompt_ids, [encode(tokenizer, r, special_tokens=False) + [eos] for r in responses],
                                pad_id(tokenizer))


def sequence_log_probs(model: nn.Module, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed response log-prob (batch,) and its response length in tokens (batch,)."""
    device = next(model.parameters()).device
    t = {k: v.to(device) for k, v in tensors.items()}
    log_probs = get_response_log_probs(model, t["input_ids"], t["labels"])["log_probs"]
    return masked_sum(log_probs, t["response_mask"], dim=-1), t["response_mask"].sum(-1).to(log_probs.dtype)


def check_reference(policy: nn.Module, reference: nn.Module) -> None:
    """A reference must score the same token ids: one error before any work when its vocabulary differs."""
    sizes = [m.get_input_embeddings().num_embeddings if hasattr(m, "get_input_embeddings") else
             m.embed_tokens.num_embeddings for m in (policy, reference)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"the reference model has a vocabulary of {sizes[1]} ids, the policy {sizes[0]}: a "
                         "reference must share the policy's tokenizer (load the checkpoint the policy started from)")


def preference_loss(policy: nn.Module, reference: nn.Module | None, chosen: dict[str, torch.Tensor],
                    rejected: dict[str, torch.Tensor], loss: nn.Module) -> tuple[torch.Tensor, dict[str, float]]:
    """The batch's mean preference loss (gradient to the policy only) and its metrics: how often the
    policy's implicit reward prefers the chosen response, and the mean margin."""
    pc, lc = sequence_log_probs(policy, chosen)
    pr, lr = sequence_log_probs(policy, rejected)
    rc = rr = torch.zeros_like(pc)
    if loss.needs_reference:
        if reference is None:
            raise ValueError(f"pref_loss={type(loss).__name__} needs a reference model")
        check_reference(policy, reference)
        with torch.no_grad():
            rc, rr = (sequence_log_probs(reference, side)[0].to(pc.device) for side in (chosen, rejected))
    per_example = loss(pc, pr, rc, rr, lc, lr)
    margin = (pc - rc - (pr - rr)).detach()
    metrics = {"loss": per_example.mean().item(), "reward_accuracy": (margin > 0).float().mean().item(),
               "margin": margin.mean().item()}
    return per_example.mean(), metrics


def _sequence_log_prob(model: nn.Module, tokenizer, text: str, eos: int, prompt_len: int) -> torch.Tensor:
    """Summed log-prob of the tokens after the first `prompt_len` of `text` + end-of-sequence."""
    ids = encode(tokenizer, text, special_tokens=True) + [eos]
    device = next(model.parameters()).device
    ids = torch.tensor([ids], device=device)
    log_probs = get_response_log_probs(model, ids[:, :-1], ids[:, 1:])["log_probs"]
    return log_probs[0, max(prompt_len - 1, 0):].sum()


def compute_per_instance_dpo_loss(lm: nn.Module, lm_ref: nn.Module, tokenizer, beta: float, prompt: str,
                                  response_chosen: str, response_rejected: str,
                                  template: str = ALPACA_TEMPLATE) -> torch.Tensor:
    """The DPO loss of one preference pair: each response formatted with the prompt by `template`,
    followed by the end-of-sequence token, scored by both models. The prompt's tokens are the same in
    both sequences, so they cancel in the margin; only the responses' log-probs are summed."""
    eos = end_of_text(tokenizer)
    prefix = template.format(prompt=prompt, response="")
    prompt_len = len(encode(tokenizer, prefix, special_tokens=True))
    texts = [template.format(prompt=prompt, response=r) for r in (response_chosen, response_rejected)]
    policy = [_sequence_log_prob(lm, tokenizer, t, eos, prompt_len) for t in texts]
    with torch.no_grad():
        ref = [_sequence_log_prob(lm_ref, tokenizer, t, eos, prompt_len).to(policy[0].device) for t in texts]
    return DPO(BetaConfig(beta))(policy[0], policy[1], ref[0], ref[1])
