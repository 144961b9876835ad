"""Token samplers (config group `sampler`): the last position's logits [B, V] -> the next tokens [B].

A sampler is a chain of logit processors in a fixed order (vLLM's): logit bias, repetition penalty,
frequency/presence penalties, temperature, then the entry's truncation (top-k, top-p, min-p),
which sets the logits of dropped tokens to -inf. `probs` is exactly the distribution `sample`
draws from, so speculative decoding can run its rejection test on it.

temperature=0 makes every entry greedy (the Hugging Face / OpenAI convention); the bias and the penalties
still apply. Everything works on whole batches, row by row, with no host sync, so a decode step that
samples can be compiled and captured in a CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from lmlab.errors import ConfigError
from lmlab.registry import Registry

SAMPLERS = Registry("sampler", group="sampler", doc="token samplers for generation")

# (logits [B, V] float32, counts [B, V] or None) -> logits. counts[b, v] is how often token v has
# occurred in sequence b so far, prompt included; only the penalties read it.
LogitProcessor = Callable[[Tensor, Tensor | None], Tensor]


class LogitBias:
    """OpenAI's logit_bias: each listed token's logit plus its bias. Its tensors are made once per device, so that
    a captured step copies nothing from the host."""

    def __init__(self, bias: dict[int, float]):
        self.ids, self.values = list(bias), list(bias.values())
        self._on: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def __call__(self, logits: Tensor, counts: Tensor | None) -> Tensor:
        if logits.device not in self._on:
            self._on[logits.device] = (torch.tensor(self.ids, device=logits.device),
                                       torch.tensor(self.values, device=logits.device))
        ids, values = self._on[logits.device]
        return logits.index_add(-1, ids, values.expand(logits.shape[0], -1))


def repetition_penalty(logits: Tensor, counts: Tensor, penalty: float) -> Tensor:
    """CTRL / Hugging Face: a seen token's logit is divided by `penalty` if positive, multiplied if negative."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(counts > 0, penalised, logits)


def frequency_presence_penalty(logits: Tensor, counts: Tensor, frequency: float, presence: float) -> Tensor:
    """OpenAI: logit -= frequency * count + presence * (count > 0)."""
    return logits - frequency * counts - presence * (counts > 0)


def divide_by_temperature(logits: Tensor, counts: Tensor | None, temperature: float) -> Tensor:
    return logits / temperature


def keep_argmax(logits: Tensor, counts: Tensor | None) -> Tensor:
    """Only each row's largest logit (the lowest id on a tie, as torch.argmax), so softmax is one-hot."""
    top = logits.argmax(-1, keepdim=True)
    return torch.full_like(logits, -torch.inf).scatter(-1, top, logits.gather(-1, top))


