"""`task=early_fusion`: an lmlab Transformer (the `model` group) trained on interleaved caption and image
tokens of synthetic captioned images, the images tokenized by a trained `task=vqvae` checkpoint.

    lmlab-train task=early_fusion task.vqvae=outputs/runs/.../checkpoints/last.ckpt

The text tokenizer (the `tokenizer` group; bpe trains on the training captions) comes first in the vocabulary.
Validation logs val/loss (all tokens), val/image_loss (image codes after their caption: text -> image),
val/caption_loss (caption tokens after their image: image -> text) and val/caption_accuracy (greedy captions
of task.caption_eval validation images that equal the scene's caption exactly). At the end it samples images
from task.samples validation captions and captions them with the same model (samples/drawn_caption_match: the
share read back as the caption they were drawn from), and writes samples.png (validation originals, their
VQ-VAE reconstructions, the images drawn from their captions) and samples.json (each caption, the greedy
caption of its image and that of the drawn image). checkpoints/last.ckpt loads with `load_early_fusion`
(its Transformer also with lmlab's `load`, as a text model).
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import torchmetrics
from omegaconf import MISSING, DictConfig, OmegaConf
from torch.utils.data import default_collate

from lmlab.alignment.tasks.stage import ItemsData
from lmlab.atomic import atomic_write_text
from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.inference.samplers import SAMPLERS
from lmlab.multimodal.early_fusion import (IGNORE, FusionVocab, caption_prompt, draw_images, fusion_rows,
                                           image_prompt, write_captions)
from lmlab.multimodal.grid import save_image_grid
from lmlab.multimodal.image_task import (CaptionSource, ImageTaskModule, SyntheticImagesConfig, fit, prepare,
                                        train_and_val_images)
from lmlab.multimodal.vqvae import VQVAE, VQVAE_CONFIG_KEY, load_vqvae, vqvae_config
from lmlab.nn.transformer import Transformer
from lmlab.tokenizers import TOKENIZERS, Tokenizer
from lmlab.tokenizers.base import pack_tokenizer
from lmlab.training.checkpoints import TOKENIZER_KEY, load
from lmlab.training.losses import LOSSES
from lmlab.training.run import uses_cuda
from lmlab.training.tasks import TASKS, Task

log = logging.getLogger(__name__)

ENCODE_BATCH = 256  # images per VQ-VAE forward when tokenizing the data set
GRID_IMAGES = 16  # columns of samples.png


@torch.no_grad()
def image_codes(vqvae: VQVAE, images: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Code ids (N, n_codes) of `images`, on the CPU."""
    vqvae = vqvae.to(device)
    return torch.cat([vqvae.tokenize(batch.to(device)).cpu() for batch in images.split(ENCODE_BATCH)])


