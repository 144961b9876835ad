"""Pipeline parallelism in 2 gloo processes: GPipe, 1F1B and interleaved 1F1B give every stage the gradients
(and the last stage the loss) of one process on the whole batch; stages cover the layers; bad plans are named."""

import pytest
import torch
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn import ModelConfig, Transformer
from lmlab.parallel import run_processes
from lmlab.parallel.pipeline import build_pipeline, problems, stage_bounds

VOCAB, ROWS, MICRO = 64, 4, 4


def _model(**changes) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(d_model=32, n_layers=4, max_seq_len=16, norm="rmsnorm", ffn={"name": "swiglu", "d_ff": 64},
               position="rope", attention={"name": "mha", "n_heads": 2}, block="prenorm", vocab_size=VOCAB,
               tie_embeddings=False)
    cfg.update(changes)
    return Transformer(ModelConfig(**cfg), VOCAB).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (ROWS, 17), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


PLANS = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]  # (schedule, stages per rank)


def _rank(rank: int, world: int) -> list[dict]:
    results = []
    for schedule, stages_per_rank in PLANS:  # one process group for all three: fewer processes to start
        model = _model()
        stages, runner = build_pipeline(model, rank, world, _loss, MICRO, schedule, stages_per_rank)
        ids, targets = _data()
        losses = []
        if rank == 0:
            runner.step(ids)
        else:
            runner.step(target=targets, losses=losses)
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        results.append({"grads": grads, "loss": torch.stack(losses).mean() if losses else None})
    return results


def test_pipeline_steps_equal_one_process():
    ranks = run_processes(_rank, 2, timeout=180)
    for i, (schedule, stages_per_rank) in enumerate(PLANS):
        _check_against_one_process([results[i] for results in ranks], stages_per_rank)


def _check_against_one_process(ranks: list[dict], stages_per_rank: int) -> None:
    model = _model()
    ids, targets = _data()
    loss = _loss(model(ids), targets)
    loss.backward()
    seen = {}
    for rank, got in enumerate(ranks):
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=1e-9, atol=1e-12,
                                       msg=f"rank {rank}: {name}")
            seen[name] = rank
    assert seen.keys() == {name for name, _ in model.named_parameters()}  # every weight lives on some stage
    torch.testing.assert_close(ranks[1]["loss"], loss.detach())
    if stages_per_rank == 1:  # rank 0: the embedding and the first two layers; rank 1: the rest and the head
        assert seen["embed_tokens.weight"] == 0 and seen["layers.1.mlp.up_proj.weight"] == 0
        assert seen["layers.2.mlp.up_proj.weight"] == 1 and seen["lm_head.weight"] == 1


def test_stage_bounds_cover_the_layers_and_bad_plans_are_named():
    assert stage_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert problems(_model(), 2) == []
    assert any("tie_embeddings" in p for p in problems(_model(tie_embeddings=True), 2))
    assert any("5 pipeline stages for 4 layers" in p for p in problems(_model(), 5))
    with pytest.raises(ConfigError, match="interleaved schedules take 2 or more"):
        build_pipeline(_model(), 0, 2, _loss, MICRO, "interleaved_1f1b", 1)
    with pytest.raises(ConfigError, match="one of gpipe, 1f1b"):
        build_pipeline(_model(), 0, 2, _loss, MICRO, "zigzag")
