"""`lmlab bench generate [OVERRIDES...]`: decode speed of lmlab's engine against Hugging Face `generate`.

    lmlab bench generate model=llama400m model.vocab_size=50304 --json gen.json --plot tokens_per_s.png

In one process and on the same weights (random, or `--ckpt`'s), for each prompt length and batch
size: lmlab eager, lmlab eager replayed from CUDA graphs (`graphs`), lmlab compiled (torch.compile
+ CUDA graphs; at batches of 2 or more it folds each RMSNorm into the kernels around it, lmlab.inference.folded_norms;
`compiled-unfolded` never does, `compiled-folded` does at batch 1 too; `compiled-sdpa` attends with masked SDPA
instead of the flash-decoding kernel, which also turns the folding off),
lmlab's decode megakernel (every layer in one persistent launch; the embedding, the head and sampling around it
compiled, all replayed from a CUDA graph;
`megakernel-stages` launches its stages one by one instead), lmlab batch-invariant (`invariant`: eager steps
of kernels whose results do not depend on the batch, replayed from CUDA graphs), Hugging Face `generate` with its dynamic
cache (`hf`) and with its static cache under torch.compile (`hf-static`), all greedy with
no stop token, so every run makes exactly `--new` tokens. Reported: time to first token, time per
output token, prefill and decode tokens/s, KV-cache bytes, and at each batch the bandwidth
roofline: bytes one decode step must read (the weights once, plus the batch's keys and values at
the mean length) over the device-to-device copy bandwidth measured in the same run. Then the KV
bytes per token of each attention kind at the model's size. Medians of `--repeats` runs after one
warm-up run (which compiles and captures the graphs).

`--quant int8 int4` also times a copy of the weights quantized by each entry (round to nearest) on each of
`--quant-engines` (compiled and megakernel by default). With `--ckpt` (a trained model) it reports instead each
entry's validation perplexity and batch-1 speed on those engines against the unquantized weights (GPTQ calibrated on
the training split), and
`--draft CKPT` speculative decoding against the target alone (lmlab.inference.bench_checkpoint).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lmlab.cli.overrides import CONF_DIR, prepare
from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.inference.megakernel import QUANT_KERNEL
from lmlab.inference.quant import quantize
from lmlab.inference.quant.registry import GROUP_SIZES
from lmlab.nn.transformer import Transformer
from lmlab.timing import sync
from lmlab.tokenizers.base import expected_vocab_size

ENGINES = ("eager", "graphs", "compiled", "compiled-sdpa", "compiled-unfolded", "compiled-folded", "megakernel",
           "megakernel-stages", "invariant", "hf", "hf-static")
# The engines a quantized model's speed is measured on (--quant-engines), by name: their Engine arguments
QUANT_ENGINES = {"eager": {}, "compiled": {"compile": True}, "megakernel": {"compile": True, "megakernel": True}}
# What an engine needs of a quantization's stored layout: the megakernel reads int4 codes as int4's dequant kernel
# keeps them (on CUDA the default packs them for tinygemm)
QUANT_LAYOUT = {"megakernel": {"kernel": QUANT_KERNEL}}


def int4_group_size(model: Transformer) -> dict:
    """The largest int4 group that divides every layer Linear's input width (llama400m's FFN, 2752: 64)."""
    widths = {m.in_features for m in model.layers.modules() if isinstance(m, torch.nn.Linear)}
    fits = [size for size in GROUP_SIZES if all(w % size == 0 for w in widths)]
    if not fits:
        raise SystemExit(f"lmlab bench generate: no int4 group size ({GROUP_SIZES}) divides the input widths {widths}")
    return {"group_size": max(fits)}


QUANT_FIT = {"int4": int4_group_size}  # per entry: settings that make it fit the model
DEFAULT_OVERRIDES = ["model=llama400m", "model.vocab_size=50304"]


def copy_bandwidth(device: torch.device, n_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy, counting the read and the write."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    return 2 * n_bytes / statistics.median(times)


def weight_bytes_per_step(model: Transformer) -> int:
    """Bytes of the weights one decode step reads: every parameter and persistent buffer (quantized
    weights are buffers) but the embedding table (one row per token), unless the output head shares it."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    if model.lm_head.weight is not model.embed_tokens.weight:
        tensors.pop(model.embed_tokens.weight.data_ptr())
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _lmlab_run(engine: Engine, prompts: torch.Tensor, new: int) -> dict:
    out = engine.generate(prompts.tolist(), max_new_tokens=new, sync_every=64)
    s = out.stats
    return {"ttft_s": s.ttft_s, "tpot_s": s.tpot_s, "prefill_tokens_per_s": s.prefill_tokens_per_s,
            "decode_tokens_per_s": s.decode_tokens_per_s, "kv_cache_bytes": s.kv_cache_bytes,
            "tokens": out.tokens[0][:8]}


