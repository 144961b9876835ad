"""Quantization-aware training against post-training int4 (a few minutes on a CPU by default).

Trains the same small model (same seed, data and steps on lmlab-train's default corpus) four times:
plain, with `qat=int4`, with `qat=int4 qat.quantize_head=true`, and with `qat=int4` from two thirds of
the steps on (`qat.start_step`: QAT as a final phase); then quantizes each checkpoint
with `quant=int4` (round-to-nearest, and GPTQ calibrated on the training split), without and with
the head, and reports the validation loss (ln perplexity over evenly spaced windows of the
validation split, as `lmlab bench generate --ckpt` measures it) of each, and the run's own last
validation loss (a QAT run's is that of its fake-quantised forward). QAT and PTQ share the group
size (128, both entries' default). Runs in OUT continue where they stopped (finished ones are kept).

    python experiments/architecture-ablations-2/qat.py [--steps 200] [--out outputs/qat] [OVERRIDE ...]

OVERRIDEs are lmlab-train overrides for every run, after SMALL's (a longer run on a GPU: `model.n_layers=4
data.context_length=256 data.batch_size=64 --steps 3000`).

The same runs from the command line: `lmlab-train SMALL... [qat=int4]`, then
`lmlab bench generate --ckpt RUN/checkpoints/last.ckpt --quant int4` (GPTQ; perplexity and decode speed).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

from lmlab.catalog import load_catalog
from lmlab.cli.compose import compose_config
from lmlab.inference.bench_checkpoint import CheckpointData, perplexity
from lmlab.inference.quant import QUANTS, quantize
from lmlab.training import train
from lmlab.training.checkpoints import load, read_checkpoint
from lmlab.training.module import METRICS_KEY

# model=tiny's width (128, so group size 128 fits every Linear) with half its depth and a short context.
SMALL = ["model.n_layers=2", "data.context_length=64", "data.batch_size=16", "trainer.val_batches=8",
         "trainer.progress_bar=false", "trainer.checkpoint_every=100000"]


def runs(steps: int) -> dict[str, list[str]]:
    """The trainings compared: plain, QAT throughout (without and with the head), QAT in the last third only."""
    return {"float": [], "qat=int4": ["qat=int4"], "qat=int4 +head": ["qat=int4", "qat.quantize_head=true"],
            "qat=int4 last third": ["qat=int4", f"qat.start_step={2 * steps // 3}"]}


PTQ = {f"int4{head} {method}": {"name": "int4", "method": method, "quantize_head": bool(head)}
       for head in ("", " +head") for method in ("rtn", "gptq")}


def trained(name: str, overrides: list[str], out: Path, steps: int) -> Path:
    """The last checkpoint of run `name` in `out`: trained, or continued where an earlier launch stopped."""
    folder = out / name.replace("=", "-").replace(" +", "-")
    train(compose_config([f"cache_dir={out / 'cache'}", *overrides, f"trainer.max_steps={steps}",  # an override
                          f"trainer.val_every={steps}", "ckpt_path=auto"]), folder)  # may share a token cache
    return folder / "checkpoints" / "last.ckpt"


def val_losses(ckpt: Path) -> dict[str, float]:
    """Validation loss of the checkpoint's float weights and of each PTQ copy of them."""
    data = CheckpointData(str(ckpt))
    model, _, _ = load(ckpt)
    losses = {"run's last val/loss": read_checkpoint(ckpt, "ckpt")[METRICS_KEY]["val/loss"],
              "float": math.log(perplexity(model, *data.val))}
    for name, cfg in PTQ.items():
        quantized = copy.deepcopy(model)
        quantize(quantized, cfg, data.calibration if QUANTS.build(cfg).method.calibrated else None)
        losses[name] = math.log(perplexity(quantized, *data.val))
    return losses


def table(results: dict[str, dict[str, float]]) -> str:
    columns = ["run's last val/loss", "float", *PTQ]
    rows = ["| run | " + " | ".join(columns) + " |", "|---" * (1 + len(columns)) + "|"]
    for run, losses in results.items():
        cells = [f"{losses[c]:.4f}" for c in columns[:2]]
        cells += [f"{losses[q]:.4f} ({losses[q] - losses['float']:+.4f})" for q in PTQ]
        rows.append(f"| {run} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("outputs/qat"))
    parser.add_argument("overrides", nargs="*", help="lmlab-train overrides for every run")
    args = parser.parse_args()
    load_catalog()
    common = [*SMALL, *args.overrides]
    results = {name: val_losses(trained(name, [*common, *run], args.out, args.steps))
               for name, run in runs(args.steps).items()}
    (args.out / "results.json").write_text(json.dumps({"steps": args.steps, "overrides": common, **results}, indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
