"""The table and plots of experiments/architecture-ablations-2 from a run.sh output folder.

    python experiments/architecture-ablations-2/report.py OUT_DIR

Per variant: parameters, effective depth, final val/loss, training tokens/s (the variant alone,
`lmlab bench train`, eager and compiled), KV-cache or recurrent-state bytes per sequence at 4k and
32k context (the engine's own caches, bf16, built on the meta device) and decode tokens/s at each
benched batch size. Writes OUT_DIR/results.md, results.json, val_loss.png and state_bytes.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from lmlab.cli.compare import find_runs  # noqa: E402
from lmlab.inference.engine import Engine  # noqa: E402
from lmlab.nn import Transformer  # noqa: E402
from lmlab.tokenizers.base import expected_vocab_size  # noqa: E402

CONTEXTS = (4096, 32768)


def state_bytes(model_cfg, vocab: int, length: int) -> int:
    """Bytes of the caches the engine allocates for one bf16 sequence of `length` tokens."""
    fields = {**OmegaConf.to_container(model_cfg, resolve=True), "max_seq_len": length}
    with torch.device("meta"):
        model = Transformer(OmegaConf.create(fields), vocab).to(torch.bfloat16)
    engine = Engine(model)
    engine.begin(1, length)
    return engine.kv_cache_bytes()


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def rows_of(out: Path) -> list[dict]:
    names = [line.split("|", 1)[0] for line in (out / "variants.txt").read_text().splitlines() if line.strip()]
    runs = {run.path.name: run for run in find_runs(out / "runs")}
    rows = []
    for name in names:
        run = runs.get(name)
        cfg = OmegaConf.load(out / "runs" / name / ".hydra" / "config.yaml") if run else None
        row = {"name": name, "val_loss": run.final("val/loss") if run else None,
               "val_curve": run.scalars.get("val/loss", []) if run else []}
        if cfg is not None:
            vocab = expected_vocab_size(cfg.tokenizer)
            with torch.device("meta"):
                model = Transformer(cfg.model, vocab)
            row.update(parameters=model.num_parameters(), effective_depth=model.effective_depth,
                       flops_per_token=model.flops_per_token(cfg.data.context_length),
                       **{f"state_bytes_{n // 1024}k": state_bytes(cfg.model, vocab, n) for n in CONTEXTS})
        train = _load(out / "bench" / f"{name}-train.json")
        for variant, key in (("reference", "train_tokens_per_s"), ("reference+compile", "train_tokens_per_s_compiled")):
            row[key] = train["variants"].get(variant, {}).get("tokens_per_s") if train else None
        generate = _load(out / "bench" / f"{name}-generate.json")
        for r in (generate or {}).get("rows", []):
            row[f"decode_tokens_per_s_b{r['batch']}"] = r["decode_tokens_per_s"]
        rows.append(row)
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    batches = sorted({int(k.rsplit("_b", 1)[1]) for r in rows for k in r if k.startswith("decode_tokens_per_s_b")})
    head = ["variant", "params (M)", "depth", "GFLOP/token", "val/loss", "train tok/s", "compiled tok/s",
            *(f"state @{n // 1024}k (MiB)" for n in CONTEXTS), *(f"decode tok/s b{b}" for b in batches)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], _fmt(r.get("parameters") and r["parameters"] / 1e6, ".2f"), _fmt(r.get("effective_depth"), "d"),
                 _fmt(r.get("flops_per_token") and r["flops_per_token"] / 1e9, ".3f"), _fmt(r["val_loss"], ".4f"),
                 _fmt(r.get("train_tokens_per_s"), ",.0f"), _fmt(r.get("train_tokens_per_s_compiled"), ",.0f"),
                 *(_fmt(r.get(f"state_bytes_{n // 1024}k") and r[f"state_bytes_{n // 1024}k"] / 2**20, ",.1f")
                   for n in CONTEXTS),
                 *(_fmt(r.get(f"decode_tokens_per_s_b{b}"), ",.0f") for b in batches)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plots(rows: list[dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r["val_curve"]:
            ax.plot(*zip(*r["val_curve"]), marker=".", label=r["name"])
    curves = [[v for _, v in r["val_curve"]] for r in rows if len(r["val_curve"]) > 2]
    if curves:  # from the second validation down: the first ones would flatten the differences that matter
        ax.set_ylim(min(min(c) for c in curves) - 0.05, max(c[2] for c in curves) + 0.05)
    ax.set(xlabel="step", ylabel="val/loss", title="Validation loss at equal parameters (same data, steps, seed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "val_loss.png", dpi=120)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    named = [r for r in rows if r.get("state_bytes_4k") is not None]
    for i, n in enumerate(CONTEXTS):
        ax.bar([j + 0.4 * i for j in range(len(named))], [r[f"state_bytes_{n // 1024}k"] / 2**20 for r in named],
               width=0.4, label=f"{n // 1024}k tokens")
    ax.set_xticks([j + 0.2 for j in range(len(named))], [r["name"] for r in named], rotation=30, ha="right")
    ax.set(ylabel="MiB per sequence (bf16)", yscale="log", title="KV cache or recurrent state per sequence")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "state_bytes.png", dpi=120)


def main() -> None:
    out = Path(sys.argv[1])
    rows = rows_of(out)
    (out / "results.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "val_curve"} for r in rows],
                                                 indent=2))
    text = table(rows)
    (out / "results.md").write_text(text + "\n")
    plots(rows, out)
    print(text)


if __name__ == "__main__":
    main()
