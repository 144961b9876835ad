"""The post-training `task` entries end to end on a tiny checkpoint trained in the test: each stage fits,
logs its metrics and writes a checkpoint that loads as a policy; bad input fails before any work."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lmlab.alignment.chat import CHAT_TEMPLATES
from lmlab.alignment.tasks.preference import read_preference_jsonl
from lmlab.alignment.tasks.rl import read_prompts_jsonl
from lmlab.alignment.verifiers import REWARDS
from lmlab.cli.compose import compose_config
from lmlab.errors import ConfigError
from lmlab.registry import RegistryError
from lmlab.training.checkpoints import CONFIG_KEY, load
from lmlab.training.tasks import TASKS
from tests.conftest import TINY, train_tiny

STAGE = ["trainer.max_steps=4", "trainer.val_every=2", "trainer.log_every=1", "sched.warmup_steps=1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """A tiny pre-trained policy and small data files of each stage's format."""
    root = tmp_path_factory.mktemp("stages")
    files = {"policy": Path(train_tiny(root / "pre", 5)), "sft": root / "sft.jsonl", "pref": root / "pref.jsonl",
             "rl": root / "rl.jsonl"}
    problems = [(f"{a}+{b}", str(a + b)) for a in range(6) for b in range(4)]
    files["sft"].write_text("".join(json.dumps({"turns": [{"role": "user", "content": q},
                                                          {"role": "assistant", "content": a}]}) + "\n"
                                    for q, a in problems))
    files["pref"].write_text("".join(json.dumps({"prompt": q, "chosen": a, "rejected": a + "0"}) + "\n"
                                     for q, a in problems) + json.dumps({"prompt": "x", "chosen": "y", "rejected": "y"}))
    files["rl"].write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in problems))
    return files


def run_stage(data, tmp_path: Path, task: str, *overrides: str) -> tuple[dict[str, float], Path]:
    source = {"sft": "sft", "dpo": "pref", "reward_model": "pref", "grpo": "rl", "ppo": "rl"}[task]
    cfg = compose_config([*TINY, *STAGE, f"cache_dir={tmp_path / 'cache'}", f"task={task}",
                          f"task.data={data[source]}", f"init_from={data['policy']}", *overrides])
    out = tmp_path / task
    return TASKS.build(cfg.task).run(cfg, out), out / "checkpoints" / "last.ckpt"


def test_sft_lowers_the_held_out_loss_on_assistant_tokens_and_saves_a_loadable_policy(data, tmp_path):
    results, ckpt = run_stage(data, tmp_path, "sft", "task.batch_size=4", "optim.lr=3e-3", "trainer.max_steps=8",
                              "trainer.val_every=4", "task.val_fraction=0.25")
    initial, _ = run_stage(data, tmp_path / "none", "sft", "task.batch_size=4", "optim.lr=1e-12", "trainer.max_steps=1",
                           "trainer.val_every=1", "task.val_fraction=0.25")
    assert results["val/loss"] < initial["val/loss"] - 0.5
    model, tokenizer, config = load(ckpt)  # what lmlab eval, lmlab generate and the next stage read
    assert config.task.name == "sft" and config.model.d_model == 32 and config.init_from == str(data["policy"])
    assert model(torch.tensor([tokenizer.encode("1+2")])).isfinite().all()


def test_packed_sft_trains_each_example_apart(data, tmp_path):
    results, _ = run_stage(data, tmp_path, "sft", "task.batch_size=2", "task.pack=true", "task.val_fraction=0.25")
    assert math.isfinite(results["val/loss"]) and math.isfinite(results["train/loss"])


def test_a_stage_recomputes_its_policy_and_trains_as_without(data, tmp_path):
    # dpo: the frozen reference is a copy of the recomputing policy
    plain, _ = run_stage(data, tmp_path / "plain", "dpo", "task.batch_size=8", "optim.lr=3e-3")
    recomputed, ckpt = run_stage(data, tmp_path / "full", "dpo", "task.batch_size=8", "optim.lr=3e-3", "recompute=full")
    assert recomputed["val/loss"] == pytest.approx(plain["val/loss"], rel=1e-4)
    assert torch.load(ckpt, weights_only=False)[CONFIG_KEY]["recompute"]["name"] == "full"


