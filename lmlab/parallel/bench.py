"""Benchmark: one training step of the same model under each parallel strategy, in one run.

    python -m lmlab.parallel.bench [--world-size N] [--d-model D] [--n-layers L] [--batch B] [--seq S] [--vocab V]
    lmlab bench parallel ...

The ~400M-parameter config of `lmlab bench train` (conf/model/llama400m.yaml) on 2 GPUs:
`--d-model 1024 --n-layers 24 --n-heads 16 --seq 2048 --vocab 50304 --batch 32`.

Each strategy trains an lmlab Transformer (SwiGLU, RoPE, AdamW) in N fresh processes on the same
global batch (B sequences, B/N per rank; under `tp` (tensor + sequence parallelism) and `pp` (a pipeline
stage per rank) every rank takes all B, and under `cp` (context parallelism) a slice of every sequence;
`ep` spreads an MoE model's experts, `--experts N`, over the ranks). `single` runs it in one process as N micro-batches of
B/N with gradient accumulation: it does the whole batch's work while holding the activations of
one rank's share, as a one-GPU run of a batch too big for one forward would. Reported per strategy:
the median step time after warm-up (the slowest rank's), tokens/s per rank, scaling efficiency
(tokens/s per rank over the single process's), and per rank the time one more (profiled) step spends in
collectives, the optimizer-state memory and the peak memory of the step (CUDA: max allocated; CPU: the rise of
the process's peak resident set over what it held before the model was built).

A strategy whose ranks run out of memory is reported as such and the others still run, so one
invocation shows which strategies fit a model: e.g. an ~10.9B-parameter model (`--d-model 4096
--n-layers 52 --n-heads 32 --batch 2`) needs about 174 GB for weights, gradients and AdamW state
unsharded and about 131 GB per rank under zero1 on two, before activations: on two H200s only
fsdp (about 87 GB per rank, plus activations) trains it.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.atomic import atomic_write_text
from lmlab.nn.transformer import ModelConfig, Transformer
from lmlab.optim import AdamW
from lmlab.parallel.bucketed_ddp import BucketedDDP
from lmlab.parallel.comm import average_gradients
from lmlab.parallel.fsdp import FSDP
from lmlab.parallel.launch import device_for, run_processes
from lmlab.parallel.context_parallel import apply_context_parallel, context_positions
from lmlab.parallel.expert_parallel import ExpertParallel
from lmlab.parallel.naive_ddp import NaiveDDP
from lmlab.parallel.pipeline import build_pipeline, stage_owners
from lmlab.parallel.ring_attention import zigzag_shard
from lmlab.parallel.tensor_parallel import apply_tensor_parallel
from lmlab.parallel.vocab_parallel import vocab_parallel_cross_entropy
from lmlab.parallel.zero1 import ZeRO1, optimizer_state_numel

Setup = Callable[[Transformer], tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]]


def _adamw(params) -> torch.optim.Optimizer:
    return AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _plain(model):
    return model, _adamw(model.parameters()), lambda: None


def _torch_ddp(model):
    device_ids = [model.lm_head.weight.device.index] if model.lm_head.weight.is_cuda else None
    wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return wrapped, _adamw(model.parameters()), lambda: None


def _lmlab_wrapper(wrap, shard: bool = False):
    def setup(model):
        wrapped = wrap(model)
        optimizer = ZeRO1(model.parameters(), AdamW, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1) if shard \
            else _adamw(model.parameters())
        return wrapped, optimizer, wrapped.finish_gradient_synchronization
    return setup


def _fsdp(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, _adamw(model.parameters()), lambda: None


def _zero3(model):
    wrapped = FSDP(model)
    return wrapped, _adamw(wrapped.parameters()), wrapped.finish_gradient_synchronization


def _pipeline(model):
    """1F1B over consecutive stages, one per rank, one sequence per micro-batch; each rank keeps only its stage."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    built = {}

    def train_chunk(chunk):  # the schedule runs every micro-batch's forward and backward itself
        if "schedule" not in built:  # the micro-batch count is the chunk's rows, known only now
            built["stages"], built["schedule"] = build_pipeline(
                model, rank, world, lambda logits, targets: _cross_entropy(model, logits.flatten(0, 1),
                                                                           targets.flatten()), len(chunk))
        last = {"target": chunk[:, 1:], "losses": []} if rank == world - 1 else {}
        built["schedule"].step(*([chunk[:, :-1]] if rank == 0 else []), **last)

    owners = stage_owners(model, world)
    keep = {id(p) for p in model.parameters() if owners[id(p)] == rank}
    for param in model.parameters():  # other stages' weights: dropped, so memory is this stage's
        if id(param) not in keep:
            param.data = param.data.new_empty(0)
    params = [p for p in model.parameters() if id(p) in keep]
    return model, _adamw(params), lambda: None, train_chunk


