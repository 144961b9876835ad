"""Megatron-style tensor parallelism with sequence parallelism, as DTensor plans over a device mesh.

Within a tensor-parallel group of tp ranks, each block's attention and FFN are split as in Megatron-LM
(Shoeybi et al. 2019):
- the input projections (q, k and v; an FFN's up and gate) by output columns, so that each rank computes
  its own heads or hidden units with no communication;
- the output projections (o; down) by input rows, whose partial sums are then combined.

Sequence parallelism (Korthikanti et al. 2022) keeps what lies between them sharded along the sequence:
the residual stream and the norms. The combine is then a reduce-scatter onto sequence shards, and an
all-gather rebuilds the whole sequence before the next attention or FFN. These are the same two collectives as
plain TP, moving no more data, while the norms' activations shrink by tp.

The token embedding is split by vocabulary rows. Each rank looks up the ids in its slice and gives zero for the
rest, and a reduce-scatter sums the lookups into sequence shards. The output head is split by vocabulary
columns, and its logits stay split: the model returns each rank's slice of the vocabulary, and the loss is
lmlab.parallel.vocab_parallel's cross-entropy over the group (`model.vocab_parallel_group`). A tied embedding
and head share one weight, sharded by vocabulary in both uses.

`problems(model, tp)` lists what this plan cannot split: it runs before any process starts
(`parallel=nd`) and again on the built model.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lmlab.errors import ConfigError
from lmlab.nn.attention import MultiHeadAttention
from lmlab.nn.ffn import FFN
from lmlab.nn.positions import PositionEncoding


def problems(model: nn.Module, tp: int) -> list[str]:
    """Why `model` (an lmlab Transformer) cannot be split over `tp` tensor-parallel ranks; empty if it can."""
    found = []
    if model.vocab_size % tp:
        found.append(f"the vocabulary of {model.vocab_size} (padded) is not divisible by parallel.tp={tp}")
    position = type(model.position)
    if position.embed is not PositionEncoding.embed or position.attn_bias is not PositionEncoding.attn_bias:
        found.append(f"model/position={position.__name__} adds to the embeddings or biases scores per head; "
                     "tensor parallelism takes rotary (rope) or no positions (nope)")
    if len(model.mtp_layers):
        found.append("model.mtp.depth > 0: multi-token prediction modules are not split")
    for i, block in enumerate(model.layers):
        attn, ffn = block.self_attn, block.mlp
        if type(attn) is not MultiHeadAttention:
            found.append(f"layer {i}: attention {type(attn).__name__} (tensor parallelism splits mha's heads)")
        elif attn.n_kv_heads % tp or attn.n_heads % tp:
            found.append(f"layer {i}: attention.n_heads={attn.n_heads} and n_kv_heads={attn.n_kv_heads} must be "
                         f"divisible by parallel.tp={tp}")
        elif not isinstance(attn.q_norm, nn.Identity):
            found.append(f"layer {i}: attention.qk_norm (its norms' weights are shared by heads that different "
                         "ranks hold)")
        if not isinstance(ffn, FFN):
            found.append(f"layer {i}: FFN {type(ffn).__name__} (tensor parallelism splits dense FFNs; MoE layers "
                         "take expert parallelism)")
        elif any(getattr(ffn, name).out_features % tp for name in ffn.projections[:-1]):
            found.append(f"layer {i}: the FFN's hidden size {getattr(ffn, ffn.projections[0]).out_features} is not "
                         f"divisible by parallel.tp={tp}")
    return found


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split `model` in place over the one-dimensional tensor-parallel `mesh` (see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    found = problems(model, mesh.size())
    if found:
        raise ConfigError("parallel.tp: " + "; ".join(found))
    tied = model.lm_head.weight is model.embed_tokens.weight
    top = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1))}  # logits: a vocabulary slice
    if not isinstance(model.norm, nn.Identity):
        top["norm"] = SequenceParallel(use_local_output=True)
    parallelize_module(model, mesh, top)
    if tied:  # the plan made the head its own copy of the shared weight: share the embedding's again
        model.lm_head.weight = model.embed_tokens.weight
    model.vocab_parallel_group = mesh.get_group()  # whose ranks hold the other slices of the logits
    for block in model.layers:
        # every module hands on plain tensors (local shards): a norm's output may meet the residual stream
        plan = {name: SequenceParallel(use_local_output=True) for name in block.norm_names}
        # attention (x, position, positions) and the FFN (x) take the whole sequence: gather the norms' shards
        plan["self_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                               desired_input_layouts=(Replicate(), None, None))
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for name in block.self_attn.fusable_projections:  # q, k, v
            plan[f"self_attn.{name}"] = ColwiseParallel()
        plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1))
        *inputs, output = block.mlp.projections
        for name in inputs:
            plan[f"mlp.{name}"] = ColwiseParallel()
        plan[f"mlp.{output}"] = RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(block, mesh, plan)
