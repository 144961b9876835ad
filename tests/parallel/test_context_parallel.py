"""Context parallelism in 2 gloo processes: a model whose attention runs through the ring, each rank on its
zigzag slice of the sequence, gives the loss and (averaged) gradients of one process on the whole sequence;
what the ring cannot compute is named."""

import torch
import torch.distributed as dist
from torch import nn

from lmlab.nn import ModelConfig, Transformer
from lmlab.parallel import run_processes
from lmlab.parallel.context_parallel import apply_context_parallel, context_positions, problems
from lmlab.parallel.ring_attention import zigzag_shard

VOCAB = 64


def _model(**changes) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(d_model=32, n_layers=2, max_seq_len=32, norm="rmsnorm", ffn={"name": "swiglu", "d_ff": 64},
               position="rope", attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2}, block="prenorm",
               vocab_size=VOCAB)
    cfg.update(changes)
    return Transformer(ModelConfig(**cfg), VOCAB).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


MODELS = [{}, {"attention": {"name": "mha", "n_heads": 4}, "block": "parallel"}]  # GQA; MHA (q, k, v views)


def _rank(rank: int, world: int) -> list[dict]:
    results = []
    for changes in MODELS:
        model = _model(**changes)
        apply_context_parallel(model)
        ids, targets = (zigzag_shard(t, rank, world, dim=1) for t in _data())
        loss = _loss(model(ids, context_positions(32)), targets)
        loss.backward()
        for p in model.parameters():  # the ranks' losses are means over equal slices: average, as DDP would
            dist.all_reduce(p.grad)
            p.grad /= world
        dist.all_reduce(loss)
        results.append({"loss": loss.detach() / world, "grads": {n: p.grad for n, p in model.named_parameters()}})
    return results


def test_ring_attention_model_equals_one_process():
    ranks = run_processes(_rank, 2, timeout=180)
    for i, changes in enumerate(MODELS):
        model = _model(**changes)
        ids, targets = _data()
        loss = _loss(model(ids), targets)
        loss.backward()
        for rank, results in enumerate(ranks):
            got = results[i]
            torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-10, atol=1e-12)
            for name, p in model.named_parameters():
                torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-9, atol=1e-12,
                                           msg=f"model {i}, rank {rank}: {name}")


def test_what_the_ring_cannot_compute_is_named():
    assert problems(_model()) == []
    assert any("ALiBi" in p for p in problems(_model(position="alibi")))
    assert any("sliding window" in p for p in problems(_model(attention={"name": "mha", "n_heads": 4, "window": 8})))
