"""lmlab.load, the CS336-shaped save_checkpoint/load_checkpoint, and unreadable checkpoint files."""

import io
import logging

import pytest
import torch
from omegaconf import DictConfig

import lmlab
from lmlab.cli.compose import compose_config
from lmlab.errors import ConfigError
from lmlab.nn.transformer import Transformer
from lmlab.optim import OPTIMIZERS
from lmlab.training import load_checkpoint, save_checkpoint, train
from lmlab.training.checkpoints import TOKENIZER_KEY, model_weights, read_checkpoint
from tests.conftest import TINY


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    overrides = [*TINY, f"cache_dir={folder / 'cache'}", "trainer.max_steps=4", "sched.warmup_steps=1",
                 "trainer.val_every=4"]
    train(compose_config(overrides), folder)
    return folder


def test_load_gives_model_tokenizer_and_config(run_dir):
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    model, tokenizer, config = lmlab.load(ckpt)
    assert isinstance(model, Transformer) and not model.training
    assert isinstance(config, DictConfig) and config.model.d_model == 32 and config.trainer.max_steps == 4
    ids = torch.tensor([tokenizer.encode("def f(x):\n    return x  # ünïcode<|endoftext|>")])
    assert ids[0, -1] == tokenizer.eot_id
    reference = Transformer(config.model, tokenizer.vocab_size)
    reference.load_state_dict(model_weights(torch.load(ckpt, weights_only=False)))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference.eval()(ids), rtol=0, atol=0)


def test_load_falls_back_to_the_settings_for_a_checkpoint_without_its_tokenizer(run_dir, tmp_path, caplog):
    old = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    packed = old.pop(TOKENIZER_KEY)
    torch.save(old, tmp_path / "old.ckpt")
    with caplog.at_level(logging.WARNING):
        _, tokenizer, _ = lmlab.load(tmp_path / "old.ckpt")  # the cached tokenizer of the same data
    assert "holds no tokenizer" in caplog.text
    assert tokenizer.fingerprint() == packed["fingerprint"]


@pytest.mark.parametrize("content", [b"not a checkpoint at all", "truncated"])
def test_an_unreadable_checkpoint_is_one_clear_error(run_dir, tmp_path, content):
    bad = tmp_path / "bad.ckpt"
    whole = (run_dir / "checkpoints" / "last.ckpt").read_bytes()
    bad.write_bytes(whole[: len(whole) // 2] if content == "truncated" else content)
    for read in (lambda: read_checkpoint(bad, "init_from"), lambda: lmlab.load(bad)):
        with pytest.raises(ConfigError, match=f"{bad} cannot be read as a checkpoint") as err:
            read()
        assert "\n" not in str(err.value)


def test_train_rejects_an_unreadable_checkpoint_before_work(tmp_path, make_cfg, tiny_overrides):
    (tmp_path / "bad.ckpt").write_bytes(b"\x00" * 100)
    for key in ("init_from", "ckpt_path"):
        with pytest.raises(ConfigError, match=f"{key}={tmp_path / 'bad.ckpt'} cannot be read as a checkpoint"):
            train(make_cfg([*tiny_overrides, f"{key}={tmp_path / 'bad.ckpt'}"]), tmp_path / "run")
        assert not (tmp_path / "run").exists()


def _steps(model, optimizer, n: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(4, 8, generator=generator)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("to_file", [False, True])
def test_save_and_load_checkpoint_continue_a_loop_exactly(tmp_path, optim, to_file):
    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        return model, OPTIMIZERS.build({"name": optim}, model)

    model, optimizer = fresh()
    _steps(model, optimizer, 3, seed=1)
    out = io.BytesIO() if to_file else tmp_path / "ckpt.pt"
    save_checkpoint(model, optimizer, 3, out)
    _steps(model, optimizer, 2, seed=2)

    restored, restored_optimizer = fresh()
    if to_file:
        out.seek(0)
    assert load_checkpoint(out, restored, restored_optimizer) == 3
    _steps(restored, restored_optimizer, 2, seed=2)
    for a, b in zip(model.parameters(), restored.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if not to_file:
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind


def test_load_checkpoint_names_an_unreadable_file(tmp_path):
    model = torch.nn.Linear(2, 2)
    (tmp_path / "x.pt").write_text("garbage")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'x.pt'} cannot be read as a checkpoint"):
        load_checkpoint(tmp_path / "x.pt", model, torch.optim.SGD(model.parameters(), lr=0.1))
