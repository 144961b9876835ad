"""Policy-gradient losses (registry `rl_loss`), per token, and the microbatch steps of SFT and GRPO.

Each entry says which signal it reads (the raw rewards or the group-normalised advantages), whether
those advantages are divided by the group std, how a response's per-token losses are reduced, and
what each token's loss is given the policy's log-probs and those at rollout time (`old_log_probs`,
for the clipped ratio of several optimizer steps per rollout batch). Every entry can add a KL penalty
to a reference policy (`kl` estimator k1, k2 or k3, times `kl_coef`).

    loss = RL_LOSSES.build("grpo_clip")                      # or {"name": "dr_grpo", "max_tokens": 1024}
    per_token, stats = loss.token_loss(log_probs, advantages[:, None], old_log_probs)
    scalar = loss.reduce(per_token, response_mask)

The names of the CS336 assignment also work where a loss type is a string: `no_baseline` is
`reinforce`, `reinforce_with_baseline` is `reinforce_baseline`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmlab.alignment.masked import masked_mean, masked_normalize
from lmlab.registry import Registry

RL_LOSSES = Registry("rl_loss", group="rl_loss", doc="policy-gradient losses: REINFORCE, GRPO, Dr. GRPO")

# The assignment's loss-type names for the entries that carry other names here.
COURSE_NAMES = {"no_baseline": "reinforce", "reinforce_with_baseline": "reinforce_baseline"}


def kl_k1(log_p: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    """log p - log ref: unbiased for KL(p || ref) under samples of p, high variance, can be negative."""
    return log_p - log_ref


def kl_k2(log_p: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    """(log p - log ref)^2 / 2: biased, low variance, never negative."""
    return 0.5 * (log_p - log_ref) ** 2


def kl_k3(log_p: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    """r - 1 - log r with r = ref / p: unbiased and never negative (Schulman's estimator, GRPO's choice)."""
    log_ratio = log_ref - log_p
    return torch.exp(log_ratio) - 1 - log_ratio


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k2": kl_k2,
                                                                                  "k3": kl_k3}


def compute_naive_policy_gradient_loss(raw_rewards_or_advantages: torch.Tensor,
                                       policy_log_probs: torch.Tensor) -> torch.Tensor:
    """-A log p per token: A (batch, 1) broadcast over the sequence (batch, seq)."""
    return -raw_rewards_or_advantages * policy_log_probs


def compute_grpo_clip_loss(advantages: torch.Tensor, policy_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                           cliprange: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) per token, ratio = p / p_old; metadata `clipped`,
    True where the clipped term was the smaller one (it sends no gradient there)."""
    ratio = torch.exp(policy_log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - cliprange, 1 + cliprange) * advantages
    return -torch.minimum(unclipped, clipped), {"clipped": clipped < unclipped}


@dataclass
class LossConfig:
    kl: str | None = None  # KL-to-reference estimator: k1, k2 or k3; None: no penalty
    kl_coef: float = 0.0


