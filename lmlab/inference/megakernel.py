"""The engine's decode step as one kernel launch for plain Llama stacks (lmlab.kernels.decode_layers).

`Megakernel.unsupported(model)` says why a model cannot take it (None: it can): pre-norm blocks with RMSNorm, softmax
attention without windows, soft-capping, QK-norm or shared KV, RoPE, SwiGLU, no MoE, no looped depth; its projections
all plain Linears, all int8 (`quantize(model, "int8")`: the kernel reads the codes and their row scales, half the
bytes), or all int4 in the layout of int4's `dequant` kernel (`quant.kernel=dequant`: two codes a byte and a scale
and zero per group; batch 1 only). `Megakernel(model)` stacks the layers' weights (codes and scales where quantized),
one tensor per kind, and makes every layer's parameters views of their slices (as `lmlab.nn.fused` does within a
layer), so no weight is held twice and training, loading or quantizing the model still changes what the kernel reads;
a parameter replaced since (a device move, quantization) is noticed and the stack rebuilt or refused. `bind(caches)`
stacks the engine's KV caches the same way, and `step(x, state)` runs one token per sequence through every layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.inference.cache import CacheState, KVCache
from lmlab.inference.quant.linear import Int4Linear, Int8Linear
from lmlab.nn.attention import MultiHeadAttention
from lmlab.nn.blocks import PreNormBlock
from lmlab.nn.ffn import SwiGLU
from lmlab.nn.fused import are_views, make_views
from lmlab.nn.norms import RMSNorm
from lmlab.nn.positions import RoPE
from lmlab.nn.transformer import Transformer


QUANT_KERNEL = "dequant"  # the quant kernel whose stored layout of codes and scales the megakernel reads
SUPPORTED_HEAD_DIMS = (32, 64, 128)  # the head sizes the kernel's attention tiles take
MAX_GROUP = 64  # query heads per kv head it takes


@dataclass
class StackedWeights:
    """A layer stack's weights, one tensor per kind with the layer first (what the kernel reads)."""

    qkv: torch.Tensor  # (layers, (heads + 2 kv_heads) * head_dim, d_model): q rows, then k, then v
    o: torch.Tensor  # (layers, d_model, heads * head_dim)
    gate_up: torch.Tensor  # (layers, 2 d_ff, d_model): gate rows, then up
    down: torch.Tensor  # (layers, d_model, d_ff)
    norm_attn: torch.Tensor  # (layers, d_model): the RMSNorm gain before attention
    norm_ffn: torch.Tensor  # (layers, d_model): before the FFN
    n_heads: int
    n_kv_heads: int
    rope_interleaved: bool  # RoPE pairs features (2i, 2i + 1); else (i, i + head_dim / 2)
    # Quantized weights' scales, per layer, in the weights' order (q, k, v, o, gate, up, down; None: not quantized):
    # int8, each row's; int4, each projection's (groups, rows, 2) scales and zeros, as Int4Linear keeps them
    scales: torch.Tensor | None = None
    group_size: int = 0  # int4: input columns per scale and zero (the weights hold two codes a byte); else 0

    @property
    def head_dim(self) -> int:
        return self.o.shape[2] * (2 if self.group_size else 1) // self.n_heads

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (the norms' gains are never quantized)."""
        return self.norm_attn.dtype


class Megakernel:
    """A plain Llama stack's weights stacked for `decode_layers`; see the module docstring."""

    MAX_BATCH = 64  # the kernel holds the batch in one tile; larger batches take the layer-by-layer step

    @staticmethod
    def unsupported(model: Transformer) -> str | None:
        if model.loops != 1:
            return "looped depth (model.loops > 1)"
        if not isinstance(model.position, RoPE):
            return f"position {type(model.position).__name__} (the kernel rotates with RoPE)"
        linears = [linear for block in model.layers for linear in _projections(block)]
        kinds = {type(linear) for linear in linears}
        if len(kinds) > 1 or kinds - {nn.Linear, Int8Linear, Int4Linear}:
            names = " and ".join(sorted(kind.__name__ for kind in kinds))
            return f"projections of {names} (the kernel reads plain Linears, int8 or int4 ones, all the same)"
        if kinds == {Int4Linear}:
            if any(linear.kernel != QUANT_KERNEL for linear in linears):
                return (f"int4 projections packed for another kernel than {QUANT_KERNEL} (the kernel reads two codes a "
                        f"byte, as quant.kernel={QUANT_KERNEL} stores them)")
            if len({linear.group_size for linear in linears}) > 1:
                return "int4 projections of several group sizes"
        for i, block in enumerate(model.layers):
            attn, mlp = block.self_attn, block.mlp
            reasons = {
                "a block layout other than prenorm": type(block) is not PreNormBlock,
                "norms other than rmsnorm": not all(type(getattr(block, n)) is RMSNorm for n in block.norm_names),
                "attention other than mha/gqa/mqa": type(attn) is not MultiHeadAttention,
                "an FFN other than swiglu (an MoE layer, a bias)": type(mlp) is not SwiGLU
                or any(getattr(mlp, n).bias is not None for n in mlp.projections),
            }
            if type(attn) is MultiHeadAttention:
                reasons.update({
                    "a sliding window": attn.window is not None,
                    "soft-capped scores": attn.softcap is not None,
                    "QK-norm": not isinstance(attn.q_norm, nn.Identity),
                    "shared keys and values (CLA)": attn.kv_source is not None or attn.shares_kv,
                    "biased projections": any(getattr(attn, n).bias is not None
                                              for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                    f"head_dim {attn.head_dim} (the kernel takes {', '.join(map(str, SUPPORTED_HEAD_DIMS))})":
                        attn.head_dim not in SUPPORTED_HEAD_DIMS,
                    f"{attn.n_heads // attn.n_kv_heads} query heads a kv head (the kernel takes {MAX_GROUP} at most)":
                        attn.n_heads // attn.n_kv_heads > MAX_GROUP,
                })
            found = [what for what, present in reasons.items() if present]
            if found:
                return f"layer {i} has {' and '.join(found)}"
        return None

    def __init__(self, model: Transformer):
        if problem := self.unsupported(model):
            raise ConfigError(f"megakernel=True: the decode megakernel cannot run this model: {problem}")
        self.model = model
        self.weights = self._stack()
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # One launch with grid barriers; else launches per layer and stage (decode_layers' STAGE_* settings), which
        # the interpreter needs, as it runs programs in turn
        self.persistent = os.environ.get("TRITON_INTERPRET") != "1"

    @property
    def max_batch(self) -> int:
        """Sequences a step may hold to take the kernel: int4 weights run at batch 1 (the matrix-vector path)."""
        return 1 if self.weights.group_size else self.MAX_BATCH

    def _groups(self) -> dict[str, list[list[torch.Tensor]]]:
        """Per kind, each layer's parameters (quantized: codes) in the order they are stacked, and their scales."""
        layers = self.model.layers
        groups = {
            "qkv": [[b.self_attn.q_proj.weight, b.self_attn.k_proj.weight, b.self_attn.v_proj.weight] for b in layers],
            "o": [[b.self_attn.o_proj.weight] for b in layers],
            "gate_up": [[b.mlp.gate_proj.weight, b.mlp.up_proj.weight] for b in layers],
            "down": [[b.mlp.down_proj.weight] for b in layers],
            "norm_attn": [[b.input_layernorm.weight] for b in layers],
            "norm_ffn": [[b.post_attention_layernorm.weight] for b in layers],
        }
        kind = type(layers[0].self_attn.q_proj)
        if kind is Int8Linear:
            groups["scales"] = [[linear.scales for linear in _projections(b)] for b in layers]
        if kind is Int4Linear:
            groups["scales"] = [[linear.scales_and_zeros for linear in _projections(b)] for b in layers]
        return groups

    def _stack(self) -> StackedWeights:
        first = self.model.layers[0]
        attn = first.self_attn
        stacked = {}
        with torch.inference_mode(False), torch.no_grad():
            for kind, per_layer in self._groups().items():
                flat = [p for params in per_layer for p in params]
                tensor = torch.cat([p.detach().reshape(-1) for p in flat]).view(len(per_layer), -1)
                if kind != "scales":  # (layers, rows, columns); the scales stay flat per layer
                    tensor = tensor.view(len(per_layer), sum(p.shape[0] for p in per_layer[0]), -1).squeeze(-1)
                make_views(flat, tensor)
                stacked[kind] = tensor
        # The engine's fused q/k/v and gate/up groups become views of the stack too, so they stay current.
        for block, qkv, gate_up in zip(self.model.layers, stacked["qkv"], stacked["gate_up"]):
            for module, rows in ((block.self_attn, qkv), (block.mlp, gate_up)):
                group = module.__dict__.get("fused_projections")
                if group is not None:
                    group.weight = rows
        q_proj = attn.q_proj
        return StackedWeights(**stacked, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
                              rope_interleaved=self.model.position.layout == "interleaved",
                              group_size=q_proj.group_size if type(q_proj) is Int4Linear else 0)

    def current(self) -> bool:
        """Every parameter is still a view of the stack (nothing replaced or moved since)."""
        return all(are_views([p for params in per_layer for p in params], getattr(self.weights, kind))
                   for kind, per_layer in self._groups().items())

    def refresh(self) -> None:
        """Stack again where a parameter was replaced or moved (e.g. `model.to(device)`)."""
        if not self.current():
            if problem := self.unsupported(self.model):
                raise ConfigError(f"megakernel=True: the decode megakernel cannot run this model any more: {problem}")
            self.weights = self._stack()

    def bind(self, caches: list) -> None:
        """Stack the engine's per-layer KV caches (their tensors become views of the stack)."""
        if not all(type(c) is KVCache for c in caches):
            raise ValueError("the decode megakernel needs a full-length KV cache per layer")
        for name in ("k", "v"):
            stacked = torch.stack([c.tensors[name] for c in caches])
            for i, cache in enumerate(caches):
                cache.tensors[name] = stacked[i]
            setattr(self, f"{name}_cache", stacked)

    def step(self, x: torch.Tensor, state: CacheState) -> torch.Tensor:
        """x (batch, 1, d_model), embedded tokens at slot state.slots[0] -> the last layer's output, same shape."""
        from lmlab.kernels.decode_layers import decode_layers

        block = self.model.layers[0]
        rope = self.model.position
        residual = x[:, 0].to(torch.float32, copy=True)  # compiled: written so by the embedding's own kernel
        out = decode_layers(residual, self.weights, self.k_cache, self.v_cache, state.slots, state.start,
                            rope.cos, rope.sin, block.input_layernorm.eps, block.self_attn.score_scale,
                            persistent=self.persistent)
        return out[:, None]


def _projections(block: PreNormBlock) -> list[nn.Module]:
    """A block's Linears in the order their weights are stacked (q, k, v, o, gate, up, down); an attention or FFN of
    another kind (which `Megakernel.unsupported` names) contributes what it has of them."""
    return [getattr(module, name) for module, names in ((block.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                                        (block.mlp, ("gate_proj", "up_proj", "down_proj")))
            for name in names if hasattr(module, name)]
