"""`lmlab bench serve [OVERRIDES...]`: the serving engine under load, continuous batching against static.

    lmlab bench serve model=llama400m model.vocab_size=50304 --rates 1 2 4 8 inf --json serve.json --plot ttft.png
    lmlab bench serve --shared-prefix 1000 --rates 8 inf      # prefix sharing on against off
    lmlab bench serve --prompts requests.jsonl                 # lengths (or token ids) from a file

An asyncio client sends `--requests` requests at each rate, with Poisson arrivals (seeded exponential
gaps; `inf` sends them all at once), to a fresh engine per scheduler and rate over one model (random
weights of the overrides' config, or `--ckpt`'s). Every run sees the same prompts, and at a given rate
the same arrival times. Prompts are random token ids; their lengths come from a synthetic ShareGPT-like
mixture (log-normal prompts: most are chat turns, a fifth long documents; log-normal outputs; all clipped
to the model's context) or from `--prompts FILE.jsonl`, one request a line, either form:

    {"prompt_len": 812, "output_len": 64}            random ids, 812 of them
    {"prompt_ids": [17, 4, 998], "output_len": 64}   these ids

Every request makes exactly its output_len tokens (greedy, no stop token). Reported per scheduler and
rate: achieved requests/s and output tokens/s (completed over the makespan), time to first token and
time per output token (p50, p99; as the client sees them), and the KV blocks in use at each step's plan
(peak, mean over steps). The headline: each scheduler's highest rate whose p99 TTFT stays within
`--ttft-slo`, and continuous over static requests/s at those rates. With `--shared-prefix N` every prompt
starts with the same N tokens (a system prompt) and each scheduler (default: continuous) runs with prefix
caching on and off: the KV blocks sharing saves, and its throughput gain.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmlab.errors import ConfigError
from lmlab.inference.bench import DEFAULT_OVERRIDES, build_model
from lmlab.serving.async_engine import AsyncEngine
from lmlab.serving.engine import SamplingParams, ServingConfig, ServingEngine
from lmlab.serving.runner import GRAPH_BATCHES
from lmlab.serving.scheduler import SCHEDULERS

LONG_FRACTION, LONG_SCALE = 0.2, 3.0  # a fifth of the prompts are documents three times the mean prompt
# the chat turns' scale, which makes the mixture's mean --prompt-mean
SHORT_SCALE = (1 - LONG_FRACTION * LONG_SCALE) / (1 - LONG_FRACTION)
PROMPT_SIGMA, OUTPUT_SIGMA = 0.8, 0.6  # log-normal spreads
WARMUP_REQUESTS = 4  # without CUDA graphs: enough to run the prefill and decode paths once
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids, the shared prefix included
    outputs: list[int]  # tokens each request makes


@dataclass
class Record:
    """One request as the client saw it (perf_counter seconds)."""

    submitted: float
    first_token: float | None
    finished: float
    tokens: int
    finish_reason: str | None


# -- the workload ---------------------------------------------------------------------------------
def read_prompts(path: Path) -> list[tuple[str, list[int] | int, int]]:
    """(where, prompt ids or length, output_len) per non-blank line of a JSONL file."""
    if not path.is_file():
        raise ConfigError(f"--prompts {path}: no such file")
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not JSON ({err})") from None
        if not isinstance(item, dict) or not _count(item.get("output_len")) or (
                ("prompt_len" in item) == ("prompt_ids" in item)):
            raise ConfigError(f'{where}: each line is {{"prompt_len": N, "output_len": M}} or '
                              f'{{"prompt_ids": [ids], "output_len": M}} with N, M >= 1; got {line.strip()[:80]}')
        prompt = item.get("prompt_len", item.get("prompt_ids"))
        if not (_count(prompt) or isinstance(prompt, list) and prompt and all(_integer(t) and t >= 0 for t in prompt)):
            raise ConfigError(f"{where}: prompt_len must be an integer >= 1, prompt_ids a non-empty list of token ids "
                              f">= 0; got {prompt!r:.80}")
        entries.append((where, prompt, item["output_len"]))
    if not entries:
        raise ConfigError(f"--prompts {path}: the file has no requests")
    return entries


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no integer


def _count(value) -> bool:
    return _integer(value) and value >= 1


def lognormal(rng: np.random.Generator, mean, sigma: float, n: int) -> np.ndarray:
    return rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, n)


def sharegpt_lengths(rng: np.random.Generator, n: int, prompt_mean: float, output_mean: float,
                     room: int) -> list[tuple[str, int, int]]:
    """ShareGPT-like (prompt, output) lengths, clipped so each request fits in `room` tokens with >= 2 outputs."""
    long = rng.random(n) < LONG_FRACTION
    prompts = lognormal(rng, np.where(long, LONG_SCALE, SHORT_SCALE) * prompt_mean, PROMPT_SIGMA, n)
    prompts = np.clip(np.rint(prompts), 1, room - 2).astype(int)
    outputs = np.clip(np.rint(lognormal(rng, output_mean, OUTPUT_SIGMA, n)), 2, room - prompts).astype(int)
    return [(f"synthetic request {i}", int(p), int(o)) for i, (p, o) in enumerate(zip(prompts, outputs))]


def make_workload(entries: list[tuple[str, list[int] | int, int]] | None, args, vocab: int,
                  max_seq_len: int) -> Workload:
    """The prompts (shared prefix first) and output lengths; one clear error for a request that cannot fit."""
    if args.shared_prefix + 3 > max_seq_len:
        raise ConfigError(f"--shared-prefix {args.shared_prefix} leaves no room in the model's context of "
                          f"{max_seq_len} tokens for a prompt and 2 output tokens")
    rng = np.random.default_rng(args.seed)
    prefix = rng.integers(vocab, size=args.shared_prefix).tolist()
    if entries is None:
        entries = sharegpt_lengths(rng, args.requests, args.prompt_mean, args.output_mean,
                                   max_seq_len - args.shared_prefix)
    prompts, outputs = [], []
    for where, prompt, output_len in entries[:args.requests]:
        ids = rng.integers(vocab, size=prompt).tolist() if isinstance(prompt, int) else prompt
        if max(ids) >= vocab:
            raise ConfigError(f"{where}: token id {max(ids)} is outside the model's vocabulary of {vocab}")
        total = args.shared_prefix + len(ids) + output_len
        if total > max_seq_len:
            raise ConfigError(f"{where}: the shared prefix ({args.shared_prefix}), prompt ({len(ids)}) and output "
                              f"({output_len}) make {total} tokens, past the model's context of {max_seq_len}")
        prompts.append(prefix + ids)
        outputs.append(output_len)
    return Workload(prompts, outputs)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson at `rate`, the first at 0."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1 / rate, n)
    return (np.cumsum(gaps) - gaps[0]).tolist()


# -- one run --------------------------------------------------------------------------------------
def probe_kv(engine: ServingEngine) -> list[int]:
    """Blocks in use at each step's plan, recorded on the engine thread: a step's peak, since sequences that
    finish in it free their blocks only after the forward."""
    used, schedule = [], engine.scheduler.schedule

    def schedule_and_count():
        plan = schedule()
        if plan:
            used.append(engine.blocks.num_used())
        return plan

    engine.scheduler.schedule = schedule_and_count
    return used


async def warm_up(engine: AsyncEngine, seed: int) -> None:
    """Run the prefill and decode paths once. With CUDA graphs, a batch of max_num_seqs shrinks by one
    sequence per step, so every decode graph the timed run replays is captured here."""
    serving = engine.engine
    count = WARMUP_REQUESTS
    if serving.runner.cuda_graphs:
        count = min(serving.scheduler.cfg.max_num_seqs, GRAPH_BATCHES[-1])
    prompt_len = min(serving.cfg.block_size, serving.max_seq_len // 2)
    rng = np.random.default_rng(seed)
    streams = [engine.submit(rng.integers(serving.model.vocab_size, size=prompt_len).tolist(),
                             SamplingParams(max_tokens=min(i + 2, serving.max_seq_len - prompt_len), ignore_eos=True))
               for i in range(count)]
    for stream in streams:
        async for _ in stream:
            pass


async def drive(engine: AsyncEngine, workload: Workload, arrivals: list[float]) -> tuple[list[Record], float]:
    """Send each request at its arrival time and follow its stream; (records, start time)."""
    start = time.perf_counter()

    async def one(prompt: list[int], output_len: int, at: float) -> Record:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        submitted, first, tokens, reason = time.perf_counter(), None, 0, None
        async for event in engine.submit(prompt, SamplingParams(max_tokens=output_len, ignore_eos=True)):
            if event.token is not None:
                tokens += 1
                first = first or time.perf_counter()
            reason = event.finish_reason or reason
        return Record(submitted, first, time.perf_counter(), tokens, reason)

    records = await asyncio.gather(*(one(p, o, a) for p, o, a in zip(workload.prompts, workload.outputs, arrivals)))
    return list(records), start


def run_once(model, args, scheduler: str, prefix_caching: bool, rate: float, workload: Workload) -> dict:
    """One fresh engine (its own KV pool and graphs) under one arrival schedule: the row of its results."""
    cfg = ServingConfig(num_blocks=args.num_blocks, block_size=args.block_size, prefix_caching=prefix_caching,
                        scheduler=scheduler_config(scheduler, args))
    serving = ServingEngine(model, None, cfg)
    for prompt, output_len in zip(workload.prompts, workload.outputs):  # a pool too small fails here, not mid-run
        serving.check(prompt, SamplingParams(max_tokens=output_len))
    engine = AsyncEngine(serving, max_waiting=len(workload.prompts) + GRAPH_BATCHES[-1]).start()
    try:
        used = probe_kv(serving)
        asyncio.run(warm_up(engine, args.seed + 1))
        used.clear()
        before = serving.stats()
        records, start = asyncio.run(drive(engine, workload, arrival_times(len(workload.prompts), rate, args.seed)))
        if engine.error is not None:
            raise RuntimeError(f"the serving engine stopped: {engine.error}") from engine.error
        after = serving.stats()
    finally:
        engine.stop()
        del engine, serving
        gc.collect()  # the next engine's pool is sized from the memory this one frees
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row = {"scheduler": scheduler, "prefix_caching": prefix_caching, "rate": rate if math.isfinite(rate) else "inf"}
    row.update(summarize(records, start, used))
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    row.update(kv_blocks_total=after["kv_blocks_total"], preemptions=after["preemptions"] - before["preemptions"],
               prefix_cache_hit_rate=(after["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries
               if queries else None)
    return row


def scheduler_config(name: str, args) -> dict:
    return {"name": name, "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[Record], start: float, used: list[int]) -> dict:
    done = [r for r in records if r.finish_reason in ("length", "stop")]
    makespan = max((r.finished for r in records), default=start) - start
    ttft = [r.first_token - r.submitted for r in done if r.first_token is not None]
    tpot = [(r.finished - r.first_token) / (r.tokens - 1) for r in done if r.tokens > 1]
    tokens = sum(r.tokens for r in done)
    return {"requests": len(records), "completed": len(done), "duration_s": makespan,
            "requests_per_s": len(done) / makespan, "output_tokens": tokens, "output_tokens_per_s": tokens / makespan,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "kv_blocks_peak": max(used, default=0), "kv_blocks_mean": float(np.mean(used)) if used else 0.0,
            "steps": len(used)}


# -- the report -----------------------------------------------------------------------------------
def label(row: dict, prefix_mode: bool) -> str:
    return f"{row['scheduler']}, prefix {'on' if row['prefix_caching'] else 'off'}" if prefix_mode else row["scheduler"]


def rate_text(rate) -> str:
    return "inf" if rate == "inf" else f"{rate:g}"


def rate_phrase(rate) -> str:
    return "all at once" if rate in ("inf", math.inf) else f"{rate:g} requests/s"


HEADER = (f"{'scheduler':<11} {'prefix':>6} {'rate/s':>6} {'done':>5} {'req/s':>7} {'out tok/s':>10} "
          f"{'TTFT p50 ms':>11} {'p99':>8} {'TPOT p50 ms':>11} {'p99':>7} {'KV peak':>8} {'KV mean':>8} {'preempt':>7}")


def format_row(row: dict) -> str:
    def ms(value):
        return "" if value is None else f"{value * 1e3:.1f}"

    return (f"{row['scheduler']:<11} {'on' if row['prefix_caching'] else 'off':>6} {rate_text(row['rate']):>6} "
            f"{row['completed']:>5} {row['requests_per_s']:>7.2f} {row['output_tokens_per_s']:>10,.0f} "
            f"{ms(row['ttft_p50_s']):>11} {ms(row['ttft_p99_s']):>8} {ms(row['tpot_p50_s']):>11} "
            f"{ms(row['tpot_p99_s']):>7} {row['kv_blocks_peak']:>8} {row['kv_blocks_mean']:>8.1f} "
            f"{row['preemptions']:>7}")


def within_slo(rows: list[dict], slo: float) -> dict[str, dict | None]:
    """Per scheduler: the row of its highest rate whose p99 TTFT is within `slo` seconds (None: no rate is)."""
    best: dict[str, dict | None] = {}
    for row in rows:
        best.setdefault(row["scheduler"], None)
        if row["ttft_p99_s"] is not None and row["ttft_p99_s"] <= slo and row["completed"] == row["requests"]:
            current = best[row["scheduler"]]
            if current is None or _rate(row) > _rate(current):
                best[row["scheduler"]] = row
    return best


def _rate(row: dict) -> float:
    return math.inf if row["rate"] == "inf" else row["rate"]


def scheduler_headline(rows: list[dict], slo: float) -> dict:
    best = within_slo(rows, slo)
    parts = [f"{name} {rate_text(row['rate'])} ({row['requests_per_s']:.2f} requests/s achieved)" if row else
             f"{name} none" for name, row in best.items()]
    print(f"\nhighest rate (requests/s offered) with p99 TTFT <= {slo:g} s: " + ", ".join(parts))
    ratio = None
    if best.get("continuous") and best.get("static"):
        ratio = best["continuous"]["requests_per_s"] / best["static"]["requests_per_s"]
        print(f"continuous serves {ratio:.2f}x the requests/s of static within that p99 TTFT")
    return {"ttft_slo_s": slo, "rate_within_slo": {name: row and row["rate"] for name, row in best.items()},
            "requests_per_s_within_slo": {name: row and row["requests_per_s"] for name, row in best.items()},
            "continuous_over_static": ratio}


def prefix_headline(rows: list[dict], shared: int) -> list[dict]:
    """Per scheduler and rate: prefix caching on against off."""
    pairs: dict[tuple, dict] = {}
    for row in rows:
        pairs.setdefault((row["scheduler"], row["rate"]), {})[row["prefix_caching"]] = row
    out = []
    print(f"\nprefix sharing, {shared}-token shared prefix:")
    for (scheduler, rate), pair in pairs.items():
        on, off = pair.get(True), pair.get(False)
        if not (on and off and off["kv_blocks_peak"] and off["requests_per_s"]):
            continue
        item = {"scheduler": scheduler, "rate": rate,
                "kv_peak_reduction": 1 - on["kv_blocks_peak"] / off["kv_blocks_peak"],
                "kv_mean_reduction": 1 - on["kv_blocks_mean"] / off["kv_blocks_mean"],
                "throughput_ratio": on["requests_per_s"] / off["requests_per_s"]}
        out.append(item)
        print(f"  {scheduler}, {rate_phrase(rate)}: peak KV blocks {off['kv_blocks_peak']} -> {on['kv_blocks_peak']} "
              f"({item['kv_peak_reduction']:.0%} less), mean {off['kv_blocks_mean']:.0f} -> {on['kv_blocks_mean']:.0f} "
              f"({item['kv_mean_reduction']:.0%} less); requests/s {off['requests_per_s']:.2f} -> "
              f"{on['requests_per_s']:.2f} ({item['throughput_ratio']:.2f}x)")
    return out


def plot(rows: list[dict], path: Path, title: str, slo: float, prefix_mode: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(label(r, prefix_mode) for r in rows):
        mine = sorted((r for r in rows if label(r, prefix_mode) == name and r["ttft_p99_s"] is not None),
                      key=lambda r: r["requests_per_s"])
        ax.plot([r["requests_per_s"] for r in mine], [r["ttft_p99_s"] for r in mine], marker="o", label=name)
    ax.axhline(slo, color="gray", linestyle="--", linewidth=1, label=f"SLO {slo:g} s")
    ax.set(yscale="log", xlabel="achieved requests/s", ylabel="p99 time to first token (s)", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# -- the command ----------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lmlab bench serve", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*",
                        help=f"lmlab-train model overrides (default: {' '.join(DEFAULT_OVERRIDES)})")
    parser.add_argument("--ckpt", default=None, help="a checkpoint's weights instead of a random model")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto: cuda if any")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="auto: bfloat16 on CUDA, else float32")
    parser.add_argument("--schedulers", nargs="+", default=None, metavar="NAME",
                        help="default: continuous static (with --shared-prefix: continuous)")
    parser.add_argument("--rates", nargs="+", type=float, default=[1, 2, 4, 8, math.inf], metavar="RATE",
                        help="requests/s of the Poisson arrivals; inf: all at once (default: 1 2 4 8 inf)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per run (default: 100, or every line of --prompts)")
    parser.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                        help='requests from a file, a line each: {"prompt_len": N, "output_len": M} or '
                             '{"prompt_ids": [...], "output_len": M}')
    parser.add_argument("--prompt-mean", type=float, default=256, help="synthetic workload: mean prompt tokens")
    parser.add_argument("--output-mean", type=float, default=192, help="synthetic workload: mean output tokens")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                        help="every prompt starts with the same N tokens; compares prefix caching on and off")
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="p99 time-to-first-token bound, seconds")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: the engine's)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG of p99 TTFT against achieved requests/s")
    args = parser.parse_args(argv)
    if bad := [r for r in args.rates if not r > 0]:
        parser.error(f"--rates must be > 0 requests/s (inf: all at once); got {bad[0]:g}")
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests must be >= 1, got {args.requests}")
    if not (args.prompt_mean >= 1 and args.output_mean >= 1):
        parser.error("--prompt-mean and --output-mean must be >= 1 token")
    if args.shared_prefix < 0 or not args.ttft_slo > 0:
        parser.error("--shared-prefix must be >= 0 and --ttft-slo > 0")
    if (args.num_blocks is not None and args.num_blocks < 2) or args.block_size < 1:
        parser.error("--num-blocks must be >= 2 (one is the null block) and --block-size >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    args.schedulers = list(dict.fromkeys(args.schedulers or (["continuous"] if args.shared_prefix
                                                            else ["continuous", "static"])))
    args.rates = list(dict.fromkeys(args.rates))
    for name in args.schedulers:  # an unknown name or a bad field fails here, naming the choices
        SCHEDULERS.resolve(scheduler_config(name, args))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    entries = read_prompts(args.prompts) if args.prompts else None
    if entries is not None:
        if args.requests is not None and args.requests > len(entries):
            raise ConfigError(f"--requests {args.requests}, but {args.prompts} has {len(entries)} requests")
        args.requests = args.requests or len(entries)
    args.requests = args.requests or 100
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = DTYPES.get(args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    overrides = args.overrides or DEFAULT_OVERRIDES
    model, _ = build_model(overrides, args.ckpt, device, dtype)
    workload = make_workload(entries, args, model.vocab_size, model.max_seq_len)

    prompt_lens = [len(p) for p in workload.prompts]
    print(f"{model.num_parameters() / 1e6:.1f}M parameters, {str(dtype).removeprefix('torch.')} on {device.type}; "
          f"{args.requests} requests per run: prompts {min(prompt_lens)}-{max(prompt_lens)} tokens "
          f"(mean {np.mean(prompt_lens):.0f}, shared prefix {args.shared_prefix}), outputs "
          f"{min(workload.outputs)}-{max(workload.outputs)} (mean {np.mean(workload.outputs):.0f})")
    prefix_mode = args.shared_prefix > 0
    runs = [(s, p, r) for s in args.schedulers for p in ((True, False) if prefix_mode else (True,)) for r in args.rates]
    print(HEADER, flush=True)
    rows = []
    for i, (scheduler, prefix_caching, rate) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {scheduler}, prefix caching {'on' if prefix_caching else 'off'}, "
              f"{rate_phrase(rate)}", file=sys.stderr, flush=True)
        rows.append(run_once(model, args, scheduler, prefix_caching, rate, workload))
        print(format_row(rows[-1]), flush=True)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"rows": rows, "device": device_name, "torch": torch.__version__, "dtype": str(dtype),
              "overrides": overrides, "ckpt": args.ckpt, "parameters": model.num_parameters(),
              "workload": {"source": str(args.prompts) if args.prompts else "sharegpt", "requests": args.requests,
                           "shared_prefix": args.shared_prefix, "mean_prompt_tokens": float(np.mean(prompt_lens)),
                           "mean_output_tokens": float(np.mean(workload.outputs)), "seed": args.seed}}
    if prefix_mode:
        result["prefix_sharing"] = prefix_headline(rows, args.shared_prefix)
    else:
        result["headline"] = scheduler_headline(rows, args.ttft_slo)
    if args.plot:
        title = f"{model.num_parameters() / 1e6:.3g}M parameters, {args.requests} requests, {device_name}"
        plot(rows, args.plot, title, args.ttft_slo, prefix_mode)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0
