"""lmlab-train with `parallel=nd parallel.ep=2` in 2 gloo processes: each rank holds half of every MoE layer's
experts, and the run ends at the weights of one process on the same global batches; its checkpoints hold whole
expert tensors (loadable by one process, `lmlab generate`, a resume in one process), a resume with ep=2 ends
exactly where the uninterrupted run did, and ep=2 resumes one process's run. Bad plans fail before any process
starts."""

import pytest
import torch

import lmlab
from lmlab.cli.compose import compose_config
from lmlab.cli.main import main as lmlab_main
from lmlab.errors import ConfigError
from lmlab.training.launch import launch
from tests.conftest import TINY
from tests.training.test_parallel_training import STEPS, final_state

# The aux-loss-free router, because its math does not depend on how the batch is split: its only loss term, the
# z-loss, is a mean over tokens (the mean of the ranks' equal-sized means is the whole batch's), and its balancing
# bias steps with the expert load summed over the ranks, the whole batch's. topk's Switch aux loss (a product of
# two per-batch means) would make 2 ranks differ from one process, as under any data parallelism.
MOE = ["model/moe=aux_free", "model.moe.n_experts=4", "model.moe.k=2"]
EP = ["parallel=nd", "parallel.ep=2", "trainer.devices=2"]
RUN = [*STEPS, "trainer.checkpoint_every=2", "trainer.grad_clip=0.05"]  # clips every step: by the whole model's norm
EXPERT = "model.layers.0.mlp.experts.gate_proj"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process and ep=2 on 2, the same 4 steps of a tiny MoE model (both with a checkpoint at step 2)."""
    base = tmp_path_factory.mktemp("ep")
    common = [*TINY, f"cache_dir={base / 'cache'}", *MOE, *RUN]
    launch(compose_config(common), base / "single")
    launch(compose_config([*common, *EP]), base / "ep")
    return base, common


def _checkpoint(run_dir, name: str) -> dict:
    return torch.load(run_dir / "checkpoints" / name, weights_only=False, map_location="cpu")


@pytest.mark.slow
def test_expert_parallel_run_matches_one_process_with_whole_expert_checkpoints(runs, capsys):
    base, _ = runs
    single, ep = final_state(base / "single"), final_state(base / "ep")
    assert ep.keys() == single.keys()
    for key, value in single.items():
        torch.testing.assert_close(ep[key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert ep[EXPERT].shape[0] == 4  # all 4 experts, gathered from the ranks' halves
    assert ep["model.layers.0.mlp.router.expert_bias"].abs().sum() > 0  # the balancing bias moved
    # whole optimizer state too: the moments of one process, for every expert
    want, got = (_checkpoint(base / run, "step000002.ckpt")["optimizer_states"][0]["state"] for run in ("single", "ep"))
    assert got.keys() == want.keys()
    for index, state in want.items():
        torch.testing.assert_close(got[index]["exp_avg"], state["exp_avg"], rtol=1e-4, atol=1e-7)

    ckpt = base / "ep" / "checkpoints" / "last.ckpt"
    model, _, _ = lmlab.load(ckpt)  # one process, the plain model
    assert model.layers[0].mlp.experts.gate_proj.shape[0] == 4
    assert lmlab_main(["generate", f"ckpt={ckpt}", "prompt=def f(x):", "max_new_tokens=4"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.slow
def test_expert_parallel_run_resumes_exactly_and_across_layouts(runs):
    base, common = runs
    middle = f"ckpt_path={base / 'ep' / 'checkpoints' / 'step000002.ckpt'}"
    launch(compose_config([*common, *EP, middle]), base / "resumed")
    straight, resumed = final_state(base / "ep"), final_state(base / "resumed")
    for key, value in straight.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)
    launch(compose_config([*common, middle]), base / "resumed_single")  # whole tensors: one process continues too
    for key, value in final_state(base / "resumed_single").items():
        torch.testing.assert_close(value, straight[key], rtol=1e-4, atol=1e-5, msg=key)
    # and ep=2 continues one process's run, slicing each rank's experts out of its weights and moments
    launch(compose_config([*common, *EP, f"ckpt_path={base / 'single' / 'checkpoints' / 'step000002.ckpt'}"]),
           base / "resumed_from_single")
    single = final_state(base / "single")
    for key, value in final_state(base / "resumed_from_single").items():
        torch.testing.assert_close(value, single[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("extra,match", [
    ([*EP], r"parallel.ep=2: the model has no MoE layers \(model.moe is null\)"),
    ([*EP, *MOE, "model.moe.n_experts=3"], "model.moe.n_experts=3 is not divisible by parallel.ep=2"),
    ([*EP, *MOE, "parallel.ep=3"], r"parallel.dp=-1 x parallel.tp=1 x parallel.cp=1 x parallel.ep=3 must equal the "
                                   "world size 2"),
    ([*EP, *MOE, "parallel.dp=2"], r"parallel.dp=2 x .* x parallel.ep=2 must equal the world size 2"),
    ([*EP, *MOE, "parallel.tp=2"], "parallel.ep=2 with parallel.tp=2 and parallel.cp=1: expert parallelism does not "
                                   "compose with tensor or context parallelism"),
    ([*EP, *MOE, "parallel.cp=2"], "parallel.ep=2 with parallel.tp=1 and parallel.cp=2"),
    ([*EP, *MOE, "parallel.ep=0"], "parallel.ep=0 must be >= 1"),
    ([*EP, *MOE, "data.batch_size=7"], r"data.batch_size=7 is not divisible by 2 \(2 data-parallel ranks"),
    ([*EP, *MOE, "trainer.compile=true"], "does not work with parallel=nd"),
])
def test_bad_expert_parallel_plans_fail_before_any_process_starts(make_cfg, tiny_overrides, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        launch(make_cfg([*tiny_overrides, *extra]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def single_moe_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("dp_moe")
    common = [*TINY, f"cache_dir={base / 'cache'}", *MOE, *STEPS]
    launch(compose_config(common), base / "single")
    return base, common


@pytest.mark.parametrize("strategy", ["naive_ddp", "fsdp"])
def test_data_parallel_moe_runs_keep_the_router_bias_of_one_process(single_moe_run, strategy):
    """Under data parallelism each rank routes its own rows; the aux-free router's balancing bias must step with
    the whole batch's expert load on every rank (Router.load_group), or the replicas drift apart."""
    base, common = single_moe_run
    launch(compose_config([*common, f"parallel={strategy}", "trainer.devices=2"]), base / strategy)
    single, split = final_state(base / "single"), final_state(base / strategy)
    assert single["model.layers.0.mlp.router.expert_bias"].abs().sum() > 0  # the bias moved
    for key, value in single.items():
        torch.testing.assert_close(split[key], value, rtol=1e-4, atol=1e-5, msg=key)
