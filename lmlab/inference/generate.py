"""Batched generation on an `Engine`: prompts of different lengths, samplers, stop tokens and
strings, streaming, and the timings a user compares engines by.

Prompts are left-padded to a common length, so every sequence writes the same cache slot at each
step while keeping its own positions. The loop keeps tokens, finished flags and a non-finite check
on the device. It syncs with the host each step when streaming or when stop strings need the text;
otherwise it looks every `sync_every` steps and reads each look at the next one (`DeviceLook`), so
the host never waits for the GPU to drain; up to 2 * sync_every - 1 steps may then run past the
last sequence's stop, their tokens dropped. Greedy decoding of one sequence runs the steps between
looks as blocks replayed from one CUDA graph each (lmlab.inference.greedy_steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lmlab.errors import ConfigError
from lmlab.kernels.registry import optional_triton_kernel
from lmlab.timing import sync

StreamCallback = Callable[[list[int | None]], None]  # each step: the new token of each sequence, None once finished


class GenerationError(RuntimeError):
    """Generation cannot go on (the model's logits turned non-finite)."""


@dataclass
class GenerationStats:
    batch: int
    prompt_tokens: int  # real (unpadded) prompt tokens
    new_tokens: int  # generated tokens, over all sequences
    steps: int  # decode steps run (the first token comes from the prefill)
    ttft_s: float  # prefill and first token
    decode_s: float  # the remaining steps
    kv_cache_bytes: int

    @property
    def tpot_s(self) -> float:
        """Time per output token of one sequence (per decode step)."""
        return self.decode_s / max(self.steps, 1)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second over the batch during decoding (finished sequences' steps count too)."""
        return self.batch * self.steps / max(self.decode_s, 1e-12)


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens of each prompt, without the stop token
    finish_reasons: list[str]  # "stop" (a stop token or string) or "length" (max_new_tokens)
    stats: GenerationStats
    texts: list[str] | None = None  # decoded (cut before a stop string) when a tokenizer was given
    extra: dict = field(default_factory=dict)  # e.g. speculative decoding's acceptance rate
    stop_tokens: list[int | None] = field(default_factory=list)  # the stop token each ended on (None: none)


def prepare_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_seq_len: int,
                    truncate: bool = False) -> list[list[int]]:
    """Check the request before any work; with `truncate`, keep the last tokens of long prompts."""
    if max_new_tokens <= 0:
        raise ConfigError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if not prompts:
        raise ConfigError("no prompts to generate from")
    prompts = [list(map(int, p)) for p in prompts]
    if any(not p for p in prompts):
        raise ConfigError("a prompt is empty: generation needs at least one token to start from")
    room = max_seq_len - max_new_tokens
    if room < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context "
                          f"of {max_seq_len} tokens")
    longest = max(len(p) for p in prompts)
    if longest > room:
        if not truncate:
            raise ConfigError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                              f"context of {max_seq_len} tokens; shorten it, lower max_new_tokens, or set "
                              f"truncate=true to keep its last {room} tokens")
        prompts = [p[-room:] for p in prompts]
    return prompts


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, P) with zeros before each prompt, start (B,): each prompt's first slot)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
    start = torch.tensor([width - len(p) for p in prompts])
    return ids.to(device), start.to(device)