class EarlyFusionModule(ImageTaskModule):
    def __init__(self, cfg: DictConfig, model: Transformer, tokenizer: Tokenizer, vocab: FusionVocab, vqvae: VQVAE,
                 val_codes: torch.Tensor, val_captions: list[str], max_caption_tokens: int):
        super().__init__(cfg)
        self.model, self.tokenizer, self.vocab = model, tokenizer, vocab
        self.vqvae = vqvae.eval().requires_grad_(False)  # frozen: it only decodes the samples at the end
        self.loss_fn = LOSSES.build(cfg.loss)
        self.val_codes, self.val_captions, self.max_caption_tokens = val_codes, val_captions, max_caption_tokens
        self.val_means = torchmetrics.MetricCollection({k: torchmetrics.MeanMetric() for k in
                                                        ("loss", "image_loss", "caption_loss")}, prefix="val/")
        self._engine: Engine | None = None

    def trainable(self) -> torch.nn.Module:
        return self.model

    def train(self, mode: bool = True):
        super().train(mode)
        self.vqvae.eval()  # an EMA codebook would update its codes in training mode
        return self

    def engine(self) -> Engine:
        """One engine for the run, so its caches are reused; a new one where the model moved (Lightning moves
        it back to the CPU after fit)."""
        if self._engine is None or self._engine.device != self.model.embed_tokens.weight.device:
            self._engine = Engine(self.model)
        return self._engine

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        inputs, targets, _ = batch
        loss = self.loss_fn(self.model(inputs), targets)["loss"]
        self.log("train/loss", loss, prog_bar=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        inputs, targets, caption_first = batch
        logits = self.model(inputs).float()
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                                 reduction="none").view_as(targets)
        real = targets != IGNORE
        parts = {"loss": real,
                 "image_loss": caption_first[:, None] & self.vocab.is_image(targets),  # text -> image
                 "caption_loss": ~caption_first[:, None] & real & (targets < self.vocab.text_size)}  # image -> text
        for name, mask in parts.items():
            if mask.any():
                self.val_means[name].update(losses[mask].mean(), int(mask.sum()))

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_means.compute(), prog_bar=True)
        self.val_means.reset()
        if self.cfg.task.caption_eval:
            self.log("val/caption_accuracy", self.caption_accuracy(self.cfg.task.caption_eval), prog_bar=True)

    def captions_of(self, codes: torch.Tensor) -> list[str]:
        eot = self.tokenizer.eot_id
        prompts = [image_prompt(c.tolist(), self.vocab, eot) for c in codes]
        was_training = self.model.training
        captions = write_captions(self.engine(), prompts, self.tokenizer, self.max_caption_tokens)
        self.model.train(was_training)
        return captions

    def caption_accuracy(self, n: int) -> float:
        """Share of the first n validation images whose greedy caption is exactly the scene's."""
        captions = self.captions_of(self.val_codes[:n])
        return sum(c == t for c, t in zip(captions, self.val_captions[:n])) / len(captions)

    def draw(self, captions: list[str], sampler) -> torch.Tensor:
        """Code ids (B, n_codes) of images sampled after each caption."""
        prompts = [caption_prompt(self.tokenizer.encode(c), self.vocab, self.tokenizer.eot_id) for c in captions]
        was_training = self.model.training
        codes = draw_images(self.engine(), prompts, self.vocab, self.vqvae.n_codes, sampler)
        self.model.train(was_training)
        return codes

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[TOKENIZER_KEY] = pack_tokenizer(self.tokenizer)
        checkpoint[VQVAE_CONFIG_KEY] = vqvae_config(self.vqvae)


