"""Mixture-of-experts routers (config group `model/moe`).

A router decides which experts process which tokens. It is parameter-free policy: the MoE
layer's `gate` (a Linear, d_model -> n_experts) computes the logits, the router turns them into
assignments. Selecting an entry of `model/moe` turns MoE on; its Config carries the whole MoE
layer's settings (`MoEConfig`) plus the router's own.

Assignments come as a flat list in priority order: when an expert is over capacity, earlier
assignments win. Token-choice routers list every token's first choice before any second
choice, so a token loses its second expert before another token loses its first (GShard).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lmlab.errors import ConfigError
from lmlab.registry import Registry

ROUTERS = Registry("router", group="model/moe", doc="mixture-of-experts routers (and the MoE layer's settings)")


@dataclass
class MoEConfig:
    """The MoE layer's settings, shared by every router."""

    n_experts: int = 8
    k: int = 2  # experts per token (expert_choice: average experts per token, which sets capacity)
    d_ff: int | None = None  # each expert's hidden size; None: the dense FFN's default
    n_shared_experts: int = 0  # experts of size d_ff that every token passes through (DeepSeekMoE)
    first_layer: int = 0  # layers before this one stay dense
    every: int = 1  # from first_layer on, every `every`-th layer is MoE (2: every other layer)
    capacity_factor: float | None = None  # None: dropless; else each expert takes ceil(cf * tokens * k / E)
    aux_loss_weight: float = 0.01  # Switch load-balancing loss, averaged over MoE layers
    z_loss_weight: float = 0.001  # router z-loss (ST-MoE), averaged over MoE layers
    jitter: float = 0.0  # training only: gate input times U(1 - jitter, 1 + jitter) (Switch)


@dataclass
class Routing:
    """The router's decision for T tokens, as N (token, expert, weight) assignments."""

    expert_index: torch.Tensor  # (N,) int64, in priority order
    token_index: torch.Tensor  # (N,) int64
    weight: torch.Tensor  # (N,) float32, multiplies the expert's output
    probs: torch.Tensor | None  # (T, E) the router's distribution over experts (None: not learned)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # unweighted auxiliary losses
    slots: int | None = None  # set when assignments are `slots` blocks of all T tokens in order (token choice)


def count_per_expert(expert_index: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many entries of `expert_index` name each expert. Unlike torch.bincount on CUDA, this
    does not read the maximum back to the host, so it does not stall the GPU."""
    counts = torch.zeros(n_experts, dtype=torch.long, device=expert_index.device)
    return counts.scatter_add_(0, expert_index, torch.ones_like(expert_index))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean(logsumexp(logits)^2): keeps router logits small, so the softmax stays well-conditioned."""
    return logits.logsumexp(dim=-1).square().mean()


def load_balancing_loss(probs: torch.Tensor, expert_index: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch Transformer's E * sum_i f_i * P_i, where f_i is the fraction of assignments sent to
    expert i and P_i the mean router probability of expert i. Equals 1 when both are uniform; the
    gradient flows through P only (f comes from an argmax)."""
    f = count_per_expert(expert_index, n_experts).float() / expert_index.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()


class Router(nn.Module):
    """Base: checks the MoE settings shared by every router; `learned` says whether a gate feeds it,
    `causal` whether a token's routing ignores later tokens (generation needs it)."""

    learned = True
    causal = True
    # The process group whose ranks' tokens make up the batch, set by data parallelism (ExpertParallel): statistics
    # of the batch that steer training (the load behind bias_update_rate's step) are summed over it. None: this process.
    load_group = None

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        if cfg.n_experts < 1:
            raise ConfigError(f"model.moe.n_experts must be >= 1, got {cfg.n_experts}")
        if not 1 <= cfg.k <= cfg.n_experts:
            raise ConfigError(f"model.moe.k={cfg.k} must be between 1 and n_experts={cfg.n_experts}")
        if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
            raise ConfigError(f"model.moe.capacity_factor must be > 0 (or null for dropless), got {cfg.capacity_factor}")
        if cfg.every < 1 or cfg.first_layer < 0 or cfg.n_shared_experts < 0:
            raise ConfigError("model.moe.every must be >= 1, first_layer and n_shared_experts >= 0, got "
                              f"every={cfg.every}, first_layer={cfg.first_layer}, n_shared_experts={cfg.n_shared_experts}")
        if not 0 <= cfg.jitter < 1:
            raise ConfigError(f"model.moe.jitter must be in [0, 1), got {cfg.jitter}")
        self.cfg = cfg
        self.n_experts, self.k = cfg.n_experts, cfg.k

    def capacity(self, n_tokens: int) -> int | None:
        """Most assignments one expert takes from `n_tokens` tokens; None: no limit."""
        cf = self.cfg.capacity_factor
        return None if cf is None else math.ceil(cf * n_tokens * self.k / self.n_experts)

    def forward(self, logits: torch.Tensor | None, token_ids: torch.Tensor | None) -> Routing:
        raise NotImplementedError


def token_choice(top_index: torch.Tensor, top_weight: torch.Tensor, probs: torch.Tensor | None,
                 losses: dict[str, torch.Tensor]) -> Routing:
    """(T, k) choices -> a Routing whose flat lists hold all first choices, then all second ones, ..."""
    n_tokens, k = top_index.shape
    tokens = torch.arange(n_tokens, device=top_index.device).repeat(k)
    return Routing(top_index.T.reshape(-1), tokens, top_weight.T.reshape(-1), probs, losses, slots=k)


SCORES = {"softmax": lambda logits: logits.softmax(dim=-1), "sigmoid": torch.sigmoid}


@ROUTERS.register("topk")
class TopKRouter(Router):
    """Token choice: each token picks its k highest-scoring experts (Switch, Mixtral, DeepSeek)."""

    @dataclass
    class Config(MoEConfig):
        score: str = "softmax"  # softmax (Mixtral) or sigmoid (DeepSeek-V3) gate scores
        renormalize: bool = True  # rescale each token's k weights to sum to 1
        noise: float = 0.0  # training only: std of Gaussian noise on the scores used for selection
        bias_update_rate: float = 0.0  # aux-loss-free balancing step per batch (DeepSeek-V3); 0: off

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        if cfg.score not in SCORES:
            raise ConfigError(f"model.moe.score must be one of {', '.join(SCORES)}, got '{cfg.score}'")
        if cfg.noise < 0 or cfg.bias_update_rate < 0:
            raise ConfigError("model.moe.noise and bias_update_rate must be >= 0")
        self.score = SCORES[cfg.score]
        # Added to the scores only to choose experts, never to weight them: balancing without a
        # loss term that fights the language-modelling gradient (Wang et al., 2024).
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))

    @property
    def updates_state_in_forward(self) -> bool:
        """The training forward steps `expert_bias`: a second forward of the batch (recompute=) would step it twice."""
        return bool(self.cfg.bias_update_rate)

    def forward(self, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> Routing:
        scores = self.score(logits)
        selection = scores + self.expert_bias
        if self.training and self.cfg.noise:
            selection = selection + self.cfg.noise * torch.randn_like(selection)
        top_index = selection.topk(self.k, dim=-1).indices
        top_weight = scores.gather(-1, top_index)
        if self.cfg.renormalize:
            top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        probs = scores / scores.sum(dim=-1, keepdim=True)  # a distribution also for sigmoid scores
        if self.training and self.cfg.bias_update_rate:
            self._update_bias(top_index.reshape(-1))
        losses = {"moe_aux_loss": load_balancing_loss(probs, top_index.reshape(-1), self.n_experts),
                  "router_z_loss": router_z_loss(logits)}
        return token_choice(top_index, top_weight, probs, losses)

    @torch.no_grad()
    def _update_bias(self, expert_index: torch.Tensor) -> None:
        """Raise the bias of under-loaded experts and lower it for over-loaded ones, by a fixed step."""
        load = count_per_expert(expert_index, self.n_experts).float()
        if self.load_group is not None:  # the whole batch's load: every rank takes the step one process would
            dist.all_reduce(load, group=self.load_group)
        self.expert_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)


