"""What `lmlab bench generate --ckpt PATH` adds for a trained checkpoint: the validation perplexity
and batch-1 speed of each quantization against the unquantized weights (GPTQ calibrated on the
training split), and speculative decoding with `--draft PATH` against target-only decoding on
prompts taken from the validation split (greedy: the outputs should be the target's own).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time

import torch
import torch.nn.functional as F

from lmlab.cli.generate import CALIBRATION_BATCH, calibration_batches, open_model
from lmlab.errors import ConfigError
from lmlab.data.batches import evenly_spaced_windows
from lmlab.inference.bench import QUANT_ENGINES, by_layout
from lmlab.inference.engine import Engine
from lmlab.inference.quant import QUANTS, quantize, set_kernels
from lmlab.inference.speculative import check_draft, speculative_generate
from lmlab.nn.transformer import Transformer
from lmlab.timing import sync

PPL_WINDOWS = 64  # validation windows of the model's context for the perplexity


@torch.inference_mode()
def perplexity(model: Transformer, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy) over windows of inputs and targets (N, context)."""
    device = model.embed_tokens.weight.device
    total = 0.0
    for x, y in zip(inputs.split(CALIBRATION_BATCH), targets.split(CALIBRATION_BATCH)):
        logits = model(x.to(device)).float()
        total += F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="sum").item()
    return math.exp(total / targets.numel())


class CheckpointData:
    """A checkpoint's validation windows and GPTQ calibration batches, from its own corpus."""

    def __init__(self, ckpt: str):
        source = open_model(ckpt, "--ckpt")
        if source.corpus is None:
            raise SystemExit(f"lmlab bench generate: --ckpt {ckpt} names no training corpus")
        train, val, context = source.corpus()
        self.context = min(context, source.max_seq_len)
        self.val = evenly_spaced_windows(val, PPL_WINDOWS, min(self.context, len(val) - 1))
        self.calibration = calibration_batches(train, self.context, f"{ckpt}'s training split")
        self.val_tokens = val
        self.tokenizer = source.tokenizer

    def prompts(self, n: int, length: int) -> list[list[int]]:
        """n prompts of `length` tokens spread over the validation split."""
        inputs, _ = evenly_spaced_windows(self.val_tokens, n, length)
        return inputs.tolist()


def _batch1_speeds(model: Transformer, prompt: list[int], new: int, engines: tuple[str, ...]) -> tuple[dict, dict]:
    """({engine: decode tokens/s of a greedy generation, after one that compiles and captures}, {engine: why it
    could not run this model}, as the megakernel on a CPU)."""
    speeds, not_run = {}, {}
    for name in engines:
        try:
            engine = Engine(model, **QUANT_ENGINES[name])
        except ConfigError as error:
            not_run[name] = str(error)
            continue
        engine.generate([prompt], max_new_tokens=new, sync_every=64)
        speeds[name] = engine.generate([prompt], max_new_tokens=new, sync_every=64).stats.decode_tokens_per_s
        del engine
    return speeds, not_run


