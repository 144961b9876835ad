"""torch.compile for training: per block (`trainer.compile`), or the whole step as CUDA graphs (`trainer.cuda_graphs`).

Per block: blocks of one kind share their code, so Dynamo traces one graph and reuses it for every layer
(parameters are graph inputs); compiling per block rather than the whole model keeps compile time flat in
depth and leaves the MoE routing and the MTP loop outside the graphs. The loss is compiled on its own so the
reference cross-entropy's upcast and softmax fuse into one pass. Fused kernels installed by `kernels=` are
traced into the graphs as they are.

Whole step: a small model's step is a few hundred microseconds of GPU work behind hundreds of kernel
launches, so the host sets its pace. Compiled whole with mode="reduce-overhead", the forward with its loss
becomes one graph and its backward another, and Inductor records each as a CUDA graph that every later step
replays with one launch. A per-block compile cannot be replayed so: each layer calls the same graph, and a
replay would overwrite the activations the layer before it saved for backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmlab.nn.transformer import Transformer
from lmlab.training.compute_dtype import CastParameters, on_copies
from lmlab.training.objective import model_terms

TermsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], dict[str, torch.Tensor]]


def compile_for_training(model: Transformer, loss_fn: nn.Module) -> None:
    for block in model.blocks():
        block.compile()
    model.norm.compile()
    loss_fn.compile()


def graphed_model_terms(model: Transformer, loss_fn: nn.Module, cast: CastParameters | None = None) -> TermsFn:
    """`model_terms(model, loss_fn, inputs, targets, positions)` compiled whole and replayed from CUDA graphs
    (on `cast`'s copies of the parameters, when given: the casts are then in the graph too).

    Static shapes only (the same batch every step), and one forward per backward: gradients come out of the
    graph's memory pool, which the next replay reuses, so they must be consumed (the optimizer step) before
    the next forward. On a CPU there is nothing to replay, and this is a whole-model compile.
    """
    terms_of = on_copies(cast, model_terms)
    compiled = torch.compile(lambda inputs, targets, positions: terms_of(model, loss_fn, inputs, targets, positions),
                             mode="reduce-overhead")

    def terms(inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None):
        # The outputs also live in that pool: copies outlast the next step's replay (logging reads them later).
        return {name: value.clone() for name, value in compiled(inputs, targets, positions).items()}

    return terms
