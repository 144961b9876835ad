"""Batch-invariant decoding: a token's logits do not depend on the shape of the step that computes them.

`Engine(model, batch_invariant=True)` computes a token at slot p to the same bits in every case: a one-token
step, a (k+1)-token speculative verification, or a batch of any size. So greedy speculative decoding gives
exactly the target's own greedy tokens in bf16 too, and a prompt gives the same tokens alone or in a batch.

Ordinary kernels do not, because each picks its reduction order from the problem's shape:
- cuBLAS picks the algorithm, tiles and split-K of a matmul by its row count;
- ATen's reductions (the RMSNorm's mean) pick theirs by the number of rows;
- the flash-decoding kernel splits the key range by how many programs the batch fills, and attends the step's
  own keys after the cached ones.
A bf16 logit is then rounded one way in a one-token step and another way in a five-token step, and a greedy
choice flips wherever two logits tie. On an H200 that parted 7 of 8 speculative outputs from the target's
(experiments/inference/README.md).

Here, while a forward runs:
- every `F.linear` goes through `lmlab.kernels.invariant_matmul_triton` (a row's reduction order depends only
  on the weight's shape);
- reference RMSNorms run the Triton row kernels (`rms_norm_triton`: one program per row, the reference's exact
  formula; a pre-norm block's residual add fused in front, `add_rms_norm_triton`), and SwiGLU's activation runs
  `swiglu_triton` (one launch instead of two: a step of eager launches pays for each);
- attention runs the decode kernel with fixed splits of `SPLIT_KEYS` slots (`decode_attention(...,
  split_keys=)`);
- in plain Llama stacks, decode steps fold the norms (lmlab.inference.folded_norms, every step of the megakernel's
  row limit, batch 1 included), with o_proj and down_proj adding into the residual stream through
  `invariant_add_product`: six launches a layer instead of eleven.
Elementwise work (RoPE on prompts, residual adds, activations) is the same per element at any shape. The
steps run eagerly, replayed from CUDA graphs: torch.compile would choose fused kernels per shape again.
Prompts run in chunks of the decode steps' size (`chunk`: the attention kernel's query rows per kv head), through
the same kernels, so a prompt's token is computed as a decode step would compute it, whatever the chunking.

Covers dense stacks whose attention layers keep a full KV cache (`KVCache`) and take the decode kernel:
softmax attention with RoPE or no rotation, no soft-capping or position bias. MoE routing, recurrent states
and sliding-window rings are refused. CUDA (or Triton's interpreter, TRITON_INTERPRET=1) only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lmlab.errors import ConfigError
from lmlab.inference.cache import KVCache, LayerCache, kernel_rotary, plain_softmax
from lmlab.nn.ffn import SwiGLU, swiglu
from lmlab.nn.moe import MoELayer
from lmlab.nn.norms import RMSNorm, rms_norm
from lmlab.nn.transformer import Transformer

SPLIT_KEYS = 64  # attention's fixed split: 2 blocks of the decode kernel's 32 keys


class _InvariantLinear(TorchFunctionMode):
    """Sends F.linear to the batch-invariant matmul where it can run (the rest passes through)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            from lmlab.kernels.invariant_matmul_triton import invariant_linear, unsupported

            call = dict(zip(("input", "weight", "bias"), args), **kwargs)
            x, weight, bias = call["input"], call["weight"], call.get("bias")
            if unsupported(x, weight, bias) is None:
                return invariant_linear(x, weight, bias)
        return func(*args, **kwargs)


class BatchInvariant:
    """The numerics of a batch-invariant engine for one model; see the module docstring."""

    def __init__(self, model: Transformer, attention_kernel: Callable | None):
        if problem := self.unsupported(model):
            raise ConfigError(f"batch_invariant=True cannot run this model: {problem}")
        if attention_kernel is None:
            raise ConfigError("batch_invariant=True needs the Triton decode-attention kernel: a CUDA device with "
                              "Triton (or TRITON_INTERPRET=1, Triton's CPU interpreter)")
        from lmlab.kernels.decode_attention_triton import MAX_QUERY_ROWS, SUPPORTED_HEAD_DIMS  # here: Triton is optional
        from lmlab.kernels.rmsnorm_triton import add_rms_norm_triton, rms_norm_triton
        from lmlab.kernels.swiglu_triton import swiglu_triton

        if bad := sorted({block.self_attn.head_dim for block in model.layers} - set(SUPPORTED_HEAD_DIMS)):
            raise ConfigError(f"batch_invariant=True: head_dim {bad[0]}; the decode-attention kernel takes "
                              f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
        self.attention_kernel = functools.partial(attention_kernel, split_keys=SPLIT_KEYS)
        group = max(block.self_attn.n_heads // block.self_attn.n_kv_heads for block in model.layers)
        self.chunk = MAX_QUERY_ROWS // group  # a prompt's tokens per forward: the decode kernel's rows
        # (class, attribute, the reference it replaces, the row kernel) for the modules' swappable kernels
        table = [(RMSNorm, "kernel", rms_norm, rms_norm_triton), (RMSNorm, "add_kernel", None, add_rms_norm_triton),
                 (SwiGLU, "kernel", swiglu, swiglu_triton)]
        self.swaps = [(module, attr, reference, kernel) for module in model.modules()
                      for cls, attr, reference, kernel in table if isinstance(module, cls)]

    @staticmethod
    def unsupported(model: Transformer) -> str | None:
        """Why this model's steps cannot be made batch-invariant here, or None."""
        for i, block in enumerate(model.layers):
            if any(isinstance(m, MoELayer) for m in block.modules()):
                return f"layer {i} routes tokens to experts (MoE), whose grouped matmuls are not covered"
            attn = block.self_attn
            if not hasattr(attn, "unrotated"):
                return f"layer {i}'s {type(attn).__name__} does not attend through the decode kernel"
            if not plain_softmax(attn, model.position) or kernel_rotary(model.position) is False:
                return (f"layer {i}'s attention (soft-capping, a position bias or a {type(model.position).__name__} "
                        "rotation) does not run in the decode kernel")
        return None

    def folded_norms(self, model: Transformer):
        """The decode steps' folded-norm path with invariant residual products, for models it runs (else None:
        the layer-by-layer step under `active`). After the engine fused the projections."""
        from lmlab.inference.folded_norms import FoldedNorms
        from lmlab.kernels.invariant_matmul_triton import invariant_add_product

        return None if FoldedNorms.unsupported(model) else FoldedNorms(model, add_product=invariant_add_product)

    @staticmethod
    def check(caches: list[LayerCache]) -> None:
        """Every layer keeps a full KV cache (a sliding-window ring attends through SDPA)."""
        for i, cache in enumerate(caches):
            if type(cache) is not KVCache:
                raise ConfigError(f"batch_invariant=True: layer {i} keeps a {type(cache).__name__}, not a full KV "
                                  "cache; generate with a max_len within its window, or without batch_invariant")

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within: F.linear, the reference RMSNorms and SwiGLU activations run their batch-invariant kernels."""
        swapped = [swap for swap in self.swaps if getattr(swap[0], swap[1]) is swap[2]]
        for module, attr, _, kernel in swapped:
            setattr(module, attr, kernel)
        try:
            with _InvariantLinear():
                yield
        finally:
            for module, attr, reference, _ in swapped:
                setattr(module, attr, reference)
