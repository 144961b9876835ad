"""A LLaVA-style VLM answering questions about synthetic scenes (task=vlm): answer accuracy per question type.

Runs, each an lmlab-train job in OUT/<run> (a finished one is read back, an interrupted one continues):
  text-lm             task=pretrain on the questions and answers as text (no images): the LM stage 1 starts from
  stage1              task=vlm task.stage=1 init_from=text-lm: the projector alone learns (encoder, LM frozen)
  stage1+stage2       task=vlm task.stage=2 init_from=stage1: projector and LM
  scratch-stage2      task=vlm task.stage=2 with a new LM (the random encoder frozen)
  scratch-stage2+enc  the same with task.train_encoder=true
  contrastive-stage2  (--contrastive) task=contrastive first, then stage 2 with its image tower, frozen
and the prior: each question type answered with its most frequent training answer (what a blind model can do).
Writes OUT/vlm.json ({run: {"answer_acc", "colour", "shape", "count", "position", "val_loss", "steps",
"seconds"}}) and prints a Markdown table.

    python experiments/multimodal/vlm.py                        # the preset for this machine: cpu, or gpu with CUDA
    python experiments/multimodal/vlm.py --preset cpu --steps 100 --out outputs/vlm-cpu
    python experiments/multimodal/vlm.py --preset gpu --contrastive --out outputs/vlm-gpu [OVERRIDE ...]

OVERRIDEs are lmlab-train overrides added to every VLM run (after the preset's).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from pathlib import Path

import torch

from lmlab.catalog import load_catalog
from lmlab.cli.compose import compose_config
from lmlab.multimodal.questions import QUESTIONS, qa_items
from lmlab.training.checkpoints import read_checkpoint
from lmlab.training.module import METRICS_KEY
from lmlab.training.tasks import TASKS

# Sizes of the encoder and the LM shared by every run (the text LM's too), and the data and batch sizes.
PRESETS = {
    "cpu": {"steps": 150, "common": ["model.d_model=64", "model.n_layers=2", "model.attention.n_heads=4",
                                     "model.max_seq_len=64", "vision_encoder.patch_size=8", "vision_encoder.width=64",
                                     "vision_encoder.n_layers=2", "vision_encoder.n_heads=4"],
            "vlm": ["task.train_size=2000", "task.val_size=128", "task.batch_size=32"]},
    "gpu": {"steps": 2000, "common": ["model.d_model=256", "model.n_layers=4", "model.attention.n_heads=4",
                                      "model.max_seq_len=128", "vision_encoder.patch_size=4", "vision_encoder.width=128",
                                      "vision_encoder.n_layers=4", "vision_encoder.n_heads=4"],
            "vlm": ["task.train_size=50000", "task.val_size=512", "task.batch_size=64", "task.val_batch_size=256"]},
}
TRAINER = ["trainer.progress_bar=false", "trainer.checkpoint_every=1000000", "logger=csv", "optim.lr=3e-3"]
KINDS = list(QUESTIONS)


def run_job(folder: Path, overrides: list[str], steps: int) -> dict[str, float]:
    """The job's final metrics: trained now (continuing an interrupted launch's checkpoint), or read from the
    checkpoint a finished earlier launch left."""
    ckpt = folder / "checkpoints" / "last.ckpt"
    if ckpt.is_file() and (saved := read_checkpoint(ckpt, "ckpt")).get("global_step", 0) >= steps:
        return {**saved[METRICS_KEY], "seconds": math.nan, "steps": steps}
    cfg = compose_config([*TRAINER, f"cache_dir={folder.parent / 'cache'}", f"trainer.max_steps={steps}",
                          f"trainer.val_every={max(steps // 4, 1)}", f"sched.warmup_steps={max(steps // 20, 1)}",
                          "ckpt_path=auto", *overrides])
    began = time.perf_counter()
    results = TASKS.build(cfg.task).run(cfg, folder)
    return {**results, "seconds": time.perf_counter() - began, "steps": steps}


def text_corpus(path: Path, n: int, seed: int) -> Path:
    """The training questions and answers as text (one JSONL document each), in the VLM's prompt format."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": f"{item.question}\n{item.answer}"}) for item in qa_items(n, seed, KINDS)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def prior(n_train: int, n_val: int, seed: int) -> dict[str, float]:
    """Accuracy of answering each question type with its most frequent training answer."""
    best = {kind: Counter(i.answer for i in qa_items(n_train, seed, KINDS) if i.kind == kind).most_common(1)[0][0]
            for kind in KINDS}
    val = qa_items(n_val, seed + 1, KINDS)
    row = {kind: sum(i.answer == best[kind] for i in val if i.kind == kind) / max(1, sum(i.kind == kind for i in val))
           for kind in KINDS}
    return {"answer_acc": sum(i.answer == best[i.kind] for i in val) / len(val), **row}


