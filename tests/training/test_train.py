"""End to end, in process: the composed real config trains, resumes and rejects bad input."""

import pytest
import torch
from omegaconf import OmegaConf

from lmlab.errors import ConfigError
from lmlab.training import train


def test_short_run_lowers_loss_and_writes_run_folder(make_cfg, tiny_overrides, tmp_path):
    out = tmp_path / "run"
    results = train(make_cfg(tiny_overrides), out)
    assert results["initial_val_loss"] > 5.5  # about ln 320: a uniform guess over the BPE vocab
    assert results["val_loss"] < results["initial_val_loss"] - 1.0
    assert results["tokens_per_s"] > 0
    assert (out / "checkpoints" / "last.ckpt").is_file() and (out / "checkpoints" / "step000010.ckpt").is_file()
    assert (out / "vocab.json").is_file() and (out / "merges.txt").is_file()  # tokenizer.path=<run folder> works
    assert list((out / "tb").glob("events.out.tfevents.*"))


def test_resume_continues_exactly(make_cfg, tiny_overrides, tmp_path):
    straight = tmp_path / "straight"
    train(make_cfg([*tiny_overrides, "trainer.max_steps=20"]), straight)
    resumed = tmp_path / "resumed"
    ckpt = straight / "checkpoints" / "step000010.ckpt"
    train(make_cfg([*tiny_overrides, "trainer.max_steps=20", f"ckpt_path={ckpt}"]), resumed)
    a = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    b = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_a_resumed_run_follows_its_own_schedule_from_its_first_step(make_cfg, tiny_overrides, tmp_path):
    """Resumed with a longer max_steps, the first step's rate is the new schedule's, not the checkpoint's."""
    from lmlab.cli.compare import read_csv
    from lmlab.optim import SCHEDULERS

    short = tmp_path / "short"
    train(make_cfg([*tiny_overrides, "trainer.max_steps=10"]), short)
    longer = [*tiny_overrides, "trainer.max_steps=20", "trainer.log_every=1", "logger=csv"]
    cfg = make_cfg([*longer, f"ckpt_path={short / 'checkpoints' / 'last.ckpt'}"])
    train(cfg, tmp_path / "resumed")
    logged = dict(read_csv(next((tmp_path / "resumed").rglob("metrics.csv")))["lr"])
    lr_at = SCHEDULERS.build(cfg.sched, cfg.optim.lr, 20)
    assert logged[10] == pytest.approx(lr_at(10)) and logged[11] == pytest.approx(lr_at(11))
    assert lr_at(10) > 2 * SCHEDULERS.build(cfg.sched, cfg.optim.lr, 10)(10)  # the old schedule's floor


def test_checkpoint_from_another_model_is_rejected_before_training(make_cfg, tiny_overrides, tmp_path):
    first = tmp_path / "first"
    train(make_cfg([*tiny_overrides, "trainer.max_steps=10"]), first)
    ckpt = first / "checkpoints" / "last.ckpt"
    before = ckpt.read_bytes()
    second = tmp_path / "second"
    with pytest.raises(ConfigError, match=r"different model config:\n  model.d_model: checkpoint 32, now 64"):
        train(make_cfg([*tiny_overrides, "model.d_model=64", f"ckpt_path={ckpt}"]), second)
    assert ckpt.read_bytes() == before and not second.exists()


