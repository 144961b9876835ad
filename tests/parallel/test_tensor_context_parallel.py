"""Tensor + sequence parallelism composed with context parallelism (ring attention), under FSDP2 over the data- and
context-parallel ranks, in gloo processes: tp 2 x cp 2 on 4, and dp 2 x cp 2 x tp 2 on 8. Every rank's loss on its
slice, averaged over the slices, and the model's (averaged) gradients equal one process's on the whole batch, in
float64, with grouped-query attention (each tensor-parallel rank rings its own heads) and a tied embedding."""

import pytest
import torch
import torch.distributed as dist

from lmlab.nn import ModelConfig, Transformer
from lmlab.parallel import run_processes
from lmlab.parallel.context_parallel import context_slice
from lmlab.parallel.tensor_context_strategy import parallelize_tensor_context, tensor_context_mesh
from lmlab.parallel.vocab_parallel import vocab_parallel_cross_entropy

VOCAB = 64
SEQ = 32  # cp 2: slices of 16 tokens (zigzag chunks of 8), sequence-parallel shards of 8 over tp 2


def _model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=SEQ, norm="rmsnorm", ffn={"name": "swiglu", "d_ff": 64},
                      position="rope", attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2}, block="prenorm",
                      vocab_size=VOCAB, tie_embeddings=True)
    return Transformer(cfg, VOCAB).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _rank(rank: int, world: int, dp: int) -> dict:
    mesh, sharded_mesh = tensor_context_mesh("cpu", dp, 2, world // (2 * dp))
    model = _model()
    parallelize_tensor_context(model, mesh, sharded_mesh)
    replica, replicas = mesh["data_parallel"].get_local_rank(), dp
    inputs, targets = (t.chunk(replicas)[replica] for t in _batch())  # the distributed sampler's rows
    inputs, targets, positions = context_slice(inputs, targets, mesh["context_parallel"].get_group())
    logits = model.forward_train(inputs, positions).logits
    loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), -100, 0.0, False,
                                        group=model.vocab_parallel_group)[0]
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # every rank's slice mean, over the world (a tensor-parallel group's ranks agree)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return {"loss": mean / world, "grads": grads, "shape": tuple(logits.shape),
            "tied": model.lm_head.weight is model.embed_tokens.weight}


@pytest.mark.parametrize("world, dp", [(4, 1), pytest.param(8, 2, marks=pytest.mark.slow)])
def test_tensor_and_context_parallel_model_equals_one_process(world, dp):
    ranks = run_processes(_rank, world, args=(dp,), timeout=300)
    model = _model()
    inputs, targets = _batch()
    loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    tp = world // (2 * dp)
    for rank, got in enumerate(ranks):
        assert got["shape"] == (4 // dp, SEQ // 2, VOCAB // tp)  # its rows, its slice, its share of the vocabulary
        assert got["tied"]
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-10, atol=1e-12)
        assert got["grads"].keys() == dict(model.named_parameters()).keys()
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-9, atol=1e-12, msg=f"rank {rank}: {name}")
