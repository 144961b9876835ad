"""Kernels: plain-PyTorch references and their Triton counterparts.

The references run anywhere PyTorch does, CPU included, and are what the Triton kernels are
tested against (forward and backward parity). The Triton kernels are imported on first use, so
`import lmlab.kernels` works without Triton:

    from lmlab.kernels import FlashAttentionReference, FlashAttentionTriton
    out = FlashAttentionTriton.apply(q, k, v, True)   # (batch, heads, seq, head_dim), causal

`lmlab.kernels.registry` (config group `kernels`) puts them into a model.
"""

import importlib

from lmlab.kernels.chunked_cross_entropy import chunked_cross_entropy
from lmlab.kernels.flash_reference import FlashAttentionReference, flash_attention_reference

# Triton kernels by name -> the module that defines them.
_TRITON = {
    "FlashAttentionTriton": "flash_triton", "flash_attention_triton": "flash_triton",
    "FusedRMSNorm": "rmsnorm_triton", "rms_norm_triton": "rmsnorm_triton",
    "FusedAddRMSNorm": "rmsnorm_triton", "add_rms_norm_triton": "rmsnorm_triton",
    "FusedSwiGLU": "swiglu_triton", "swiglu_triton": "swiglu_triton",
    "FusedCrossEntropy": "cross_entropy_triton", "cross_entropy_triton": "cross_entropy_triton",
    "decode_attention": "decode_attention_triton",
}

__all__ = ["FlashAttentionReference", "chunked_cross_entropy", "flash_attention_reference", *_TRITON]


def __getattr__(name: str):
    if name not in _TRITON:
        raise AttributeError(f"module 'lmlab.kernels' has no attribute '{name}'")
    try:
        module = importlib.import_module(f"lmlab.kernels.{_TRITON[name]}")
    except ModuleNotFoundError as err:
        if err.name != "triton":
            raise
        raise ImportError(f"lmlab.kernels.{name} needs Triton (pip install triton)") from None
    return getattr(module, name)