def _context_parallel(model):
    """Ring attention over the ranks, each on its zigzag slice of every sequence; gradients averaged."""
    import torch.distributed as dist

    apply_context_parallel(model)
    rank, world = dist.get_rank(), dist.get_world_size()

    def train_chunk(chunk):
        inputs, targets = (zigzag_shard(t, rank, world, dim=1) for t in (chunk[:, :-1], chunk[:, 1:]))
        with torch.autocast("cuda", torch.bfloat16, enabled=chunk.is_cuda):
            logits = model(inputs, context_positions(chunk.shape[1] - 1, device=chunk.device))
        _cross_entropy(model, logits.flatten(0, 1), targets.flatten()).backward()

    return model, _adamw(model.parameters()), lambda: average_gradients(list(model.parameters())), train_chunk


def _expert_parallel(model):
    """Each rank holds 1/world of every MoE layer's experts (all-to-all dispatch); the rest is data parallel:
    lmlab-train's `parallel=nd parallel.ep=N` with N the world size."""
    wrapped = ExpertParallel(model)
    return wrapped, _adamw(model.parameters()), wrapped.finish_gradient_synchronization


def _tensor_parallel(model):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    apply_tensor_parallel(model, init_device_mesh(model.lm_head.weight.device.type, (dist.get_world_size(),)))
    return model, _adamw(model.parameters()), lambda: None


STRATEGIES: dict[str, Setup] = {
    "single": _plain,
    "ddp": _torch_ddp,
    "naive_ddp": _lmlab_wrapper(NaiveDDP),
    "bucketed_ddp": _lmlab_wrapper(BucketedDDP),
    "zero1": _lmlab_wrapper(BucketedDDP, shard=True),
    "fsdp": _fsdp,
    "zero3": _zero3,
    "tp": _tensor_parallel,  # tensor + sequence parallel over all ranks (lmlab.parallel.tensor_parallel)
    "pp": _pipeline,  # one pipeline stage per rank, 1F1B (lmlab.parallel.pipeline)
    "ep": _expert_parallel,  # MoE experts spread over the ranks (lmlab.parallel.expert_parallel); needs --experts
    "cp": _context_parallel,  # each rank a slice of every sequence, ring attention (lmlab.parallel.context_parallel)
}
WHOLE_BATCH = {"tp", "pp", "cp"}  # strategies whose ranks all train on every row: they split the model, not the batch


def _rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _bench_rank(rank: int, world_size: int, strategy: str, model_cfg: dict, vocab: int, batch: int, seq: int,
                steps: int, backend: str, micro_batch: int) -> dict:
    device = device_for(backend, rank)
    before = _current_rss_mb()
    torch.manual_seed(0)
    try:
        return _train_steps(device, before, strategy, model_cfg, vocab, batch, seq, steps, rank, world_size,
                            micro_batch)
    except torch.OutOfMemoryError as error:
        # Every rank of a strategy holds the same sizes, so all of them get here and none is left
        # waiting in a collective.
        return {"out_of_memory": str(error).splitlines()[0]}


