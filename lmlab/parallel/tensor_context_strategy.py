"""The Lightning strategy of `parallel=nd parallel.tp=T parallel.cp=C`: tensor + sequence parallelism composed with
context parallelism, with FSDP2 (ZeRO-3) over the data- and context-parallel ranks together.

The ranks form a (data_parallel, context_parallel, tensor_parallel) device mesh, tensor parallel innermost, so a
tensor-parallel group is T consecutive ranks (on GPUs, one node's fast links): rank = (d x C + c) x T + t.
- The T ranks of a tensor-parallel group take the same rows and the same slice of every sequence, and split the
  model as lmlab.parallel.tensor_parallel does; sequence parallelism shards their slice again, T ways, between the
  attentions and FFNs.
- The C ranks of a context-parallel group take the same rows, each its zigzag slice of every sequence, and attend
  through a ring over the group (lmlab.parallel.context_parallel) on the heads their tensor-parallel rank holds.
- The D data-parallel replicas take different rows.
Each rank's loss is the mean over its slice's tokens, and the slices are equal, so averaging the gradients over the
D x C ranks that share a tensor-parallel rank gives the whole batch's mean gradient: FSDP2 shards the weights over
those ranks (one flattened mesh dimension) and its reduce-scatter averages there.
"""

from __future__ import annotations

import torch
from torch import nn

from lmlab.parallel.context_parallel import apply_context_parallel, context_slice
from lmlab.parallel.strategies import MeshStrategy
from lmlab.parallel.tensor_parallel import apply_tensor_parallel

MESH_DIMS = ("data_parallel", "context_parallel", "tensor_parallel")


def tensor_context_mesh(device_type: str, dp: int, cp: int, tp: int):
    """(the (data_parallel, context_parallel, tensor_parallel) mesh, its first two dimensions flattened into one:
    where FSDP2 shards); every rank must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dp, cp, tp), mesh_dim_names=MESH_DIMS)
    return mesh, mesh[MESH_DIMS[:2]]._flatten("data_context_parallel")


def parallelize_tensor_context(model: nn.Module, mesh, sharded_mesh) -> None:
    """Split `model` in place over `tensor_context_mesh`'s meshes (see the module doc)."""
    apply_tensor_parallel(model, mesh["tensor_parallel"])
    # After the tensor-parallel plan: the ring then passes around the heads this rank's q, k and v hold.
    apply_context_parallel(model, mesh["context_parallel"].get_group())
    MeshStrategy._fully_shard(model, sharded_mesh)


class TensorContextStrategy(MeshStrategy):
    """MeshStrategy on the three-dimensional mesh of the module doc. Lightning's distributed sampler splits the rows
    over the mesh's data_parallel dimension; the LightningModule takes this rank's slice of them through
    `context_slice`. Checkpoints hold full state dicts (whole tensors), and the gradient norm for clipping is the
    whole model's (the gradients are DTensors over the whole mesh)."""

    def __init__(self, dp: int, cp: int, tp: int, backend: str):
        super().__init__(dp, tp, backend)
        self.cp = cp
        self._sharded_mesh = None  # made with the mesh, once the processes are up

    def setup_environment(self) -> None:
        """ModelParallelStrategy's, with this mesh in place of its (data_parallel, tensor_parallel) one."""
        self._setup_distributed()
        self._device_mesh, self._sharded_mesh = tensor_context_mesh(
            self.root_device.type, self._data_parallel_size, self.cp, self._tensor_parallel_size)
        self.lightning_module._device_mesh = self._device_mesh

    def parallelize_model(self, model: nn.Module) -> None:
        parallelize_tensor_context(model, self.device_mesh, self._sharded_mesh)

    def context_slice(self, inputs: torch.Tensor, targets: torch.Tensor):
        """This rank's slice of a batch's rows: (inputs, targets, positions in the whole sequences)."""
        return context_slice(inputs, targets, self.device_mesh["context_parallel"].get_group())
