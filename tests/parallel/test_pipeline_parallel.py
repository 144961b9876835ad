"""PipelineParallel: the rank layout, which rank holds each weight, placeholders that keep the optimizer's groups,
and in 2 gloo processes a step, its clipping, validation (with padded rows), whole checkpoints and their loading,
each equal to one process on the whole batch."""

import pytest
import torch
import torch.nn.functional as F

from lmlab.cli.compose import compose_config
from lmlab.optim import OPTIMIZERS
from lmlab.parallel import run_processes
from lmlab.parallel.pipeline import plan_problems, stage_owners
from lmlab.parallel.pipeline_parallel import PipelineParallel, _placeholder, rank_layout
from tests.parallel.test_pipeline import _data, _model


def test_rank_layout_puts_pipeline_ranks_outermost():
    pipelines, dp_groups = rank_layout(8, 2)
    assert pipelines == [[0, 4], [1, 5], [2, 6], [3, 7]]  # replica d: stage 0 on rank d, stage 1 on rank 4 + d
    assert dp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the ranks holding each stage
    assert rank_layout(2, 2) == ([[0, 1]], [[0], [1]])
    assert rank_layout(6, 3) == ([[0, 2, 4], [1, 3, 5]], [[0, 1], [2, 3], [4, 5]])
    for world, pp in ((8, 2), (8, 4), (6, 3)):  # every rank: one pipeline and one dp group, meeting in it alone
        pipelines, dp_groups = rank_layout(world, pp)
        for rank in range(world):
            (pipeline,), (group,) = ([p for p in pipelines if rank in p], [g for g in dp_groups if rank in g])
            assert set(pipeline) & set(group) == {rank}
    with pytest.raises(ValueError, match="pp=4 pipeline ranks must divide the world size 6"):
        rank_layout(6, 4)


def test_every_weight_sits_on_one_rank_and_learned_positions_on_the_first():
    model = _model(position="learned")
    owners = {name: stage_owners(model, 2)[id(p)] for name, p in model.named_parameters()}
    assert owners["embed_tokens.weight"] == owners["position.embed_positions.weight"] == 0
    assert owners["layers.1.mlp.up_proj.weight"] == 0 and owners["layers.2.mlp.up_proj.weight"] == 1
    assert owners["norm.weight"] == owners["lm_head.weight"] == 1
    interleaved = {name: stage_owners(model, 2, 2)[id(p)] for name, p in model.named_parameters()}
    assert [interleaved[f"layers.{i}.mlp.up_proj.weight"] for i in range(4)] == [0, 1, 0, 1]  # stage s on s % pp
    assert interleaved["lm_head.weight"] == 1


def test_plan_problems_name_the_fields():
    assert plan_problems("1f1b", 2, 1, 2) == []
    assert plan_problems("interleaved_1f1b", 2, 2, 4) == []
    assert "parallel.pp_schedule=zigzag is not one of gpipe, 1f1b" in plan_problems("zigzag", 2, 1, 2)[0]
    assert "interleaved schedules take 2 or more" in plan_problems("gpipe", 2, 2, 2)[0]
    assert "parallel.pp_microbatches=1 for parallel.pp=2 leaves stages idle" in plan_problems("1f1b", 2, 1, 1)[0]
    assert "needs a multiple of 2" in plan_problems("interleaved_1f1b", 2, 2, 5)[0]


def test_placeholders_keep_muons_groups_and_get_no_state():
    whole, split = _model().float(), _model().float()
    dropped = [p for name, p in split.named_parameters() if not name.startswith("layers.0.")]
    for p in dropped:
        p.data = _placeholder(p, p.device)
    assert all(p.untyped_storage().nbytes() == p.element_size() for p in dropped)  # one element each
    optim = compose_config(["optim=muon"]).optim
    groups = [[(g["optimizer"], [tuple(p.shape) for p in g["params"]]) for g in OPTIMIZERS.build(optim, m).param_groups]
              for m in (whole, split)]
    assert groups[0] == groups[1] and {"muon", "adamw"} <= {name for name, _ in groups[0]}
    optimizer = OPTIMIZERS.build(optim, split)
    F.cross_entropy(split.layers[0](torch.randn(1, 4, 32), split.position, torch.arange(4)).flatten(0, 1),
                    torch.zeros(4, dtype=torch.long)).backward()
    optimizer.step()  # only the held layer has gradients
    assert {id(p) for p in optimizer.state} == {id(p) for p in split.layers[0].parameters()}


def _loss_terms(logits, targets):
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return {"loss": 2 * ce, "ce": ce}


def _rank(rank: int, world: int) -> dict:
    model = _model()
    pipeline = PipelineParallel(model, pp=2, n_microbatches=2)
    assert pipeline.dropped and all(p.untyped_storage().nbytes() == p.element_size() for p in pipeline.dropped)
    ids, targets = _data()
    pipeline.eval_loss(ids, targets)  # validation first, as lmlab-train does, then training through the same stages
    terms = pipeline.train_step(ids, targets, _loss_terms)
    assert all(p.grad is None for p in model.parameters())  # held until accumulate_gradients
    pipeline.accumulate_gradients()
    norm = pipeline.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.5)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.step()
    full = pipeline.full_optimizer_state_dict(optimizer)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pipeline.load_full_optimizer_state_dict(fresh, full)
    return {"terms": {k: v.item() for k, v in terms.items()}, "norm": norm.item(), "grads": grads,
            "val": [pipeline.eval_loss(ids, targets).item(), pipeline.eval_loss(ids[:3], targets[:3]).item()],
            "weights": pipeline.gather_full_params(), "optimizer": full,
            "reloaded": {n: p in fresh.state for n, p in model.named_parameters()},
            "held": {n for n, p in model.named_parameters() if any(p is h for h in pipeline.held)}}


def test_a_pipeline_step_and_its_checkpoint_equal_one_process():
    ranks = run_processes(_rank, 2, timeout=180)
    model = _model()
    ids, targets = _data()
    loss = 2 * F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.step()
    with torch.no_grad():  # validation after the step, on all rows and on 3
        val = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in ((ids, targets),
                                                                                          (ids[:3], targets[:3]))]
    names = [name for name, _ in model.named_parameters()]
    for rank, got in enumerate(ranks):
        assert got["terms"] == pytest.approx({"loss": loss.item(), "ce": loss.item() / 2}, rel=1e-6)  # float32
        assert got["norm"] == pytest.approx(norm.item(), rel=1e-9)  # the whole model's, on every rank
        assert got["val"] == pytest.approx(val, rel=1e-6)  # a 3-row batch runs padded to 4
        assert got["grads"].keys() == got["held"] and got["reloaded"] == {n: n in got["held"] for n in names}
        for name, p in model.named_parameters():
            if name in got["grads"]:
                torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-9, atol=1e-12, msg=name)
            torch.testing.assert_close(got["weights"][name], p.detach(), rtol=1e-9, atol=1e-12, msg=name)
        want = optimizer.state_dict()["state"]
        assert got["optimizer"]["state"].keys() == want.keys()
        for index, state in want.items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got["optimizer"]["state"][index][key], state[key], rtol=1e-9, atol=1e-12)
    assert ranks[0]["held"] | ranks[1]["held"] == set(names) and not ranks[0]["held"] & ranks[1]["held"]
