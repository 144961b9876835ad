"""recompute=full/selective: the blocks' backward recomputes activations instead of keeping them. The loss and
every gradient equal recompute=none's; `full` runs the whole block again (its matmuls too), `selective` only what
lies between the matmuls; the model's parameters, names and copies are untouched; a forward with state updates
is refused."""

import copy
import pickle

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.nn.transformer import Transformer
from lmlab.training.losses import LOSSES
from lmlab.training.objective import model_terms
from lmlab.training.recompute import RECOMPUTE
from tests.conftest import OpCounts

MOE_MTP = ["model/moe=topk", "model.moe.n_experts=4", "model.moe.k=2", "model.mtp.depth=1"]
POLICIES = [name for name in RECOMPUTE.names() if name != "none"]


def _model(make_cfg, overrides, policy: str, **fields) -> tuple[Transformer, torch.nn.Module]:
    cfg = make_cfg(overrides)
    torch.manual_seed(0)
    model = Transformer(cfg.model, 320)
    RECOMPUTE.build({"name": policy, **fields}).install(model)
    return model, LOSSES.build(cfg.loss)


def _loss_and_grads(model, loss_fn, ops: OpCounts | None = None):
    tokens = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = model_terms(model, loss_fn, tokens[:, :-1], tokens[:, 1:])["loss"]
    if ops is None:
        loss.backward()
    else:
        with ops:  # the backward only: what it recomputes
            loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("extra", [[], MOE_MTP, ["model.kv_share=2"]], ids=["dense", "moe-mtp", "cla"])
@pytest.mark.parametrize("policy", POLICIES)
def test_recomputed_blocks_give_the_same_loss_and_gradients(make_cfg, tiny_overrides, policy, extra):
    plain = _loss_and_grads(*_model(make_cfg, [*tiny_overrides, *extra], "none"))
    recomputed = _loss_and_grads(*_model(make_cfg, [*tiny_overrides, *extra], policy))
    torch.testing.assert_close(recomputed[0], plain[0], rtol=0, atol=0)
    assert recomputed[1].keys() == plain[1].keys()
    for name, grad in plain[1].items():
        torch.testing.assert_close(recomputed[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_full_reruns_whole_blocks_and_selective_only_the_ops_between_matmuls(make_cfg, tiny_overrides):
    counts = {}
    for policy in RECOMPUTE.names():
        ops = OpCounts()
        _loss_and_grads(*_model(make_cfg, [*tiny_overrides, "model.n_layers=4"], policy), ops)
        counts[policy] = ops.counts
    plain, full, selective = counts["none"], counts["full"], counts["selective"]
    assert "silu" not in plain  # the backward of SwiGLU's silu reads what the forward kept
    assert full["silu"] == selective["silu"] == 4  # recomputed: one per block
    # full repeats each block's forward matmuls (q, k, v, o, gate, up) up to the last whose output the backward
    # reads (down's is not: checkpointing stops there); selective kept their outputs
    assert full["mm"] == plain["mm"] + 4 * 6 and selective["mm"] == plain["mm"]


def test_every_picks_the_blocks_and_parameters_stay_as_they_were(make_cfg, tiny_overrides):
    model = Transformer(make_cfg([*tiny_overrides, "model.n_layers=4"]).model, 320)
    before = dict(model.named_parameters())
    assert RECOMPUTE.build({"name": "full", "every": 3}).install(model) == 2  # blocks 0 and 3
    assert [hasattr(block, "recompute_context") for block in model.layers] == [True, False, False, True]
    assert type(model.layers[0]) is type(model.layers[3])  # one class: torch.compile traces one graph for both
    assert dict(model.named_parameters()) == before and set(model.state_dict()) == set(before)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # copies recompute the same blocks
        assert [type(b) for b in twin.layers] == [type(b) for b in model.layers]
        assert twin.layers[0].self_attn.q_proj.weight is not model.layers[0].self_attn.q_proj.weight
    with pytest.raises(ConfigError, match="layers.0 recomputes already"):
        RECOMPUTE.build("selective").install(model)
    with pytest.raises(ConfigError, match="recompute.every must be >= 1"):
        RECOMPUTE.build({"name": "full", "every": 0})


def test_a_router_that_steps_its_bias_in_the_forward_is_refused(make_cfg, tiny_overrides):
    cfg = make_cfg([*tiny_overrides, *MOE_MTP, "model.moe.bias_update_rate=0.01"])
    with pytest.raises(ConfigError, match=r"layers\.0\..*router.* update\(s\) state in the forward pass"):
        RECOMPUTE.build("selective").install(Transformer(cfg.model, 320))


def test_a_task_that_would_ignore_recompute_refuses_it(make_cfg, tiny_overrides):
    from lmlab.cli.train import check_job

    with pytest.raises(ConfigError, match="task=contrastive does not apply recompute=full"):
        check_job(make_cfg([*tiny_overrides, "task=contrastive", "recompute=full"]))
    check_job(make_cfg([*tiny_overrides, "recompute=full"]))  # pretrain applies it


@pytest.mark.parametrize("policy", POLICIES)
def test_torch_compile_traces_one_graph_for_every_recomputed_block(make_cfg, tiny_overrides, policy):
    # A function set on each block (rather than one shared class) made Dynamo skip the blocks, which then ran
    # eagerly: on an H100 the ~400M step ran at 0.55x (selective) and 0.51x (full) the speed of compiled blocks.
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lmlab.training.compile import compile_for_training

    torch._dynamo.reset()
    counters.clear()
    model, loss_fn = _model(make_cfg, [*tiny_overrides, "model.n_layers=4"], policy)
    compile_for_training(model, loss_fn)
    _loss_and_grads(model, loss_fn)
    # three graphs: the blocks' (one for all four), the final norm's, the loss's
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]


@pytest.mark.slow
def test_lmlab_train_runs_with_recompute_under_compile(tiny_overrides, tmp_path, make_cfg):
    from lmlab.training import train

    results = train(make_cfg([*tiny_overrides, "recompute=selective", "trainer.compile=true", "trainer.max_steps=4",
                              "trainer.val_every=4", "sched.warmup_steps=1"]), tmp_path)
    assert results["val_loss"] < results["initial_val_loss"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_recompute_lowers_the_steps_peak_memory(make_cfg, tiny_overrides):
    overrides = [*tiny_overrides, "model.d_model=256", "model.n_layers=4", "model.attention.n_heads=4",
                 "model.max_seq_len=1024"]
    peaks = {}
    for policy in RECOMPUTE.names():
        model, loss_fn = _model(make_cfg, overrides, policy)
        model.cuda()
        tokens = torch.randint(0, 320, (8, 1025), device="cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", torch.bfloat16):
            loss = model_terms(model, loss_fn, tokens[:, :-1], tokens[:, 1:])["loss"]
        loss.backward()
        peaks[policy] = torch.cuda.max_memory_allocated() - base
        del model, loss
    assert peaks["full"] < peaks["selective"] < peaks["none"]
