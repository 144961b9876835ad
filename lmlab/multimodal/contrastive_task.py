"""`task=contrastive`: a vision encoder and a text Transformer trained with a contrastive loss (CLIP, SigLIP).

    lmlab-train task=contrastive contrastive_loss=siglip vision_encoder.width=64 model.d_model=64

Parts come from their groups: `vision_encoder` (the image tower), `model` (the text tower, read at the
end-of-text token: lmlab.multimodal.dual_encoder), `tokenizer` (trained on the training captions, or
loaded), `contrastive_loss`, `image_data` (pairs; its zero-shot set gives val/zero_shot_acc), `optim`,
`sched` and `trainer`. Logged: train/loss, train/logit_scale (and train/logit_bias for SigLIP), val/loss
on held-out pairs of the trained classes, and val/zero_shot_acc: images of held-out classes classified by
their nearest candidate caption.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.multimodal.data import IMAGE_DATA, ImageTextSplits
from lmlab.multimodal.dual_encoder import CaptionTokens, DualEncoder, zero_shot_accuracy
from lmlab.multimodal.image_task import CaptionSource, fit
from lmlab.tokenizers import TOKENIZERS
from lmlab.tokenizers.base import Tokenizer, pack_tokenizer
from lmlab.training.checkpoints import CONFIG_KEY, TOKENIZER_KEY
from lmlab.training.loggers import final_scalars
from lmlab.training.module import METRICS_KEY, optimizer_and_schedule
from lmlab.training.progress import quiet_library_noise
from lmlab.training.resume import resolve_auto_resume
from lmlab.training.tasks import TASKS, Task, check_single_process

log = logging.getLogger(__name__)


class ContrastiveModule(L.LightningModule):
    """The dual encoder (`model`) trained on batches {"images", "ids", "last"}; validation adds
    val/zero_shot_acc on the data's zero-shot set when it has one."""

    def __init__(self, cfg: DictConfig, tokenizer: Tokenizer, data: ImageTextSplits):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tokens = CaptionTokens(tokenizer, cfg.model.max_seq_len)
        self.model = DualEncoder.from_config(cfg, tokenizer.vocab_size)
        self.zero_shot = data.zero_shot
        self.val_loss = torchmetrics.MeanMetric()

    def configure_optimizers(self):
        return optimizer_and_schedule(self, self.cfg, self.model)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.log("train/grad_norm", torch.nn.utils.clip_grad_norm_(params, self.cfg.trainer.grad_clip or math.inf))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        out = self.model(batch["images"], batch["ids"], batch["last"])
        self.log("train/loss", out["loss"], prog_bar=True)
        self.log("train/logit_scale", out["logit_scale"])
        if "logit_bias" in out:
            self.log("train/logit_bias", out["logit_bias"])
        return out["loss"]

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.val_loss.update(self.model(batch["images"], batch["ids"], batch["last"])["loss"], len(batch["ids"]))

    def on_validation_epoch_end(self) -> None:
        metrics = {"val/loss": self.val_loss.compute()}
        self.val_loss.reset()
        if self.zero_shot is not None:
            acc = zero_shot_accuracy(self.model, self.zero_shot, self.tokens, self.cfg.task.batch_size)
            metrics["val/zero_shot_acc"] = torch.tensor(acc, device=self.device)
        self.log_dict(metrics, prog_bar=True)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[CONFIG_KEY] = OmegaConf.to_container(self.cfg, resolve=True)
        checkpoint[TOKENIZER_KEY] = pack_tokenizer(self.tokenizer)
        checkpoint[METRICS_KEY] = final_scalars(self.trainer)


class PairCollate:
    """Items {"image", "caption"} -> a batch {"images", "ids", "last"} (a class, so DataLoader workers can pickle it)."""

    def __init__(self, tokens: CaptionTokens):
        self.tokens = tokens

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        ids, last = self.tokens([item["caption"] for item in items])
        return {"images": torch.stack([item["image"] for item in items]), "ids": ids, "last": last}


class PairsData(L.LightningDataModule):
    """Training pairs in seeded shuffled batches (the last incomplete one dropped: every contrastive batch has
    the same size), validation pairs in order."""

    def __init__(self, data: ImageTextSplits, batch_size: int, collate, seed: int, num_workers: int):
        super().__init__()
        self.data, self.batch_size, self.collate, self.seed, self.num_workers = data, batch_size, collate, seed, num_workers

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data.train, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          collate_fn=self.collate, generator=torch.Generator().manual_seed(self.seed),
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data.val, batch_size=self.batch_size, collate_fn=self.collate,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)


@TASKS.register("contrastive")
class Contrastive(Task):
    """CLIP/SigLIP: image and text encoders trained contrastively on image_data; val/zero_shot_acc on held-out classes."""

    @dataclass
    class Config:
        embed_dim: int = 64  # the shared embedding space both towers project into
        batch_size: int = 64  # pairs per step: the negatives each image is contrasted with
        num_workers: int = 0  # DataLoader processes that render or read the images

        def __post_init__(self) -> None:
            at_least("task", self, 1, "embed_dim", "batch_size")
            at_least("task", self, 0, "num_workers")

    def check(self, cfg: DictConfig, data: ImageTextSplits) -> None:
        check_single_process(cfg)
        if cfg.init_from:
            raise ConfigError("task=contrastive trains both towers from scratch; init_from is not used (unset it)")
        if len(data.train) < self.cfg.batch_size:
            raise ConfigError(f"image_data has {len(data.train)} training pairs, fewer than task.batch_size="
                              f"{self.cfg.batch_size}; lower the batch size or add pairs")

    def run(self, cfg: DictConfig, output_dir: str | Path) -> dict[str, float]:
        output_dir = Path(output_dir)
        quiet_library_noise()
        cfg = resolve_auto_resume(cfg, output_dir)
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        image_size = OmegaConf.to_object(cfg.vision_encoder).image_size  # the size every image is converted to
        data = IMAGE_DATA.build(cfg.image_data).load(image_size, cfg.seed)
        self.check(cfg, data)
        tokenizer = TOKENIZERS.build(cfg.tokenizer, CaptionSource(data.train_captions), cfg.cache_dir,
                                     cfg.trainer.progress_bar)
        module = ContrastiveModule(cfg, tokenizer, data)
        log.info("contrastive: %d training pairs, %d validation pairs, %s zero-shot images; %.2fM image and %.2fM "
                 "text parameters", len(data.train), len(data.val),
                 len(data.zero_shot.targets) if data.zero_shot else "no",
                 sum(p.numel() for p in module.model.image_encoder.parameters()) / 1e6,
                 sum(p.numel() for p in module.model.text_encoder.parameters()) / 1e6)
        datamodule = PairsData(data, self.cfg.batch_size, PairCollate(module.tokens), cfg.seed, self.cfg.num_workers)
        tokenizer.save(output_dir)
        _, results = fit(cfg, output_dir, module, datamodule)
        log.info("task=contrastive: %s; outputs in %s", ", ".join(
            f"{k} {v:.4g}" for k, v in sorted(results.items()) if k.startswith("val/")), output_dir)
        return results
