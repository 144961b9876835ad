"""Activation recomputation (config group `recompute`): a second forward pass of the blocks, run during the
backward, in place of the activations it would otherwise keep from the first.

    lmlab-train recompute=full                   # each block keeps its input only and runs again in backward
    lmlab-train recompute=full recompute.every=2  # every second block (half the saving, half the extra work)
    lmlab-train recompute=selective              # keep the matmuls' and attention's outputs; recompute the rest

A block's activations are mostly elementwise results (norms, activations, RoPE, residual sums), cheap to
compute again but as large as the matmuls' outputs, so `selective` (the op-level policy of Korthikanti et al.
2022 and torchtitan) keeps what is costly to recompute and frees the rest; `full` frees everything inside a
block for a whole extra forward (about a third more FLOPs). Both run through `torch.utils.checkpoint` (the
non-reentrant kind), whose recomputation torch.compile traces like any other code, and leave the model's
parameters, names and checkpoints as they are: a block becomes an instance of a subclass of its own class whose
forward is the checkpointed original.

A module whose forward updates state (an aux-loss-free router stepping its expert bias) would update it again
when its block is recomputed; such a module says so through `updates_state_in_forward`, and its block is
refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lmlab.errors import ConfigError
from lmlab.registry import Registry

RECOMPUTE = Registry("recompute", group="recompute",
                     doc="activation recomputation: which activations the blocks' backward recomputes")

# Kept by `selective`: matmuls (plain, float8) and attention, whose recomputation costs what the forward did.
SAVED_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_fused_attention_overrideable", "lmlab::flash_attention_triton_fwd",
})


def blocks_of(model: nn.Module) -> dict[str, nn.Module]:
    """`model`'s residual blocks by name."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ConfigError(f"recompute: {type(model).__name__} has no residual blocks (blocks()) to recompute; "
                          "use recompute=none")
    names = {module: name for name, module in model.named_modules()}
    return {names[block]: block for block in blocks()}


def recompute_block(name: str, block: nn.Module, context_fn=None) -> None:
    """Run the forward of `block` (`name` in its model) under non-reentrant activation checkpointing, with
    `context_fn` if given (a selective policy's), in place."""
    stateful = [".".join(filter(None, (name, inner))) for inner, m in block.named_modules()
                if getattr(m, "updates_state_in_forward", False)]
    if stateful:
        raise ConfigError(f"recompute: {', '.join(stateful)} update(s) state in the forward pass, which a recomputed "
                          "block would update twice (e.g. a router's bias_update_rate); use recompute=none or turn "
                          "that update off")
    if hasattr(block, "recompute_context"):
        raise ConfigError(f"recompute: {name} recomputes already; a second policy would nest its checkpoint")
    block.__class__ = recomputing(type(block), context_fn)


@functools.cache
def recomputing(cls: type[nn.Module], context_fn) -> type[nn.Module]:
    """`cls` with its forward checkpointed. One class per (block class, context): blocks of a kind keep sharing
    their code, so torch.compile still traces one graph for all of them (Dynamo skipped, and left eager, blocks
    whose forward was a function set on the instance)."""

    # no context_fn at all without one: torch.compile cannot trace checkpoint's default (noop_context_fn) passed in
    options = {} if context_fn is None else {"context_fn": context_fn}

    def forward(self, *args, **kwargs):
        return checkpoint(super(recomputed, self).forward, *args, use_reentrant=False, **options, **kwargs)

    def __reduce_ex__(self, protocol):  # pickle and deepcopy: rebuild the plain block, then swap its class again
        plain = cls.__new__(cls)
        plain.__dict__ = self.__dict__
        return recomputed_block, (plain, context_fn)

    recomputed = type(f"Recomputed{cls.__name__}", (cls,), {"forward": forward, "__reduce_ex__": __reduce_ex__,
                                                            "recompute_context": context_fn,
                                                            "__module__": cls.__module__})
    return recomputed


def recomputed_block(plain: nn.Module, context_fn) -> nn.Module:
    plain.__class__ = recomputing(type(plain), context_fn)
    return plain


@RECOMPUTE.register("none")
class NoRecompute:
    """Keep every activation the backward needs (the default)."""

    def __init__(self, cfg=None):
        self.cfg = cfg

    def install(self, model: nn.Module) -> int:
        return 0


@RECOMPUTE.register("full")
class FullRecompute:
    """Each chosen block keeps only its input; its whole forward runs again in the backward."""

    @dataclass
    class Config:
        every: int = 1  # recompute blocks 0, every, 2*every, ...: 1 is all of them

    def __init__(self, cfg: Config):
        if cfg.every < 1:
            raise ConfigError(f"recompute.every must be >= 1 (1: every block), got {cfg.every}")
        self.cfg = cfg

    def install(self, model: nn.Module) -> int:
        """Recompute the chosen blocks of `model`; returns how many."""
        chosen = list(blocks_of(model).items())[::self.cfg.every]
        for name, block in chosen:
            recompute_block(name, block)
        return len(chosen)


def keep_costly_ops(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """`selective`'s policy: save the outputs of SAVED_OPS, recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if func.name() in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """`selective`'s checkpoint contexts (a module-level function: one recomputing class per block class)."""
    return create_selective_checkpoint_contexts(keep_costly_ops)


@RECOMPUTE.register("selective")
class SelectiveRecompute:
    """Every block keeps its matmuls' and attention's outputs; the elementwise ops between them run again."""

    def __init__(self, cfg=None):
        self.cfg = cfg

    def install(self, model: nn.Module) -> int:
        blocks = blocks_of(model)
        for name, block in blocks.items():
            recompute_block(name, block, selective_contexts)
        return len(blocks)
