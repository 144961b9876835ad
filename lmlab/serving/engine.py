"""The serving engine: requests in, tokens out, one scheduler step at a time.

    engine = ServingEngine(model, tokenizer, ServingConfig(num_blocks=4096))
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=64, sampler={"name": "top_p", "p": 0.9}))
    while engine.has_work():
        for event in engine.step(): ...        # new text of each sequence, and how it finished
    engine.generate([ids_a, ids_b], params)    # offline: every request to the end

Each step the scheduler picks the work, the runner runs the decodes and the prompt chunks as two
forwards over the paged caches, and each sequence that reached its last token samples the next with
its request's sampler (requests with equal sampler settings and no seed are sampled together). A
request with n > 1 reads its prompt once: its further sequences fork the first one's blocks when its
first token is sampled, and copy a shared block only when they write into it.

Log-probabilities (lmlab.serving.logprobs) cost nothing unless a request asks: the sampled tokens' come from the
logits already there, and a prompt's from its chunks' logits at every position, for that request's rows only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmlab.errors import ConfigError
from lmlab.inference.generate import StopStrings, padding_ids, usable_vocab_size
from lmlab.inference.samplers import SAMPLERS, Sampler
from lmlab.inference.text_stream import TextStream
from lmlab.nn.transformer import Transformer
from lmlab.registry import Registry
from lmlab.serving.blocks import BlockManager
from lmlab.serving.logprobs import TokenLogprobs, logprobs_of
from lmlab.serving.runner import PagedRunner, Row
from lmlab.serving.scheduler import SCHEDULERS, Sequence, Work

MAX_CPU_KV_BYTES = 2 * 2**30  # the default pool on a CPU: enough blocks for every sequence, up to this


class RequestError(ConfigError):
    """A request the engine refuses, naming the request's field (`param`) that is wrong."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16  # 0: read the prompt and sample nothing (to score it, with prompt_logprobs)
    # a `sampler` registry config: a name, {"name": "top_p", "p": 0.9, "seed": 0, ...}, or an entry's Config instance
    sampler: Any = "greedy"
    n: int = 1  # sequences sampled from the prompt
    stop: list[str] = field(default_factory=list)  # stop strings: the text ends before the first
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's end-of-text token(s)
    ignore_eos: bool = False  # do not stop at the model's end-of-text token(s)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # each sampled token's log-probability and this many most likely tokens; None: none
    # the same for each prompt token after the first; the prompt is then computed whole, not taken from the prefix cache
    prompt_logprobs: int | None = None


@dataclass
class ServingConfig:
    num_blocks: int | None = None  # KV blocks, the null block (padding) included; None: kv_memory_fraction of free memory
    block_size: int = 16  # token slots per block
    kv_memory_fraction: float = 0.8  # of the free GPU memory after the weights, for the pool (CUDA, num_blocks=None)
    scheduler: Any = "continuous"  # a `scheduler` registry config: continuous | static, with max_num_seqs, ...
    prefix_caching: bool = True  # share the blocks of equal prompt prefixes
    attention_kernel: bool | None = None  # Triton paged decode attention (default: on CUDA with Triton)
    cuda_graphs: bool | None = None  # decode steps replayed from CUDA graphs (default: on CUDA)


@dataclass
class Event:
    """What one step produced for one sequence: new text (possibly empty while held back), the token, and
    the finish reason once it ends (stop, length, abort or error)."""

    request_id: str
    index: int
    text: str
    token: int | None
    finish_reason: str | None = None
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # the token's, when the request asks
    # on a sequence's first event after its prompt is read, when the request asks: one per prompt token, None first
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id, when the request asks
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Request:
    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, sampler: Sampler,
                 tokenizer, stops: StopStrings, on_event: Callable[[Event], None] | None, device):
        self.id, self.prompt, self.params, self.sampler = request_id, prompt, params, sampler
        self.sequences = [Sequence(self, i, list(prompt), len(prompt)) for i in range(params.n)]
        self.generator = sampler.generator(device)
        self.streams = [TextStream(tokenizer, params.stop) for _ in range(params.n)]
        self.outputs: list[list[int]] = [[] for _ in range(params.n)]
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(params.n)]
        # filled as the prompt's chunks are read; each sequence's first event after that carries it
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None if params.prompt_logprobs is None else [None]
        self.prompt_sent = [False] * params.n
        if self.prompt_logprobs is not None:
            self.sequences[0].reuse_prefix = False
        self.finish_reasons: list[str | None] = [None] * params.n
        self.texts: list[str] = [""] * params.n
        self.stops, self.on_event = stops, on_event
        self.counts: torch.Tensor | None = None  # (n, V) token occurrences, for the penalties
        self.forked = params.n == 1

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.finish_reasons)

    def completions(self) -> list[Completion]:
        return [Completion(i, self.texts[i], self.outputs[i], self.finish_reasons[i], self.logprobs[i],
                           self.prompt_logprobs) for i in range(self.params.n)]