def _train_steps(device: torch.device, before: float, strategy: str, model_cfg: dict, vocab: int, batch: int,
                 seq: int, steps: int, rank: int, world_size: int, micro_batch: int) -> dict:
    with device:  # parameters are made on the GPU: a model too big for host memory per rank still builds
        model = Transformer(ModelConfig(**model_cfg), vocab).to(device)
    # a strategy may also return how it trains one chunk (pp: its schedule runs forward and backward)
    wrapped, optimizer, synchronize, *own_training = STRATEGIES[strategy](model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the step's peak, not the whole model built before sharding
    share, first = (batch, 0) if strategy in WHOLE_BATCH else (batch // world_size, rank * batch // world_size)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)[first:first + share].to(device)
    chunks = ids.split(micro_batch)  # one chunk on the ranks of a parallel strategy; N for `single`
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")

    def train_chunk(chunk):
        with autocast:
            logits = wrapped(chunk[:, :-1])
        (_cross_entropy(model, logits.flatten(0, 1), chunk[:, 1:].flatten()) / len(chunks)).backward()

    train = own_training[0] if own_training else train_chunk

    def step():
        for chunk in chunks:
            train(chunk)
        synchronize()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    comm_s = communication_seconds(step, device)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else _rss_peak_mb() - before
    element = next(iter(optimizer.state.values()))["exp_avg"].element_size() if optimizer.state else 4
    return {"step_s": statistics.median(times[2:]), "peak_mb": peak, "comm_ms": comm_s * 1e3,
            "optimizer_state_mb": optimizer_state_numel(optimizer) * element / 2**20}


def _cross_entropy(model: Transformer, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    group = getattr(model, "vocab_parallel_group", None)  # tp: each rank holds a slice of the vocabulary
    if group is None:
        return F.cross_entropy(logits.float(), targets)
    return vocab_parallel_cross_entropy(logits, targets, -100, 0.0, False, group=group)[0]


def communication_seconds(step: Callable[[], None], device: torch.device) -> float:
    """The time one more `step` spends in collectives, from torch.profiler: NCCL kernels on a GPU, gloo's
    collectives on a CPU. Communication that overlaps compute counts in full, so this bounds what it costs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        step()
    if cuda:
        return sum(e.device_time for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.name.startswith("nccl")) / 1e6
    return sum(e.cpu_time_total for e in prof.events() if e.name.startswith("gloo:")) / 1e6


def run(strategies: list[str], world_size: int, model_cfg: dict, batch: int, seq: int, steps: int,
        vocab: int = 8192) -> dict:
    backend = "nccl" if torch.cuda.device_count() >= world_size else "gloo"
    rows = {}
    for name in strategies:
        world = 1 if name == "single" else world_size
        print(f"lmlab bench parallel: {name} on {world} rank(s) ...", file=sys.stderr, flush=True)
        micro_batch = batch if name in WHOLE_BATCH else batch // world_size
        per_rank = run_processes(_bench_rank, world, backend,
                                 args=(name, model_cfg, vocab, batch, seq, steps, backend, micro_batch))
        out_of_memory = [r["out_of_memory"] for r in per_rank if "out_of_memory" in r]
        if out_of_memory:
            rows[name] = {"world_size": world, "out_of_memory": out_of_memory[0]}
            continue
        step_s = max(r["step_s"] for r in per_rank)
        rows[name] = {"world_size": world, "step_s": step_s, "tokens_per_s_per_rank": batch * seq / world / step_s,
                      "peak_mb": [r["peak_mb"] for r in per_rank], "comm_ms": [r["comm_ms"] for r in per_rank],
                      "optimizer_state_mb": [r["optimizer_state_mb"] for r in per_rank]}
    if "tokens_per_s_per_rank" in rows.get("single", {}):
        for row in rows.values():  # tokens/s per rank against one process's: 1.0 is perfect scaling
            if "tokens_per_s_per_rank" in row:
                row["scaling_efficiency"] = row["tokens_per_s_per_rank"] / rows["single"]["tokens_per_s_per_rank"]
    return {"backend": backend, "model": model_cfg, "vocab": vocab, "batch": batch, "seq": seq, "steps": steps,
            "strategies": rows}


def report(r: dict) -> str:
    m = r["model"]
    lines = [f"{r['backend']}: d_model {m['d_model']}, {m['n_layers']} layers, global batch {r['batch']} x {r['seq']} "
             f"tokens, AdamW; median of {r['steps'] - 2} steps after 2 warm-up steps (slowest rank)",
             f"  {'strategy':<13} {'ranks':>5} {'step ms':>9} {'tok/s/rank':>11} {'scaling':>8} "
             f"{'peak MB/rank':>16} {'opt state MB/rank':>20} {'comm ms/rank':>14}"]
    for name, row in r["strategies"].items():
        if "out_of_memory" in row:
            lines.append(f"  {name:<13} {row['world_size']:>5}   out of memory: {row['out_of_memory']}")
            continue
        peak = "/".join(f"{v:.0f}" for v in row["peak_mb"])
        state = "/".join(f"{v:.1f}" for v in row["optimizer_state_mb"])
        comm = "/".join(f"{v:.1f}" for v in row.get("comm_ms", []))
        scaling = f"{row['scaling_efficiency']:.2f}" if "scaling_efficiency" in row else "-"
        lines.append(f"  {name:<13} {row['world_size']:>5} {row['step_s'] * 1e3:>9.1f} "
                     f"{row['tokens_per_s_per_rank']:>11,.0f} {scaling:>8} {peak:>16} {state:>20} {comm:>14}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lmlab bench parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES),
                        help="default: every one that runs the model (ep only with --experts)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over the ranks")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=7, help="steps per strategy, the first two are warm-up")
    parser.add_argument("--experts", type=int, default=0, help="MoE FFNs of this many experts (0: dense; ep needs them)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token, with --experts")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.strategies = args.strategies or [name for name in STRATEGIES if name != "ep" or args.experts]
    if args.world_size < 2 or args.batch % args.world_size or args.steps < 3:
        parser.error("--world-size must be >= 2 and divide --batch, and --steps must be >= 3")
    if "pp" in args.strategies and args.n_layers < args.world_size:
        parser.error(f"pp gives each of the {args.world_size} ranks a stage of layers: --n-layers must be >= that")
    if "cp" in args.strategies and args.seq % (2 * args.world_size):
        parser.error(f"cp cuts each sequence into 2 x {args.world_size} chunks: --seq must be a multiple of that")
    if "ep" in args.strategies and (not args.experts or args.experts % args.world_size):
        parser.error("ep spreads the experts over the ranks: --experts must be a multiple of --world-size")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_cfg = {"d_model": args.d_model, "n_layers": args.n_layers, "max_seq_len": args.seq, "norm": "rmsnorm",
                 "ffn": "swiglu", "position": "rope", "attention": {"name": "mha", "n_heads": args.n_heads},
                 "block": "prenorm"}
    if args.experts:
        model_cfg["moe"] = {"name": "topk", "n_experts": args.experts, "k": args.top_k}
    result = run(args.strategies, args.world_size, model_cfg, args.batch, args.seq, args.steps, args.vocab)
    print(report(result))
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
