"""lmlab-train with `parallel=nd parallel.tp=2 parallel.cp=2` on 4 gloo processes: tensor + sequence parallelism in
pairs of consecutive ranks, context parallelism (ring attention) across the pairs, FSDP2 over the cp ranks. The run
ends at the weights, validation and training losses and (clipped every step) gradient norms of one process on the
same global batches; its checkpoints hold whole tensors and moments, load in one process and continue there, and a
resume on 4 processes ends exactly where the uninterrupted run did. Plans that cannot split fail before any process
starts, naming the field."""

import os
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf

import lmlab
from lmlab.cli.compose import compose_config
from lmlab.errors import ConfigError
from lmlab.parallel import run_processes
from lmlab.training.launch import launch
from lmlab.training.run import check_parallel
from tests.conftest import TINY
from tests.training.test_optim_training import scalars
from tests.training.test_parallel_training import STEPS, final_state
from tests.training.test_pipeline_training import _assert_same_weights, _checkpoint, _train_rank_on_few_cores

TP_CP = ["parallel=nd", "parallel.tp=2", "parallel.cp=2", "trainer.devices=4"]
RUN = [*STEPS, "trainer.checkpoint_every=2", "trainer.grad_clip=0.05", "trainer.log_every=1"]  # clips every step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process, and tp=2 x cp=2 on 4: the same 4 steps (checkpoints at steps 2 and 4)."""
    base = tmp_path_factory.mktemp("tp_cp")
    common = [*TINY, f"cache_dir={base / 'cache'}", *RUN]
    single = launch(compose_config(common), base / "single")  # also fills the cache the ranks read
    cfg = compose_config([*common, *TP_CP])
    with mock.patch("os.cpu_count", return_value=4):  # launch's checks, on a machine with fewer cores than ranks
        check_parallel(cfg, cfg.data.batch_size)
    split = run_processes(_train_rank_on_few_cores, 4, args=(OmegaConf.to_container(cfg, resolve=True),
                                                             str(base / "tp_cp")), timeout=600)[0]
    return base, common, {"single": single, "tp_cp": split}


@pytest.mark.slow
def test_tensor_and_context_parallel_run_matches_one_process(runs):
    base, _, results = runs
    _assert_same_weights(final_state(base / "tp_cp"), final_state(base / "single"))
    for key in ("initial_val_loss", "val_loss", "train_loss"):  # each rank validates and trains on its slice
        assert results["tp_cp"][key] == pytest.approx(results["single"][key], rel=1e-5), key
    for tag in ("train/loss", "train/grad_norm"):  # the whole batch's loss, the whole model's norm
        want, got = scalars(base / "single", tag), scalars(base / "tp_cp", tag)
        assert got.keys() == want.keys() and len(got) == 4, tag
        assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-4), tag
    assert min(scalars(base / "single", "train/grad_norm").values()) > 0.05  # trainer.grad_clip=0.05 clipped each step


def _moments(checkpoint: dict) -> list[torch.Tensor]:
    """The first moments in the optimizer's parameter order: a full state dict gathered from a mesh numbers the
    parameters in the model's order, and torch's load_state_dict matches them to parameters through the groups."""
    state = checkpoint["optimizer_states"][0]
    return [state["state"][i]["exp_avg"] for group in state["param_groups"] for i in group["params"]]


@pytest.mark.slow
def test_tensor_and_context_parallel_checkpoint_is_whole_and_continues_in_one_process(runs):
    base, common, _ = runs
    model, _, _ = lmlab.load(base / "tp_cp" / "checkpoints" / "last.ckpt")  # one process, the plain model
    single = final_state(base / "single")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, single[f"model.{name}"], rtol=1e-4, atol=1e-5, msg=name)
    # whole optimizer state: one process's moments for every parameter
    want, got = (_moments(_checkpoint(base / run, "step000002.ckpt")) for run in ("single", "tp_cp"))
    assert len(got) == len(want) == len(single)
    for i, (mine, theirs) in enumerate(zip(got, want)):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-7, msg=f"parameter {i}")
    middle = f"ckpt_path={base / 'tp_cp' / 'checkpoints' / 'step000002.ckpt'}"
    launch(compose_config([*common, middle]), base / "continued")
    _assert_same_weights(final_state(base / "continued"), single)


@pytest.mark.parametrize("extra,match", [
    ([*TP_CP, "data.context_length=30"], r"parallel.cp: data.context_length=30 is not a multiple of 2 x cp = 4"),
    (["parallel=nd", "parallel.tp=4", "parallel.cp=2", "trainer.devices=8", "model.attention.n_heads=4",
      "data.context_length=36", "model.max_seq_len=36"],
     r"parallel.cp: data.context_length=36 leaves each rank a slice of 18 tokens, not divisible by parallel.tp=4"),
    ([*TP_CP, "model.attention.n_heads=1"], r"parallel.tp: .*n_heads=1 and n_kv_heads=1 must be divisible by "
                                            r"parallel.tp=2"),
    ([*TP_CP, "model.attention.window=8"], r"parallel.cp: layer 0: a sliding window"),
    (["parallel=nd", "parallel.tp=2", "parallel.cp=2", "trainer.devices=2"],
     r"parallel.dp=-1 x parallel.tp=2 x parallel.cp=2 x parallel.ep=1 must equal the world size 2"),
    ([*TP_CP, "parallel.ep=2", "trainer.devices=8"], "expert parallelism does not compose with tensor or context"),
    ([*TP_CP, "parallel.pp=2", "trainer.devices=8"], "pipeline parallelism does not compose with tensor, context"),
])
def test_bad_tensor_context_plans_fail_before_any_process_starts(make_cfg, tiny_overrides, tmp_path, monkeypatch,
                                                                 extra, match):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # trainer.devices beyond this machine's cores: no process starts
    with pytest.raises(ConfigError, match=match):
        launch(make_cfg([*tiny_overrides, *extra]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_tensor_and_context_parallel_run_resumes_exactly(runs):
    """Each rank takes its shards of the whole weights and moments of the middle checkpoint."""
    base, common, _ = runs
    middle = f"ckpt_path={base / 'tp_cp' / 'checkpoints' / 'step000002.ckpt'}"
    cfg = OmegaConf.to_container(compose_config([*common, *TP_CP, middle]), resolve=True)
    run_processes(_train_rank_on_few_cores, 4, args=(cfg, str(base / "resumed")), timeout=600)
    _assert_same_weights(final_state(base / "resumed"), final_state(base / "tp_cp"), exact=True)
