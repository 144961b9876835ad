"""What `lmlab bench generate --ckpt PATH` adds for a trained checkpoint: the validation perplexity
and batch-1 speed of each quantization against the unquantized weights (GPTQ calibrated on the
training split), and speculative decoding with `--draft PATH` against target-only decoding on
prompts taken from the validation split (greedy: the outputs should be the target's own).
"""

from __future__ import annotations

import copy
import math
import time

import torch
import torch.nn.functional as F

from lmlab.cli.generate import CALIBRATION_BATCH, calibration_batches, open_model
from lmlab.data.batches import evenly_spaced_windows
from lmlab.inference.engine import Engine
from lmlab.inference.quant import QUANTS, quantize
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


def _batch1_speed(model: Transformer, prompt: list[int], new: int, compile: bool) -> float:
    engine = Engine(model, compile=compile)
    engine.generate([prompt], max_new_tokens=new)  # compiles and captures
    return engine.generate([prompt], max_new_tokens=new).stats.decode_tokens_per_s


def quant_quality(model: Transformer, data: CheckpointData, quants: list, new: int,
                  compile: bool = True) -> list[dict]:
    """Per quant entry (and the unquantized weights first): validation perplexity and batch-1 decode
    tokens/s of the (compiled) engine; entries that calibrate use the training split."""
    prompt = data.prompts(1, min(128, data.context // 2))[0]
    rows = [{"quant": "none", "ppl": perplexity(model, *data.val), "decode_tokens_per_s": _batch1_speed(model, prompt, new, compile)}]
    for quant in quants:  # entry names or configs
        quantized = copy.deepcopy(model)
        calibrated = QUANTS.build(quant).method.calibrated
        report = quantize(quantized, quant, data.calibration if calibrated else None)
        rows.append({"quant": report["quant"], "method": report["method"], "kernels": report["kernels"],
                     "ppl": perplexity(quantized, *data.val),
                     "decode_tokens_per_s": _batch1_speed(quantized, prompt, new, compile)})
        del quantized
    for row in rows[1:]:
        row["ppl_change"] = row["ppl"] / rows[0]["ppl"] - 1
        row["speedup"] = row["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
    return rows


def speculative_speedup(target: Transformer, draft: Transformer, prompts: list[list[int]], new: int, k: int,
                        compile: bool = True) -> dict:
    """Batch-1 greedy decoding of each prompt, target alone and with the draft, both (compiled) engines."""
    check_draft(target, draft)
    alone, target_engine = Engine(target, compile=compile), Engine(target, compile=compile)
    draft_engine = Engine(draft, compile=compile)
    speculative_generate(target_engine, draft_engine, prompts[0], k=k, max_new_tokens=new)  # compiles, captures
    alone.generate([prompts[0]], max_new_tokens=new)
    times, outputs, accepted = {"target": 0.0, "speculative": 0.0}, {"target": [], "speculative": []}, []
    for prompt in prompts:
        for name, run in (("target", lambda p=prompt: alone.generate([p], max_new_tokens=new)),
                          ("speculative", lambda p=prompt: speculative_generate(target_engine, draft_engine, p, k=k,
                                                                                 max_new_tokens=new))):
            sync()
            start = time.perf_counter()
            out = run()
            sync()
            times[name] += time.perf_counter() - start
            outputs[name].append(out.tokens[0])
            if name == "speculative":
                accepted.append(out.extra["acceptance_rate"])
    speed = {name: sum(len(t) for t in outputs[name]) / times[name] for name in times}
    return {"k": k, "prompts": len(prompts), "new": new, "target_tokens_per_s": speed["target"],
            "speculative_tokens_per_s": speed["speculative"], "speedup": speed["speculative"] / speed["target"],
            "acceptance_rate": sum(accepted) / len(accepted),
            "identical_outputs": sum(a == b for a, b in zip(outputs["target"], outputs["speculative"])),
            "divergences": divergences(target, prompts, outputs["target"], outputs["speculative"]),
            "draft_parameters": draft.num_parameters(), "target_parameters": target.num_parameters()}


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
