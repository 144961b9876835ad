"""`task=vqvae`: a VQ-VAE image tokenizer trained on synthetic captioned images.

    lmlab-train task=vqvae codebook=ema codebook.size=512 task.downsample=4 trainer.max_steps=2000

Logs train/loss (reconstruction MSE + the codebook's terms) and its terms, and at each validation
val/loss, val/recon_mse (of the clamped reconstructions), val/codebook_usage (fraction of codes used over
the validation images) and val/codebook_perplexity. Writes checkpoints/last.ckpt, which
`task=early_fusion task.vqvae=...` and `load_vqvae` read, and reconstructions.png (originals above their
reconstructions) at the end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import torchmetrics
from omegaconf import DictConfig

from lmlab.alignment.tasks.stage import ItemsData
from lmlab.multimodal.codebook import CodeUsage
from lmlab.multimodal.grid import save_image_grid
from lmlab.multimodal.image_task import ImageTaskModule, SyntheticImagesConfig, fit, prepare, train_and_val_images
from lmlab.multimodal.vqvae import VQVAE, VQVAE_CONFIG_KEY, VQVAEConfig, build_vqvae, net_config, vqvae_config
from lmlab.training.tasks import TASKS, Task

log = logging.getLogger(__name__)

GRID_IMAGES = 16  # originals and reconstructions shown in reconstructions.png


class VQVAEModule(ImageTaskModule):
    def __init__(self, cfg: DictConfig, vqvae: VQVAE):
        super().__init__(cfg)
        self.vqvae = vqvae
        self.val_loss = torchmetrics.MeanMetric()
        self.val_mse = torchmetrics.MeanMetric()
        self.usage = CodeUsage(vqvae.codebook.size)

    def trainable(self) -> torch.nn.Module:
        return self.vqvae

    def training_step(self, images: torch.Tensor, batch_idx: int) -> torch.Tensor:
        out = self.vqvae(images)
        self.log("train/loss", out.loss, prog_bar=True)
        self.log_dict({f"train/{k}": v for k, v in out.terms.items()})
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        if hasattr(self.vqvae.codebook, "restarts"):
            self.log("train/code_restarts", float(self.vqvae.codebook.restarts))
        return out.loss

    def on_validation_epoch_start(self) -> None:
        self.usage = CodeUsage(self.vqvae.codebook.size, self.device)

    def validation_step(self, images: torch.Tensor, batch_idx: int) -> None:
        out = self.vqvae(images)
        n = len(images)
        self.val_loss.update(out.loss.float(), n)
        self.val_mse.update(F.mse_loss(out.reconstruction.float().clamp(0, 1), images.float()), n)
        self.usage.update(out.quantized.codes)

    def on_validation_epoch_end(self) -> None:
        self.log_dict({"val/loss": self.val_loss.compute(), "val/recon_mse": self.val_mse.compute(),
                       "val/codebook_usage": self.usage.fraction_used(),
                       "val/codebook_perplexity": self.usage.perplexity()}, prog_bar=True)
        self.val_loss.reset()
        self.val_mse.reset()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[VQVAE_CONFIG_KEY] = vqvae_config(self.vqvae)


@TASKS.register("vqvae")
class VQVAETask(Task):
    """A VQ-VAE image tokenizer (conv encoder/decoder, the `codebook` entry) on synthetic captioned images."""

    @dataclass
    class Config(SyntheticImagesConfig, VQVAEConfig):
        pass

    def run(self, cfg: DictConfig, output_dir: str | Path) -> dict[str, float]:
        cfg, output_dir = prepare(cfg, output_dir)
        t: VQVAETask.Config = self.cfg
        vqvae = build_vqvae(net_config(t), cfg.codebook)  # a bad codebook entry or size fails before rendering
        train, val = train_and_val_images(t, t.image_size, cfg.seed)
        log.info("vqvae: %.2fM parameters, %d x %d codes per image from a %d-code %s codebook; %d training and %d "
                 "validation images", sum(p.numel() for p in vqvae.parameters()) / 1e6, vqvae.grid, vqvae.grid,
                 vqvae.codebook.size, cfg.codebook.name, len(train.images), len(val.images))
        module = VQVAEModule(cfg, vqvae)
        data = ItemsData(train.images, val.images, t.batch_size, collate=torch.stack, seed=cfg.seed)
        _, results = fit(cfg, output_dir, module, data, sweep_metric="val/recon_mse")
        vqvae.eval()  # on the CPU: Lightning moves the module back after fit
        originals = val.images[:GRID_IMAGES]
        with torch.no_grad():
            reconstructions = vqvae(originals.to(module.device)).reconstruction
        grid = save_image_grid([originals, reconstructions.cpu()], output_dir / "reconstructions.png")
        log.info("task=vqvae: val/recon_mse %.4g, val/codebook_usage %.3f, val/codebook_perplexity %.1f; %s; "
                 "outputs in %s", results.get("val/recon_mse", float("nan")), results.get("val/codebook_usage", 0.0),
                 results.get("val/codebook_perplexity", float("nan")), grid.name, output_dir)
        return results
