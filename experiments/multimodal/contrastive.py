"""CLIP vs SigLIP at equal batch sizes (task=contrastive on synthetic scenes): zero-shot accuracy on held-out
(shape, colour) classes, and how each loss behaves as the batch shrinks.

Every run sees the same number of training pairs (`--pairs`), so a smaller batch takes more steps; the
zero-shot probe classifies images of held-out classes among the captions of all 36 classes (chance 1/36).
Each run is an lmlab-train job in OUT/<loss>-b<batch>-s<seed> (a finished one is read back, not trained again).
Writes OUT/contrastive.json ({"settings": ..., "runs": {run: {"loss", "batch_size", "seed", "zero_shot_acc",
"val_loss", "logit_scale", "steps", "seconds"}}}), OUT/zero_shot_vs_batch.png, and prints a Markdown table.

    python experiments/multimodal/contrastive.py --tiny                 # a few CPU minutes: does it all run?
    python experiments/multimodal/contrastive.py                        # the preset for this machine: cpu, or gpu with CUDA
    python experiments/multimodal/contrastive.py --preset gpu --batch-sizes 32,128,512 --seeds 0,1 --out outputs/clip-gpu

OVERRIDEs after the options are lmlab-train overrides added to every run (after the preset's).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import torch

from lmlab.catalog import load_catalog
from lmlab.cli.compose import compose_config
from lmlab.training.checkpoints import read_checkpoint
from lmlab.training.module import METRICS_KEY
from lmlab.training.tasks import TASKS

# Tower sizes, data sizes, the batch sizes swept and the pairs every run trains on.
PRESETS = {
    "tiny": {"pairs": 1920, "batch_sizes": [8, 32], "workers": 0,
             "common": ["model.d_model=32", "model.n_layers=2", "model.attention.n_heads=2", "model.max_seq_len=32",
                        "vision_encoder.width=32", "vision_encoder.n_layers=2", "vision_encoder.n_heads=2",
                        "vision_encoder.patch_size=8", "task.embed_dim=32",
                        "image_data.n_train=2048", "image_data.n_val=64", "image_data.n_zero_shot=128"]},
    "cpu": {"pairs": 9600, "batch_sizes": [16, 32, 64], "workers": 0,
            "common": ["model.d_model=64", "model.n_layers=2", "model.attention.n_heads=4", "model.max_seq_len=32",
                       "vision_encoder.width=64", "vision_encoder.n_layers=2", "vision_encoder.n_heads=4",
                       "vision_encoder.patch_size=8", "task.embed_dim=64",
                       "image_data.n_train=8192", "image_data.n_val=256", "image_data.n_zero_shot=256"]},
    # ~15 minutes on one H200 (the small towers' steps are overhead-bound, ~45 ms each: time follows the step count)
    "gpu": {"pairs": 100_000, "batch_sizes": [16, 64, 256, 1024], "workers": 8,
            "common": ["model.d_model=256", "model.n_layers=4", "model.attention.n_heads=4", "model.max_seq_len=32",
                       "vision_encoder.width=192", "vision_encoder.n_layers=6", "vision_encoder.n_heads=6",
                       "vision_encoder.patch_size=4", "task.embed_dim=128",
                       "image_data.n_train=100000", "image_data.n_val=1024", "image_data.n_zero_shot=1024"]},
}
TRAINER = ["task=contrastive", "trainer.progress_bar=false", "trainer.checkpoint_every=1000000", "logger=csv",
           "optim.lr=1e-3"]
LOSSES = ("clip", "siglip")


def run_job(folder: Path, overrides: list[str], steps: int) -> dict[str, float]:
    """The job's final metrics: trained now, or read from the checkpoint a finished earlier launch left."""
    ckpt = folder / "checkpoints" / "last.ckpt"
    if ckpt.is_file():
        return {**read_checkpoint(ckpt, "ckpt")[METRICS_KEY], "seconds": math.nan}
    cfg = compose_config([*TRAINER, f"cache_dir={folder.parent / 'cache'}", f"trainer.max_steps={steps}",
                          f"trainer.val_every={max(steps // 4, 1)}", f"trainer.log_every={max(steps // 20, 1)}",
                          f"sched.warmup_steps={max(steps // 20, 1)}", *overrides])
    began = time.perf_counter()
    results = TASKS.build(cfg.task).run(cfg, folder)
    return {**results, "seconds": time.perf_counter() - began}


def table(runs: dict[str, dict]) -> str:
    columns = ["loss", "batch_size", "seed", "steps", "zero_shot_acc", "val_loss", "logit_scale", "seconds"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in runs.values():
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) and not math.isnan(r[c]) else
                 "-" if isinstance(r[c], float) else str(r[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for loss in LOSSES:
        sizes = sorted({r["batch_size"] for r in runs.values() if r["loss"] == loss})
        means = [sum(accs) / len(accs) for b in sizes
                 if (accs := [r["zero_shot_acc"] for r in runs.values() if r["loss"] == loss and r["batch_size"] == b])]
        ax.plot(sizes, means, marker="o", label=loss)
    ax.axhline(1 / 36, color="grey", linestyle=":", label="chance (1/36)")
    ax.set(xscale="log", xlabel="batch size (pairs per step)", ylabel="zero-shot accuracy (held-out classes)",
           title="CLIP vs SigLIP, equal pairs seen")
    ticks = sorted({r["batch_size"] for r in runs.values()})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=["auto", *PRESETS], default="auto")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset: a few minutes on a CPU")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default: the preset's)")
    parser.add_argument("--pairs", type=int, default=None, help="training pairs per run (default: the preset's)")
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; the plot averages over them")
    parser.add_argument("--out", type=Path, default=None, help="default: outputs/contrastive-<preset>")
    parser.add_argument("overrides", nargs="*", help="lmlab-train overrides for every run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")  # the runs' progress lines
    load_catalog()
    name = "tiny" if args.tiny else ("gpu" if torch.cuda.is_available() else "cpu") if args.preset == "auto" else args.preset
    preset = PRESETS[name]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else preset["batch_sizes"]
    pairs = args.pairs or preset["pairs"]
    out = args.out or Path(f"outputs/contrastive-{name}")
    out.mkdir(parents=True, exist_ok=True)
    settings = {"preset": name, "pairs": pairs, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                else "cpu", "overrides": [*preset["common"], *args.overrides]}
    runs = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        for batch in batch_sizes:
            for loss in args.losses.split(","):
                steps = max(pairs // batch, 1)
                run = f"{loss}-b{batch}-s{seed}"
                results = run_job(out / run, [*preset["common"], f"contrastive_loss={loss}", f"task.batch_size={batch}",
                                              f"task.num_workers={preset['workers']}", f"seed={seed}", *args.overrides],
                                  steps)
                runs[run] = {"loss": loss, "batch_size": batch, "seed": seed, "steps": steps,
                             "zero_shot_acc": results.get("val/zero_shot_acc", math.nan),
                             "val_loss": results.get("val/loss", math.nan),
                             "logit_scale": results.get("train/logit_scale", math.nan),
                             "seconds": results.get("seconds", math.nan)}
                # after each run: an interrupted launch keeps what it has
                (out / "contrastive.json").write_text(json.dumps({"settings": settings, "runs": runs}, indent=2))
    plot(runs, out / "zero_shot_vs_batch.png")
    print(f"{table(runs)}\n\n{out / 'contrastive.json'}")


if __name__ == "__main__":
    main()