def keep_top_k(logits: Tensor, counts: Tensor | None, k: int) -> Tensor:
    """The k largest logits of each row (more when others tie with the k-th, as in Hugging Face)."""
    kth = logits.topk(min(k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -torch.inf)


def keep_top_p(logits: Tensor, counts: Tensor | None, p: float) -> Tensor:
    """Nucleus (Holtzman et al. 2020): the smallest set of most likely tokens whose mass reaches p.

    A token stays when the mass of the tokens ranked above it is still below p, so the top token
    always stays. The stable sort ranks tied tokens by id, so ties at the boundary keep the lowest ids.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = probs.cumsum(-1) - probs >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, -torch.inf)


def keep_min_p(logits: Tensor, counts: Tensor | None, min_p: float) -> Tensor:
    """Min-p (Nguyen et al. 2024): the tokens whose probability is at least min_p times the row's largest."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -torch.inf)


def exponential_race(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One draw per row from `probs`: argmax(probs / E) with E ~ Exponential(1) is a categorical sample
    (the Gumbel-max trick) that needs no host sync, as in gpt-fast; torch.multinomial checks its input."""
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(-1)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def token_biases(bias: dict) -> dict[int, float]:
    """logit_bias by integer token id: each key an integer >= 0, or its digits."""
    ids = {key: key if isinstance(key, int) and not isinstance(key, bool) else
           int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None for key in bias}
    _require(all(i is not None and i >= 0 for i in ids.values()),
             f"sampler.logit_bias={bias} holds a key that is not a token id (an integer >= 0)")
    return {ids[key]: float(value) for key, value in bias.items()}


@dataclass
class SamplerConfig:
    """The fields every sampler shares: logit bias, penalties, temperature and seed."""

    temperature: float = 1.0  # logits / temperature before truncation; 0 = greedy decoding
    repetition_penalty: float = 1.0  # a seen token's logit / this if > 0, * this if < 0 (HF); 1 = off
    frequency_penalty: float = 0.0  # logit -= this * the token's count so far (OpenAI); 0 = off
    presence_penalty: float = 0.0  # logit -= this once the token has occurred (OpenAI); 0 = off
    seed: int | None = None  # seeds generator(), so generation repeats; None: torch's global RNG
    # token id -> added to its logit first (OpenAI); ids as integers or as their digits (JSON's keys, and Hydra's:
    # sampler.logit_bias={"50256":-100}, or +sampler.logit_bias.50256=-100)
    logit_bias: dict[Any, float] = field(default_factory=dict)


class Sampler:
    """The processors a config asks for, then `truncation`, which each entry may define."""

    greedy = False  # True: the next token is the argmax (the greedy entry, or temperature=0)
    # True: `sample` is the argmax of the logits as they come (greedy, no bias or penalty before it), so a caller may
    # take it from the logits itself (a fused argmax kernel, speculative decoding's fixed greedy rounds)
    argmax_of_logits = False

    def __init__(self, cfg: SamplerConfig):
        _require(cfg.temperature >= 0,
                 f"sampler.temperature={cfg.temperature} is negative; use 0 for greedy decoding or a positive value")
        _require(cfg.repetition_penalty > 0, f"sampler.repetition_penalty={cfg.repetition_penalty} must be > 0 "
                                             "(1 is off, above 1 discourages repeats)")
        _require(all(math.isfinite(b) for b in cfg.logit_bias.values()),
                 f"sampler.logit_bias={cfg.logit_bias} holds a bias that is not finite")
        self.logit_bias = token_biases(cfg.logit_bias)
        self.cfg = cfg
        truncation = self.truncation(cfg)  # checks the entry's fields even when temperature=0 leaves them unused
        self.greedy = self.greedy or cfg.temperature == 0
        self.needs_counts = cfg.repetition_penalty != 1 or cfg.frequency_penalty != 0 or cfg.presence_penalty != 0
        self.processors: list[LogitProcessor] = []
        if self.logit_bias:
            self.processors.append(LogitBias(self.logit_bias))
        if cfg.repetition_penalty != 1:
            self.processors.append(partial(repetition_penalty, penalty=cfg.repetition_penalty))
        if cfg.frequency_penalty != 0 or cfg.presence_penalty != 0:
            self.processors.append(partial(frequency_presence_penalty, frequency=cfg.frequency_penalty,
                                           presence=cfg.presence_penalty))
        if self.greedy:
            self.argmax_of_logits = not self.processors
            self.processors.append(keep_argmax)
            return
        if cfg.temperature != 1:
            self.processors.append(partial(divide_by_temperature, temperature=cfg.temperature))
        if truncation is not None:
            self.processors.append(truncation)

    def bias_outside(self, vocab: int) -> int | None:
        """The first logit_bias token id that a vocabulary of `vocab` tokens lacks; None when it has them all."""
        return next((t for t in self.logit_bias if t >= vocab), None)

    def truncation(self, cfg: SamplerConfig) -> LogitProcessor | None:
        """The entry's processor that drops unlikely tokens, after checking its fields; None keeps them all."""
        return None

    def process(self, logits: Tensor, counts: Tensor | None = None) -> Tensor:
        """The logits after every processor: penalties, temperature, dropped tokens at -inf."""
        return self._apply(self.processors, logits, counts)

    def _apply(self, processors: list[LogitProcessor], logits: Tensor, counts: Tensor | None) -> Tensor:
        if self.needs_counts and counts is None:
            raise ValueError("this sampler applies a penalty: pass counts (token occurrences per sequence)")
        logits = logits.float()
        for processor in processors:
            logits = processor(logits, counts)
        return logits

    def probs(self, logits: Tensor, counts: Tensor | None = None) -> Tensor:
        """The distribution `sample` draws from (one-hot when greedy)."""
        return self.process(logits, counts).softmax(-1)

    def sample(self, logits: Tensor, counts: Tensor | None = None,
               generator: torch.Generator | None = None) -> Tensor:
        """The next token of each row, [B] long."""
        if self.greedy:  # the argmax of the penalised logits: keep_argmax's masking would not change it
            return self._apply(self.processors[:-1], logits, counts).argmax(-1)
        return exponential_race(self.process(logits, counts).softmax(-1), generator)

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        """A generator seeded with `seed` for `sample`; None (torch's global RNG) when no seed is set."""
        if self.cfg.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.cfg.seed)


@SAMPLERS.register("greedy")
class Greedy(Sampler):
    """The most likely token (lowest id on a tie); ignores temperature, applies the penalties."""

    greedy = True

    @dataclass
    class Config(SamplerConfig):
        pass


@SAMPLERS.register("temperature")
class Temperature(Sampler):
    """A draw from softmax(logits / temperature) over the whole vocabulary."""

    @dataclass
    class Config(SamplerConfig):
        pass


@SAMPLERS.register("top_k")
class TopK(Sampler):
    """A draw from the top_k most likely tokens."""

    @dataclass
    class Config(SamplerConfig):
        top_k: int = 50  # keep this many of the most likely tokens (Hugging Face's default)

    def truncation(self, cfg: Config) -> LogitProcessor:
        _require(cfg.top_k >= 1, f"sampler.top_k={cfg.top_k} must be >= 1 (1 is greedy)")
        return partial(keep_top_k, k=cfg.top_k)


@SAMPLERS.register("top_p")
class TopP(Sampler):
    """Nucleus sampling: a draw from the smallest set of most likely tokens whose mass reaches p."""

    @dataclass
    class Config(SamplerConfig):
        p: float = 0.9  # the probability mass to keep, in (0, 1]; 1 keeps every token

    def truncation(self, cfg: Config) -> LogitProcessor | None:
        _require(0 < cfg.p <= 1, f"sampler.p={cfg.p} must be in (0, 1] (the probability mass top_p keeps)")
        # p=1 keeps everything; skipping it spares a sort and float32 cumsum rounding near 1.
        return partial(keep_top_p, p=cfg.p) if cfg.p < 1 else None


@SAMPLERS.register("min_p")
class MinP(Sampler):
    """Min-p sampling: a draw from the tokens at least min_p times as likely as the most likely one."""

    @dataclass
    class Config(SamplerConfig):
        min_p: float = 0.1  # keep tokens with prob >= min_p * the largest prob, in [0, 1]; 0 keeps every token

    def truncation(self, cfg: Config) -> LogitProcessor | None:
        _require(0 <= cfg.min_p <= 1, f"sampler.min_p={cfg.min_p} must be in [0, 1]")
        return partial(keep_min_p, min_p=cfg.min_p) if cfg.min_p > 0 else None