class HFContender:
    """The same weights as `transformers`' LlamaForCausalLM, generating with its own `generate`."""

    def __init__(self, model: Transformer, static: bool):
        from transformers import LlamaConfig, LlamaForCausalLM

        from lmlab.hf import to_hf_llama

        config, state = to_hf_llama(model)
        weight = model.embed_tokens.weight
        self.model = LlamaForCausalLM(LlamaConfig(**config)).to(weight.device, weight.dtype).eval()
        self.model.load_state_dict(state)
        self.static = static
        if static:
            self.model.forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)

    def _generate(self, prompts: torch.Tensor, new: int):
        kwargs = {"cache_implementation": "static"} if self.static else {}
        return self.model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                                   min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)

    def run(self, prompts: torch.Tensor, new: int) -> dict:
        sync()
        start = time.perf_counter()
        self._generate(prompts, 1)
        sync()
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = self._generate(prompts, new)
        sync()
        total = time.perf_counter() - start
        decode_s = max(total - ttft, 1e-9)
        batch = prompts.shape[0]
        return {"ttft_s": ttft, "tpot_s": decode_s / (new - 1), "prefill_tokens_per_s": prompts.numel() / ttft,
                "decode_tokens_per_s": batch * (new - 1) / decode_s, "kv_cache_bytes": None,
                "tokens": out[0, prompts.shape[1]:prompts.shape[1] + 8].tolist()}


def _median_run(run, repeats: int) -> dict:
    runs = [run() for _ in range(repeats)]
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    return {**runs[-1], **{k: statistics.median(r[k] for r in runs) for k in keys}}


