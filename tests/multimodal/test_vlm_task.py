"""task=vlm end to end: a stage-2 run from scratch, stage 1 continued from its checkpoint, the checkpoint loaded
back to answer a question about an image, and bad settings refused before any training."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lmlab.cli.compose import compose_config
from lmlab.errors import ConfigError
from lmlab.multimodal.questions import QUESTIONS, SceneQA, qa_items
from lmlab.multimodal.vlm_task import Collate, load_vlm
from lmlab.training.checkpoints import CONFIG_KEY, read_checkpoint
from lmlab.training.tasks import TASKS
from tests.conftest import run_cli

VLM_TINY = ["task=vlm", "model.d_model=32", "model.n_layers=2", "model.max_seq_len=64", "model.attention.n_heads=2",
            "vision_encoder.image_size=16", "vision_encoder.patch_size=8", "vision_encoder.width=16",
            "vision_encoder.n_layers=1", "vision_encoder.n_heads=2", "task.train_size=64", "task.val_size=8",
            "task.batch_size=8", "trainer.max_steps=4", "trainer.val_every=4", "trainer.log_every=1",
            "trainer.progress_bar=false", "sched.warmup_steps=1", "optim.lr=1e-2", "logger=csv"]


def run_vlm(out: Path, *overrides: str) -> dict[str, float]:
    cfg = compose_config([*VLM_TINY, f"cache_dir={out / 'cache'}", *overrides])
    return TASKS.build(cfg.task).run(cfg, out)


def test_stage_2_then_stage_1_from_its_checkpoint_and_the_vlm_answers_from_it(tmp_path):
    first = run_vlm(tmp_path / "stage2", "task.questions=[colour,count]")
    assert {"val/loss", "val/answer_acc", "val/answer_acc/colour", "val/answer_acc/count"} <= first.keys()
    assert 0 <= first["val/answer_acc"] <= 1 and math.isfinite(first["val_loss"])
    ckpt = tmp_path / "stage2" / "checkpoints" / "last.ckpt"
    saved = read_checkpoint(ckpt, "ckpt")[CONFIG_KEY]
    assert saved["vision_encoder"]["width"] == 16 and saved["projector"]["name"] == "mlp"
    assert saved["tokenizer"]["name"] == "byte"

    second = run_vlm(tmp_path / "stage1", "task.stage=1", f"init_from={ckpt}", "projector=linear",
                     "vision_encoder.width=64")  # the VLM checkpoint's own settings win over these
    assert math.isfinite(second["val/answer_acc"])
    vlm, tokenizer, config = load_vlm(tmp_path / "stage1" / "checkpoints" / "last.ckpt")
    assert config["task"]["stage"] == 1 and config["projector"]["name"] == "mlp" and vlm.encoder.width == 16
    stage2 = load_vlm(ckpt)[0]
    for name, p in vlm.named_parameters():  # stage 1 moved the projector alone
        assert torch.equal(p, stage2.get_parameter(name)) != name.startswith("projector."), name

    data = SceneQA(qa_items(2, 5, list(QUESTIONS)), size=16, seed=5)
    batch = Collate(vlm, tokenizer, tokenizer.eot_id)([data[0], data[1]])
    out = vlm.generate(batch["prompts"], batch["images"], tokenizer=tokenizer, max_new_tokens=8,
                       stop_token_ids=[tokenizer.eot_id])
    assert len(out.texts) == 2 and all(isinstance(t, str) for t in out.texts)


@pytest.mark.parametrize("overrides, message", [
    (["task.stage=3"], "task.stage=3"),
    (["task.stage=1", "task.train_encoder=true"], "projector alone"),
    (["task.questions=[colour,size]"], "pick distinct question types"),
    (["loss.ignore_index=0"], "ignore_index=-100"),
    (["init_from=/no/such.ckpt"], "init_from=/no/such.ckpt is not a file"),
    (["task.encoder_from=/no/such.ckpt"], "task.encoder_from=/no/such.ckpt is not a file"),
    (["model.max_seq_len=16"], "exceeds the LM's context"),
    (["task.max_answer_tokens=3"], "more than task.max_answer_tokens=3"),
    (["model.vocab_size=257"], "no id past the tokenizer's 257"),
])
def test_bad_settings_fail_before_training(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_vlm(tmp_path, *overrides)
    assert not (tmp_path / "checkpoints").exists()


def test_encoder_from_must_be_a_contrastive_checkpoint(tmp_path):
    run_vlm(tmp_path / "vlm", "trainer.max_steps=1", "trainer.val_every=1", "task.val_size=1")
    with pytest.raises(ConfigError, match="holds no image encoder"):
        run_vlm(tmp_path / "again", f"task.encoder_from={tmp_path / 'vlm' / 'checkpoints' / 'last.ckpt'}")


@pytest.mark.slow
def test_lmlab_train_task_vlm_runs_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    result = run_cli(["lmlab-train", *VLM_TINY, "trainer.max_steps=6", "trainer.val_every=3",
                      f"hydra.run.dir={out}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val/answer_acc" in result.stdout + result.stderr
    assert (out / "checkpoints" / "last.ckpt").is_file()
