"""What the multimodal tasks share: synthetic captioned images rendered once into tensors, captions as a text
source for the tokenizer, the single-process check, and the Lightning run that fits a module and saves
`checkpoints/last.ckpt` (task=vqvae, early_fusion, contrastive and vlm)."""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from lmlab.checks import at_least
from lmlab.data.sources import TextSource
from lmlab.errors import ConfigError
from lmlab.multimodal.synthetic import SyntheticImageText
from lmlab.training.checkpoints import CONFIG_KEY
from lmlab.training.loggers import build_logger, final_scalars
from lmlab.training.module import METRICS_KEY, optimizer_and_schedule
from lmlab.training.progress import quiet_library_noise
from lmlab.training.resume import resolve_auto_resume
from lmlab.training.run import build_trainer
from lmlab.training.tasks import check_single_process

log = logging.getLogger(__name__)

VAL_SEED_OFFSET = 1_000_003  # the held-out scenes' seed: seed + this, so they are drawn apart from training's


@dataclass
class SyntheticImagesConfig:
    """Synthetic captioned scenes (lmlab.multimodal.synthetic), seeded by the run's `seed`."""

    train_images: int = 8192  # scenes rendered once, then shuffled each pass
    val_images: int = 512  # drawn with another seed
    batch_size: int = 64  # images (vqvae) or rows (early_fusion: two per image) per optimizer step
    glyph_fraction: float = 0.0  # share of scenes that show a digit or letter instead of shapes

    def __post_init__(self) -> None:
        at_least("task", self, 1, "train_images", "val_images", "batch_size")
        if not 0 <= self.glyph_fraction <= 1:
            raise ConfigError(f"task.glyph_fraction must be in [0, 1], got {self.glyph_fraction}")
        super_post_init = getattr(super(), "__post_init__", None)
        if super_post_init is not None:  # a Config that also extends another dataclass with checks
            super_post_init()


@dataclass
class ImageSet:
    images: torch.Tensor  # (N, 3, S, S) in [0, 1]
    captions: list[str]
    scenes: list


def synthetic_images(n: int, size: int, seed: int, glyph_fraction: float) -> ImageSet:
    """`n` seeded scenes rendered into one tensor, so that training reads no PIL in its loop."""
    data = SyntheticImageText(n, size=size, seed=seed, glyph_fraction=glyph_fraction)
    items = [data[i] for i in range(n)]
    return ImageSet(torch.stack([item["image"] for item in items]), [item["caption"] for item in items],
                    [item["scene"] for item in items])


def train_and_val_images(t: SyntheticImagesConfig, size: int, seed: int) -> tuple[ImageSet, ImageSet]:
    return (synthetic_images(t.train_images, size, seed, t.glyph_fraction),
            synthetic_images(t.val_images, size, seed + VAL_SEED_OFFSET, t.glyph_fraction))


class ImageTaskModule(L.LightningModule):
    """Base of the two tasks' modules: the `optim`/`sched` entries on `trainable()`, clipping to
    trainer.grad_clip, and the run's config and last numbers in every checkpoint."""

    def __init__(self, cfg: DictConfig):
        super().__init__()
        self.cfg = cfg

    def trainable(self) -> torch.nn.Module:
        raise NotImplementedError

    def configure_optimizers(self):
        return optimizer_and_schedule(self, self.cfg, self.trainable())

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.log("train/grad_norm", torch.nn.utils.clip_grad_norm_(params, self.cfg.trainer.grad_clip or math.inf))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[CONFIG_KEY] = OmegaConf.to_container(self.cfg, resolve=True)
        checkpoint[METRICS_KEY] = final_scalars(self.trainer)


class CaptionSource(TextSource):
    """Captions as the documents a tokenizer (tokenizer=bpe) trains on, and is cached by."""

    def __init__(self, captions: list[str]):
        self.captions = captions

    def documents(self) -> Iterator[str]:
        return iter(self.captions)

    def fingerprint(self) -> str:
        return "captions-" + hashlib.sha256("\n".join(self.captions).encode()).hexdigest()[:20]


def fit(cfg: DictConfig, output_dir: Path, module: L.LightningModule, datamodule: L.LightningDataModule,
        sweep_metric: str = "val/loss") -> tuple[L.Trainer, dict[str, float]]:
    """Fit with lmlab-train's Trainer (validating every trainer.val_every steps and after the last), save
    checkpoints/last.ckpt; returns the trainer and the final numbers, `val_loss` being `sweep_metric`
    (the number lmlab-train reports to a sweep)."""
    logger = build_logger(cfg.logger, output_dir)
    trainer = build_trainer(cfg, output_dir, logger, "auto")
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    # The last step validated inside fit (build_trainer's StopAtLastStep); a run resumed when already finished
    # trained no step, so validates here.
    if sweep_metric not in trainer.callback_metrics:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.save_checkpoint(output_dir / "checkpoints" / "last.ckpt", weights_only=False)
    results = final_scalars(trainer)
    results["val_loss"] = results.get(sweep_metric, math.nan)
    logger.finish(OmegaConf.to_container(cfg, resolve=True), {f"hp/{k}": v for k, v in results.items()},
                  trainer.global_step)
    return trainer, results


def prepare(cfg: DictConfig, output_dir: str | Path) -> tuple[DictConfig, Path]:
    """The common start of a run: library noise down, ckpt_path=auto resolved, one process, seeded."""
    quiet_library_noise()
    output_dir = Path(output_dir)
    cfg = resolve_auto_resume(cfg, output_dir)
    check_single_process(cfg)
    if cfg.init_from:
        raise ConfigError(f"task={cfg.task.name} trains from scratch; init_from is not read (resume with ckpt_path)")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    return cfg, output_dir