def quant_quality(model: Transformer, data: CheckpointData, quants: list, new: int,
                  engines: tuple[str, ...] = ("compiled",)) -> list[dict]:
    """Per quant entry (and the unquantized weights first): validation perplexity and batch-1 decode
    tokens/s on each of `engines` (QUANT_ENGINES), and its speed-up over the unquantized weights on the same
    engine; entries that calibrate use the training split. Each entry quantizes once; engines that need another
    stored layout of the codes (QUANT_LAYOUT) get a copy re-packed so; the perplexity is the first copy's."""
    if unknown := sorted(set(engines) - set(QUANT_ENGINES)):
        raise ValueError(f"unknown engine {', '.join(unknown)}; choose from {', '.join(QUANT_ENGINES)}")
    prompt = data.prompts(1, min(128, data.context // 2))[0]
    speeds, not_run = _batch1_speeds(model, prompt, new, engines)
    rows = [{"quant": "none", "ppl": perplexity(model, *data.val), "decode_tokens_per_s": speeds, "not_run": not_run}]
    for quant in quants:  # entry names or configs
        _, config = QUANTS.resolve(quant)
        calibration = data.calibration if QUANTS.build(config).method.calibrated else None
        row = {"decode_tokens_per_s": {}, "not_run": {}}
        readable = copy.deepcopy(model)  # in the layout that gives its codes back, for each engine's re-packing
        report = quantize(readable, dataclasses.replace(config, kernel="dequant"), calibration)
        row.update(quant=report["quant"], method=report["method"])
        layouts = list(by_layout(list(engines)).items())
        for i, (layout, group) in enumerate(layouts):
            # a copy per layout but the last, which re-packs `readable` itself
            quantized = copy.deepcopy(readable) if i < len(layouts) - 1 else readable
            kernels = set_kernels(quantized, dict(layout).get("kernel", config.kernel))
            if "ppl" not in row:
                row.update(kernels=kernels, ppl=perplexity(quantized, *data.val))
            speeds, not_run = _batch1_speeds(quantized, prompt, new, tuple(group))
            row["decode_tokens_per_s"].update(speeds)
            row["not_run"].update(not_run)
            del quantized
        del readable
        rows.append(row)
    base = rows[0]["decode_tokens_per_s"]
    for row in rows[1:]:
        row["ppl_change"] = row["ppl"] / rows[0]["ppl"] - 1
        row["speedup"] = {name: speed / base[name] for name, speed in row["decode_tokens_per_s"].items()
                          if name in base}
    return rows


class SpeculativeComparison:
    """Batch-1 greedy decoding of each prompt by the target alone, timed once, against speculative decoding
    with any number of drafters and k, on (compiled) engines built once: a sweep compiles each shape once.
    Speeds are given over whole generations (prefill included) and over their decoding alone."""

    def __init__(self, target: Transformer, prompts: list[list[int]], new: int, compile: bool = True,
                 batch_invariant: bool = False):
        """batch_invariant: the target's engines (alone and speculative) are batch-invariant (eager steps in CUDA
        graphs, lmlab.inference.batch_invariant), so the outputs must be identical in any precision."""
        self.target, self.prompts, self.new = target, prompts, new
        engine = lambda: Engine(target, compile=compile and not batch_invariant, batch_invariant=batch_invariant)  # noqa: E731
        self.engine = engine()  # speculative decoding's target
        self.alone_generations, self.alone_tokens_per_s, self.alone_decode_tokens_per_s = self.time_alone(engine())

    def time_alone(self, engine: Engine) -> tuple[list, float, float]:
        """The target alone on `engine` over the prompts: its Generations, tokens/s and decode tokens/s."""
        engine.generate([self.prompts[0]], max_new_tokens=self.new)  # compiles and captures
        seconds, generations = self._timed(lambda p: engine.generate([p], max_new_tokens=self.new))
        return generations, sum(len(g.tokens[0]) for g in generations) / seconds, decode_tokens_per_s(generations)

    def _timed(self, run) -> tuple[float, list]:
        """Seconds of run(prompt) over the prompts, synced, and its Generations."""
        seconds, outputs = 0.0, []
        for prompt in self.prompts:
            sync()
            start = time.perf_counter()
            out = run(prompt)
            sync()
            seconds += time.perf_counter() - start
            outputs.append(out)
        return seconds, outputs

    def measure(self, draft_engine: Engine, k: int) -> dict:
        """The target alone against speculative decoding with `draft_engine` drafting k tokens a round."""
        check_draft(self.target, draft_engine.model)
        run = lambda p: speculative_generate(self.engine, draft_engine, p, k=k, max_new_tokens=self.new)  # noqa: E731
        run(self.prompts[0])  # compiles and captures this k's shapes
        seconds, generations = self._timed(run)
        alone = [out.tokens[0] for out in self.alone_generations]
        spec = [out.tokens[0] for out in generations]
        speed = {"target": self.alone_tokens_per_s, "speculative": sum(map(len, spec)) / seconds}
        decode = {"target": self.alone_decode_tokens_per_s, "speculative": decode_tokens_per_s(generations)}
        rounds = sum(out.extra["rounds"] for out in generations)
        fixed = draft_engine.drafted_rounds
        return {"k": k, "prompts": len(self.prompts), "new": self.new, "target_tokens_per_s": speed["target"],
                "speculative_tokens_per_s": speed["speculative"], "speedup": speed["speculative"] / speed["target"],
                # after the target's prefill and first token (the draft's prefill counts in the speculative decode)
                "target_decode_tokens_per_s": decode["target"], "speculative_decode_tokens_per_s": decode["speculative"],
                "decode_speedup": decode["speculative"] / decode["target"],
                "acceptance_rate": sum(out.extra["acceptance_rate"] for out in generations) / len(generations),
                # the first token comes from the prefill
                "tokens_per_round": sum(len(t) - 1 for t in spec) / rounds, "ms_per_round": seconds / rounds * 1e3,
                # whether the greedy rounds replayed one captured CUDA graph each (else op by op)
                "round_graph": fixed is not None and fixed.graph is not None,
                "identical_outputs": sum(a == b for a, b in zip(alone, spec)),
                "divergences": divergences(self.target, self.prompts, alone, spec),
                "draft_parameters": draft_engine.model.num_parameters(),
                "target_parameters": self.target.num_parameters()}


def decode_tokens_per_s(generations: list) -> float:
    """Tokens per second after each prefill and first token, over batch-1 generations."""
    return sum(g.stats.steps for g in generations) / sum(g.stats.decode_s for g in generations)


def speculative_speedup(target: Transformer, draft: Transformer, prompts: list[list[int]], new: int, k: int,
                        compile: bool = True, draft_megakernel: bool = False, batch_invariant: bool = False) -> dict:
    """Batch-1 greedy decoding of each prompt, target alone and with the draft, both (compiled) engines;
    draft_megakernel: the draft's one-token steps in the decode megakernel (CUDA, plain Llama stacks);
    batch_invariant: the target's engines batch-invariant (SpeculativeComparison)."""
    check_draft(target, draft)
    comparison = SpeculativeComparison(target, prompts, new, compile, batch_invariant)
    return comparison.measure(Engine(draft, compile=compile, megakernel=draft_megakernel), k)


@torch.inference_mode()
def divergences(target: Transformer, prompts: list[list[int]], alone: list[list[int]],
                speculative: list[list[int]]) -> list[dict]:
    """Where greedy outputs part: the first differing token of each pair, and the target's margin there
    (top-1 minus top-2 logit after the prompt and the common prefix, one plain forward). In exact
    arithmetic the outputs are equal; in bf16 the verifier's (k+1)-token forward rounds differently from
    a one-token decode step, so a margin near the rounding error can flip the greedy choice."""
    device = target.embed_tokens.weight.device
    found = []
    for i, (prompt, a, b) in enumerate(zip(prompts, alone, speculative)):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
        if at is None:
            continue
        logits = target(torch.tensor([prompt + a[:at]], device=device))[0, -1].float()
        top = logits.topk(2).values
        found.append({"prompt": i, "at": at, "target_margin": (top[0] - top[1]).item()})
    return found