def token_counts(ids: torch.Tensor, start: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, V) occurrences of each token in each (unpadded) prompt, for the penalties."""
    real = torch.arange(ids.shape[1], device=ids.device)[None, :] >= start[:, None]
    return torch.zeros(ids.shape[0], vocab_size, device=ids.device).scatter_add_(1, ids, real.float())


class StopStrings:
    """Finds stop strings in the decoded tail of each sequence. The text is cut before the first one
    (OpenAI's API) or, with `include_in_output`, after it (vLLM's include_stop_str_in_output: a verifier
    that reads "<answer>...</answer>" needs the closing tag that stopped the response)."""

    def __init__(self, stops: Sequence[str], tokenizer, include_in_output: bool = False):
        if stops and tokenizer is None:
            raise ConfigError("stop strings need the tokenizer, to see the text")
        self.stops, self.tokenizer, self.include = [s for s in stops if s], tokenizer, include_in_output
        self.tail = 4 * max((len(s) for s in self.stops), default=0) + 4  # a token is at least one byte

    def hit(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens[-self.tail:])
        return any(s in text for s in self.stops)

    def cut(self, text: str) -> str:
        found = [(text.find(s), -len(s)) for s in self.stops if s in text]
        if not found:
            return text
        start, minus_length = min(found)  # the earliest stop; of two starting there, the longer
        return text[:start - minus_length] if self.include else text[:start]


def usable_vocab_size(model_vocab_size: int, tokenizer) -> int:
    """How many leading ids may be sampled: the tokenizer's (at most the model's). A model's vocabulary is padded
    (to a multiple of 64); the ids past the tokenizer's mean nothing, yet an untrained or barely trained model gives
    them probability."""
    return min(tokenizer_vocab_size(tokenizer) or model_vocab_size, model_vocab_size)


def padding_ids(model_vocab_size: int, tokenizer, device) -> torch.Tensor | None:
    """(V,) bool of the ids past `usable_vocab_size`, or None when there are none."""
    usable = usable_vocab_size(model_vocab_size, tokenizer)
    return torch.arange(model_vocab_size, device=device) >= usable if usable < model_vocab_size else None


def without_padding(logits: torch.Tensor, beyond: torch.Tensor | None) -> torch.Tensor:
    """The logits with the padding ids at -inf, so that they are never sampled."""
    return logits if beyond is None else logits.masked_fill(beyond, -torch.inf)


def plain_greedy(sampler) -> bool:
    """Whether `sampler` picks each row's argmax as Sampler does, without bias or penalties (nor their token counts)."""
    from lmlab.inference.samplers import Sampler

    return isinstance(sampler, Sampler) and type(sampler).sample is Sampler.sample and sampler.argmax_of_logits


def pick(sampler, logits: torch.Tensor, counts: torch.Tensor | None, generator: torch.Generator | None,
         beyond: torch.Tensor | None, usable: int, peaks: torch.Tensor, finished: torch.Tensor | None = None,
         out: torch.Tensor | None = None, next_step: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`sampler.sample` over the ids that are not padding (`padding_ids`' mask `beyond`, the ids from `usable` on),
    writing each row's largest |logit| over all ids into peaks [B] (NaN or inf where one is not finite: generation's
    check). Rows that `finished` [B] marks take token 0; `out` [B]: where the tokens go; `next_step` (ids [B], slot
    [1]): the next decode step's input, which gets the tokens too, and its slot, advanced by one. Any object with a
    Sampler's `sample`, `greedy` and `needs_counts` serves (a wrapper that restricts the ids, say). Greedy decoding by
    a Sampler that samples as Sampler does, without penalties, takes both from one pass over the logits on a GPU
    (lmlab.kernels.argmax_peak_triton: one launch instead of four)."""
    fused = optional_triton_kernel(logits.device, None, "lmlab.kernels.argmax_peak_triton", "argmax_peak")
    if fused is not None and plain_greedy(sampler):
        return fused(logits, usable, peaks, finished, out, next_step)
    torch.linalg.vector_norm(logits, float("inf"), dim=-1, out=peaks)
    token = sampler.sample(without_padding(logits, beyond), counts, generator)
    if finished is not None:
        token = token.masked_fill(finished, 0)
    if next_step is not None:
        next_step[0].copy_(token)
        next_step[1].add_(1)
    return token if out is None else out.copy_(token)


def mark_stop_tokens(finished: torch.Tensor, token: torch.Tensor, stop_ids: torch.Tensor) -> None:
    """finished [B] |= whether each row's token [B] is one of stop_ids (none: no launch), in place."""
    if len(stop_ids):
        finished.logical_or_(torch.isin(token, stop_ids))


def tokenizer_vocab_size(tokenizer) -> int | None:
    """How many ids `tokenizer` can decode (a Hugging Face tokenizer's length, or lmlab's `vocab_size`);
    None when it does not say."""
    return len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)