def test_dpo_and_the_reward_model_learn_the_preference(data, tmp_path):
    dpo, _ = run_stage(data, tmp_path, "dpo", "task.batch_size=8", "optim.lr=3e-3")
    assert dpo["val/reward_accuracy"] > 0.5 and dpo["val/margin"] > 0 and dpo["val/loss"] < math.log(2)
    rm, ckpt = run_stage(data, tmp_path, "reward_model", "task.batch_size=8", "optim.lr=3e-3", "trainer.max_steps=8")
    assert rm["val/accuracy"] > 0.5 and rm["val/loss"] < math.log(2)
    assert any(k.startswith("reward.score.") for k in torch.load(ckpt, weights_only=False)["state_dict"])
    assert torch.load(ckpt, weights_only=False)[CONFIG_KEY]["task"]["name"] == "reward_model"
    # The trained model as a reward (reward=reward_model): it prefers the chosen responses it learned.
    learned = REWARDS.build({"name": "reward_model", "path": str(ckpt)})
    pairs, _ = read_preference_jsonl(data["pref"], CHAT_TEMPLATES.build("plain"))
    chosen, rejected = ([s["reward"] for s in learned.score_batch([p.prompt for p in pairs], [getattr(p, side) for p in pairs])]
                        for side in ("chosen", "rejected"))
    assert sum(c > r for c, r in zip(chosen, rejected)) > len(pairs) / 2
    results, _ = run_stage(data, tmp_path, "grpo", "task.rollout_batch_size=8", "task.group_size=4",
                           "task.max_new_tokens=4", "trainer.max_steps=2", "reward=reward_model", f"reward.path={ckpt}")
    assert math.isfinite(results["train/reward_std"]) and results["train/reward_std"] > 0  # real-valued scores


def test_identical_pairs_are_skipped_and_counted(data):
    pairs, skipped = read_preference_jsonl(data["pref"], CHAT_TEMPLATES.build("plain"))
    assert skipped == 1 and len(pairs) == 24
    assert pairs[0].prompt == "User: 0+0\nAssistant:" and pairs[0].chosen == " 0" and pairs[0].rejected == " 00"


# bf16-mixed: the rollouts generate outside the training step's autocast, in the weights' dtype.
@pytest.mark.parametrize("task,extra", [("grpo", ["rl_loss=dr_grpo", "trainer.precision=bf16-mixed"]),
                                        ("ppo", ["task.epochs=2", "rl_loss=ppo"])])
def test_rl_stages_log_every_metric_the_issue_names(data, tmp_path, task, extra):
    results, ckpt = run_stage(data, tmp_path, task, "task.rollout_batch_size=8", "task.group_size=4",
                              "task.micro_batch_size=4", "task.max_new_tokens=4", "reward=exact_match",
                              "rl_loss.kl=k3", "rl_loss.kl_coef=0.1", *extra)
    for key in ("train/reward_mean", "train/reward_std", "train/accuracy", "train/response_length", "train/entropy",
                "train/kl", "train/clip_fraction", "train/grad_norm", "train/rollout_tokens_per_s", "val/accuracy",
                "val/response_length"):
        assert key in results and math.isfinite(results[key]), key
    assert 0 <= results["val/accuracy"] <= 1 and results["train/rollout_tokens_per_s"] > 0
    assert load(ckpt)[2].task.name == task


def test_rl_epochs_stop_at_exactly_max_steps_optimizer_steps(data, tmp_path):
    """Two optimizer steps per rollout batch and trainer.max_steps=3: the second batch takes one, so the
    optimizer, the schedule (built for 3 steps) and the step counter all end at 3, not 4."""
    _, ckpt = run_stage(data, tmp_path, "grpo", "task.epochs=2", "task.rollout_batch_size=8", "task.group_size=4",
                        "task.micro_batch_size=4", "task.max_new_tokens=4", "rl_loss.kl=k3", "rl_loss.kl_coef=0.05",
                        "trainer.max_steps=3", "trainer.val_every=2")
    saved = torch.load(ckpt, weights_only=False)
    assert saved["global_step"] == 3
    assert saved["lr_schedulers"][0]["last_epoch"] == 3
    assert {float(s["step"]) for s in saved["optimizer_states"][0]["state"].values()} == {3.0}


