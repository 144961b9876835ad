"""Decode steps of plain Llama stacks with each RMSNorm folded into the kernels around it: no norm launches.

A pre-norm layer computes `h + attn(norm(h))`, then `h + ffn(norm(h))`. At batch 32 the engine's compiled step
spends two of its ~9 kernels a layer on the residual add and RMSNorm, kernels that move 64 KB each and cost
their launch; taking them out (and the adds) would save ~100 of the step's ~1,080 us on an H200
(experiments/inference/probe_without_norms.py). RMSNorm is `s * (h * g)` with s = 1 / sqrt(mean(h^2) + eps)
one scalar per token, so:
- the gain g folds into the next matmul's weight (`W * g` over its input features, a copy made at each
  `Engine.begin`, so weights changed since are picked up);
- the matmul runs on h itself and the scale s moves past it: the attention kernel scales this step's q, k and v
  by it (it reads the token's row of h), and the SwiGLU kernel scales gate and up (`swiglu_rms`);
- the residual adds become the beta of cuBLAS's in-place `addmm_` for o_proj and down_proj (run eagerly inside a
  compiled step: traced, `addmm` copies its residual into a new output first, 48 copies and ~50 us a step).
A layer is then q/k/v, attention, o_proj, gate/up, the activation and down_proj. Roundings move (the folded
weight is rounded once to the model's dtype; s is applied after the matmul's rounding instead of before), so in
bf16 logits differ from the unfolded step's in their last bits; in float32 they agree to ~1e-6.

`FoldedNorms.unsupported(model)` is the megakernel's: pre-norm RMSNorm blocks, RoPE, softmax attention without
windows or QK-norm, SwiGLU, no MoE. Steps of up to MAX_QUERY_ROWS query rows per kv head (decode, speculative
verification) take this path; prompts take the layer-by-layer one. Imports Triton (the engine imports this
module only when asked for it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange

from lmlab.errors import ConfigError
from lmlab.inference.cache import CacheState, KVCache, kernel_rotary
from lmlab.inference.megakernel import Megakernel
from lmlab.kernels.decode_attention_triton import MAX_QUERY_ROWS
from lmlab.kernels.swiglu_triton import swiglu_rms
from lmlab.nn.transformer import Transformer


class FoldedNorms:
    """A plain Llama stack's q/k/v and gate/up weights with their RMSNorm gains folded in; see the module docstring."""

    def __init__(self, model: Transformer, min_batch: int = 1,
                 add_product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        """model: with its q/k/v and gate/up fused (lmlab.nn.fused.fuse_projections, as the engine does); the
        folded copies of those weights cost their memory again. min_batch: smaller batches take the layer-by-layer
        step. add_product(h, x, weight): h += x @ weight.T in place, for o_proj and down_proj (default cuBLAS's
        `addmm_`; the batch-invariant engine passes its own kernel)."""
        if problem := self.unsupported(model):
            raise ConfigError(f"folded_norms=True cannot run this model: {problem}")
        self.model, self.min_batch = model, min_batch
        self.add_product = add_product or _addmm
        self.folded: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: (q/k/v, gate/up)
        attn = model.layers[0].self_attn
        self.sizes = [attn.n_heads * attn.head_dim, *[attn.n_kv_heads * attn.head_dim] * 2]
        self.group = attn.n_heads // attn.n_kv_heads

    @staticmethod
    def unsupported(model: Transformer) -> str | None:
        """Why this model's norms cannot be folded (the megakernel's limits, or quantized projections), or None."""
        if problem := Megakernel.unsupported(model):
            return problem
        return next((problem for i, block in enumerate(model.layers) if (problem := _unfused(i, block))), None)

    def takes(self, batch: int, tokens: int) -> bool:
        """Whether a step of `batch` sequences of `tokens` each takes this path: batches of min_batch or more whose
        query rows fit the attention kernel (prompts take the layer-by-layer path)."""
        return batch >= self.min_batch and tokens * self.group <= MAX_QUERY_ROWS

    def refresh(self) -> None:
        """Fold the current gains into copies of the current weights (in place once made: captured graphs keep
        their pointers). Needs the engine's fused q/k/v and gate/up groups (plain Linears: not quantized)."""
        with torch.inference_mode(False), torch.no_grad():
            for i, block in enumerate(self.model.layers):
                if problem := _unfused(i, block):
                    raise ConfigError(f"folded norms: {problem}; make the Engine after changing the model, or "
                                      "with folded_norms=False")
                pairs = ((block.self_attn, block.input_layernorm), (block.mlp, block.post_attention_layernorm))
                groups = [module.__dict__["fused_projections"] for module, _ in pairs]
                if len(self.folded) <= i:
                    self.folded.append(tuple(torch.empty_like(group.weight) for group in groups))
                for out, group, (_, norm) in zip(self.folded[i], groups, pairs):
                    torch.mul(group.weight, norm.weight.to(group.weight.dtype), out=out)

    @staticmethod
    def check(caches: list) -> None:
        """The engine's caches, when it makes them: the step reads and writes each layer's full-length KV cache."""
        if not all(type(cache) is KVCache for cache in caches):
            raise ConfigError("folded_norms=True needs a full-length KV cache per layer")

    @torch.compiler.disable  # eager inside a compiled step: functionalised, each addmm_ would copy its residual first
    def step(self, x: torch.Tensor, state: CacheState, caches: list) -> torch.Tensor:
        """x (batch, S, d_model), embedded tokens at slots state.slots -> the last layer's output, same shape."""
        batch, s, width = x.shape
        rotary = kernel_rotary(self.model.position)
        h = x.reshape(batch * s, width).clone()  # the residual stream, updated in place
        for block, cache, (qkv_weight, gate_up_weight) in zip(self.model.layers, caches, self.folded):
            attn, mlp = block.self_attn, block.mlp
            q, k, v = (rearrange(t, "(b s) (h d) -> b h s d", b=batch, d=attn.head_dim)
                       for t in F.linear(h, qkv_weight).split(self.sizes, dim=-1))
            out = state.attention_kernel(q, cache.tensors["k"], cache.tensors["v"], state.slots, state.start,
                                         attn.score_scale, attn.window, new_keys=k, new_values=v, rotary=rotary,
                                         norm=(h.view(batch, s, width), block.input_layernorm.eps))
            self.add_product(h, rearrange(out, "b h s d -> (b s) (h d)"), attn.o_proj.weight)
            self.add_product(h, swiglu_rms(F.linear(h, gate_up_weight), h, block.post_attention_layernorm.eps),
                             mlp.down_proj.weight)
        return h.view(batch, s, width)


def _addmm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return h.addmm_(x, weight.t())


def _unfused(i: int, block) -> str | None:
    """Why a block's q/k/v or gate/up are not one fused plain matmul each (quantized, say), or None."""
    if any(module.__dict__.get("fused_projections") is None for module in (block.self_attn, block.mlp)):
        return f"layer {i}'s projections are not plain Linears (quantized?)"
    return None
