"""The lm-evaluation-harness bridge: lm-eval's model `lmlab`, an lmlab checkpoint or a Hugging Face Llama folder
run by lmlab's `Scorer`, so every harness task runs on lmlab's inference engine.

    lmlab lm-eval --model lmlab --model_args ckpt=outputs/runs/<date>/<time>/checkpoints/last.ckpt --tasks hellaswag

    import lm_eval, lmlab.eval.harness  # the import registers the model
    lm_eval.simple_evaluate(model="lmlab", model_args="ckpt=PATH,dtype=bfloat16", tasks=["arc_easy"])

model_args (lm-eval's `key=value,...`): ckpt, dtype (auto | float32 | bfloat16), batch_tokens (tokens per
scoring forward) and stride (tokens between rolling windows; default the model's context: lm-eval's disjoint
windows). lm-eval's --device and --batch_size reach the model as device (auto | cpu | cuda | cuda:N; lm-eval's
CLI passes cuda:0 unless told, so, as in its HF model, CUDA falls back to the CPU where there is none; on the
CLI give --device, not device= in model_args, which lm-eval would pass twice) and batch_size (prompts generated
together; auto: --max_batch_size, else 64).

Requests are read as lm-eval's HF model reads them (its `TemplateLM`): a context's trailing whitespace
moves to the continuation, whose ids are those of context + continuation after the context's, and an
empty context is end-of-text. A rolling log-likelihood scores the document after end-of-text. Generation
requests are grouped by equal gen_kwargs; do_sample=False is greedy, else temperature sampling, truncated
by top_k, top_p or min_p when one is set; lm-eval's seed seeds it.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
from tqdm.auto import tqdm

from lmlab.cli.generate import device_and_dtype, open_model
from lmlab.errors import ConfigError
from lmlab.eval.scoring import Scorer
from lmlab.inference.samplers import SAMPLERS

log = logging.getLogger(__name__)

MAX_GEN_TOKS = 256  # tokens generated where a request sets no max_gen_toks (lm-eval's HF model's default)
AUTO_BATCH = 64  # prompts generated together with --batch_size auto and no --max_batch_size (as lm-eval's HF model)
# gen_kwargs that choose a truncating sampler: key -> (SAMPLERS entry, its field)
TRUNCATIONS = {"top_k": ("top_k", "top_k"), "top_p": ("top_p", "p"), "min_p": ("min_p", "min_p")}
SAMPLER_FIELDS = ("temperature", "repetition_penalty")  # gen_kwargs that are sampler fields of the same name


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """lmlab's device_and_dtype, which also takes lm-eval's cuda:N; without CUDA, a CUDA device is the CPU."""
    kind, _, index = str(device).partition(":")
    if kind == "cuda" and not torch.cuda.is_available():
        log.warning("lmlab: device=%s, but torch sees no CUDA device; running on the CPU", device)
        kind, index = "cpu", ""
    chosen, torch_dtype = device_and_dtype(SimpleNamespace(device=kind, dtype=dtype))
    return (torch.device(kind, int(index)) if index else chosen), torch_dtype


def generation_batch(batch_size: int | str, max_batch_size: int | None) -> int:
    """Prompts generated together from lm-eval's --batch_size: a number, or auto (--max_batch_size, else 64)."""
    if str(batch_size).startswith("auto"):
        return max_batch_size or AUTO_BATCH
    if not str(batch_size).isdigit() or int(batch_size) <= 0:
        raise ConfigError(f"batch_size={batch_size} must be a positive number or auto")
    return int(batch_size)


