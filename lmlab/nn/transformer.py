"""The decoder-only Transformer, assembled from the model registries.

Parameter names follow the Hugging Face Llama layout (`embed_tokens`, `layers.N.self_attn.q_proj`,
`layers.N.mlp.gate_proj`, `norm`, `lm_head`), so weights move to and from that ecosystem by a
thin adapter.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import MISSING
from torch import nn

from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION
from lmlab.nn.blocks import BLOCKS
from lmlab.nn.hybrid import check_layer_pattern
from lmlab.nn.init import INITS
from lmlab.nn.moe import MoELayer
from lmlab.nn.mtp import MTPConfig, MTPModule, check_mtp
from lmlab.nn.norms import NORMS
from lmlab.nn.positions import POSITIONS


@dataclass
class ModelConfig:
    """Sizes of the model; the parts come from their config groups."""

    d_model: int = 128
    n_layers: int = 4
    max_seq_len: int = 256
    vocab_size: int | None = None  # None: the tokenizer's, rounded up to a multiple of 64
    tie_embeddings: bool = False
    logit_softcap: float | None = None  # squash output logits with c * tanh(logits / c) (Gemma 2)
    init: Any = "gpt2"  # an entry of model/init
    norm: Any = MISSING
    ffn: Any = MISSING
    position: Any = MISSING
    attention: Any = MISSING
    block: Any = MISSING
    moe: Any = None  # an entry of model/moe turns FFNs into mixtures of experts; None: dense
    mtp: MTPConfig = field(default_factory=MTPConfig)
    # Hybrids: an attention entry per layer, repeated to n_layers, e.g. [mamba2, mamba2, mamba2, mha] (lmlab.nn.hybrid)
    layer_pattern: list[str] | None = None
    mixers: dict[str, Any] = field(default_factory=dict)  # fields of the pattern's entries other than `attention`'s
    kv_share: int = 1  # cross-layer attention (CLA): groups of this many adjacent layers share one K/V and its cache
    loops: int = 1  # looped depth: the layer stack runs this many times with the same weights
    loop_inject: bool = False  # looped depth: add the embeddings into the residual stream again before each loop


@dataclass(frozen=True)
class OutputHead:
    """The output head's parts, for a loss that projects the final hidden states itself
    (`loss.fused_head`, lmlab.kernels.chunked_cross_entropy): logits = softcap(multiplier * hidden @ weight.T)."""

    weight: torch.Tensor  # (V, d): lm_head's (the token embedding when tied)
    multiplier: float  # muP's output multiplier (1 otherwise)
    softcap: float | None  # model.logit_softcap


@dataclass
class ModelOutput:
    """What a training step needs from the model."""

    logits: torch.Tensor | None  # (B, S, V), predicting token t+1; None from forward_train(logits=False)
    mtp_logits: list[torch.Tensor]  # depth d (1-based): (B, S-d, V), predicting token t+d+1 (empty without logits)
    aux_losses: dict[str, tuple[float, torch.Tensor]]  # name -> (weight, unweighted value)
    hidden: torch.Tensor  # (B, S, d): the final norm's output, which the head projects into `logits`
    mtp_hidden: list[torch.Tensor]  # depth d: (B, S-d, d), its MTP module's normed output
    head: OutputHead | None  # the head's parts (None from forward_train(logits=True))


def padded_vocab_size(n: int, multiple: int = 64) -> int:
    return multiple * math.ceil(n / multiple)


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        at_least("model", cfg, 1, "d_model", "n_layers", "max_seq_len", "vocab_size", "kv_share", "loops")
        check_layer_pattern(cfg)
        if cfg.loops > 1 and cfg.moe is not None:
            raise ConfigError("model.loops > 1 with model.moe: the routers' auxiliary losses would see only the last loop")
        if cfg.logit_softcap is not None and not cfg.logit_softcap > 0:
            raise ConfigError(f"model.logit_softcap must be > 0 (or null), got {cfg.logit_softcap}")
        if cfg.vocab_size is not None and cfg.vocab_size < vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's {vocab_size}")
        self.vocab_size = cfg.vocab_size or padded_vocab_size(vocab_size)
        self.max_seq_len = cfg.max_seq_len
        attn_entry, attn_cfg = ATTENTION.resolve(cfg.attention)
        head_dim, n_heads = attn_entry.target.shape_for(cfg.d_model, attn_cfg)

        self.embed_tokens = nn.Embedding(self.vocab_size, cfg.d_model)
        self.position = POSITIONS.build(cfg.position, cfg.max_seq_len, cfg.d_model, head_dim, n_heads)
        self.layers = nn.ModuleList(BLOCKS.build(cfg.block, cfg, layer_idx=i) for i in range(cfg.n_layers))
        # A bidirectional layer lets each position read the token it is trained to predict: the loss falls towards
        # zero and the model learns nothing it could generate with. causal=false is for encoders (lmlab.multimodal).
        if bidirectional := [i for i, block in enumerate(self.layers)
                             if not getattr(getattr(block, "self_attn", None), "causal", True)]:
            raise ConfigError(f"layer {bidirectional[0]}'s attention has causal=false, but a decoder-only language "
                              "model must not see the tokens it predicts; set model.attention.causal=true "
                              "(causal=false is for encoders such as vision_encoder=vit)")
        self.loops, self.loop_inject = cfg.loops, cfg.loop_inject
        if cfg.kv_share > 1:
            self._share_kv(cfg.kv_share)
        self.norm = NORMS.build(cfg.norm, cfg.d_model) if self.layers[0].final_norm else nn.Identity()
        check_mtp(cfg.mtp)
        self.mtp_layers = nn.ModuleList(MTPModule(cfg, layer_idx=cfg.n_layers + d) for d in range(cfg.mtp.depth))
        self.mtp_loss_weight = cfg.mtp.loss_weight
        for block in self.blocks():  # attention that cannot use this position scheme says so now
            if hasattr(block.self_attn, "check_position"):
                block.self_attn.check_position(self.position)
        for module in self.modules():  # parts sized by the vocabulary (the hash router's table)
            if hasattr(module, "bind_vocab"):
                module.bind_vocab(self.vocab_size)
        # Found once: the forward pass and logging visit the MoE layers every step.
        self._moe_names = [name for name, m in self.named_modules() if isinstance(m, MoELayer)]
        # Parts with auxiliary losses (MoE routers, sparse attention's indexer): `losses` and `loss_weights`
        self._loss_modules = [m for m in self.modules() if hasattr(m, "losses") and hasattr(m, "loss_weights")]
        self._routes_by_token = any(not moe.router.learned for _, moe in self._moe_layers())
        self.lm_head = nn.Linear(cfg.d_model, self.vocab_size, bias=False)
        self.logit_softcap = cfg.logit_softcap
        self.output_multiplier = 1.0  # muP sets 1/width_mult
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Learning-rate multipliers by parameter name (muP); the optimizer makes groups of them.
        self.lr_multipliers: dict[str, float] = INITS.build(cfg.init).apply(self)

    def blocks(self) -> list[nn.Module]:
        """The residual blocks: the layers, then each MTP module's block."""
        return [*self.layers, *(m.layer for m in self.mtp_layers)]

    @property
    def effective_depth(self) -> int:
        """Layers a token passes through: n_layers * loops."""
        return len(self.layers) * self.loops

    def applied_layers(self) -> list[nn.Module]:
        """The layers in the order the forward applies them (each loop again): one KV cache each."""
        return [layer for _ in range(self.loops) for layer in self.layers]

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, caches=None) -> torch.Tensor:
        """The embedded tokens through the layer stack, `loops` times; `caches`: one per applied layer."""
        caches = iter(caches if caches is not None else [None] * self.effective_depth)
        embedded = x
        for loop in range(self.loops):
            if loop and self.loop_inject:
                x = x + embedded
            for layer in self.layers:
                x = layer(x, self.position, positions, next(caches))
        return x

    def _share_kv(self, every: int) -> None:
        """CLA: each layer reads the keys and values of its group's first layer (groups of `every`)."""
        for i, block in enumerate(self.layers):
            if i % every:
                share = getattr(block.self_attn, "share_kv_with", None)
                if share is None:
                    raise ConfigError(f"model.kv_share={every}: layer {i}'s {type(block.self_attn).__name__} cannot read "
                                      "another layer's keys and values (model/attention=mha can)")
                share(self.layers[i - i % every].self_attn)

    def _moe_layers(self, prefix: str = "") -> Iterator[tuple[str, MoELayer]]:
        """(layer name, MoE layer) of the MoE layers whose module names start with `prefix`."""
        return ((name.removesuffix(".mlp"), self.get_submodule(name)) for name in self._moe_names
                if name.startswith(prefix))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            params.pop(id(self.embed_tokens.weight), None)
        return sum(p.numel() for p in params.values())

    def num_active_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters one token meets: with MoE, its k routed experts instead of all of them."""
        inactive = sum(moe.experts.params_per_expert() * (moe.router.n_experts - moe.router.k)
                       for _, moe in self._moe_layers())
        return self.num_parameters(exclude_embeddings) - inactive

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per matmul weight a token meets (forward + backward; with MoE
        its k experts, with MTP the output head once more per depth), plus each attention layer's
        score and value products (see `score_flops_per_token`). Embedding lookups, norms and
        activations are not counted (the PaLM appendix's convention)."""
        linear = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        looped = (self.loops - 1) * sum(m.weight.numel() for m in self.layers.modules() if isinstance(m, nn.Linear))
        experts = sum(moe.router.k * moe.experts.params_per_expert() for _, moe in self._moe_layers())
        head_reuse = len(self.mtp_layers) * self.lm_head.weight.numel()
        applied = [*self.applied_layers(), *(m.layer for m in self.mtp_layers)]
        attention = sum(block.self_attn.score_flops_per_token(seq_len) for block in applied)
        return 6 * (linear + looped + experts + head_reuse) + attention

    def kv_cache_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes of keys and values cached per generated token, over all layers (bf16 by default)."""
        return bytes_per_element * sum(layer.self_attn.kv_cache_elements_per_token() for layer in self.applied_layers())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the next token (the main head only: MTP modules are not run). `positions` (batch, seq)
        marks packed documents, each restarting at 0: a token attends only within its document. `positions`
        (seq,) are every row's tokens' places in their sequence (a context-parallel slice's); None: 0..seq-1.
        `embeds` (batch, seq, d_model): the inputs in place of the token embeddings (a VLM's image features
        at its marker positions); `input_ids` still name the tokens, for routers that hash them."""
        return self._head(self.hidden_states(input_ids, positions, embeds))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output at each position (batch, seq, d_model): what the head reads, and what a
        reward or value head reads instead."""
        hidden, _ = self._hidden(input_ids, positions, embeds)
        return self.norm(hidden)

    def forward_train(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      embeds: torch.Tensor | None = None, logits: bool = True) -> ModelOutput:
        """Logits of the main head and of every MTP depth, the hidden states they project, and the MoE layers'
        auxiliary losses. `logits=False` leaves the projection to the loss (`loss.fused_head`): no logits, and the
        head's parts instead (`output_head`)."""
        hidden, positions = self._hidden(input_ids, positions, embeds)
        normed, mtp_hidden = self.norm(hidden), []
        for d, module in enumerate(self.mtp_layers, start=1):
            ahead = input_ids[:, d:]
            self._route_by(f"mtp_layers.{d - 1}.", ahead)
            hidden = module(hidden[:, :-1], self.embed_tokens(ahead), self.position, positions[..., :-d])
            mtp_hidden.append(module.norm(hidden))
        if not logits:
            return ModelOutput(None, [], self._aux_losses(), normed, mtp_hidden, self.output_head())
        return ModelOutput(self._head(normed), [self._head(h) for h in mtp_hidden], self._aux_losses(), normed,
                           mtp_hidden, None)

    def output_head(self) -> OutputHead:
        """The head as weight, multiplier and soft-cap, for a loss that fuses the projection in. Only a plain,
        bias-free lm_head is that: one that fake-quantises its weight (qat with quantize_head) is refused."""
        if type(self.lm_head) is not nn.Linear or self.lm_head.bias is not None:
            raise ConfigError(f"loss.fused_head projects with lm_head's weight itself, but lm_head is a "
                              f"{type(self.lm_head).__name__}{' with a bias' if self.lm_head.bias is not None else ''} "
                              "(qat with quantize_head=true makes it one): set qat.quantize_head=false or "
                              "loss.fused_head=false")
        return OutputHead(self.lm_head.weight, self.output_multiplier, self.logit_softcap)

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = input_ids.shape[1]
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds model.max_seq_len={self.max_seq_len}")
        if positions is None:
            positions = torch.arange(seq_len, device=input_ids.device)
        elif positions.dim() == 2:
            self._check_documents(input_ids, positions)
        elif positions.shape != (seq_len,):
            raise ValueError(f"positions {tuple(positions.shape)}: (seq,) for every row, or (batch, seq) for packed "
                             f"documents, with seq = {seq_len}")
        self._route_by("layers.", input_ids)
        x = self.position.embed(self.token_embeddings(input_ids, embeds), positions)
        return self.run_layers(x, positions), positions

    def token_embeddings(self, input_ids: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The embedded tokens (batch, seq, d_model), or `embeds` given in their place (checked against the ids)."""
        if embeds is None:
            return self.embed_tokens(input_ids)
        expected = (*input_ids.shape, self.embed_tokens.embedding_dim)
        if tuple(embeds.shape) != expected:
            raise ValueError(f"embeds {tuple(embeds.shape)} must be (batch, seq, d_model) = {expected}, one per input id")
        return embeds

    def _check_documents(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions {tuple(positions.shape)} must match input_ids {tuple(input_ids.shape)}")
        unsupported = {type(block.self_attn).__name__ for block in self.blocks()
                       if not getattr(block.self_attn, "supports_documents", False)}
        if unsupported:
            raise ValueError(f"packed documents need an attention with a document mask; {', '.join(sorted(unsupported))} "
                             "has none (use unpacked rows)")

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x)
        if self.output_multiplier != 1.0:  # muP; skipped otherwise, as it costs a pass over the logits each way
            logits = logits * self.output_multiplier
        if self.logit_softcap is not None:
            logits = self.logit_softcap * torch.tanh(logits / self.logit_softcap)
        return logits

    def _route_by(self, prefix: str, token_ids: torch.Tensor) -> None:
        """Tell the MoE layers under `prefix` which tokens they see (for routers that hash token ids)."""
        if self._routes_by_token:
            for _, moe in self._moe_layers(prefix):
                moe.token_ids = token_ids

    def _aux_losses(self) -> dict[str, tuple[float, torch.Tensor]]:
        """Each auxiliary loss averaged over the parts that give it (MoE layers, indexers), with its weight."""
        values, weights = defaultdict(list), {}
        for module in self._loss_modules:
            for name, value in module.losses.items():
                values[name].append(value)
                weights[name] = module.loss_weights[name]
        return {name: (weights[name], torch.stack(v).mean()) for name, v in values.items()}

    def moe_stats(self) -> dict[str, torch.Tensor]:
        """Per-layer expert load, dropped-token fraction and router entropy of the last forward,
        and the dropped fraction and entropy averaged over layers."""
        stats, per_name = {}, defaultdict(list)
        for layer, moe in self._moe_layers():
            for name, value in moe.stats().items():
                stats[f"moe/{layer}/{name}"] = value
                if "/" not in name:
                    per_name[name].append(value)
        stats.update({f"moe/{name}": torch.stack(v).mean() for name, v in per_name.items()})
        return stats
