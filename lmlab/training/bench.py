"""`lmlab bench train [OVERRIDES...]`: full training steps of a config, reference path against kernels.

    lmlab bench train model=llama400m tokenizer=byte model.vocab_size=50304 data.context_length=2048 \\
        data.batch_size=16 --lmlab-train --json bench-train.json

Takes the same overrides as `lmlab-train` and times a bare training loop (no Lightning) of that
model, loss and optimizer on random tokens of the configured batch and context, for each
variant: the reference PyTorch path and `kernels=triton`, each eager and under torch.compile
(`trainer.compile`'s per-block compile, or with `+graphs` the whole step replayed from CUDA graphs:
`trainer.cuda_graphs`), optionally with float8 block matmuls (`+fp8-rowwise`, `+fp8-tensorwise`: the
`fp8` config group), activation recomputation (`+recompute-selective`, `+recompute-full`: the `recompute`
group), bf16 copies of the float32 weights (`+compute-bfloat16`: `trainer.compute_dtype`) and bf16 weights with
no float32 copy (`+bf16-true`: `trainer.precision=bf16-true`, Adam rounding them stochastically). A step is forward,
loss, backward, gradient clipping and the optimizer step, under bf16 autocast on a GPU (or in bf16 throughout with
`+bf16-true`) as `lmlab-train` runs it, through Lightning's own precision plugin. Variants are timed in
turns (median step after warm-up), from the same initial weights. Reported per variant: step
time, tokens/s, MFU (the model's training FLOPs per token, 6 N plus attention scores, against the
GPU's dense bf16 peak) and the step's peak memory above the resident weights and optimizer state
(not for `+graphs`: its graphs' pool holds the step's memory from capture on).

`--profile DIR` writes each variant's torch.profiler table of two steps (operators and kernels by
their own device time) to DIR/<variant>.txt. `--lmlab-train` also runs `lmlab-train` itself with the last variant's settings and compares its
measured tokens/s with the bare loop's: the framework's cost per step.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lmlab.cli.overrides import CONF_DIR, prepare
from lmlab.errors import ConfigError
from lmlab.kernels.registry import KERNELS, install_kernels
from lmlab.optim import OPTIMIZERS
from lmlab.timing import interleaved_medians, sync
from lmlab.tokenizers.base import expected_vocab_size
from lmlab.training.compile import compile_for_training, graphed_model_terms
from lmlab.training.compute_dtype import DTYPES, CastParameters, check_compute_dtype, on_copies
from lmlab.training.fp8 import FP8
from lmlab.training.hardware import peak_flops
from lmlab.training.losses import LOSSES
from lmlab.training.objective import model_terms
from lmlab.training.recompute import RECOMPUTE
from lmlab.training.profile import profiler_for
from lmlab.training.precision import HALF_WEIGHTS, precision_plugin, resolve_precision

VARIANTS = ("reference", "triton", "reference+compile", "triton+compile")


@dataclass(frozen=True)
class Variant:
    """What one variant runs: a `kernels` config, trainer.compile and trainer.cuda_graphs, an `fp8` entry, a
    `recompute` entry, trainer.compute_dtype and trainer.precision (None: lmlab-train's default)."""

    kernels: dict
    compiled: bool
    fp8: str = "none"
    graphs: bool = False
    recompute: str = "none"
    compute: str | None = None
    precision: str | None = None

    def overrides(self) -> list[str]:
        """The same settings as lmlab-train overrides."""
        kernels = dict(self.kernels)
        return [f"kernels={kernels.pop('name')}", *(f"kernels.{op}=false" for op in kernels),
                f"trainer.compile={self.compiled}", f"fp8={self.fp8}", f"trainer.cuda_graphs={self.graphs}",
                f"recompute={self.recompute}", f"trainer.compute_dtype={self.compute or 'null'}",
                f"trainer.precision={self.precision or 'auto'}"]


def parse_variant(variant: str) -> Variant:
    """`KERNELS[-OP...][+compile[+graphs]][+fp8-RECIPE][+recompute-POLICY][+compute-DTYPE][+PRECISION]` ->
    Variant; `-OP` turns one kernel off, e.g. `triton-attention+compile` is kernels=triton kernels.attention=false
    under torch.compile, `reference+compile+fp8-rowwise` adds fp8=rowwise, `reference+compile+graphs` replays CUDA
    graphs, `reference+compile+recompute-selective` adds recompute=selective, `reference+compile+compute-bfloat16`
    trainer.compute_dtype=bfloat16 and `reference+compile+bf16-true` trainer.precision=bf16-true."""
    spec, *options = variant.split("+")
    name, *off = spec.split("-")
    prefixed = {prefix: [o.removeprefix(prefix) for o in options if o.startswith(prefix)]
                for prefix in ("fp8-", "recompute-", "compute-")}
    fp8, recompute, compute = prefixed.values()
    precision = [o for o in options if o in HALF_WEIGHTS]
    unknown = [o for o in options if o not in ("compile", "graphs", *HALF_WEIGHTS)
               and not o.startswith(tuple(prefixed))]
    if "graphs" in options and "compile" not in options:
        unknown.append("graphs without compile")
    if (name not in KERNELS or unknown or any(len(chosen) > 1 for chosen in (*prefixed.values(), precision))
            or any(f not in FP8 for f in fp8) or any(r not in RECOMPUTE for r in recompute)
            or any(d not in DTYPES for d in compute)):
        raise SystemExit(f"lmlab bench train: unknown variant '{variant}'; use "
                         "KERNELS[-OP...][+compile[+graphs]][+fp8-RECIPE][+recompute-POLICY][+compute-DTYPE]"
                         f"[+PRECISION] with KERNELS in {', '.join(KERNELS.names())}, RECIPE in "
                         f"{', '.join(FP8.names())}, POLICY in {', '.join(RECOMPUTE.names())}, DTYPE in "
                         f"{', '.join(DTYPES)} and PRECISION in {', '.join(HALF_WEIGHTS)}")
    fields = {f.name for f in KERNELS.get(name).fields()}
    if set(off) - fields:
        raise SystemExit(f"lmlab bench train: variant '{variant}': {name} has no kernel "
                         f"{', '.join(sorted(set(off) - fields))}; its fields: {', '.join(sorted(fields))}")
    chosen = Variant({"name": name, **{op: False for op in off}}, "compile" in options, fp8[0] if fp8 else "none",
                     "graphs" in options, recompute[0] if recompute else "none", compute[0] if compute else None,
                     precision[0] if precision else None)
    try:
        check_compute_dtype(chosen.compute, chosen.recompute, "single", shards_parameters=False,
                            precision=chosen.precision or "auto")
    except ConfigError as err:
        raise SystemExit(f"lmlab bench train: variant '{variant}': {err}") from None
    return chosen


class Contender:
    """One variant's model, loss and optimizer, and its training step."""

    def __init__(self, variant: str, cfg, vocab: int, device: torch.device):
        from lmlab.nn.transformer import Transformer

        chosen = parse_variant(variant)
        torch.manual_seed(cfg.seed)  # every variant starts from the same weights
        self.model = Transformer(cfg.model, vocab).to(device)
        FP8.build(chosen.fp8).install(self.model)  # before compiling, as lmlab-train does
        RECOMPUTE.build(chosen.recompute).install(self.model)
        self.loss_fn = LOSSES.build(cfg.loss)
        ops = KERNELS.build(chosen.kernels)
        install_kernels(ops, self.model, self.loss_fn)
        # Lightning's plugin for the run's precision: it converts the model (bf16-true), as lmlab-train's strategy
        # does before compiling, and gives the forward's context (autocast, or bf16 as the default dtype).
        plugin = precision_plugin(resolve_precision(chosen.precision or "auto"), device)
        self.model = plugin.convert_module(self.model)
        self.forward_context = plugin.forward_context
        self.graphed = chosen.graphs
        cast = None if chosen.compute is None else CastParameters(self.model, DTYPES[chosen.compute])
        if chosen.graphs:  # as LanguageModelTask.configure_model chooses
            self.terms = graphed_model_terms(self.model, self.loss_fn, cast)
        else:
            if chosen.compiled:
                compile_for_training(self.model, self.loss_fn)
            self.terms = partial(on_copies(cast, model_terms), self.model, self.loss_fn)
        self.optimizer = OPTIMIZERS.build(cfg.optim, self.model)
        install_kernels(ops, self.optimizer)
        self.grad_clip = cfg.trainer.grad_clip

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        with self.forward_context():
            terms = self.terms(inputs, targets)
        terms["loss"].backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _peak_step_bytes(contender: Contender, batch, device: torch.device) -> int | None:
    """Bytes a step allocates above what was allocated before it; None off a GPU, and for a `+graphs` variant,
    whose step runs in the memory pool its CUDA graphs took at capture (already allocated, so it would read 0)."""
    if device.type != "cuda" or contender.graphed:
        return None
    sync()
    resident = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    contender.step(*batch)
    sync()
    return torch.cuda.max_memory_allocated(device) - resident


def profile_steps(contender: Contender, batch, device: torch.device, path: Path, steps: int = 2) -> None:
    with profiler_for(device) as prof:
        for _ in range(steps):
            contender.step(*batch)
        sync()
    table = prof.key_averages().table
    tables = [table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90)]
    if device.type == "cuda":  # device time first; host time says where a launch-bound (small) step goes
        tables.insert(0, table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
    path.write_text("\n\n".join(tables) + "\n")


def time_variants(cfg, variants: list[str], vocab: int, steps: int, warmup: int, device: torch.device,
                  profile_dir: Path | None = None) -> dict:
    from lmlab.data import SOURCES

    _, data_cfg = SOURCES.resolve(cfg.data)
    batch, seq = data_cfg.batch_size, data_cfg.context_length
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
    data = (tokens[:, :-1], tokens[:, 1:])
    contenders = {}
    for variant in variants:
        print(f"building and warming up {variant} ...", file=sys.stderr, flush=True)
        contenders[variant] = Contender(variant, cfg, vocab, device)
        for _ in range(warmup):  # compiles, autotunes kernels, fills the allocator's cache
            contenders[variant].step(*data)
    peak_bytes = {name: _peak_step_bytes(c, data, device) for name, c in contenders.items()}
    print(f"timing {steps} steps of each variant, in turns ...", file=sys.stderr, flush=True)
    # In turns, so a slow stretch of the machine hits every variant alike; warm-up was done above.
    step_s = interleaved_medians({name: (lambda c=c: c.step(*data)) for name, c in contenders.items()}, steps, warmup=0)
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        for name, contender in contenders.items():
            profile_steps(contender, data, device, profile_dir / f"{name}.txt")
    model = next(iter(contenders.values())).model
    flops_per_token = model.flops_per_token(seq)
    peak = peak_flops(device)
    results = {}
    for name in contenders:
        tokens_per_s = batch * seq / step_s[name]
        results[name] = {
            "step_ms": step_s[name] * 1e3,
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * flops_per_token / peak if peak else None,
            "step_peak_gib": peak_bytes[name] / 2**30 if peak_bytes[name] is not None else None,
        }
    return {"parameters": model.num_parameters(), "flops_per_token": flops_per_token, "batch": batch,
            "context_length": seq, "vocab_size": vocab, "variants": results}


def lmlab_train_tokens_per_s(overrides: list[str], variant: str, steps: int) -> float:
    """tokens/s that `lmlab-train` itself logs over `steps` steps, after `steps` steps of warm-up."""
    from lmlab.training.run import train

    run_overrides = [*overrides, *parse_variant(variant).overrides(),
                     f"trainer.max_steps={2 * steps}", f"trainer.log_every={steps}", f"trainer.val_every={2 * steps}",
                     "trainer.val_batches=1", f"trainer.checkpoint_every={10 * steps}", "trainer.progress_bar=false",
                     "sched.warmup_steps=1"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=run_overrides)
    with tempfile.TemporaryDirectory() as out:
        return train(cfg, out)["tokens_per_s"]


def format_table(result: dict) -> str:
    rows = [f"{'variant':<30} {'step ms':>9} {'tokens/s':>11} {'MFU':>6} {'peak GiB':>9} {'vs reference':>13}"]
    base = result["variants"].get("reference", next(iter(result["variants"].values())))["step_ms"]
    for name, r in result["variants"].items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['step_peak_gib']:.1f}" if r["step_peak_gib"] is not None else "-"
        rows.append(f"{name:<30} {r['step_ms']:>9.1f} {r['tokens_per_s']:>11,.0f} {mfu:>6} {mem:>9} "
                    f"{base / r['step_ms']:>12.2f}x")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmlab bench train", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="lmlab-train overrides, e.g. model=llama400m")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated KERNELS[-OP...][+compile[+graphs]][+fp8-RECIPE][+recompute-POLICY]"
                             "[+compute-DTYPE][+PRECISION], "
                             "e.g. triton-attention+compile "
                             f"(default: {','.join(VARIANTS)})")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    parser.add_argument("--lmlab-train", action="store_true",
                        help="also run lmlab-train with the last variant and compare its tokens/s")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="write each variant's profiler table of two steps to DIR/<variant>.txt")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    variants = [v for v in args.variants.split(",") if v]
    prepare(args.overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=args.overrides)
    vocab = cfg.model.vocab_size or expected_vocab_size(cfg.tokenizer)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as lmlab-train sets it
    result = time_variants(cfg, variants, vocab, args.steps, args.warmup, device, args.profile)
    result.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  overrides=args.overrides, torch=torch.__version__)
    print(f"{result['parameters'] / 1e6:.1f}M parameters, {result['batch']} x {result['context_length']} tokens per "
          f"step, {result['flops_per_token'] / 1e9:.2f} GFLOP per token, on {result['device']}")
    print(format_table(result))
    if args.lmlab_train:
        logging.getLogger("lightning").setLevel(logging.WARNING)
        variant = variants[-1]
        measured = lmlab_train_tokens_per_s(args.overrides, variant, args.steps)
        bare = result["variants"][variant]["tokens_per_s"]
        result["lmlab_train"] = {"variant": variant, "tokens_per_s": measured, "vs_bare_loop": measured / bare}
        print(f"lmlab-train ({variant}): {measured:,.0f} tokens/s = {measured / bare:.3f}x the bare loop's {bare:,.0f}")
    if args.json:
        args.json.write_text(json.dumps({**result, "config": OmegaConf.to_container(cfg, resolve=True)}, indent=2))
    return 0