# Every task's fit stops itself at the last step (build_trainer's StopAtLastStep), so Lightning validates there.
@pytest.mark.parametrize("task,overrides,expected", [
    ("sft", ["task.batch_size=4", "trainer.max_steps=5", "trainer.val_every=3"], [3, 5]),
    # val_every counts rollout batches: 2 batches of 2 steps reach max_steps=3 before the 5th batch.
    ("grpo", ["task.epochs=2", "task.rollout_batch_size=8", "task.group_size=4", "task.max_new_tokens=4",
              "trainer.max_steps=3", "trainer.val_every=5"], [3]),
])
def test_the_last_step_of_a_stage_validates(data, tmp_path, monkeypatch, task, overrides, expected):
    from lmlab.alignment.tasks.stage import StageModule

    validated, end = [], StageModule.on_validation_epoch_end

    def recording(module):
        validated.append(module.global_step)
        end(module)

    monkeypatch.setattr(StageModule, "on_validation_epoch_end", recording)
    run_stage(data, tmp_path, task, *overrides)
    assert validated == expected


def test_gsm8k_answers_keep_the_final_number(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "How many?", "answer": "2 + 3 = 5\n#### 1,005"}) + "\n")
    assert read_prompts_jsonl(path, "question", "answer") == [("How many?", "1005")]


@pytest.mark.parametrize("task,overrides,match", [
    ("grpo", ["task.group_size=3"], "task.group_size=3 does not divide task.rollout_batch_size=64"),
    ("grpo", ["task.micro_batch_size=5"], "task.micro_batch_size=5 does not divide"),
    ("grpo", ["rl_loss=ppo"], "task=ppo takes rl_loss=ppo"),
    ("ppo", [], "task=ppo takes rl_loss=ppo"),
    ("grpo", ["task.max_new_tokens=30"], "prompts are longer than 2 tokens"),
    # No room for a prompt (TINY's context is 32): the setting and the context, not "longer than 0 tokens".
    ("grpo", ["task.max_new_tokens=32"], "task.max_new_tokens=32 must be below the model's context, model.max_seq_len=32"),
    ("grpo", ["task.max_new_tokens=40"], "task.max_new_tokens=40 must be below the model's context, model.max_seq_len=32"),
    ("dpo", ["task.reference=/nonexistent.ckpt"], "^task.reference=/nonexistent.ckpt is not a file"),
    ("grpo", ["trainer.accumulate_grad_batches=2"], "accumulates with task.micro_batch_size"),
    ("sft", ["init_from=null"], "set init_from="),
    ("sft", ["init_from=/nonexistent.ckpt"], "init_from=/nonexistent.ckpt is not a file"),
    ("sft", ["task.data=/nonexistent.jsonl"], "is not a file"),
])
def test_bad_input_fails_before_any_work(data, tmp_path, task, overrides, match):
    with pytest.raises((ConfigError, RegistryError), match=match):
        run_stage(data, tmp_path, task, *overrides)
    assert not (tmp_path / task / "checkpoints").exists()


def test_unknown_loss_and_reward_names_are_registry_errors(data, tmp_path):
    with pytest.raises(Exception, match="rl_loss.*grpo"):
        run_stage(data, tmp_path, "grpo", "rl_loss=grpo")
    with pytest.raises(Exception, match="reward.*exact"):
        run_stage(data, tmp_path, "grpo", "reward=exact")


def test_a_reference_of_another_architecture_is_refused(data, tmp_path):
    other = train_tiny(tmp_path / "other", 2, "model.n_layers=1")
    with pytest.raises(ConfigError, match="has another architecture"):
        run_stage(data, tmp_path, "dpo", f"task.reference={other}")


def test_a_command_line_override_of_the_policys_model_is_refused_not_ignored(data, tmp_path, monkeypatch, capsys):
    from hydra.core.global_hydra import GlobalHydra

    from lmlab.cli.app import run_hydra_app
    from lmlab.cli.train import _train

    monkeypatch.setattr("sys.argv", ["pytest"])  # run_hydra_app hands its argv to Hydra through sys.argv
    argv = ["task=sft", f"task.data={data['sft']}", f"init_from={data['policy']}", "model.d_model=64",
            f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"]
    try:
        with pytest.raises(SystemExit) as ended:
            run_hydra_app("lmlab-train", "train", _train, argv)
    finally:
        GlobalHydra.instance().clear()
    assert ended.value.code == 2 and "model.d_model would be ignored" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()