def row(results: dict[str, float]) -> dict[str, float]:
    out = {"answer_acc": results.get("val/answer_acc", math.nan)}
    out.update({kind: results.get(f"val/answer_acc/{kind}", math.nan) for kind in KINDS})
    out.update({k: results.get(k, math.nan) for k in ("steps", "seconds")})
    out["val_loss"] = results.get("val/loss", math.nan)
    return out


def table(rows: dict[str, dict[str, float]]) -> str:
    columns = ["answer_acc", *KINDS, "val_loss", "steps", "seconds"]
    lines = ["| run | " + " | ".join(columns) + " |", "|---" * (1 + len(columns)) + "|"]
    for name, r in rows.items():
        cells = [("-" if math.isnan(r.get(c, math.nan)) else f"{r[c]:.3f}" if c in ["answer_acc", *KINDS, "val_loss"]
                  else f"{r[c]:.0f}") for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=["auto", *PRESETS], default="auto")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the preset's)")
    parser.add_argument("--out", type=Path, default=Path("outputs/vlm"))
    parser.add_argument("--contrastive", action="store_true", help="also a stage-2 VLM on a task=contrastive encoder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="lmlab-train overrides for every VLM run")
    args = parser.parse_args()
    load_catalog()
    preset = PRESETS[("gpu" if torch.cuda.is_available() else "cpu") if args.preset == "auto" else args.preset]
    steps = args.steps or preset["steps"]
    common = [*preset["common"], f"seed={args.seed}"]
    vlm = ["task=vlm", *common, *preset["vlm"], *args.overrides]
    train_size = int(next(o.split("=")[1] for o in reversed(vlm) if o.startswith("task.train_size=")))
    val_size = int(next(o.split("=")[1] for o in reversed(vlm) if o.startswith("task.val_size=")))
    out = args.out
    rows = {"prior (most frequent answer)": prior(train_size, val_size, args.seed)}

    corpus = text_corpus(out / "text_lm.jsonl", train_size, args.seed)
    run_job(out / "text-lm", ["task=pretrain", *common, "tokenizer=byte", "data=text_files", f"data.paths=[{corpus}]",
                              "data.context_length=64", "data.batch_size=32", "trainer.val_batches=4"], steps)
    lm_ckpt = out / "text-lm" / "checkpoints" / "last.ckpt"
    runs = {
        "stage1": ["task.stage=1", f"init_from={lm_ckpt}"],
        "stage1+stage2": ["task.stage=2", f"init_from={out / 'stage1' / 'checkpoints' / 'last.ckpt'}"],
        "scratch-stage2": ["task.stage=2"],
        "scratch-stage2+enc": ["task.stage=2", "task.train_encoder=true"],
    }
    if args.contrastive:
        run_job(out / "contrastive", ["task=contrastive", *common, "task.batch_size=64"], steps)
        runs["contrastive-stage2"] = ["task.stage=2", f"task.encoder_from={out / 'contrastive' / 'checkpoints' / 'last.ckpt'}"]
    for name, extra in runs.items():  # in order: stage1+stage2 starts from stage1's checkpoint
        rows[name] = row(run_job(out / name, [*vlm, *extra], steps))
        (out / "vlm.json").write_text(json.dumps(rows, indent=2))  # after each run: an interrupted launch keeps them
    print(f"{table(rows)}\n\n{out / 'vlm.json'}")


if __name__ == "__main__":
    main()