def sum_router_load_over(model: nn.Module, group) -> None:
    """Every router of `model` takes the batch statistics that steer training (the expert load behind
    bias_update_rate's step) summed over `group`'s ranks: the step one process takes on their rows together."""
    for module in model.modules():
        if isinstance(module, Router):
            module.load_group = group


@ROUTERS.register("aux_free")
class AuxLossFreeRouter(TopKRouter):
    """Top-k with sigmoid scores balanced by a per-expert selection bias instead of an aux loss."""

    @dataclass
    class Config(TopKRouter.Config):
        score: str = "sigmoid"
        bias_update_rate: float = 1e-3
        aux_loss_weight: float = 0.0


@ROUTERS.register("expert_choice")
class ExpertChoiceRouter(Router):
    """Expert choice (Zhou et al., 2022): each expert takes its top tokens up to capacity.

    Balanced by construction, but a token's experts depend on the other tokens of the batch,
    later positions included: for causal language modelling this leaks the future, so use it
    as a training-time study, not for generation.
    """

    causal = False

    @dataclass
    class Config(MoEConfig):
        capacity_factor: float | None = 1.0  # expert capacity = ceil(cf * tokens * k / E)

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        if cfg.capacity_factor is None:
            raise ConfigError("model/moe=expert_choice needs a capacity_factor (each expert's share of tokens)")

    def capacity(self, n_tokens: int) -> int | None:
        return None  # the router itself takes exactly its capacity per expert

    def forward(self, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> Routing:
        n_tokens = logits.shape[0]
        probs = logits.softmax(dim=-1)
        per_expert = min(n_tokens, super().capacity(n_tokens))
        top = probs.T.topk(per_expert, dim=-1)  # (E, capacity)
        experts = torch.arange(self.n_experts, device=logits.device).repeat_interleave(per_expert)
        return Routing(experts, top.indices.reshape(-1), top.values.reshape(-1), probs,
                       {"router_z_loss": router_z_loss(logits)})


@ROUTERS.register("hash")
class HashRouter(Router):
    """Hash layers (Roller et al., 2021): a fixed random table sends each token id to its experts."""

    learned = False

    @dataclass
    class Config(MoEConfig):
        vocab_size: int | None = None  # size of the table; None: the model's vocabulary
        seed: int = 0

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.register_buffer("expert_of_token", torch.empty(0, dtype=torch.long))

    def bind_vocab(self, vocab_size: int) -> None:
        """Build the table for the model's vocabulary: an equal share of token ids per expert."""
        if self.cfg.vocab_size is not None and self.cfg.vocab_size != vocab_size:
            raise ConfigError(
                f"model/moe=hash: the router's vocab_size={self.cfg.vocab_size} does not match the model's "
                f"vocabulary of {vocab_size} ids; set model.moe.vocab_size={vocab_size} or null")
        order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(self.cfg.seed))
        self.expert_of_token = (order % self.n_experts).to(self.expert_of_token.device)

    def forward(self, logits: None, token_ids: torch.Tensor | None) -> Routing:
        if token_ids is None:
            raise RuntimeError("the hash router needs the token ids of its layer's input")
        first = self.expert_of_token[token_ids]
        top_index = (first[:, None] + torch.arange(self.k, device=first.device)) % self.n_experts
        top_weight = torch.full(top_index.shape, 1 / self.k, device=first.device)
        return token_choice(top_index, top_weight, probs=None, losses={})
