"""VQ-VAE image tokenizers and an early-fusion model on synthetic captioned images.

Trains `task=vqvae` once per codebook entry (default: ema and straight_through, same seed, data and steps)
and reports each one's held-out reconstruction MSE, codebook usage (fraction of codes used) and code
perplexity; then trains `task=early_fusion` (a Transformer over caption and image tokens, both orders) on
the first codebook's tokenizer and reports its image-conditioned caption accuracy (greedy caption equal to
the scene's exactly), how often images it draws from validation captions are captioned back (by the same
model) as the caption they were drawn from, and its held-out losses. Writes OUT/results.json, OUT/results.md
and the PNGs (reconstructions-<codebook>.png: originals above reconstructions; samples.png: originals, their
VQ-VAE reconstructions, images sampled from their captions). Runs in OUT continue where they stopped.

    python experiments/multimodal/vqvae_fusion.py                      # the preset of this machine
    python experiments/multimodal/vqvae_fusion.py --preset cpu --out outputs/vqvae-fusion-cpu
    python experiments/multimodal/vqvae_fusion.py --preset gpu --vqvae trainer.max_steps=5000 --fusion model.n_layers=8

--vqvae and --fusion take lmlab-train overrides applied after the preset's. The same runs from the command
line: `lmlab-train task=vqvae codebook=ema ...`, then
`lmlab-train task=early_fusion task.vqvae=RUN/checkpoints/last.ckpt ...`.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from lmlab.catalog import load_catalog
from lmlab.cli.compose import compose_config
from lmlab.training.tasks import TASKS

COMMON = ["trainer.progress_bar=false", "logger=csv", "trainer.checkpoint_every=100000"]
# cpu: minutes on a 2-core CPU (shapes only). gpu: a fuller run on one GPU (bf16-mixed), a quarter of the scenes
# rendered digits and letters, which are harder to read from 8 x 8 codes.
PRESETS = {
    "cpu": {
        "vqvae": ["task.train_images=1024", "task.val_images=128", "task.batch_size=32", "task.hidden=32",
                  "codebook.size=128", "codebook.dim=16", "trainer.max_steps=200", "trainer.val_every=100",
                  "trainer.log_every=50"],
        "fusion": ["task.train_images=2048", "task.val_images=128", "task.batch_size=32", "task.caption_eval=128",
                   "model.d_model=128", "model.n_layers=2", "model.max_seq_len=96", "trainer.max_steps=300",
                   "trainer.val_every=150", "trainer.log_every=50"],
    },
    "gpu": {
        "vqvae": ["task.train_images=32768", "task.val_images=1024", "task.batch_size=128", "task.hidden=128",
                  "task.glyph_fraction=0.25", "codebook.size=512", "codebook.dim=64", "optim.lr=1e-3",
                  "trainer.max_steps=2000", "trainer.val_every=500", "trainer.log_every=100"],
        "fusion": ["task.train_images=32768", "task.val_images=1024", "task.batch_size=128", "task.caption_eval=512",
                   "task.glyph_fraction=0.25", "task.samples=256", "model.d_model=384", "model.n_layers=6",
                   "model.attention.n_heads=6", "model.max_seq_len=96", "optim.lr=1e-3", "trainer.max_steps=4000",
                   "trainer.val_every=1000", "trainer.log_every=100"],
    },
}
VQVAE_KEYS = ("val/recon_mse", "val/codebook_usage", "val/codebook_perplexity", "val/loss", "train/loss")
FUSION_KEYS = ("val/caption_accuracy", "samples/drawn_caption_match", "val/loss", "val/image_loss", "val/caption_loss",
               "train/loss")


def run_task(overrides: list[str], folder: Path) -> tuple[dict[str, float], float]:
    """lmlab-train's job for `overrides` in `folder` (continued from its newest checkpoint): results, seconds."""
    cfg = compose_config([*COMMON, *overrides, "ckpt_path=auto"])
    start = time.perf_counter()
    results = TASKS.build(cfg.task).run(cfg, folder)
    return results, time.perf_counter() - start


def table(results: dict) -> str:
    lines = ["| VQ-VAE codebook | val recon MSE | codes used | code perplexity | minutes |", "|---|---|---|---|---|"]
    for name, r in results["vqvae"].items():
        lines.append(f"| {name} | {r['val/recon_mse']:.5f} | {r['val/codebook_usage']:.3f} | "
                     f"{r['val/codebook_perplexity']:.1f} | {r['seconds'] / 60:.1f} |")
    f = results["early_fusion"]
    lines += ["", "| early fusion on | caption accuracy | drawn images read back | val loss | image loss "
              "(text->image) | caption loss (image->text) | minutes |", "|---|---|---|---|---|---|---|",
              f"| {f['codebook']} | {f['val/caption_accuracy']:.3f} | {f['samples/drawn_caption_match']:.3f} | "
              f"{f['val/loss']:.3f} | {f['val/image_loss']:.3f} | {f['val/caption_loss']:.3f} | "
              f"{f['seconds'] / 60:.1f} |"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="default: outputs/vqvae-fusion-<preset>")
    parser.add_argument("--codebooks", nargs="+", default=["ema", "straight_through"],
                        help="codebook entries to train a VQ-VAE with; early fusion uses the first")
    parser.add_argument("--vqvae", nargs="*", default=[], help="extra lmlab-train overrides of the VQ-VAE runs")
    parser.add_argument("--fusion", nargs="*", default=[], help="extra lmlab-train overrides of the early-fusion run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    load_catalog()
    out = args.out or Path("outputs") / f"vqvae-fusion-{args.preset}"
    preset = PRESETS[args.preset]
    seed = f"seed={args.seed}"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    overrides = {"vqvae": preset["vqvae"] + args.vqvae, "fusion": preset["fusion"] + args.fusion}
    results: dict = {"preset": args.preset, "device": device, "overrides": overrides, "vqvae": {}}
    for codebook in args.codebooks:
        folder = out / f"vqvae-{codebook}"
        numbers, seconds = run_task(["task=vqvae", f"codebook={codebook}", seed, *preset["vqvae"], *args.vqvae], folder)
        results["vqvae"][codebook] = {**{k: numbers.get(k) for k in VQVAE_KEYS}, "seconds": seconds}
        shutil.copyfile(folder / "reconstructions.png", out / f"reconstructions-{codebook}.png")
    tokenizer_ckpt = out / f"vqvae-{args.codebooks[0]}" / "checkpoints" / "last.ckpt"
    folder = out / "early-fusion"
    numbers, seconds = run_task(["task=early_fusion", f"task.vqvae={tokenizer_ckpt}", seed, *preset["fusion"],
                                 *args.fusion], folder)
    results["early_fusion"] = {"codebook": args.codebooks[0], **{k: numbers.get(k) for k in FUSION_KEYS},
                               "seconds": seconds,
                               "samples": json.loads((folder / "samples.json").read_text())[:16]}
    shutil.copyfile(folder / "samples.png", out / "samples.png")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
