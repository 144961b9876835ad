"""End to end, in process: MoE + MTP training logs its terms and statistics; dense -> upcycle -> init_from."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lmlab.cli.main import main as lmlab_main
from lmlab.errors import ConfigError
from lmlab.training import train

MOE = ["model/moe=topk", "model.moe.n_experts=4", "model.moe.k=2"]


def events(run_dir) -> EventAccumulator:
    loaded = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    loaded.Reload()
    return loaded


def scalar_tags(run_dir):
    return set(events(run_dir).Tags()["scalars"])


def scalar_steps(run_dir, tag):
    return [event.step for event in events(run_dir).Scalars(tag)]


def test_moe_with_mtp_trains_and_logs_losses_and_expert_load(make_cfg, tiny_overrides, tmp_path):
    out = tmp_path / "run"
    results = train(make_cfg([*tiny_overrides, *MOE, "model.mtp.depth=2", "trainer.max_steps=20"]), out)
    assert results["val_loss"] < results["initial_val_loss"] - 0.5
    tags = scalar_tags(out)
    for tag in ["train/lm_loss", "train/mtp_1_loss", "train/mtp_2_loss", "train/moe_aux_loss", "train/router_z_loss",
                "moe/layers.0/load/expert3", "moe/layers.1/dropped", "moe/layers.1/router_entropy", "moe/dropped",
                "moe/mtp_layers.1.layer/load/expert0"]:
        assert tag in tags, tag
    # the statistics land on the steps whose losses are written, the last one included
    assert scalar_steps(out, "moe/dropped") == scalar_steps(out, "train/lm_loss")


def test_dense_checkpoint_upcycles_and_continues_from_its_loss(make_cfg, tiny_overrides, tmp_path):
    dense = train(make_cfg([*tiny_overrides, "trainer.max_steps=20"]), tmp_path / "dense")
    upcycled = tmp_path / "upcycled.ckpt"
    ckpt = tmp_path / "dense" / "checkpoints" / "last.ckpt"
    assert lmlab_main(["upcycle", f"ckpt={ckpt}", *MOE, f"out={upcycled}"]) == 0
    sparse = train(make_cfg([*tiny_overrides, *MOE, "trainer.max_steps=10", f"init_from={upcycled}"]),
                   tmp_path / "sparse")
    assert sparse["initial_val_loss"] == pytest.approx(dense["val_loss"], abs=1e-4)  # same function at step 0
    with pytest.raises(ConfigError, match="different model config"):  # init_from checks the model like ckpt_path
        train(make_cfg([*tiny_overrides, f"init_from={upcycled}"]), tmp_path / "wrong")
