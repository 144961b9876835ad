"""The `kernels` config group: which implementation runs the model's hot operations.

A kernel is an alternative implementation of a reference operation with the same signature.
The model is always built with the plain-PyTorch references; an entry here returns a
`KernelOps` of replacements, and `install_kernels` hands it to every module that owns a hot
operation (`use_kernels(ops)`: RMSNorm, SwiGLU, causal attention, cross-entropy, and the Adam
optimizers' update), which takes what it can use and may say why it keeps its reference (a
sliding window, ALiBi, ...).

    lmlab-train kernels=triton                      # all four Triton kernels
    lmlab-train kernels=triton kernels.attention=false

On a machine without CUDA (or without Triton) `kernels=triton` falls back to the references
with one warning, or fails before anything runs if `kernels.strict=true`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.registry import Registry

log = logging.getLogger(__name__)

KERNELS = Registry("kernels", group="kernels", doc="implementations of the model's hot operations")


@dataclass(frozen=True)
class KernelOps:
    """Replacements for the reference operations; None keeps the module's reference."""

    rms_norm: Callable | None = None  # (x, weight, eps) -> y
    add_rms_norm: Callable | None = None  # (x, residual, weight, eps) -> (x + residual, y): pre-norm blocks
    attention: Callable | None = None  # (q, k, v, causal, scale) -> out, (batch, heads, seq, head_dim)
    attention_head_dims: tuple[int, ...] = ()  # head dims `attention` supports
    swiglu: Callable | None = None  # (gate, up) -> silu(gate) * up
    cross_entropy: Callable | None = None  # (logits, targets, ignore_index, label_smoothing, z_loss) -> (ce, z)
    # in-place Adam step of a parameter group: (params, grads, ms, vs, steps, lr, betas, eps, weight_decay, decoupled)
    adam: Callable | None = None


@KERNELS.register("reference")
def reference_kernels(cfg) -> KernelOps:
    """Plain PyTorch for every operation (the default; runs anywhere)."""
    return KernelOps()


@dataclass
class TritonKernelsConfig:
    rms_norm: bool = True  # fused RMSNorm: one pass forward, dx and a two-stage weight gradient backward
    add_rms_norm: bool = True  # a pre-norm block's residual add fused into the RMSNorm after it
    attention: bool = True  # FlashAttention-2 (causal layers without window, softcap, dropout or ALiBi)
    swiglu: bool = True  # silu(gate) * up in one pass each way
    cross_entropy: bool = True  # never materialises float32 logits or probabilities
    adam: bool = True  # Adam/AdamW update in one launch per parameter group (also Muon's AdamW part)
    strict: bool = False  # without CUDA or Triton: fail instead of falling back to the references


@KERNELS.register("triton", config=TritonKernelsConfig)
def triton_kernels(cfg: TritonKernelsConfig) -> KernelOps:
    """Triton kernels for RMSNorm (and add + RMSNorm), attention, SwiGLU, cross-entropy and Adam (CUDA; else the references)."""
    missing = triton_unavailable()
    if missing:
        if cfg.strict:
            raise ConfigError(f"kernels=triton with kernels.strict=true, but {missing}")
        _warn_fallback(missing)
        return KernelOps()
    # Imported here: Triton modules need Triton, which a CPU-only install may lack.
    from lmlab.kernels.adam_triton import adam_update_triton
    from lmlab.kernels.cross_entropy_triton import cross_entropy_triton
    from lmlab.kernels.flash_triton import SUPPORTED_HEAD_DIMS, flash_attention_triton
    from lmlab.kernels.rmsnorm_triton import add_rms_norm_triton, rms_norm_triton
    from lmlab.kernels.swiglu_triton import swiglu_triton

    return KernelOps(
        rms_norm=rms_norm_triton if cfg.rms_norm else None,
        add_rms_norm=add_rms_norm_triton if cfg.add_rms_norm else None,
        attention=flash_attention_triton if cfg.attention else None,
        attention_head_dims=SUPPORTED_HEAD_DIMS,
        swiglu=swiglu_triton if cfg.swiglu else None,
        cross_entropy=cross_entropy_triton if cfg.cross_entropy else None,
        adam=adam_update_triton if cfg.adam else None,
    )


def triton_unavailable() -> str | None:
    """Why Triton kernels cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "this machine has no CUDA GPU"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    return None


def optional_triton_kernel(device: torch.device, wanted: bool | None, module: str, name: str,
                           option: str = "attention_kernel") -> Callable | None:
    """The Triton kernel `module.name` where it can run, or None (the caller's PyTorch path). wanted=None:
    on CUDA with Triton; False: never; True: always (CPU tensors too under Triton's interpreter,
    TRITON_INTERPRET=1), and one clear error, naming the `option` that asked, where it cannot run."""
    if device.type == "cuda":
        missing = triton_unavailable()
    elif wanted and os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
        missing = None
    else:
        missing = "the model is not on a CUDA device"
    if wanted and missing:
        raise ConfigError(f"{option}=True, but {missing}")
    if missing or wanted is False:
        return None
    return getattr(importlib.import_module(module), name)  # imported here: only set kernels need Triton


@functools.cache
def _warn_fallback(reason: str) -> None:
    log.warning("kernels=triton: %s, so the reference PyTorch implementations run instead "
                "(set kernels.strict=true to make this an error)", reason)


def _parts(root: nn.Module | torch.optim.Optimizer) -> Iterator[object]:
    """A module's submodules; an optimizer and the optimizers inside it (composite parts, a
    sharding wrapper's inner optimizer)."""
    if isinstance(root, nn.Module):
        yield from root.modules()
        return
    yield root
    for inner in [*getattr(root, "parts", {}).values(), getattr(root, "optimizer", None)]:
        if inner is not None:
            yield from _parts(inner)


def install_kernels(ops: KernelOps, *roots: nn.Module | torch.optim.Optimizer) -> list[str]:
    """Offer `ops` to every part of `roots` (modules, optimizers) that owns a hot operation;
    returns the distinct reasons parts gave for keeping their reference."""
    notes: list[str] = []
    for root in roots:
        for part in _parts(root):
            use = getattr(part, "use_kernels", None)
            note = use(ops) if use is not None else None
            if note and note not in notes:
                notes.append(note)
    return notes
