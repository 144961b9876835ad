"""Residual block layouts (config group `model/block`).

A layout decides where the norms sit around the two sub-layers, attention (`self_attn`) and
FFN (`mlp`); the sub-layers themselves come from their own registries. Each layout lists its
norms by name in `norm_names`, and the shared base class builds them.

Norm names follow Hugging Face Llama where the position matches: `input_layernorm` feeds
attention and `post_attention_layernorm` feeds the FFN. Norms Llama has no slot for get
names that say what they normalise.
"""

from __future__ import annotations

import torch
from torch import nn

from lmlab.nn.attention import ATTENTION
from lmlab.nn.hybrid import layer_attention
from lmlab.nn.moe.layer import build_mlp
from lmlab.nn.norms import NORMS, add_and_norm
from lmlab.nn.positions import PositionEncoding
from lmlab.registry import Registry

BLOCKS = Registry("block", group="model/block", doc="residual block layouts")


class Block(nn.Module):
    """Shared construction of a block: `self_attn`, `mlp` and one norm per name in `norm_names`.

    Subclasses define `forward(x, position, positions, cache=None)` and run attention through
    `attend`, which hands it to the layer's KV cache during generation (lmlab.inference).
    `final_norm` says whether the model should normalise the last block's output (a layout that
    already ends in a norm says no).
    """

    norm_names: tuple[str, ...] = ()
    final_norm: bool = True

    def __init__(self, model_cfg, cfg=None, layer_idx: int = 0):
        super().__init__()
        d = model_cfg.d_model
        # Attention, FFN, then norms: the Hugging Face Llama order of a layer's parameters.
        self.self_attn = ATTENTION.build(layer_attention(model_cfg, layer_idx), d, layer_idx=layer_idx)
        self.mlp = build_mlp(model_cfg, layer_idx)  # an FFN, or an MoE layer where model.moe says
        for name in self.norm_names:
            setattr(self, name, NORMS.build(model_cfg.norm, d))

    def attend(self, h: torch.Tensor, position: PositionEncoding, positions: torch.Tensor, cache=None) -> torch.Tensor:
        """Self-attention of h; with a cache (generation), the cache runs it over the cached keys too."""
        if cache is None:
            return self.self_attn(h, position, positions)
        return cache(self.self_attn, h, position, positions)


@BLOCKS.register("prenorm")
class PreNormBlock(Block):
    """x + attn(norm(x)), then x + ffn(norm(x)): the GPT-2/Llama layout."""

    norm_names = ("input_layernorm", "post_attention_layernorm")

    def forward(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor, cache=None) -> torch.Tensor:
        x, h = add_and_norm(self.post_attention_layernorm, x,
                            self.attend(self.input_layernorm(x), position, positions, cache))
        return x + self.mlp(h)


@BLOCKS.register("postnorm")
class PostNormBlock(Block):
    """norm(x + attn(x)), then norm(x + ffn(x)): the original Transformer (and BERT) layout."""

    # The residual stream itself is normalised, so nothing un-normalised reaches the next
    # layer; this is what makes deep post-norm stacks need warm-up (Xiong et al., 2020).
    norm_names = ("post_attention_layernorm", "post_mlp_layernorm")
    final_norm = False  # the last block's output is normalised already

    def forward(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor, cache=None) -> torch.Tensor:
        x = self.post_attention_layernorm(x + self.attend(x, position, positions, cache))
        return self.post_mlp_layernorm(x + self.mlp(x))


@BLOCKS.register("sandwich")
class SandwichBlock(Block):
    """x + norm(attn(norm(x))), then x + norm(ffn(norm(x))): peri-norm, four norms per block."""

    # The extra norms bound what each sub-layer adds to the residual stream. Gemma 2 has this
    # layout; its names for our post_attention_layernorm, attn_output_layernorm and
    # mlp_output_layernorm are pre_feedforward_layernorm, post_attention_layernorm and
    # post_feedforward_layernorm (note the clash on post_attention_layernorm).
    norm_names = ("input_layernorm", "attn_output_layernorm", "post_attention_layernorm", "mlp_output_layernorm")

    def forward(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.attn_output_layernorm(self.attend(self.input_layernorm(x), position, positions, cache))
        return x + self.mlp_output_layernorm(self.mlp(self.post_attention_layernorm(x)))


@BLOCKS.register("parallel")
class ParallelBlock(Block):
    """x + attn(norm(x)) + ffn(norm(x)) from one shared norm: the GPT-J/PaLM layout."""

    # Attention and FFN read the same input, so their input matmuls can be fused and run
    # together; PaLM reports ~15% faster training at large scale for a small quality cost.
    norm_names = ("input_layernorm",)

    def forward(self, x: torch.Tensor, position: PositionEncoding, positions: torch.Tensor, cache=None) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.attend(h, position, positions, cache) + self.mlp(h)
