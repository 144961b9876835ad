"""lmlab-train with each parallel strategy in 2 gloo processes equals one process on the same global batch."""

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.training.launch import launch

STEPS = ["trainer.max_steps=4", "trainer.val_every=4", "trainer.checkpoint_every=100", "sched.warmup_steps=1"]


def final_state(run_dir):
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("model.")}


@pytest.fixture
def single_run(make_cfg, tiny_overrides, tmp_path):
    out = tmp_path / "single"
    launch(make_cfg([*tiny_overrides, *STEPS]), out)
    return final_state(out)


SETTINGS = {"bucketed_ddp": ["parallel.bucket_size_mb=0.01"], "zero1": ["parallel.bucket_size_mb=0.01"],  # several buckets
            "nd_tp": ["parallel=nd", "parallel.tp=2"],  # tensor + sequence parallel over both ranks
            "nd_cp": ["parallel=nd", "parallel.cp=2"]}  # each rank half of every sequence, ring attention


@pytest.mark.parametrize("strategy", ["ddp", "naive_ddp", "bucketed_ddp", "zero1", "fsdp", "zero3", "nd_tp", "nd_cp"])
def test_two_processes_match_one(make_cfg, tiny_overrides, tmp_path, single_run, strategy):
    extra = [f"parallel={strategy}", "trainer.devices=2", *SETTINGS.get(strategy, [])]
    if strategy.startswith("nd_"):
        extra = ["trainer.devices=2", *SETTINGS[strategy]]
    out = tmp_path / strategy
    results = launch(make_cfg([*tiny_overrides, *STEPS, *extra]), out)
    assert results["val_loss"] < 6.0
    state = final_state(out)
    assert state.keys() == single_run.keys()
    for key, value in single_run.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("strategy", ["naive_ddp", "bucketed_ddp"])
def test_accumulating_ranks_match_one_process(make_cfg, tiny_overrides, tmp_path, single_run, strategy):
    """Micro-batches but the last only accumulate (the wrapper's no_sync); the last synchronizes the sums."""
    out = tmp_path / strategy
    launch(make_cfg([*tiny_overrides, *STEPS, f"parallel={strategy}", "trainer.devices=2",
                     "trainer.accumulate_grad_batches=2", *SETTINGS.get(strategy, [])]), out)
    for key, value in single_run.items():
        torch.testing.assert_close(final_state(out)[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("extra,match", [
    (["parallel=ddp", "trainer.devices=2", "data.batch_size=7"], r"data.batch_size=7 is not divisible by 2 \(2 data-parallel ranks of world size 2"),
    (["parallel=ddp", "trainer.devices=4096"], "more than the"),
    (["trainer.devices=2"], "parallel=single runs one process"),
    (["parallel=ddp", "parallel.backend=nccl"], "needs CUDA GPUs"),
    (["parallel=zero1", "parallel.bucket_size_mb=0"], "bucket_size_mb must be > 0"),
    (["parallel=zero3", "trainer.devices=2", "trainer.compile=true"], "does not work with parallel=zero3"),
    (["parallel=zero3", "parallel.compute_dtype=int8"], "compute_dtype must be"),
    (["parallel=fsdp", "trainer.devices=2", "trainer.accumulate_grad_batches=2", "trainer.grad_noise_scale=true"],
     "parallel=fsdp shards or reduces the gradients during backward"),
    (["parallel=nd", "parallel.tp=2", "parallel.dp=2", "trainer.devices=2"], r"dp=2 x parallel.tp=2 x parallel.cp=1 x parallel.ep=1 must equal the world size 2"),
    (["parallel=nd", "parallel.tp=2", "trainer.devices=2", "model.attention.n_heads=1"], "n_heads=1 and n_kv_heads=1 must be divisible"),
    (["parallel=nd", "parallel.tp=2", "trainer.devices=2", "model/position=alibi"], "position=ALiBi"),
    (["parallel=nd", "parallel.tp=2", "trainer.devices=2", "model/moe=topk"], "MoE layers take expert parallelism"),
    (["parallel=nd", "parallel.tp=2", "parallel.cp=2", "trainer.devices=2"], r"parallel.tp=2 x parallel.cp=2 x parallel.ep=1 must equal the world size 2"),
    (["parallel=nd", "parallel.cp=2", "trainer.devices=2", "data.context_length=30"], "not a multiple of 2 x cp = 4"),
    (["parallel=nd", "parallel.cp=2", "trainer.devices=2", "model/position=alibi"], "ring attention has no bias"),
])
def test_bad_parallel_settings_fail_before_any_process_starts(make_cfg, tiny_overrides, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        launch(make_cfg([*tiny_overrides, *extra]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_logged_training_loss_is_the_global_batch_mean_whatever_the_device_count(make_cfg, tiny_overrides, tmp_path):
    """Each rank used to log the loss of its own half of the batch (4.574 on 2 ranks vs 4.505 on one)."""
    from tests.training.test_optim_training import scalars

    logged = {}
    for name, extra in (("one", []), ("two", ["parallel=ddp", "trainer.devices=2"])):
        launch(make_cfg([*tiny_overrides, *STEPS, "trainer.log_every=1", *extra]), tmp_path / name)
        logged[name] = scalars(tmp_path / name, "train/loss")
    assert logged["one"].keys() == logged["two"].keys() and len(logged["one"]) == 4
    for step, loss in logged["one"].items():
        assert abs(logged["two"][step] - loss) < 1e-4, step


def test_zero3_checkpoints_hold_whole_tensors_and_resume_exactly(make_cfg, tiny_overrides, tmp_path):
    """lmlab's FSDP saves whole weights and whole optimizer state (loadable by one process), and a run
    resumed from its middle checkpoint in 2 processes ends where the uninterrupted run did."""
    extra = [*tiny_overrides, "parallel=zero3", "trainer.devices=2", "trainer.max_steps=4", "trainer.val_every=4",
             "trainer.checkpoint_every=2", "sched.warmup_steps=1"]
    launch(make_cfg(extra), tmp_path / "straight")
    middle = torch.load(tmp_path / "straight" / "checkpoints" / "step000002.ckpt", weights_only=False)
    single = torch.load(next((tmp_path / "straight" / "checkpoints").glob("*.ckpt")), weights_only=False)
    for key, value in middle["state_dict"].items():
        assert value.shape == single["state_dict"][key].shape
    moments = middle["optimizer_states"][0]["state"][0]["exp_avg"]
    assert moments.shape == middle["state_dict"]["model.embed_tokens.weight"].shape  # whole, not a shard
    launch(make_cfg([*extra, f"ckpt_path={tmp_path / 'straight' / 'checkpoints' / 'step000002.ckpt'}"]),
           tmp_path / "resumed")
    straight, resumed = final_state(tmp_path / "straight"), final_state(tmp_path / "resumed")
    for key, value in straight.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)