@torch.inference_mode()
def generate(engine, prompts: Sequence[Sequence[int]], sampler=None, max_new_tokens: int = 256,
             stop_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (), tokenizer=None,
             stream: StreamCallback | None = None, truncate: bool = False, sync_every: int = 16,
             include_stop_str_in_output: bool = False,
             embed: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Generation:
    """Generate from each prompt (token ids) until a stop token or string, or `max_new_tokens`. The texts
    end before the stop string that ended them, or after it with `include_stop_str_in_output`. `embed` maps
    the left-padded prompt ids (B, P) to the embeddings the prefill runs on instead (B, P, d_model): a VLM's,
    with image features at its marker positions; the generated tokens are embedded as usual."""
    from lmlab.inference.greedy_steps import GreedySteps  # here: it builds on this module's pick
    from lmlab.inference.samplers import SAMPLERS  # registry entries load with the engine's users

    model, device = engine.model, engine.device
    prompts = prepare_prompts(prompts, max_new_tokens, model.max_seq_len, truncate)
    sampler = SAMPLERS.build("greedy") if sampler is None else sampler
    stops = StopStrings(stop_strings, tokenizer, include_stop_str_in_output)
    generator = sampler.generator(device)
    ids, start = left_pad(prompts, device)
    batch = len(prompts)
    stop_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=device)
    out = torch.zeros(max_new_tokens, batch, dtype=torch.long, device=device)  # step-major: each step's row contiguous
    peaks = torch.zeros(max_new_tokens, batch, device=device)  # each step's and row's largest |logit|: NaN or inf
    # where one is not finite
    counts = token_counts(ids, start, model.vocab_size) if sampler.needs_counts else None
    beyond, usable = padding_ids(model.vocab_size, tokenizer, device), usable_vocab_size(model.vocab_size, tokenizer)
    step_every = 1 if stream is not None or stops.stops else sync_every
    block = min(step_every, max_new_tokens - 1)  # decode steps per block of static steps, where they apply

    sync()
    began = time.perf_counter()
    engine.begin(batch, ids.shape[1] + max_new_tokens, start)
    blocks = None
    if block > 0 and GreedySteps.applies(sampler, step_every == 1, batch):
        sizes = {block, (max_new_tokens - 1) % block} - {0}
        blocks = GreedySteps.prepare(engine, sampler, sizes, stop_ids, beyond, usable)
    finished = torch.zeros(batch, dtype=torch.bool, device=device) if blocks is None else blocks.finished
    logits = engine.extend(ids, embeds=None if embed is None else embed(ids))
    host_done = [False] * batch
    look, looked = None, -1  # the last look at the device, and its step

    def take(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step n's tokens from its logits, and (when streaming) which sequences had finished before them."""
        # one launch each where a step's host-free bookkeeping can take it: at batch 1 every launch is ~3% of a step
        token = pick(sampler, logits, counts, generator, beyond, usable, peaks[n], finished, out[n])
        if counts is not None:
            counts.scatter_add_(1, token[:, None], (~finished).float()[:, None])
        was_finished = finished.clone() if stream is not None else None
        mark_stop_tokens(finished, token, stop_ids)
        return token, was_finished

    def ends_after(n: int, token: torch.Tensor, was_finished: torch.Tensor | None) -> bool:
        """The host's look after step n: whether generation ends there."""
        nonlocal look, looked
        if n == max_new_tokens - 1 or step_every == 1:
            _check_finite(peaks, n)
            if stream is not None:
                stream([None if done else t for done, t in zip(was_finished.tolist(), token.tolist())])
            if stops.stops:
                _mark_stop_strings(out, n, finished, host_done, stops)
            return n == max_new_tokens - 1 or bool(finished.all())
        if n - looked < step_every:
            return False
        if look is not None and look.all_finished(peaks):
            return True
        look, looked = DeviceLook(peaks, n, finished), n
        return False

    n = 0
    token, was_finished = take(logits, n)
    sync()
    ttft = time.perf_counter() - began
    decode_began = time.perf_counter()
    while not ends_after(n, token, was_finished):
        if blocks is not None:
            size = min(block, max_new_tokens - 1 - n)
            blocks.run(token, out[n + 1:n + 1 + size], peaks[n + 1:n + 1 + size])
            n += size
            token = out[n]
        else:
            n += 1
            token, was_finished = take(engine.decode(token), n)
    sync()
    decode_s = time.perf_counter() - decode_began
    return build_generation(out[:n + 1].T.tolist(), stop_token_ids, stops, tokenizer, ttft, decode_s, n,
                   sum(map(len, prompts)), engine.kv_cache_bytes())


class DeviceLook:
    """Generation's look at the device after step n, read later: whether any logits so far turned non-finite and
    whether every sequence has finished, copied to the host without waiting. Reading it waits only for the work queued
    up to step n, not for the steps queued since, so the GPU keeps work while the host reads."""

    def __init__(self, peaks: torch.Tensor, n: int, finished: torch.Tensor):
        flags = torch.stack([(~torch.isfinite(peaks[:n + 1])).any(), finished.all()])
        self.n = n
        self.host = torch.empty(2, dtype=torch.bool, pin_memory=flags.is_cuda)
        self.host.copy_(flags, non_blocking=True)
        self.ready = torch.cuda.Event() if flags.is_cuda else None
        if self.ready is not None:
            self.ready.record()

    def all_finished(self, peaks: torch.Tensor) -> bool:
        """Whether every sequence had finished at the look; non-finite logits by then raise, naming the step."""
        if self.ready is not None:
            self.ready.synchronize()
        non_finite, done = self.host.tolist()
        if non_finite:
            _check_finite(peaks, self.n)
        return done


def _check_finite(peaks: torch.Tensor, n: int) -> None:
    bad = (~torch.isfinite(peaks[:n + 1])).any(1).nonzero()
    if len(bad):
        step = int(bad[0])
        raise GenerationError(f"the logits turned non-finite (NaN or inf) at generation step {step} (new token "
                              f"{step + 1}); the weights or activations overflow (try float32, or check the checkpoint)")


def _mark_stop_strings(out: torch.Tensor, n: int, finished: torch.Tensor, host_done: list[bool],
                       stops: StopStrings) -> None:
    rows = out[:n + 1].T.tolist()
    for b, tokens in enumerate(rows):
        if not host_done[b] and stops.hit(tokens):
            host_done[b] = True
            finished[b] = True


def build_generation(rows: list[list[int]], stop_token_ids: Sequence[int], stops: StopStrings, tokenizer,
                     ttft: float, decode_s: float, steps: int, prompt_tokens: int, kv_bytes: int) -> Generation:
    """The result of a generation from each sequence's new tokens: cut at the first stop token (left
    out) or after the tokens that complete a stop string (the text is cut before it)."""
    stop_set = set(stop_token_ids)
    tokens, reasons, stop_tokens = [], [], []
    for row in rows:
        end = next((i for i, t in enumerate(row) if t in stop_set), None)  # the stop token is left out
        stop_tokens.append(None if end is None else row[end])
        if end is None and stops.stops:  # the tokens that complete a stop string stay; the text is cut
            end = next((i + 1 for i in range(len(row)) if stops.hit(row[:i + 1])), None)
        tokens.append(row if end is None else row[:end])
        reasons.append("length" if end is None else "stop")
    texts = None
    if tokenizer is not None:
        texts = [stops.cut(tokenizer.decode(t)) if stops.stops else tokenizer.decode(t) for t in tokens]
    stats = GenerationStats(batch=len(rows), prompt_tokens=prompt_tokens, new_tokens=sum(map(len, tokens)),
                            steps=steps, ttft_s=ttft, decode_s=decode_s, kv_cache_bytes=kv_bytes)
    return Generation(tokens, reasons, stats, texts, stop_tokens=stop_tokens)
