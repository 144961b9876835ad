"""`lmlab info [OVERRIDES...]`: the cost model of a training config, without training.

Composes the same config as `lmlab-train` (same overrides), builds the model on the meta
device and prints parameter counts, training FLOPs per token (the number behind `perf/mfu`),
KV-cache bytes per token, and the time a step and the whole run would take on an accelerator
at an assumed MFU.
"""

from __future__ import annotations

import argparse

import torch
from lmlab.cli.compose import compose_config
from lmlab.tokenizers.base import expected_vocab_size
from lmlab.training.hardware import BF16_PEAK_FLOPS


def cost_model(cfg, vocab_size: int) -> dict[str, float]:
    from lmlab.data import SOURCES
    from lmlab.nn.transformer import Transformer

    _, data_cfg = SOURCES.resolve(cfg.data)
    with torch.device("meta"):
        model = Transformer(cfg.model, vocab_size)
    tokens_per_step = data_cfg.batch_size * data_cfg.context_length
    flops_per_token = model.flops_per_token(data_cfg.context_length)
    return {
        "params": model.num_parameters(),
        "non_embedding_params": model.num_parameters(exclude_embeddings=True),
        "active_params": model.num_active_parameters(),
        "flops_per_token": flops_per_token,
        "kv_cache_bytes_per_token": model.kv_cache_bytes_per_token(),
        "tokens_per_step": tokens_per_step,
        "steps": cfg.trainer.max_steps,
        "flops_per_step": flops_per_token * tokens_per_step,
    }


def report(c: dict[str, float], accelerator: str, mfu: float) -> str:
    peak = BF16_PEAK_FLOPS[accelerator]
    step_s = c["flops_per_step"] / (peak * mfu)
    rows = [
        ("parameters", f"{c['params'] / 1e6:,.2f}M ({c['non_embedding_params'] / 1e6:,.2f}M without the token embedding)"),
        ("active parameters", f"{c['active_params'] / 1e6:,.2f}M per token (fewer than all with MoE)"),
        ("training FLOPs per token", f"{c['flops_per_token'] / 1e6:,.2f} MFLOP (6 x matmul weights + attention)"),
        ("KV cache per token", f"{c['kv_cache_bytes_per_token'] / 1024:,.2f} KiB in bf16"),
        ("tokens per step", f"{c['tokens_per_step']:,}"),
        (f"step on {accelerator} at {mfu:.0%} MFU", f"{step_s * 1e3:,.3f} ms ({peak / 1e12:,.0f} TFLOP/s bf16 peak)"),
        (f"run of {c['steps']:,} steps", f"{step_s * c['steps']:,.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmlab info", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="lmlab-train overrides, e.g. model.d_model=768")
    parser.add_argument("--accelerator", default="H100", choices=sorted(BF16_PEAK_FLOPS))
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="tokenizer vocab (default: model.vocab_size, else what the tokenizer config asks for)")
    args = parser.parse_args(argv)
    if not 0 < args.mfu <= 1:
        parser.error(f"--mfu must be in (0, 1], got {args.mfu}")
    cfg = compose_config(args.overrides)
    vocab = args.vocab_size or cfg.model.vocab_size or expected_vocab_size(cfg.tokenizer)
    print(report(cost_model(cfg, vocab), args.accelerator, args.mfu))
    return 0