def kv_bytes_by_attention(cfg, vocab: int, length: int = 4096) -> dict[str, dict]:
    """Cache bytes per token and per sequence of `length` tokens for each attention kind at the
    model's width and depth, from the caches the engine allocates (on the meta device)."""
    heads = cfg.model.attention.get("n_heads", 16)
    groups = max(1, heads // 4)  # GQA with a quarter of the heads' keys and values
    mha, gqa = {"name": "mha", "n_heads": heads}, {"name": "mha", "n_heads": heads, "n_kv_heads": groups}
    kinds = {"mha": {"attention": mha},
             f"gqa (n_kv_heads={groups})": {"attention": gqa},
             "mqa": {"attention": {**mha, "n_kv_heads": 1}},
             "mla (kv_lora_rank=256)": {"attention": {"name": "mla", "n_heads": heads, "kv_lora_rank": 256,
                                                      "qk_rope_head_dim": 32}},
             "sliding window 1024": {"attention": {**mha, "window": 1024}},
             "cla (kv_share=2, mha)": {"attention": mha, "kv_share": 2},
             f"cla (kv_share=2, gqa {groups})": {"attention": gqa, "kv_share": 2},
             "linear": {"attention": {"name": "linear", "n_heads": heads}},
             "mamba2": {"attention": {"name": "mamba2"}},
             "gated_deltanet": {"attention": {"name": "gated_deltanet", "n_heads": heads}}}
    if cfg.model.n_layers % 4 == 0:  # the pattern must tile the layers
        kinds[f"hybrid 3:1 mamba2:gqa {groups}"] = {"attention": gqa, "layer_pattern": ["mamba2"] * 3 + ["mha"]}
    # the plain stack of the model's width and depth: each kind sets its own pattern or sharing
    base = {**OmegaConf.to_container(cfg.model, resolve=True), "layer_pattern": None, "mixers": {}, "kv_share": 1,
            "loops": 1}
    table = {}
    for kind, fields in kinds.items():
        with torch.device("meta"):
            model = Transformer(OmegaConf.create({**base, **fields, "max_seq_len": length}), vocab)
        engine = Engine(model.to(torch.bfloat16))
        engine.begin(1, length)
        total = engine.kv_cache_bytes()
        table[kind] = {"bytes_per_token": total / length, "bytes_at_length": total, "length": length}
    return table


def _roofline(model: Transformer, batch: int, prompt: int, new: int, bandwidth: float) -> float:
    """Decode tokens/s if each step only had to read its bytes at the measured bandwidth."""
    mean_len = prompt + new / 2
    step_bytes = weight_bytes_per_step(model) + batch * mean_len * model.kv_cache_bytes_per_token(
        model.embed_tokens.weight.element_size())
    return batch * bandwidth / step_bytes


def run_benchmark(model: Transformer, engines: list[str], batches: list[int], prompts: list[int], new: int,
                  repeats: int, seed: int = 0, label: str = "") -> dict:
    """Rows of timings per prompt length, batch and engine; `label` is appended to the engine names."""
    device = model.embed_tokens.weight.device
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    rows = []
    for prompt_len in prompts:
        for batch in batches:
            ids = torch.randint(0, model.vocab_size, (batch, prompt_len),
                                generator=torch.Generator().manual_seed(seed)).to(device)
            for name in engines:
                row = {"engine": name + label, "batch": batch, "prompt": prompt_len, "new": new}
                run = contender(name, model)
                run(ids, new)  # warm-up: compiles and captures
                row.update(_median_run(lambda: run(ids, new), repeats))
                if bandwidth:
                    row["roofline_tokens_per_s"] = _roofline(model, batch, prompt_len, new, bandwidth)
                    row["fraction_of_roofline"] = row["decode_tokens_per_s"] / row["roofline_tokens_per_s"]
                rows.append(row)
                print(format_row(row), flush=True)
    return {"rows": rows, "copy_bandwidth_bytes_per_s": bandwidth, "parameters": model.num_parameters(),
            "weight_bytes_per_step": weight_bytes_per_step(model),
            "kv_bytes_per_token": model.kv_cache_bytes_per_token(model.embed_tokens.weight.element_size())}


_CONTENDERS: dict[tuple[str, int], object] = {}


def contender(name: str, model: Transformer):
    """The run function of one engine, built once per model (engines keep their compiled graphs)."""
    key = (name, id(model))
    if key not in _CONTENDERS:
        builders = {**{engine: (lambda kw=kw: _engine_run(Engine(model, **kw)))
                       for engine, kw in QUANT_ENGINES.items()},
                    "graphs": lambda: _engine_run(Engine(model, cuda_graphs=True)),
                    "compiled-sdpa": lambda: _engine_run(Engine(model, True, attention_kernel=False)),
                    "compiled-unfolded": lambda: _engine_run(Engine(model, True, folded_norms=False)),
                    "compiled-folded": lambda: _engine_run(Engine(model, True, folded_norms=True)),
                    "megakernel-stages": lambda: _engine_run(_per_stage(Engine(model, True, megakernel=True))),
                    "invariant": lambda: _engine_run(Engine(model, batch_invariant=True)),
                    "hf": lambda: HFContender(model, static=False).run,
                    "hf-static": lambda: HFContender(model, static=True).run}
        _CONTENDERS[key] = builders[name]()
    return _CONTENDERS[key]


def by_layout(engines: list[str]) -> dict[tuple, list[str]]:
    """The engines grouped by what they need of a quantization's layout (QUANT_LAYOUT), as quant overrides."""
    groups: dict[tuple, list[str]] = {}
    for name in engines:
        groups.setdefault(tuple(sorted(QUANT_LAYOUT.get(name, {}).items())), []).append(name)
    return groups


def _runnable(engines: list[str], model: Transformer) -> list[str]:
    """Those of `engines` that can run `model` (built here, kept for the run); each other is named with its reason."""
    runnable = []
    for name in engines:
        try:
            contender(name, model)
        except ConfigError as error:
            print(f"{name}: not run: {error}", flush=True)
            continue
        runnable.append(name)
    return runnable


def _per_stage(engine: Engine) -> Engine:
    """The megakernel's stages as a launch each (the many-launch baseline of the same code)."""
    engine.megakernel.persistent = False
    return engine


def _engine_run(engine: Engine):
    return lambda ids, new: _lmlab_run(engine, ids, new)


HEADER = (f"{'engine':<13} {'batch':>5} {'prompt':>6} {'TTFT ms':>9} {'TPOT ms':>8} {'prefill tok/s':>14} "
          f"{'decode tok/s':>13} {'KV MiB':>8} {'roofline':>9}")


def format_row(row: dict) -> str:
    kv = "" if row["kv_cache_bytes"] is None else f"{row['kv_cache_bytes'] / 2**20:.0f}"
    roof = f"{row['fraction_of_roofline']:.0%}" if "fraction_of_roofline" in row else ""
    return (f"{row['engine']:<13} {row['batch']:>5} {row['prompt']:>6} {row['ttft_s'] * 1e3:>9.1f} "
            f"{row['tpot_s'] * 1e3:>8.2f} {row['prefill_tokens_per_s']:>14,.0f} {row['decode_tokens_per_s']:>13,.0f} "
            f"{kv:>8} {roof:>9}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (engine, prompt) in sorted({(r["engine"], r["prompt"]) for r in rows}):
        mine = sorted((r for r in rows if r["engine"] == engine and r["prompt"] == prompt), key=lambda r: r["batch"])
        if len(mine) < 2:
            continue
        ax.plot([r["batch"] for r in mine], [r["decode_tokens_per_s"] for r in mine], marker="o",
                label=f"{engine}, {prompt}-token prompt")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tokens/s", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def build_model(overrides: list[str], ckpt: str | None, device: torch.device, dtype: torch.dtype):
    """(model, its config): a checkpoint's, or a random model of the overrides' config."""
    if ckpt:
        from lmlab.training.checkpoints import load

        model, _, cfg = load(ckpt)
    else:
        prepare(overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        torch.manual_seed(0)
        model = Transformer(cfg.model, cfg.model.vocab_size or expected_vocab_size(cfg.tokenizer))
    return model.to(device, dtype).eval(), cfg


def quant_config(name: str, model: Transformer) -> dict:
    """The quant entry `name` with the settings that make it fit `model` (QUANT_FIT)."""
    fit = QUANT_FIT.get(name)
    return {"name": name, **(fit(model) if fit else {})}


def checkpoint_quant(model: Transformer, data, args) -> list[dict]:
    from lmlab.inference.bench_checkpoint import quant_quality

    quants = [quant_config(name, model) for name in args.quant]
    rows = quant_quality(model, data, quants, args.new, tuple(args.quant_engines))
    for row in rows:
        change = f"{row['ppl_change']:+.2%}" if "ppl_change" in row else "reference"
        speeds = [f"{name} {speed:,.0f} tokens/s" + (f" ({row['speedup'][name]:.2f}x)" if name in row.get("speedup", {})
                                                     else "") for name, speed in row["decode_tokens_per_s"].items()]
        speeds += [f"{name} not run: {why}" for name, why in row["not_run"].items()]
        print(f"quant {row['quant']:<5} validation perplexity {row['ppl']:.3f} ({change}), batch-1 decode: "
              f"{'; '.join(speeds)}", flush=True)
    return rows


def checkpoint_speculative(model: Transformer, data, args) -> dict:
    from lmlab.inference.bench_checkpoint import speculative_speedup

    draft, _ = build_model([], args.draft, model.embed_tokens.weight.device, model.embed_tokens.weight.dtype)
    prompts = data.prompts(args.spec_prompts, args.prompt[0])
    row = speculative_speedup(model, draft, prompts, args.new, args.draft_k, draft_megakernel=args.draft_megakernel,
                              batch_invariant=args.target_invariant)
    print(f"speculative, k={row['k']}, {row['draft_parameters'] / 1e6:.1f}M draft for a "
          f"{row['target_parameters'] / 1e6:.1f}M target: {row['speculative_tokens_per_s']:,.0f} against "
          f"{row['target_tokens_per_s']:,.0f} tokens/s alone ({row['speedup']:.2f}x; decoding alone "
          f"{row['speculative_decode_tokens_per_s']:,.0f} against {row['target_decode_tokens_per_s']:,.0f}, "
          f"{row['decode_speedup']:.2f}x), acceptance "
          f"{row['acceptance_rate']:.0%}, identical outputs {row['identical_outputs']}/{row['prompts']}", flush=True)
    if row["divergences"]:
        print("  first differing token of each differing pair, and the target's top-1 minus top-2 logit there: "
              + ", ".join(f"{d['at']} ({d['target_margin']:.3f})" for d in row["divergences"]), flush=True)
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lmlab bench generate", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help=f"lmlab-train model overrides (default: {' '.join(DEFAULT_OVERRIDES)})")
    parser.add_argument("--ckpt", default=None, help="a checkpoint's weights instead of a random model")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--prompt", type=int, nargs="+", default=[128, 512], help="prompt lengths")
    parser.add_argument("--new", type=int, default=256, help="new tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--quant", nargs="*", default=[], metavar="NAME",
                        help="also time --quant-engines on a copy of the model quantized by each quant entry "
                             "(round to nearest: the speed of GPTQ's weights, without calibration data)")
    parser.add_argument("--quant-engines", nargs="+", default=["compiled", "megakernel"], choices=list(QUANT_ENGINES),
                        help="the engines --quant times (default: compiled and megakernel; one that cannot run a "
                             "quantized copy, as the megakernel on a CPU, is named and skipped)")
    parser.add_argument("--draft", default=None, metavar="CKPT",
                        help="with --ckpt: speculative decoding with this draft checkpoint against the target alone "
                             "(batch 1, greedy, prompts from the validation split)")
    parser.add_argument("--draft-k", type=int, default=4, help="draft tokens per round (default 4)")
    parser.add_argument("--draft-megakernel", action="store_true",
                        help="the draft's one-token steps in the decode megakernel (CUDA; the target stays compiled)")
    parser.add_argument("--target-invariant", action="store_true",
                        help="the target's engines batch-invariant (CUDA): outputs identical to the target's in bf16")
    parser.add_argument("--spec-prompts", type=int, default=8, help="prompts for the speculative comparison")
    parser.add_argument("--kv-table", action="store_true", help="only print the KV bytes per attention kind")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG of decode tokens/s against batch size")
    args = parser.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    if unknown := sorted(set(engines) - set(ENGINES)):
        parser.error(f"unknown engine {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    if args.new < 2 or args.repeats < 1:
        parser.error("--new must be at least 2 and --repeats at least 1")
    if args.draft and not args.ckpt:
        parser.error("--draft needs --ckpt (the target it drafts for)")
    overrides = args.overrides or DEFAULT_OVERRIDES
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, cfg = build_model(overrides, args.ckpt, device, getattr(torch, args.dtype))
    kv_table = kv_bytes_by_attention(cfg, model.vocab_size)
    print(f"KV cache of each attention kind at d_model={cfg.model.d_model}, {cfg.model.n_layers} layers, bf16:")
    for kind, row in kv_table.items():
        print(f"  {kind:<30} {row['bytes_per_token'] / 1024:>8.1f} KiB/token  "
              f"{row['bytes_at_length'] / 2**20:>8.1f} MiB at {row['length']} tokens")
    result = {"kv_by_attention": kv_table, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": args.dtype, "overrides": overrides, "ckpt": args.ckpt}
    if not args.kv_table:
        print(f"{model.num_parameters() / 1e6:.0f}M parameters, {args.dtype}, {args.new} new tokens, greedy\n{HEADER}")
        result.update(run_benchmark(model, engines, args.batch, args.prompt, args.new, args.repeats))
        data = None
        if args.ckpt and (args.quant or args.draft):  # its corpus, read once for both
            from lmlab.inference.bench_checkpoint import CheckpointData

            data = CheckpointData(args.ckpt)
        if args.ckpt and args.quant:  # a trained model: calibrated weights, and the perplexity they cost
            result["quant_quality"] = checkpoint_quant(model, data, args)
        for name in [] if args.ckpt else args.quant:
            for layout, quant_engines in by_layout(args.quant_engines).items():
                quantized = copy.deepcopy(model)
                report = quantize(quantized, {**quant_config(name, model), "method": "rtn", **dict(layout)})
                print(f"{name}: {report['layers']} layers, kernels {report['kernels']}", flush=True)
                result["rows"] += run_benchmark(quantized, _runnable(quant_engines, quantized), args.batch,
                                                args.prompt, args.new, args.repeats, label=f"+{name}")["rows"]
        if args.draft:
            result["speculative"] = checkpoint_speculative(model, data, args)
        if args.plot:
            plot(result["rows"], args.plot, f"{model.num_parameters() / 1e6:.0f}M, {args.new} new tokens, "
                                            f"{result['device']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0
