"""`trainer.compute_dtype`: forward and backward on bf16 (or fp16) copies of the float32 parameters.

Under bf16 autocast (Lightning's bf16-mixed, lmlab-train's default on a GPU) the weights stay float32 and only
the matmuls run in bf16. The embedding's output is then float32, so the residual stream is too, and each norm's
float32 gain promotes its bf16 result back to float32 before the next matmul casts it down again. Every
elementwise kernel between the matmuls (norms, residual adds, their backward) moves float32, twice the bytes.

With `trainer.compute_dtype=bfloat16`, each step casts the parameters to bf16 copies (one multi-tensor launch) and
runs forward and backward on the copies, so activations are bf16 throughout. Megatron-LM does this by
default (fp32_residual_connection=False), as does torchtitan (FSDP2's param_dtype). The float32 parameters stay
the master weights: each copy's gradient comes back cast to float32 into its parameter's `.grad`. Accumulation,
all-reduce, clipping and the optimizer see it there as before, and checkpoints hold float32.

float16 copies need their gradients scaled against underflow, as `trainer.precision=16-mixed`'s scaler does (it
unscales the float32 parameters' gradients); bf16 needs none.

Buffers are not cast. Position tables cast themselves to their input's dtype, and a buffer that a module updates
(a router's expert bias) must stay the one it updates. Autocast stays on, so the ops it runs in float32 (softmax,
layer_norm) still do.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.training.precision import HALF_WEIGHTS

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(name: str | None) -> torch.dtype | None:
    """The dtype `trainer.compute_dtype` names (None: none)."""
    if name is None:
        return None
    if name not in DTYPES:
        raise ConfigError(f"trainer.compute_dtype must be one of {', '.join(DTYPES)} (or null), got '{name}'")
    return DTYPES[name]


def check_compute_dtype(name: str | None, recompute: str, parallel: str, shards_parameters: bool,
                        precision: str) -> None:
    """Refuse what cannot run on cast copies, before any work starts (`name` checked already, as TrainerConfig and
    the bench's variants do)."""
    if name is None:
        return
    if precision in HALF_WEIGHTS:
        raise ConfigError(f"trainer.compute_dtype={name} casts float32 weights for the forward, but "
                          f"trainer.precision={precision} stores them in 16 bits already. Set "
                          "trainer.compute_dtype=null, or trainer.precision=bf16-mixed to keep float32 weights")
    if recompute != "none":
        raise ConfigError(f"trainer.compute_dtype={name} with recompute={recompute}: a recomputed block runs again "
                          "in the backward, after the step's cast copies are swapped out, and would meet the float32 "
                          "parameters instead. Set recompute=none or trainer.compute_dtype=null")
    if shards_parameters:
        raise ConfigError(f"trainer.compute_dtype={name} casts whole parameters, but parallel={parallel} shards or "
                          "splits them (zero3 has parallel.compute_dtype for this). Use a data-parallel strategy "
                          "(ddp, naive_ddp, bucketed_ddp, zero1) or trainer.compute_dtype=null")


class _Linked(torch.autograd.Function):
    """`_Linked.apply(n, *originals, *copies)` returns the copies, made outside autograd, as functions of the n
    originals: their gradients come back in the originals' dtypes, one multi-tensor launch per call."""

    @staticmethod
    def forward(ctx, n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unused copy's gradient stays None, as an unused parameter's would
        ctx.dtypes = [t.dtype for t in tensors[:n]]
        return tuple(copy.view_as(copy) for copy in tensors[n:])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        present = [i for i, g in enumerate(grads) if g is not None]
        upcast = [torch.empty_like(grads[i], dtype=ctx.dtypes[i]) for i in present]
        if upcast:
            torch._foreach_copy_(upcast, [grads[i] for i in present])
        out: list[torch.Tensor | None] = [None] * len(grads)
        for i, grad in zip(present, upcast):
            out[i] = grad
        return (None, *out, *[None] * len(grads))


class CastParameters:
    """`cast(fn, *args)` runs `fn(*args)` with `model`'s float32 parameters replaced by `dtype` copies (the
    gradients flow back to the originals).

    A step starts after a sync (the step guard's), so the host time before the first block's launch is time the GPU
    waits: the copies are made in one multi-tensor launch into one buffer, and put in the modules' parameter slots
    directly (torch.func.functional_call, which does the same, took 2 ms a call for 219 tensors on a CPU). The
    gradients come back a block at a time (the rest together, last), so a data-parallel strategy can reduce a
    block's while the next one computes."""

    ALIGN = 16  # elements: every copy starts on a 32-byte boundary of the buffer, for vectorised loads and stores

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        seen: set[int] = set()
        self.units: list[list[nn.Parameter]] = []
        for module in [*getattr(model, "blocks", list)(), model]:  # the rest last
            unit = [p for p in module.parameters() if p.dtype == torch.float32 and id(p) not in seen]
            seen.update(id(p) for p in unit)
            if unit:
                self.units.append(unit)
        self.params = [p for unit in self.units for p in unit]
        index = {id(p): i for i, p in enumerate(self.params)}
        # every slot a cast parameter sits in: a tied weight in each of its modules
        self.slots = [(module, name, index[id(p)]) for module in model.modules()
                      for name, p in module._parameters.items() if p is not None and id(p) in index]
        self.starts = [0]
        for p in self.params:
            self.starts.append(self.starts[-1] + -(-p.numel() // self.ALIGN) * self.ALIGN)

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self.params:
            return fn(*args, **kwargs)
        buffer = torch.empty(self.starts[-1], dtype=self.dtype, device=self.params[0].device)
        flat = [buffer[start:start + p.numel()].view(p.shape) for start, p in zip(self.starts, self.params)]
        with torch.no_grad():
            torch._foreach_copy_(flat, self.params)
        made, copies = iter(flat), []
        for unit in self.units:
            copies.extend(_Linked.apply(len(unit), *unit, *(next(made) for _ in unit)))
        for module, name, i in self.slots:
            module._parameters[name] = copies[i]
        try:
            return fn(*args, **kwargs)
        finally:
            for module, name, i in self.slots:
                module._parameters[name] = self.params[i]


def on_copies(cast: CastParameters | None, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, run on `cast`'s copies of the parameters (as it is without a cast)."""
    return fn if cast is None else partial(cast, fn)