@pytest.mark.parametrize("extra,match", [
    (["data.context_length=64"], "data.context_length=64 is larger than model.max_seq_len=32"),
    (["data=text_files", "data.paths=[/nonexistent/*.txt]"], "matches no file"),
    (["ckpt_path=/nonexistent.ckpt"], "is not a file"),
    (["sched.warmup_steps=100"], "longer than the run"),
    (["optim.lr=-1"], "learning rate must be > 0"),
    (["model.attention.n_heads=3"], "not divisible"),
    (["model.attention.n_kv_heads=3"], "attention.n_heads=2 is not divisible by attention.n_kv_heads=3"),
    (["model.attention.window=64"], "attention.window=64 is larger than data.context_length=32"),
    (["model.attention.n_heads=8", "model.d_model=24"], "position=rope needs an even head dim"),
    (["trainer.val_every=0"], "trainer.val_every must be >= 1, got 0"),
    (["trainer.log_every=0"], "trainer.log_every must be >= 1, got 0"),
    (["trainer.max_steps=0"], "trainer.max_steps must be >= 1, got 0"),
    (["trainer.precision=bf17"], "trainer.precision=bf17 is not one of Lightning's.*Did you mean 'bf16'"),
    (["trainer.accelerator=foo"], "trainer.accelerator=foo is not one of Lightning's: auto, gpu, cpu"),
    (["model.attention.causal=false"], "causal=false, but a decoder-only language model"),
    (["data.batch_size=0"], "data.batch_size must be >= 1, got 0"),
    (["data.batch_size=-4"], "data.batch_size must be >= 1, got -4"),
    (["data.context_length=0"], "data.context_length must be >= 1, got 0"),
    (["data.val_fraction=1.5"], "data.val_fraction must be in"),
    (["model.n_layers=0"], "model.n_layers must be >= 1, got 0"),
    (["model.d_model=0"], "model.d_model must be >= 1, got 0"),
    (["trainer.accumulate_grad_batches=3"], "data.batch_size=8 is not divisible by 3"),
    (["trainer.grad_noise_scale=true"], "set trainer.accumulate_grad_batches to 2 or more"),
    (["trainer.cuda_graphs=true"], "set trainer.compile=true too"),
    (["trainer.cuda_graphs=true", "trainer.compile=true", "trainer.accumulate_grad_batches=2"],
     "micro-batches cannot accumulate"),
])
def test_bad_input_fails_before_training(make_cfg, tiny_overrides, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        train(make_cfg([*tiny_overrides, *extra]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_empty_corpus_is_a_clear_error(make_cfg, tiny_overrides, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="corpus is empty"):
        train(make_cfg([*tiny_overrides, "data=text_files", f"data.paths=[{tmp_path / 'empty.txt'}]"]), tmp_path / "r")
    assert not (tmp_path / "cache" / "tokenizers").exists()  # said before a tokenizer was trained on nothing


def test_wrong_field_type_fails_at_composition(make_cfg, tiny_overrides):
    with pytest.raises(Exception, match="model.norm.eps"):
        make_cfg([*tiny_overrides, "model.norm.eps=abc"])
    with pytest.raises(Exception, match="trainer.max_steps"):
        make_cfg([*tiny_overrides, "trainer.max_steps=many"])


def test_group_choice_swaps_the_part(make_cfg, tiny_overrides):
    cfg = make_cfg([*tiny_overrides, "model/norm=layernorm", "model/ffn=gelu", "model/position=learned",
                    "model/init=mup", "model.init.base_d_model=16"])
    assert (cfg.model.norm.name, cfg.model.ffn.name, cfg.model.position.name) == ("layernorm", "gelu", "learned")
    assert cfg.model.init.name == "mup" and cfg.model.init.base_d_model == 16
    assert OmegaConf.select(cfg, "model.norm.bias") is True


def test_the_last_training_loss_survives_the_final_validation(make_cfg, tiny_overrides, tmp_path):
    """A run that ends between validations validates once more after fit; the summary still
    reports the training loss of its last logged step."""
    results = train(make_cfg([*tiny_overrides, "trainer.max_steps=7", "trainer.val_every=5", "trainer.log_every=1"]),
                    tmp_path / "run")
    assert 0 < results["train_loss"] < results["initial_val_loss"]


def test_a_run_shorter_than_one_logging_window_reports_its_tokens_per_second(make_cfg, tiny_overrides, tmp_path):
    overrides = ["trainer.max_steps=6", "trainer.log_every=10", "trainer.val_every=6", "sched.warmup_steps=1"]
    results = train(make_cfg([*tiny_overrides, *overrides]), tmp_path / "run")
    assert results["tokens_per_s"] > 0
