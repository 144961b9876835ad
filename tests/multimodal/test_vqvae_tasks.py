"""task=vqvae and task=early_fusion: bad settings fail before any work, and (slow) short lmlab-train runs of
both write what the other and the user read: checkpoints, metrics, PNGs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from lmlab.errors import ConfigError
from lmlab.training.tasks import TASKS
from tests.conftest import run_cli

TINY_VQVAE = ["task=vqvae", "task.train_images=64", "task.val_images=16", "task.batch_size=16", "task.hidden=16",
              "task.res_blocks=1", "codebook.size=32", "codebook.dim=8", "trainer.max_steps=12",
              "trainer.val_every=6", "trainer.log_every=3", "trainer.progress_bar=false", "logger=csv"]
TINY_FUSION = ["task=early_fusion", "tokenizer=byte", "task.train_images=64", "task.val_images=16",
               "task.batch_size=16", "task.caption_eval=4", "task.samples=3", "model.d_model=32", "model.n_layers=1",
               "model.attention.n_heads=2", "model.max_seq_len=112", "trainer.max_steps=8", "trainer.val_every=4",
               "trainer.log_every=2", "trainer.progress_bar=false", "logger=csv"]


@pytest.mark.parametrize("codebook", ["ema", "straight_through"])
def test_codebook_size_zero_fails_before_any_work(make_cfg, tmp_path, codebook):
    cfg = make_cfg(["task=vqvae", f"codebook={codebook}", "codebook.size=0"])
    with pytest.raises(ConfigError, match="codebook.size=0: a codebook needs at least one code"):
        TASKS.build(cfg.task).run(cfg, tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_early_fusion_needs_a_vqvae_checkpoint(make_cfg, tmp_path):
    cfg = make_cfg(["task=early_fusion", f"task.vqvae={tmp_path / 'nope.ckpt'}"])
    with pytest.raises(ConfigError, match="task.vqvae=.*nope.ckpt is not a file"):
        TASKS.build(cfg.task).run(cfg, tmp_path)


def test_early_fusion_asks_for_no_more_images_than_it_has(make_cfg, tmp_path):
    (tmp_path / "v.ckpt").touch()
    cfg = make_cfg(["task=early_fusion", f"task.vqvae={tmp_path / 'v.ckpt'}", "task.val_images=4", "task.samples=8"])
    with pytest.raises(ConfigError, match="task.val_images=4 is fewer"):
        TASKS.build(cfg.task).run(cfg, tmp_path)


def test_vqvae_runs_in_one_process(make_cfg, tmp_path):
    cfg = make_cfg(["task=vqvae", "parallel=ddp", "trainer.devices=2"])
    with pytest.raises(ConfigError, match="task=vqvae runs in one process"):
        TASKS.build(cfg.task).run(cfg, tmp_path)


def _last_metrics(run: Path) -> dict[str, float]:
    (metrics,) = run.glob("csv/**/metrics.csv")
    last: dict[str, float] = {}
    for row in csv.DictReader(metrics.read_text().splitlines()):
        last |= {k: float(v) for k, v in row.items() if v not in ("", None)}
    return last


@pytest.mark.slow
def test_vqvae_then_early_fusion_end_to_end(tmp_path):
    from lmlab.multimodal.early_fusion_task import load_early_fusion
    from lmlab.multimodal.vqvae import load_vqvae

    vq_run, fusion_run = tmp_path / "vq", tmp_path / "fusion"
    done = run_cli(["lmlab-train", *TINY_VQVAE, f"hydra.run.dir={vq_run}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = _last_metrics(vq_run)
    for key in ("train/loss", "val/recon_mse", "val/codebook_usage", "val/codebook_perplexity"):
        assert key in metrics
    assert 0 < metrics["val/codebook_usage"] <= 1 and 1 <= metrics["val/codebook_perplexity"] <= 32
    assert Image.open(vq_run / "reconstructions.png").size[1] > 2 * 32  # originals above reconstructions
    vqvae = load_vqvae(vq_run / "checkpoints" / "last.ckpt")
    assert vqvae.n_codes == 64 and vqvae.codebook.size == 32

    done = run_cli(["lmlab-train", *TINY_FUSION, f"task.vqvae={vq_run / 'checkpoints' / 'last.ckpt'}",
                    f"hydra.run.dir={fusion_run}", f"cache_dir={tmp_path / 'cache'}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = _last_metrics(fusion_run)
    for key in ("train/loss", "val/loss", "val/image_loss", "val/caption_loss", "val/caption_accuracy"):
        assert key in metrics
    assert len(json.loads((fusion_run / "samples.json").read_text())) == 3
    assert Image.open(fusion_run / "samples.png").size[0] > 3 * 32
    model, tokenizer, vocab, frozen = load_early_fusion(fusion_run / "checkpoints" / "last.ckpt")
    assert (vocab.text_size, vocab.n_codes) == (257, 32)
    assert model.vocab_size >= vocab.size
    assert all(torch.equal(a, b) for a, b in zip(frozen.state_dict().values(), vqvae.state_dict().values()))