def sampler_config(gen_kwargs: dict) -> dict:
    """The SAMPLERS config for lm-eval's normalised gen_kwargs, less until and max_gen_toks."""
    supported = {"do_sample", *SAMPLER_FIELDS, *TRUNCATIONS}
    if unknown := sorted(set(gen_kwargs) - supported):
        raise ConfigError(f"gen_kwargs {', '.join(unknown)} are not supported by the lmlab model; it takes until, "
                          f"max_gen_toks and {', '.join(sorted(supported))}")
    chosen = [key for key in TRUNCATIONS if key in gen_kwargs]
    if len(chosen) > 1:
        raise ConfigError(f"gen_kwargs set {' and '.join(chosen)}; lmlab's samplers truncate one way: set one")
    fields = {key: gen_kwargs[key] for key in SAMPLER_FIELDS if key in gen_kwargs}
    if not gen_kwargs["do_sample"]:
        return {"name": "greedy", **fields}
    if chosen:
        name, field = TRUNCATIONS[chosen[0]]
        return {"name": name, field: gen_kwargs[chosen[0]], **fields}
    return {"name": "temperature", **fields}


@register_model("lmlab")
class LmlabLM(TemplateLM):
    """An lmlab checkpoint, or Hugging Face Llama folder, as an lm-eval model."""

    def __init__(self, ckpt: str | None = None, device: str = "auto", dtype: str = "auto", batch_tokens: int = 16384,
                 stride: int | None = None, batch_size: int | str = 32, max_batch_size: int | None = None):
        super().__init__()
        if ckpt is None:
            raise ConfigError("the lmlab model needs model_args ckpt=PATH: a checkpoint lmlab-train wrote, or a "
                              "Hugging Face Llama folder")
        if batch_tokens <= 0:
            raise ConfigError(f"batch_tokens must be > 0, got {batch_tokens}")
        self.batch_size = generation_batch(batch_size, max_batch_size)
        self._device, torch_dtype = resolve_device(device, dtype)
        source = open_model(str(ckpt), "ckpt")
        self.stride = stride or source.max_seq_len
        if not 0 < self.stride <= source.max_seq_len:
            raise ConfigError(f"stride must be in 1..{source.max_seq_len} (the model's context), got {stride}")
        model = source.load().to(self._device, torch_dtype)
        self.scorer = Scorer(model, source.tokenizer, source.max_seq_len, source.stop_ids, batch_tokens)

    @property
    def eot_token_id(self) -> int:
        """End-of-text, which conditions an empty context (lm-eval's prefix_token_id)."""
        if self.scorer.tokenizer.eot_id is None:
            raise ConfigError("an empty context needs an end-of-text token to condition on; this tokenizer has none")
        return self.scorer.tokenizer.eot_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.scorer.tokenizer.encode(string)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """((context, continuation), context ids, continuation ids) -> (log p(continuation), is greedy)."""
        truncated = self.scorer.truncated
        with tqdm(total=len(requests), desc="loglikelihood", unit="req", disable=disable_tqdm) as bar:
            scores = self.scorer.loglikelihoods([(context, continuation) for _, context, continuation in requests],
                                                bar.update)
        self._note_truncated(truncated)
        results = [(score.logprob, score.greedy) for score in scores]
        for (pair, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, its first token conditioned on end-of-text where the tokenizer has one."""
        eot = self.scorer.tokenizer.eot_id
        results = []
        for request in tqdm(requests, desc="loglikelihood_rolling", unit="doc", disable=disable_tqdm):
            (text,) = request.args
            nll, _ = self.scorer.rolling_nll(([] if eot is None else [eot]) + self.tok_encode(text), self.stride)
            results.append(-nll)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, -nll)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Completions cut before the first of `until`, one sampler and length per group of equal gen_kwargs."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        results = [""] * len(requests)
        truncated = self.scorer.truncated
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], MAX_GEN_TOKS)
            until, max_new_tokens = [s for s in kwargs.pop("until") if s], kwargs.pop("max_gen_toks")
            sampler = SAMPLERS.build(sampler_config(kwargs))
            prompts = {i: self.tok_encode(requests[i].args[0]) for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))  # prompts of similar length batch together
            texts = self.scorer.generate([prompts[i] for i in order], sampler, max_new_tokens, until, self.batch_size,
                                         desc="generate_until")
            for i, text in zip(order, texts):
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        self._note_truncated(truncated)
        return results

    def _note_truncated(self, before: int) -> None:
        if self.scorer.truncated > before:
            log.warning("lmlab: %d prompts longer than the model's context of %d tokens lost their oldest tokens",
                        self.scorer.truncated - before, self.scorer.max_len)
