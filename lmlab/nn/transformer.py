"""The decoder-only Transformer, assembled from the model registries.

Parameter names follow the Hugging Face Llama layout (`embed_tokens`, `layers.N.self_attn.q_proj`,
`layers.N.mlp.gate_proj`, `norm`, `lm_head`), so weights move to and from that ecosystem by a
thin adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import MISSING
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION
from lmlab.nn.blocks import BLOCKS
from lmlab.nn.init import INITS
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


def padded_vocab_size(n: int, multiple: int = 64) -> int:
    return multiple * math.ceil(n / multiple)


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        if cfg.vocab_size is not None and cfg.vocab_size < vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's {vocab_size}")
        self.vocab_size = cfg.vocab_size or padded_vocab_size(vocab_size)
        self.max_seq_len = cfg.max_seq_len
        attn_entry, attn_cfg = ATTENTION.resolve(cfg.attention)
        head_dim, n_heads = attn_entry.target.shape_for(cfg.d_model, attn_cfg)

        self.embed_tokens = nn.Embedding(self.vocab_size, cfg.d_model)
        self.position = POSITIONS.build(cfg.position, cfg.max_seq_len, cfg.d_model, head_dim, n_heads)
        self.layers = nn.ModuleList(BLOCKS.build(cfg.block, cfg, layer_idx=i) for i in range(cfg.n_layers))
        for layer in self.layers:  # attention that cannot use this position scheme says so now
            if hasattr(layer.self_attn, "check_position"):
                layer.self_attn.check_position(self.position)
        self.norm = NORMS.build(cfg.norm, cfg.d_model) if self.layers[0].final_norm else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, self.vocab_size, bias=False)
        self.logit_softcap = cfg.logit_softcap
        self.output_multiplier = 1.0  # muP sets 1/width_mult
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Learning-rate multipliers by parameter name (muP); the optimizer makes groups of them.
        self.lr_multipliers: dict[str, float] = INITS.build(cfg.init).apply(self)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            params.pop(id(self.embed_tokens.weight), None)
        return sum(p.numel() for p in params.values())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per matmul weight (forward + backward), plus each attention
        layer's score and value products (see `score_flops_per_token`). Embedding lookups, norms
        and activations are not counted (the PaLM appendix's convention)."""
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_params + sum(layer.self_attn.score_flops_per_token(seq_len) for layer in self.layers)

    def kv_cache_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes of keys and values cached per generated token, over all layers (bf16 by default)."""
        return bytes_per_element * sum(layer.self_attn.kv_cache_elements_per_token() for layer in self.layers)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds model.max_seq_len={self.max_seq_len}")
        positions = torch.arange(seq_len, device=input_ids.device)
        x = self.position.embed(self.embed_tokens(input_ids), positions)
        for layer in self.layers:
            x = layer(x, self.position, positions)
        logits = self.lm_head(self.norm(x)) * self.output_multiplier
        if self.logit_softcap is not None:
            logits = self.logit_softcap * torch.tanh(logits / self.logit_softcap)
        return logits
