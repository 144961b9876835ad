"""The MoE feed-forward layer, and `build_mlp`, which gives each block an FFN or an MoE layer.

Dispatch has no Python loop over tokens: assignments are sorted by expert (stably, so priority
order survives), those past an expert's capacity are cut, the kept tokens are gathered into
one contiguous array, the experts run on their slices (`grouped_linear`), and the outputs go
back to their tokens: for token-choice routings by placing each in its (slot, token) row and a
weighted sum over slots, for expert choice by a weighted `index_add_`. A token no expert kept
gets zero from the routed experts, so it passes through the residual connection unchanged
(plus any shared experts).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.ffn import FFNS
from lmlab.nn.moe.experts import Experts
from lmlab.nn.moe.routers import ROUTERS, MoEConfig, Routing, count_per_expert


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def is_moe_layer(cfg: MoEConfig, layer_idx: int) -> bool:
    return layer_idx >= cfg.first_layer and (layer_idx - cfg.first_layer) % cfg.every == 0


def _ffn_with_hidden(ffn_cfg, d_model: int, d_ff: int | None) -> nn.Module:
    entry, cfg = FFNS.resolve(ffn_cfg)
    if d_ff is not None:
        if not hasattr(cfg, "d_ff"):
            raise ConfigError(f"model/ffn={entry.name} has no d_ff field, so model.moe.d_ff cannot size its experts")
        cfg = dataclasses.replace(cfg, d_ff=d_ff)
    return entry.target(d_model, cfg=cfg)


class GatherBySlot(torch.autograd.Function):
    """rows = x[order % T] for slot-major assignments (assignment i is token i % T), where `order`
    holds distinct assignments. The backward puts each row's gradient at its assignment and sums
    over slots: no atomic adds and no sort, unlike the generic backward of x[index]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, slots: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.slots, ctx.n_tokens = slots, x.shape[0]
        return x.index_select(0, order % x.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        per_slot = grad.new_zeros(ctx.slots * ctx.n_tokens, grad.shape[1]).index_copy_(0, order, grad)
        return per_slot.view(ctx.slots, ctx.n_tokens, -1).sum(dim=0), None, None


class MoELayer(nn.Module):
    """Routed experts (+ optional shared experts) in place of one FFN.

    After each forward, `losses` holds the router's unweighted auxiliary losses (with gradient)
    and `stats()` computes load statistics of that forward on demand (logging steps only); the
    Transformer collects both. `token_ids` is set by the Transformer before each forward, for
    routers that route by token id.
    """

    def __init__(self, d_model: int, ffn_cfg, moe_cfg):
        super().__init__()
        self.router = ROUTERS.build(moe_cfg)
        cfg: MoEConfig = self.router.cfg
        self.gate = nn.Linear(d_model, cfg.n_experts, bias=False) if self.router.learned else None
        self.experts = Experts(_ffn_with_hidden(ffn_cfg, d_model, cfg.d_ff), cfg.n_experts)
        self.shared_experts = None
        if cfg.n_shared_experts:  # one FFN as wide as all shared experts together (DeepSeekMoE)
            hidden = getattr(self.experts, self.experts.ffn.projections[0]).shape[1]  # first projection: d -> hidden
            self.shared_experts = _ffn_with_hidden(ffn_cfg, d_model, cfg.n_shared_experts * hidden)
        self.loss_weights = {"moe_aux_loss": cfg.aux_loss_weight, "router_z_loss": cfg.z_loss_weight}
        self.token_ids: torch.Tensor | None = None
        self.losses: dict[str, torch.Tensor] = {}
        self._last: tuple | None = None  # (probs, token_index, order, counts, n_tokens) of the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = None
        if self.gate is not None:
            gate_in = flat
            if self.training and self.router.cfg.jitter:
                j = self.router.cfg.jitter
                gate_in = flat * torch.empty_like(flat).uniform_(1 - j, 1 + j)
            logits = self.gate(gate_in)
            if logits.element_size() < 4:  # routing decisions in float32 at least, also under bf16 autocast
                logits = logits.float()
        token_ids = None if self.token_ids is None else self.token_ids.reshape(-1)
        routing = self.router(logits, token_ids)
        order, counts = self._dispatch(routing, len(flat))
        # Gather in the compute dtype (bf16 under autocast): half the bytes of a float32 gather.
        x_compute = flat.to(_compute_dtype(flat))
        if routing.slots:
            y = self.experts(GatherBySlot.apply(x_compute, order, routing.slots), counts)
            out = self._combine_slots(y, routing, order, len(flat))
        else:
            tokens = routing.token_index[order]
            y = self.experts(x_compute[tokens], counts) * routing.weight[order, None].to(x_compute.dtype)
            out = y.new_zeros(flat.shape).index_add_(0, tokens, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        self.losses = routing.losses
        probs = None if routing.probs is None else routing.probs.detach()
        self._last = (probs, routing.token_index, order, counts, len(flat))
        return out.reshape(x.shape)

    @staticmethod
    def _combine_slots(y: torch.Tensor, routing: Routing, order: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """out[t] = sum over token t's slots of weight * expert output: the sorted outputs go back
        to their (slot, token) rows (dropped assignments stay zero), then a weighted sum over slots."""
        per_slot = y.new_zeros(routing.slots * n_tokens, y.shape[1]).index_copy(0, order, y)
        weight = routing.weight.to(y.dtype).view(routing.slots, n_tokens, 1)
        return (per_slot.view(routing.slots, n_tokens, -1) * weight).sum(dim=0)

    def _dispatch(self, routing: Routing, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Assignment order sorted by expert with those over capacity removed, and kept counts per expert."""
        expert_index = routing.expert_index
        order = torch.argsort(expert_index, stable=True)
        counts = count_per_expert(expert_index, self.router.n_experts)
        capacity = self.router.capacity(n_tokens)
        if capacity is not None:
            first_of_expert = counts.cumsum(0) - counts
            rank = torch.arange(len(order), device=order.device) - first_of_expert[expert_index[order]]
            order = order[rank < capacity]
            counts = counts.clamp(max=capacity)
        return order, counts

    @torch.no_grad()
    def stats(self) -> dict[str, torch.Tensor]:
        """Of the last forward: each expert's share of the computed assignments, the fraction of
        tokens no routed expert processed, and the mean entropy of the router's distribution."""
        if self._last is None:
            return {}
        probs, token_index, order, counts, n_tokens = self._last
        stats = {f"load/expert{e}": c for e, c in enumerate(counts.float() / counts.sum().clamp(min=1))}
        stats["dropped"] = 1 - (count_per_expert(token_index[order], n_tokens) > 0).float().mean()
        if probs is not None:
            stats["router_entropy"] = -(probs * probs.clamp(min=1e-9).log()).sum(dim=-1).mean()
        return stats


def build_mlp(model_cfg, layer_idx: int) -> nn.Module:
    """The FFN of layer `layer_idx`: an MoE layer where model.moe selects one, else model.ffn."""
    moe_cfg = getattr(model_cfg, "moe", None)
    if moe_cfg is not None:
        _, typed = ROUTERS.resolve(moe_cfg)
        if is_moe_layer(typed, layer_idx):
            return MoELayer(model_cfg.d_model, model_cfg.ffn, typed)
    return FFNS.build(model_cfg.ffn, model_cfg.d_model)