class PolicyGradientLoss:
    """Base of the entries; see the module docstring."""

    reads = "advantages"  # or "raw_rewards"

    def __init__(self, cfg: LossConfig):
        if cfg.kl is not None and cfg.kl not in KL_ESTIMATORS:
            raise ValueError(f"rl_loss.kl={cfg.kl!r}: choose one of {', '.join(KL_ESTIMATORS)} or null")
        if cfg.kl_coef < 0:
            raise ValueError(f"rl_loss.kl_coef must be >= 0, got {cfg.kl_coef}")
        self.cfg = cfg

    @property
    def normalize_by_std(self) -> bool:
        """Whether the rollout divides advantages by the group std (the entries that have the field)."""
        return getattr(self.cfg, "normalize_by_std", False)

    def signal(self, raw_rewards: torch.Tensor | None, advantages: torch.Tensor | None) -> torch.Tensor:
        """Of a rollout's raw rewards and advantages, the one this entry reads."""
        chosen = {"raw_rewards": raw_rewards, "advantages": advantages}[self.reads]
        if chosen is None:
            raise ValueError(f"rl_loss={type(self).__name__} needs {self.reads}")
        return chosen

    def per_token(self, signal: torch.Tensor, log_probs: torch.Tensor,
                  old_log_probs: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def token_loss(self, log_probs: torch.Tensor, signal: torch.Tensor, old_log_probs: torch.Tensor | None = None,
                   ref_log_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Per-token loss (batch, seq) from the policy's log-probs and the signal this entry reads (one per
        response, (batch,) or (batch, 1); or one per token, (batch, seq), as PPO's GAE gives), plus the KL
        penalty when configured (it needs `ref_log_probs`)."""
        signal = (signal if signal.dim() == 2 else signal[:, None]).to(log_probs.dtype)
        loss, stats = self.per_token(signal, log_probs, old_log_probs)
        if self.cfg.kl is not None:
            if ref_log_probs is None:
                raise ValueError(f"rl_loss.kl={self.cfg.kl} needs the reference policy's log-probs")
            kl = KL_ESTIMATORS[self.cfg.kl](log_probs, ref_log_probs)
            loss, stats = loss + self.cfg.kl_coef * kl, {**stats, "kl": kl.detach()}
        return loss, stats

    def reduce(self, token_loss: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """One number for the microbatch: each response's mean over its own tokens, then the batch mean."""
        return masked_mean(token_loss, response_mask, dim=-1).mean()


@RL_LOSSES.register("reinforce")
class Reinforce(PolicyGradientLoss):
    """REINFORCE without a baseline: -R log p with the raw reward R."""

    reads = "raw_rewards"

    @dataclass
    class Config(LossConfig):
        pass

    def per_token(self, signal, log_probs, old_log_probs):
        return compute_naive_policy_gradient_loss(signal, log_probs), {}


@RL_LOSSES.register("reinforce_baseline")
class ReinforceBaseline(PolicyGradientLoss):
    """REINFORCE with the group mean as baseline: -A log p, A the group-normalised advantage."""

    @dataclass
    class Config(LossConfig):
        normalize_by_std: bool = True

    def per_token(self, signal, log_probs, old_log_probs):
        return compute_naive_policy_gradient_loss(signal, log_probs), {}


def _clipped(signal, log_probs, old_log_probs, cliprange: float):
    if old_log_probs is None:
        raise ValueError("a clipped policy-gradient loss needs old_log_probs (the log-probs at rollout time)")
    return compute_grpo_clip_loss(signal, log_probs, old_log_probs, cliprange)


@RL_LOSSES.register("grpo_clip")
class GRPOClip(PolicyGradientLoss):
    """GRPO (DeepSeekMath): the PPO-clipped ratio on group-normalised advantages, averaged per response."""

    @dataclass
    class Config(LossConfig):
        cliprange: float = 0.2
        normalize_by_std: bool = True

    def per_token(self, signal, log_probs, old_log_probs):
        return _clipped(signal, log_probs, old_log_probs, self.cfg.cliprange)


@RL_LOSSES.register("dr_grpo")
class DrGRPO(PolicyGradientLoss):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): GRPO without the std division
    and without the per-response mean, whose 1/length favours long wrong answers; the token losses are
    summed and divided by one constant."""

    @dataclass
    class Config(LossConfig):
        cliprange: float = 0.2
        max_tokens: int | None = None  # the constant; None: the batch's padded response length

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        if cfg.max_tokens is not None and cfg.max_tokens < 1:
            raise ValueError(f"rl_loss.max_tokens must be >= 1, got {cfg.max_tokens}")

    def per_token(self, signal, log_probs, old_log_probs):
        return _clipped(signal, log_probs, old_log_probs, self.cfg.cliprange)

    def reduce(self, token_loss, response_mask):
        constant = self.cfg.max_tokens or token_loss.shape[-1]
        return masked_normalize(token_loss, response_mask, constant, dim=-1).mean()


@RL_LOSSES.register("ppo")
class PPO(PolicyGradientLoss):
    """PPO (Schulman et al. 2017) for language models: the clipped ratio on per-token advantages from a
    critic (`generalized_advantage_estimation`), and the critic's clipped value loss (`value_loss`)."""

    @dataclass
    class Config(LossConfig):
        cliprange: float = 0.2
        cliprange_value: float = 0.2  # how far a value may move from its rollout-time estimate per update
        vf_coef: float = 0.5  # the value loss's weight in the total

    def per_token(self, signal, log_probs, old_log_probs):
        return _clipped(signal, log_probs, old_log_probs, self.cfg.cliprange)

    def value_loss(self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                   response_mask: torch.Tensor) -> torch.Tensor:
        """vf_coef * the masked mean of max((V - R)^2, (clip(V, V_old +- cliprange_value) - R)^2) / 2."""
        clipped = old_values + (values - old_values).clamp(-self.cfg.cliprange_value, self.cfg.cliprange_value)
        worst = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
        return self.cfg.vf_coef * 0.5 * masked_mean(worst, response_mask)


def _course_loss(loss_type: str, cliprange: float | None) -> PolicyGradientLoss:
    name = COURSE_NAMES.get(loss_type, loss_type)
    fields = {"cliprange": cliprange} if cliprange is not None and "cliprange" in {
        f.name for f in RL_LOSSES.get(name).fields()} else {}
    return RL_LOSSES.build({"name": name, **fields})


def compute_policy_gradient_loss(policy_log_probs: torch.Tensor, loss_type: str,
                                 raw_rewards: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                                 old_log_probs: torch.Tensor | None = None,
                                 cliprange: float | None = None) -> tuple[torch.Tensor, dict]:
    """The per-token loss (batch, seq) of the `rl_loss` entry `loss_type` (or the assignment's name)."""
    loss = _course_loss(loss_type, cliprange)
    return loss.token_loss(policy_log_probs, loss.signal(raw_rewards, advantages), old_log_probs)


def grpo_microbatch_train_step(policy_log_probs: torch.Tensor, response_mask: torch.Tensor,
                               gradient_accumulation_steps: int, loss_type: str,
                               raw_rewards: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                               old_log_probs: torch.Tensor | None = None,
                               cliprange: float | None = None) -> tuple[torch.Tensor, dict]:
    """The entry's per-token loss reduced its way (a per-response mean, or Dr. GRPO's constant), scaled by
    1 / gradient_accumulation_steps and backpropagated; returns that scaled loss and the loss's stats."""
    loss_fn = _course_loss(loss_type, cliprange)
    per_token, stats = loss_fn.token_loss(policy_log_probs, loss_fn.signal(raw_rewards, advantages), old_log_probs)
    loss = loss_fn.reduce(per_token, response_mask) / gradient_accumulation_steps
    loss.backward()
    return loss, stats


def sft_microbatch_train_step(policy_log_probs: torch.Tensor, response_mask: torch.Tensor,
                              gradient_accumulation_steps: int,
                              normalize_constant: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Negative log-likelihood of the response tokens: summed per example, divided by
    `normalize_constant`, averaged over the batch, scaled by 1 / gradient_accumulation_steps and
    backpropagated. Prompt and padding positions send no gradient."""
    nll = -masked_normalize(policy_log_probs, response_mask, normalize_constant, dim=-1).mean()
    loss = nll / gradient_accumulation_steps
    loss.backward()
    return loss, {"nll": nll.detach(), "response_tokens": response_mask.sum()}
