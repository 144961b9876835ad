"""Tensor + sequence parallelism in 2 and 4 gloo processes, alone and inside FSDP2 (dp 2 x tp 2): the split
model's logits (each rank's slice of the vocabulary) and gradients equal one process's, every split weight
holds 1/tp of the whole, the vocabulary-parallel cross-entropy (label smoothing, ignored rows, z-loss) equals
torch's, and what the plan cannot split is named."""

import pytest
import torch
from torch import nn

from lmlab.nn import ModelConfig, Transformer
from lmlab.parallel import run_processes
from lmlab.parallel.tensor_parallel import apply_tensor_parallel, problems
from lmlab.parallel.vocab_parallel import vocab_parallel_cross_entropy

VOCAB = 64


def _model(**changes) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(d_model=32, n_layers=2, max_seq_len=16, norm="rmsnorm", ffn={"name": "swiglu", "d_ff": 64},
               position="rope", attention={"name": "mha", "n_heads": 4, "n_kv_heads": 4}, block="prenorm",
               vocab_size=VOCAB, tie_embeddings=True)
    cfg.update(changes)
    return Transformer(ModelConfig(**cfg), VOCAB).double()


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(model: Transformer, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Logits (under tensor parallelism: this rank's slice of the vocabulary), loss and whole gradients."""
    ids = _batch()[rows]
    logits = model(ids)
    group = getattr(model, "vocab_parallel_group", None)
    if group is None:
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
    else:
        loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten(), -100, 0.0, False,
                                            group=group)[0]
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return logits.detach(), loss.detach(), grads


def _rank(rank: int, world: int, models: list[dict]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh, results = init_device_mesh("cpu", (world,)), []
    for changes in models:
        model = _model(**changes)
        apply_tensor_parallel(model, mesh)
        local = {name: (p.to_local().numel(), p.numel()) for name, p in model.named_parameters()
                 if isinstance(p, DTensor)}
        logits, loss, grads = _loss_and_grads(model)
        tied = model.lm_head.weight is model.embed_tokens.weight
        results.append({"logits": logits, "loss": loss, "grads": grads, "local": local, "tied": tied})
    return {"models": results, "2d": _grads_2d() if world == 4 else None,
            "cross_entropy": _split_cross_entropy(rank, world) if world == 2 else None}


@pytest.mark.parametrize("world, models", [  # 4: also dp 2 x tp 2 (tensor parallel inside FSDP2)
    (2, [{}, {"attention": {"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "block": "parallel", "ffn": {"name": "gelu"}}]),
    (4, [{"tie_embeddings": False, "block": "sandwich", "norm": "layernorm"}]),
])
def test_split_model_equals_one_process(world, models):
    ranks = run_processes(_rank, world, args=(models,), timeout=180)
    for i, changes in enumerate(models):
        _check_against_one_process(changes, world, [results["models"][i] for results in ranks])
    if world == 2:  # the same processes also ran the vocabulary-parallel cross-entropy alone
        for case, (ignore_index, smoothing, z_loss) in enumerate(CE_CASES):
            logits, targets = _logits_and_targets()
            logits.requires_grad_()
            want = _cross_entropy_reference(logits, targets, ignore_index, smoothing, z_loss)
            want.backward()
            for rank, results in enumerate(ranks):
                loss, grad = results["cross_entropy"][case]
                torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(grad, logits.grad.chunk(2, dim=-1)[rank], rtol=1e-9, atol=1e-12)
    if world == 4:  # the same processes also ran dp 2 x tp 2
        _, _, grads = _loss_and_grads(_model())
        for rank, results in enumerate(ranks):
            got = results["2d"]
            assert got.keys() == grads.keys()
            for name, grad in grads.items():  # FSDP averages the pairs' gradients: the whole batch's mean loss
                torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12, msg=f"rank {rank}: {name}")


def _check_against_one_process(changes: dict, world: int, ranks: list[dict]) -> None:
    logits, loss, grads = _loss_and_grads(_model(**changes))
    for rank, got in enumerate(ranks):
        mine = logits.chunk(world, dim=-1)[rank]  # the rank's slice of the vocabulary
        torch.testing.assert_close(got["logits"], mine, rtol=1e-10, atol=1e-10, msg=f"rank {rank}: logits")
        torch.testing.assert_close(got["loss"], loss, rtol=1e-10, atol=1e-10)
        assert got["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-9, atol=1e-12, msg=f"rank {rank}: {name}")
        assert got["tied"] == changes.get("tie_embeddings", True)
        split = {name for name, (local, whole) in got["local"].items() if local * world == whole}
        assert {"layers.0.self_attn.q_proj.weight", "layers.1.self_attn.o_proj.weight", "embed_tokens.weight"} <= split
        assert any(name.startswith("layers.0.mlp.") for name in split)


CE_CASES = [(-100, 0.0, False), (3, 0.1, True)]  # (ignore_index, label_smoothing, z_loss)


def _logits_and_targets() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    targets = torch.randint(0, VOCAB, (24,), generator=g)
    targets[:3] = 3  # rows the second case ignores
    return torch.randn(24, VOCAB, generator=g, dtype=torch.float64) * 3, targets


def _cross_entropy_reference(logits, targets, ignore_index, smoothing, z_loss):
    ce = nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, label_smoothing=smoothing)
    keep = targets != ignore_index
    return ce + (logits[keep].logsumexp(-1).pow(2).mean() if z_loss else 0.0)


def _split_cross_entropy(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """lmlab's vocabulary-parallel cross-entropy on this rank's slice: (loss, gradient of the slice) per case."""
    import torch.distributed as dist

    results = []
    for ignore_index, smoothing, z_loss in CE_CASES:
        logits, targets = _logits_and_targets()
        mine = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
        ce, z = vocab_parallel_cross_entropy(mine, targets, ignore_index, smoothing, z_loss, group=dist.group.WORLD)
        loss = ce + (z if z_loss else 0.0)
        loss.backward()
        results.append((loss.detach(), mine.grad))
    return results


def _grads_2d() -> dict:
    """dp 2 x tp 2, as parallel=nd lays it out: tensor parallel within a pair, FSDP2 across the pairs, each pair
    on its half of the batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from lmlab.parallel.strategies import MeshStrategy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = _model()
    apply_tensor_parallel(model, mesh["tensor_parallel"])
    MeshStrategy._fully_shard(model, mesh["data_parallel"])
    dp_rank = mesh["data_parallel"].get_local_rank()
    _, _, grads = _loss_and_grads(model, slice(dp_rank, dp_rank + 1))
    return grads


def test_what_the_plan_cannot_split_is_named():
    assert problems(_model(), 2) == []
    assert any("n_heads=4 and n_kv_heads=1" in p for p in problems(_model(attention={"name": "mha", "n_heads": 4,
                                                                                     "n_kv_heads": 1}), 2))
    assert any("qk_norm" in p for p in problems(_model(attention={"name": "mha", "n_heads": 4, "qk_norm": True}), 2))
    assert any("position=LearnedPosition" in p for p in problems(_model(position="learned"), 2))
    assert any("hidden size 64" in p for p in problems(_model(), 3))