@TASKS.register("early_fusion")
class EarlyFusionTask(Task):
    """Chameleon-style early fusion: one Transformer over caption and VQ-VAE image tokens (task.vqvae)."""

    @dataclass
    class Config(SyntheticImagesConfig):
        vqvae: str = MISSING  # checkpoints/last.ckpt of a task=vqvae run: the image size, codes and decoder
        caption_eval: int = 64  # validation images captioned greedily for val/caption_accuracy at each validation
        samples: int = 64  # captions drawn as images at the end, then captioned back (samples/drawn_caption_match)
        temperature: float = 1.0  # of that image-token sampling; 0: greedy

        def __post_init__(self) -> None:
            super().__post_init__()
            at_least("task", self, 0, "caption_eval", "samples", "temperature")

    def check_config(self, cfg: DictConfig) -> None:
        t = self.cfg
        if cfg.loss.name != "cross_entropy":
            raise ConfigError(f"task=early_fusion trains with loss=cross_entropy (its ignore_index masks the "
                              f"padding), not loss={cfg.loss.name}")
        if not Path(t.vqvae).is_file():
            raise ConfigError(f"task.vqvae={t.vqvae} is not a file: pass the checkpoints/last.ckpt of a task=vqvae run")
        if max(t.samples, t.caption_eval) > t.val_images:
            raise ConfigError(f"task.samples={t.samples} and task.caption_eval={t.caption_eval} take validation "
                              f"images; task.val_images={t.val_images} is fewer")

    def run(self, cfg: DictConfig, output_dir: str | Path) -> dict[str, float]:
        cfg, output_dir = prepare(cfg, output_dir)
        self.check_config(cfg)
        # The frozen VQ-VAE stays in eval mode on purpose.
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=UserWarning)
        t = self.cfg
        vqvae = load_vqvae(t.vqvae)
        train, val = train_and_val_images(t, vqvae.cfg.image_size, cfg.seed)
        tokenizer = TOKENIZERS.build(cfg.tokenizer, CaptionSource(train.captions), cfg.cache_dir,
                                     cfg.trainer.progress_bar)
        if tokenizer.eot_id is None:
            raise ConfigError("task=early_fusion starts and ends each row with <|endoftext|>: keep it in "
                              "tokenizer.special_tokens")
        device = "cuda" if uses_cuda(cfg.trainer.accelerator) else "cpu"
        train_codes, val_codes = image_codes(vqvae, train.images, device), image_codes(vqvae, val.images, device)
        vqvae.cpu()
        vocab = FusionVocab(tokenizer.vocab_size, vqvae.codebook.size)
        captions = [[tokenizer.encode(c) for c in part.captions] for part in (train, val)]
        rows = [fusion_rows(c, k, vocab, tokenizer.eot_id, cfg.model.max_seq_len)
                for c, k in zip(captions, (train_codes, val_codes))]
        model = Transformer(cfg.model, vocab.size)
        longest_caption = max(len(c) for part in captions for c in part)
        log.info("early fusion: %.2fM parameters; vocabulary %d = %d text + %d image codes + <image>, </image>; "
                 "%d image tokens per image, captions of up to %d tokens; %d training and %d validation rows",
                 model.num_parameters() / 1e6, vocab.size, vocab.text_size, vocab.n_codes, vqvae.n_codes,
                 longest_caption, len(rows[0]), len(rows[1]))
        module = EarlyFusionModule(cfg, model, tokenizer, vocab, vqvae, val_codes, val.captions, longest_caption + 1)
        data = ItemsData(rows[0], rows[1], t.batch_size, collate=default_collate, seed=cfg.seed)
        tokenizer.save(output_dir)
        _, results = fit(cfg, output_dir, module, data, sweep_metric="val/loss")
        results |= write_samples(module.to(device), val, t, cfg.seed, output_dir)
        log.info("task=early_fusion: %s; outputs in %s", ", ".join(
            f"{k} {v:.4g}" for k, v in sorted(results.items()) if k.startswith("val/")), output_dir)
        return results


def write_samples(module: EarlyFusionModule, val, t: EarlyFusionTask.Config, seed: int,
                  output_dir: Path) -> dict[str, float]:
    """Images sampled from the first task.samples validation captions, read back by the model's own greedy
    captioning (the share read back as their caption: samples/drawn_caption_match); samples.png (rows: the
    first GRID_IMAGES originals, their VQ-VAE reconstructions, the images drawn from their captions) and
    samples.json."""
    if not t.samples:
        return {}
    n, shown = t.samples, min(t.samples, GRID_IMAGES)
    sampler = SAMPLERS.build({"name": "temperature", "temperature": t.temperature, "seed": seed})
    with torch.no_grad():
        drawn = module.draw(val.captions[:n], sampler)
        read_back = module.captions_of(drawn)
        generated = module.captions_of(module.val_codes[:n])
        pictures = [module.vqvae.detokenize(codes[:shown].to(module.device)).cpu()
                    for codes in (module.val_codes, drawn)]
        save_image_grid([val.images[:shown], *pictures], output_dir / "samples.png")
    atomic_write_text(output_dir / "samples.json", json.dumps(
        [{"caption": c, "generated_caption": g, "caption_of_drawn_image": r}
         for c, g, r in zip(val.captions[:n], generated, read_back)], indent=2))
    return {"samples/drawn_caption_match": sum(r == c for r, c in zip(read_back, val.captions)) / n}


def load_early_fusion(path: str | Path, device: str | torch.device = "cpu"):
    """(Transformer, text tokenizer, FusionVocab, VQ-VAE) of a task=early_fusion checkpoint, in eval mode."""
    model, tokenizer, config = load(path, device)
    if OmegaConf.select(config, "task.name") != "early_fusion":
        raise ConfigError(f"{path} was written by task={OmegaConf.select(config, 'task.name')}, not task=early_fusion")
    vqvae = load_vqvae(path, device)
    return model, tokenizer, FusionVocab(tokenizer.vocab_size, vqvae.codebook.size), vqvae

