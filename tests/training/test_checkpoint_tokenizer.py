"""Checkpoints carry their tokenizer: resuming or starting from one on other data keeps its token ids."""

import logging

import pytest
import torch
from pydoc_data import topics

from lmlab.cli.compose import compose_config as config
from lmlab.errors import ConfigError
from lmlab.training import train
from lmlab.training.checkpoints import TOKENIZER_KEY
from tests.conftest import TINY

TOPICS = sorted(topics.topics)


def corpus(folder, name: str, keys: list[str], prefix: str = "") -> list[str]:
    path = folder / f"{name}.txt"
    path.write_text(prefix + "\n\n".join(topics.topics[k] for k in keys), encoding="utf-8")
    return ["data=text_files", f"data.paths=[{path}]"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A short run on corpus X (half the pydoc topics). Corpus Y is the other half after a made-up
    word so frequent that a BPE trained on Y merges it first, shifting the ids of every later merge;
    its validation tail is pydoc text, which the trained weights know."""
    folder = tmp_path_factory.mktemp("first")
    common = [*TINY, f"cache_dir={folder / 'cache'}"]
    x, y = corpus(folder, "x", TOPICS[0::2]), corpus(folder, "y", TOPICS[1::2], prefix=" qzv" * 20_000 + "\n\n")
    results = train(config([*common, *x, "trainer.max_steps=60", "trainer.val_every=30"]), folder / "run")
    return {"common": common, "x": x, "y": y, "folder": folder, "results": results,
            "ckpt": folder / "run" / "checkpoints" / "last.ckpt"}


def same_tokenizer(run, first_run) -> bool:
    """The run used the first run's tokenizer: the same merges in its folder and in its checkpoint."""
    first = first_run["ckpt"].parents[1]
    return ((run / "merges.txt").read_text() == (first / "merges.txt").read_text()
            and saved_tokenizer(run / "checkpoints" / "last.ckpt") == saved_tokenizer(first_run["ckpt"]))


def saved_tokenizer(ckpt):
    return torch.load(ckpt, weights_only=True)[TOKENIZER_KEY]


def test_init_from_on_other_data_uses_the_checkpoints_tokenizer(first_run, tmp_path):
    on_y = [*first_run["common"], *first_run["y"], "trainer.max_steps=1", "sched.warmup_steps=0"]
    fresh = train(config(on_y), tmp_path / "fresh")
    started = train(config([*on_y, f"init_from={first_run['ckpt']}"]), tmp_path / "init")
    assert same_tokenizer(tmp_path / "init", first_run) and not same_tokenizer(tmp_path / "fresh", first_run)
    # The trained weights read Y with the ids they learned: far better than a fresh model (~ln 320).
    assert started["initial_val_loss"] < fresh["initial_val_loss"] - 1.0
    assert started["initial_val_loss"] < first_run["results"]["val_loss"] + 0.5


def test_resume_on_other_data_uses_the_checkpoints_tokenizer(first_run, tmp_path):
    # tokenizer.num_workers changes how fast a BPE trains, never its ids: no conflict
    overrides = [*first_run["common"], *first_run["y"], "trainer.max_steps=61", "tokenizer.num_workers=1",
                 f"ckpt_path={first_run['ckpt']}"]
    results = train(config(overrides), tmp_path / "resumed")
    assert same_tokenizer(tmp_path / "resumed", first_run)
    assert results["val_loss"] < first_run["results"]["val_loss"] + 0.5


@pytest.mark.parametrize("extra,match", [
    (["tokenizer=byte"], r"different tokenizer config:\n  tokenizer: checkpoint 'bpe', now 'byte'\n"),
    (["tokenizer.vocab_size=320", "tokenizer.path=/elsewhere"], r"tokenizer.path: checkpoint None, now '/elsewhere'"),
    (["tokenizer.vocab_size=512"], r"tokenizer.vocab_size: checkpoint 320, now 512"),
])
def test_other_tokenizer_settings_are_refused_before_work(first_run, tmp_path, extra, match):
    overrides = [*(o for o in first_run["common"] if not o.startswith("tokenizer.")), *first_run["y"], *extra]
    for key in ("init_from", "ckpt_path"):
        with pytest.raises(ConfigError, match="(?s)" + match + ".*it brings its tokenizer"):
            train(config([*overrides, f"{key}={first_run['ckpt']}"]), tmp_path / key)
        assert not (tmp_path / key).exists()


def test_a_checkpoint_without_its_tokenizer_still_starts_a_run_with_a_warning(first_run, tmp_path, caplog):
    old = torch.load(first_run["ckpt"], weights_only=False)
    del old[TOKENIZER_KEY]
    torch.save(old, tmp_path / "old.ckpt")
    overrides = [*first_run["common"], *first_run["x"], "trainer.max_steps=1", "sched.warmup_steps=0",
                 f"init_from={tmp_path / 'old.ckpt'}"]
    with caplog.at_level(logging.WARNING):
        results = train(config(overrides), tmp_path / "run")
    assert "holds no tokenizer" in caplog.text
    # The same data, so today's behaviour trains (here: finds in the cache) the same tokenizer.
    assert results["initial_val_loss"] < first_run["results"]["val_loss"] + 0.5


def test_an_upcycled_checkpoint_keeps_the_tokenizer(first_run, tmp_path):
    from lmlab.cli.upcycle import upcycle_checkpoint

    upcycle_checkpoint(first_run["ckpt"], ["model/moe=topk", "model.moe.n_experts=2"], tmp_path / "moe.ckpt", 0.0, 0)
    assert saved_tokenizer(tmp_path / "moe.ckpt") == saved_tokenizer(first_run["ckpt"])