class ServingEngine:
    def __init__(self, model: Transformer, tokenizer, cfg: ServingConfig | None = None, stop_ids=(),
                 scheduler_registry: Registry = SCHEDULERS):
        self.cfg = cfg = cfg or ServingConfig()
        if cfg.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {cfg.block_size}")
        self.model, self.tokenizer, self.stop_ids = model, tokenizer, set(stop_ids)
        device = model.embed_tokens.weight.device
        self.device, self.max_seq_len = device, model.max_seq_len
        _, scheduler_cfg = scheduler_registry.resolve(cfg.scheduler)
        num_blocks = cfg.num_blocks or default_num_blocks(model, cfg, scheduler_cfg.max_num_seqs)
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.prefix_caching)
        self.scheduler = scheduler_registry.build(cfg.scheduler, self.blocks)
        self.runner = PagedRunner(model, num_blocks, cfg.block_size, cfg.attention_kernel, cfg.cuda_graphs)
        self.beyond = padding_ids(model.vocab_size, tokenizer, device) if tokenizer is not None else None
        self.usable_vocab = usable_vocab_size(model.vocab_size, tokenizer) if tokenizer is not None else model.vocab_size
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.totals = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0}

    # -- requests ---------------------------------------------------------------------------------
    def check(self, prompt: list[int], params: SamplingParams) -> Sampler:
        """One clear error for a request that cannot run, before it is queued; else its sampler, built."""
        if not prompt:
            raise ConfigError("the prompt is empty: generation needs at least one token to start from")
        if params.max_tokens < 0:
            raise ConfigError(f"max_tokens must be >= 0 (0 reads the prompt only), got {params.max_tokens}")
        if params.n < 1:
            raise ConfigError(f"n must be >= 1, got {params.n}")
        # the tokenizer's ids: a padded vocabulary's extra ids have no text, and the samplers never pick them
        vocab = self.usable_vocab
        if (bad := next((t for t in prompt if not 0 <= t < vocab), None)) is not None:
            raise RequestError(f"the prompt holds token id {bad}, outside the vocabulary (0..{vocab - 1})", "prompt")
        for name in ("logprobs", "prompt_logprobs"):
            if (value := getattr(params, name)) is not None and not 0 <= value <= vocab:
                raise ConfigError(f"{name} must be in 0..{vocab} (the vocabulary), got {value}")
        # a prompt that only is read may fill the context; one to continue needs a position left
        if len(prompt) > self.max_seq_len or (len(prompt) == self.max_seq_len and params.max_tokens > 0):
            raise ConfigError(f"the prompt has {len(prompt)} tokens; the model's context is {self.max_seq_len} "
                              "tokens, prompt and completion together")
        longest = min(len(prompt) + params.max_tokens, self.max_seq_len)
        if self.blocks.blocks_for(longest) > self.blocks.usable:  # it could never finish, even alone
            raise ConfigError(f"a sequence of {longest} tokens (prompt and max_tokens) needs "
                              f"{self.blocks.blocks_for(longest)} KV blocks and the pool has {self.blocks.usable}")
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need the tokenizer, to see the text")
        sampler = SAMPLERS.build(params.sampler)
        if (bad := sampler.bias_outside(vocab)) is not None:
            raise RequestError(f"logit_bias holds token id {bad}, outside the vocabulary (0..{vocab - 1})", "logit_bias")
        return sampler

    def add_request(self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    on_event: Callable[[Event], None] | None = None) -> Request:
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        sampler = self.check(prompt, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already running")
        request = Request(request_id, prompt, params, sampler, self.tokenizer,
                          StopStrings(params.stop, self.tokenizer, params.include_stop_str_in_output), on_event,
                          self.device)
        if sampler.needs_counts:
            counts = torch.zeros(self.model.vocab_size, device=self.device)
            counts.scatter_add_(0, torch.tensor(prompt, device=self.device), torch.ones(len(prompt), device=self.device))
            request.counts = counts.expand(params.n, -1).clone()
        self.requests[request_id] = request
        self.scheduler.add(request.sequences[0])  # further samples fork it after the prompt is read
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += len(prompt)
        return request

    def abort(self, request_id: str) -> None:
        """Cancel a request, queued or running: its blocks are freed at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.sequences:
            if not seq.finished:
                self.scheduler.finish(seq)
                self._emit(request, seq.index, "", None, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- steps ------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """One scheduler step: plan, forward, sample; the events of every sequence that advanced."""
        plan = self.scheduler.schedule()
        self.totals["preemptions"] = self.scheduler.preemptions
        events: list[Event] = []
        if not plan:
            return events
        self.runner.copy_blocks(plan.copies)
        for works in (plan.decodes, plan.prefills):
            if works:
                rows = [Row(w.seq.tokens[w.start:w.start + w.count], w.start, w.seq.table) for w in works]
                scored = [i for i, w in enumerate(works) if _prompt_span(w)]
                if scored:
                    logits, every = self.runner.forward_every(rows, scored)
                    for i, all_logits in zip(scored, every):
                        self._score_prompt(works[i], all_logits)
                else:
                    logits = self.runner.forward(rows)
                events += self._advance(works, logits)
        return events

    def _score_prompt(self, work: Work, logits: torch.Tensor) -> None:
        """Record the log-probabilities of the prompt tokens that `logits` (one row per token of `work`) give."""
        span, seq = _prompt_span(work), work.seq
        request = seq.request
        rows = logits[span.start - 1 - work.start:span.stop - 1 - work.start]
        request.prompt_logprobs += logprobs_of(rows, seq.tokens[span.start:span.stop],
                                               [request.params.prompt_logprobs] * len(span), self.beyond)
        if len(request.prompt_logprobs) == seq.prompt_len:  # computed again after a preemption, it may reuse blocks
            seq.reuse_prefix = True

    def _advance(self, works: list[Work], logits: torch.Tensor) -> list[Event]:
        for work in works:
            work.seq.computed = work.start + work.count
            self.blocks.register_full(work.seq.table, work.seq.tokens, work.seq.computed)
        events = []
        for work in works:
            request = work.seq.request
            if work.samples and request.params.max_tokens == 0:  # read, not continued: every sequence ends
                for seq in request.sequences:
                    events += self._finish(request, seq, "length")
        sampling = [(i, w.seq) for i, w in enumerate(works) if w.samples and not w.seq.finished]
        if not sampling:
            return events
        rows = torch.tensor([i for i, _ in sampling], device=logits.device)
        logits = logits.index_select(0, rows)
        finite = torch.isfinite(logits).all(-1).tolist()
        seqs = [seq for _, seq in sampling]
        tokens = self._sample(logits, seqs)
        logprobs = self._logprobs(logits, seqs, tokens)
        for row, (seq, token, logprob, ok) in enumerate(zip(seqs, tokens, logprobs, finite)):
            request = seq.request
            if not ok:
                events += self._finish(request, seq, "error", "the logits turned non-finite (NaN or inf)")
                continue
            if not request.forked:  # the first token: the request's further samples start from this prompt
                events += self._fork(request, seq, logits[row:row + 1])
            events += self._append(request, seq, token, logprob)
        return events

    def _fork(self, request: Request, parent: Sequence, logits: torch.Tensor) -> list[Event]:
        request.forked = True
        events = []
        siblings = request.sequences[1:]
        logits = logits.expand(len(siblings), -1)
        tokens = self._sample(logits, siblings)
        for child, token, logprob in zip(siblings, tokens, self._logprobs(logits, siblings, tokens)):
            self.scheduler.fork(parent, child)
            events += self._append(request, child, token, logprob)
        return events

    def _logprobs(self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprobs | None]:
        """The sampled tokens' log-probabilities, for the rows whose request asks (nothing computed otherwise)."""
        out: list[TokenLogprobs | None] = [None] * len(seqs)
        wanted = [i for i, seq in enumerate(seqs) if seq.request.params.logprobs is not None]
        if wanted:
            rows = logits.index_select(0, torch.tensor(wanted, device=logits.device))
            found = logprobs_of(rows, [tokens[i] for i in wanted], [seqs[i].request.params.logprobs for i in wanted],
                                self.beyond)
            for i, logprob in zip(wanted, found):
                out[i] = logprob
        return out

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """The next token of each row, each with its request's sampler; rows of requests that share sampler
        settings and have no seed of their own are sampled in one call."""
        groups: dict[object, list[int]] = {}
        for i, seq in enumerate(seqs):
            request = seq.request
            key = (repr(request.sampler.cfg), request.id if request.generator is not None else None)
            groups.setdefault(key, []).append(i)
        out = [0] * len(seqs)
        if self.beyond is not None:
            logits = logits.masked_fill(self.beyond, -torch.inf)
        for rows in groups.values():
            request = seqs[rows[0]].request
            sampler = request.sampler
            counts = torch.stack([seqs[i].request.counts[seqs[i].index] for i in rows]) if sampler.needs_counts else None
            index = torch.tensor(rows, device=logits.device)
            picked = sampler.sample(logits.index_select(0, index), counts, request.generator).tolist()
            for i, token in zip(rows, picked):
                out[i] = token
        return out

    def _append(self, request: Request, seq: Sequence, token: int, logprob: TokenLogprobs | None) -> list[Event]:
        if token in request.params.stop_token_ids or (token in self.stop_ids and not request.params.ignore_eos):
            return self._finish(request, seq, "stop")
        seq.tokens.append(token)
        output = request.outputs[seq.index]
        output.append(token)
        if logprob is not None:
            request.logprobs[seq.index].append(logprob)
        self.totals["generation_tokens"] += 1
        if request.counts is not None:
            request.counts[seq.index, token] += 1
        delta = request.streams[seq.index].push(token) if self.tokenizer is not None else ""
        if request.stops.stops and request.stops.hit(output):
            return self._finish(request, seq, "stop", prefix=delta, token=token, logprob=logprob)
        if len(output) >= request.params.max_tokens or len(seq.tokens) >= self.max_seq_len:
            return self._finish(request, seq, "length", prefix=delta, token=token, logprob=logprob)
        return [self._emit(request, seq.index, delta, token, None, logprob=logprob)]

    def _finish(self, request: Request, seq: Sequence, reason: str, error: str | None = None, prefix: str = "",
                token: int | None = None, logprob: TokenLogprobs | None = None) -> list[Event]:
        self.scheduler.finish(seq)
        request.finish_reasons[seq.index] = reason
        text = ""
        if self.tokenizer is not None:
            decoded = self.tokenizer.decode(request.outputs[seq.index])
            text = request.stops.cut(decoded) if request.stops.stops else decoded
            request.texts[seq.index] = text
        delta = prefix + request.streams[seq.index].finish(text) if self.tokenizer is not None else ""
        if request.finished:
            self.requests.pop(request.id, None)
        return [self._emit(request, seq.index, delta, token, reason, error, logprob)]

    def _emit(self, request: Request, index: int, text: str, token: int | None, reason: str | None,
              error: str | None = None, logprob: TokenLogprobs | None = None) -> Event:
        prompt = request.prompt_logprobs
        if prompt is not None and len(prompt) == len(request.prompt) and not request.prompt_sent[index]:
            request.prompt_sent[index] = True
        else:
            prompt = None
        event = Event(request.id, index, text, token, reason, error, logprob, prompt)
        if request.on_event is not None:
            request.on_event(event)
        return event

    # -- offline ----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[Completion]]:
        """Every prompt to the end (offline batch inference through the scheduler)."""
        requests = [self.add_request(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return [r.completions() for r in requests]

    def stats(self) -> dict[str, float]:
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "kv_blocks_used": self.blocks.num_used(), "kv_blocks_total": self.blocks.usable,
                "prefix_cache_queries": self.blocks.queries, "prefix_cache_hits": self.blocks.hits,
                "copy_on_write": self.blocks.copies, **self.totals}


def _prompt_span(work: Work) -> range:
    """The prompt positions whose tokens' log-probabilities `work`'s logits give and that are not recorded yet
    (position p's comes from the logits at p - 1); empty unless the request asks for them."""
    recorded = work.seq.request.prompt_logprobs
    if recorded is None:
        return range(0)
    return range(max(len(recorded), work.start + 1), min(work.start + work.count, work.seq.prompt_len - 1) + 1)


def default_num_blocks(model: Transformer, cfg: ServingConfig, max_num_seqs: int) -> int:
    """On CUDA, kv_memory_fraction of the free memory; elsewhere every sequence's whole context, up to
    MAX_CPU_KV_BYTES."""
    weight = model.embed_tokens.weight
    block_bytes = model.kv_cache_bytes_per_token(weight.element_size()) * cfg.block_size
    if weight.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(weight.device)
        budget = int(free * cfg.kv_memory_fraction)
    else:
        budget = min(max_num_seqs * -(-model.max_seq_len // cfg.block_size) * block_bytes, MAX_CPU_KV_BYTES)
    return max(budget // block_bytes, 2) + 1  # + the null block
