"""torch.compile for training: each residual block and the loss, compiled in place.

Blocks of one kind share their code, so Dynamo traces one graph and reuses it for every layer
(parameters are graph inputs); compiling per block rather than the whole model keeps compile
time flat in depth and leaves the MoE routing and the MTP loop outside the graphs. The loss is
compiled on its own so the reference cross-entropy's upcast and softmax fuse into one pass.
Fused kernels installed by `kernels=` are traced into the graphs as they are.
"""

from __future__ import annotations

from torch import nn

from lmlab.nn.transformer import Transformer


def compile_for_training(model: Transformer, loss_fn: nn.Module) -> None:
    for block in model.blocks():
        block.compile()
    model.norm.compile()
    loss_fn.compile()
