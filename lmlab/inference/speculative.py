"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a cheap drafter proposes k tokens,
the target scores them all in one forward, and modified rejection sampling keeps the target's output
distribution exactly (with the greedy sampler: exactly the target's greedy output).

    out = speculative_generate(target, Engine(small_model), prompt_ids, sampler, k=4)
    out = speculative_generate(target, None, prompt_ids)    # self-speculation with its MTP modules
    out.extra["acceptance_rate"], out.extra["tokens_per_round"]

A round starts from a pending token x at position n (sampled, not yet run by the target). The
drafter proposes d_1..d_k, each drawn from its processed distribution q_i; the target runs
[x, d_1..d_k] in its static (k+1)-token step (a CUDA graph when compiled) for p_0..p_k; d_i stands
with probability min(1, p/q) and the first rejection is replaced by a draw from norm(max(0, p - q)),
or, when all stand, a bonus token comes from p_k. Both caches then roll back to the accepted length.
The host syncs once per round, to read how many stood. A greedy sampler makes p and q one-hot, so the
test reduces to comparing the drafts with the target's argmaxes (`greedy_accept`), a few launches where
the general test takes tens: at batch 1 the host's launches, not the GPU, set a round's pace. Every
round drafts k tokens, also the last (its extra tokens are dropped), so the verification is always the
static step; only the model's context limit makes a round shorter. With a draft model and a greedy
sampler without penalties, every round is then the same static steps, and it runs as one CUDA graph
(`lmlab.inference.greedy_rounds`) where the engines replay graphs.

Drafters: `DraftModel`, a smaller model with the same tokenizer on an Engine of its own; and
`MTPDraft`, the target's own multi-token-prediction modules (DeepSeek-V3): module d takes the
previous depth's hidden state at the last accepted position and the embedding of the token d ahead,
so a round drafts up to `depth` tokens, verified by the main model exactly as above.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from lmlab.errors import ConfigError
from lmlab.inference.cache import CacheState, factory_for
from lmlab.inference.engine import Engine
from lmlab.inference.greedy_rounds import DRAFT_STEPS, GreedyRounds, greedy_accept
from lmlab.inference.generate import (Generation, GenerationError, StopStrings, StreamCallback, build_generation,
                                      padding_ids, prepare_prompts, token_counts, without_padding)
from lmlab.inference.samplers import SAMPLERS, Sampler, exponential_race
from lmlab.timing import sync

DRAFT_MODEL_K = 4  # draft tokens per round from a draft model when k is not given


def accept_and_correct(p: Tensor, q: Tensor, draft_tokens: Tensor,
                       generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Modified rejection sampling, over any leading batch dimensions.

    p (..., k+1, V): the target's distributions at the k+1 positions; q (..., k, V): the drafter's, which
    draft_tokens (..., k) were drawn from. Returns (accepted (...): how many leading draft tokens stand,
    token (...): the token after them, drawn from norm(max(0, p - q)) at the first rejection or from p_k
    when all stand), so that the emitted tokens follow p exactly."""
    index = draft_tokens[..., None]
    p_draft = p[..., :-1, :].gather(-1, index).squeeze(-1)
    q_draft = q.gather(-1, index).squeeze(-1)
    u = torch.rand(q_draft.shape, generator=generator, device=p.device)
    accepted = (u * q_draft < p_draft).long().cumprod(-1).sum(-1)  # u < p/q, without dividing by q
    residual = (p - F.pad(q, (0, 0, 0, 1))).clamp_min(0)  # row k has no draft: p_k itself
    at = accepted[..., None, None].expand(*accepted.shape, 1, p.shape[-1])
    row, fallback = residual.gather(-2, at).squeeze(-2), p.gather(-2, at).squeeze(-2)
    row = torch.where(row.sum(-1, keepdim=True) > 0, row, fallback)  # rounding can leave p - q <= 0 everywhere
    return accepted, exponential_race(row, generator)  # the race needs no normalised row


def check_draft(target_model, draft_model, target_tokenizer=None, draft_tokenizer=None) -> None:
    """One clear error for a draft whose token ids do not mean what the target's mean."""
    if draft_model.vocab_size != target_model.vocab_size:
        raise ConfigError(f"the draft model's vocabulary has {draft_model.vocab_size} ids but the target's has "
                          f"{target_model.vocab_size}; use a draft trained with the target's tokenizer and vocab_size")
    if target_tokenizer is not None and draft_tokenizer is not None:
        target_print, draft_print = target_tokenizer.fingerprint(), draft_tokenizer.fingerprint()
        if target_print != draft_print:
            raise ConfigError(f"the draft's tokenizer (fingerprint {draft_print}) differs from the target's "
                              f"({target_print}), so their token ids differ; use a draft trained with the same tokenizer")


def _check_rewindable(blocks, who: str) -> None:
    """Speculation rolls caches back; a recurrent state cannot. Checked on 'meta' tensors, before any work."""
    meta = torch.device("meta")
    state = CacheState.empty(1, meta)
    for block in blocks:
        if not factory_for(block.self_attn)(block.self_attn, state, 1, 1, meta, torch.float32).rewindable:
            raise ConfigError(f"the {who}'s {type(block.self_attn).__name__} layers keep a recurrent state that "
                              "cannot roll back to the accepted tokens, so it cannot take part in speculative "
                              "decoding; generate without a draft")


class Drafter(ABC):
    """Proposes draft tokens from position n on; `seq` (1, L) holds the tokens so far on the device, the
    pending one at n, and the drafts are written after it (later rounds overwrite them)."""

    @abstractmethod
    def start(self, prompt: Tensor, k: int) -> None:
        """Take in the prompt (1, P), after the target's prefill."""

    @abstractmethod
    def catch_up(self, seq: Tensor, n: int) -> None:
        """Forget drafts that did not stand and take in the tokens before n not seen yet."""

    @abstractmethod
    def logits(self, seq: Tensor, n: int, i: int) -> Tensor:
        """(1, V) float logits of draft token i + 1 (at position n + i + 1)."""

    @abstractmethod
    def cache_bytes(self) -> int:
        """Bytes of the drafter's KV caches."""

    def propose(self, seq: Tensor, n: int, k: int, sampler: Sampler, counts: Tensor | None,
                generator: torch.Generator | None, beyond: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(tokens (k,), q (k, V)): k >= 1 draft tokens, each drawn from the sampler's processed distribution q
        (without the padding ids `beyond`, as the target's). A greedy sampler takes the argmax and returns the
        draft's raw logits as q: the acceptance test needs no distribution then, only a check that they are finite."""
        self.catch_up(seq, n)
        tokens, probs = [], []
        for i in range(k):
            raw = self.logits(seq, n, i)
            if sampler.greedy:
                q, token = raw, sampler.sample(without_padding(raw, beyond), counts)
            else:
                q = sampler.probs(without_padding(raw, beyond), counts)
                token = exponential_race(q, generator)
            seq[:, n + i + 1] = token
            if counts is not None:
                counts = counts.scatter_add(1, token[:, None], torch.ones_like(q[:, :1]))
            tokens.append(token)
            probs.append(q)
        return torch.cat(tokens), torch.cat(probs)


class DraftModel(Drafter):
    """A smaller model with the target's tokenizer, on an Engine of its own; `steps`: its static decode steps."""

    def __init__(self, engine: Engine, max_len: int, steps: tuple[int, ...] = (1,)):
        self.engine, self.max_len, self.steps = engine, max_len, steps

    def start(self, prompt: Tensor, k: int) -> None:
        # a round writes k - 1 slots it may roll back
        self.engine.begin(1, self.max_len, lookahead=k - 1, steps=self.steps)
        self.engine.extend(prompt)

    def catch_up(self, seq: Tensor, n: int) -> None:
        self.engine.rewind(min(self.engine.next_slot, n))
        for slot in range(self.engine.next_slot, n):  # every draft stood: the last one was never run
            self.engine.decode(seq[:, slot])

    def logits(self, seq: Tensor, n: int, i: int) -> Tensor:
        return self.engine.decode(seq[:, n + i])

    def cache_bytes(self) -> int:
        return self.engine.kv_cache_bytes()


class MTPDraft(Drafter):
    """The target's MTP modules, each block with its own KV cache. Module d at position t reads depth
    d-1's hidden state at t and the embedding of token t+d, so its cache holds every earlier position:
    the first round runs it over the prompt, and later rounds rerun the positions whose token t+d was
    a draft (`frontier`)."""

    def __init__(self, target: Engine, k: int):
        self.target, self.model = target, target.model
        self.modules = list(target.model.mtp_layers[:k])

    def start(self, prompt: Tensor, k: int) -> None:
        target, length = self.target, self.target.shape[1]
        self.state = CacheState.empty(1, target.device)
        self.caches = [factory_for(m.layer.self_attn)(m.layer.self_attn, self.state, 1, length, target.device,
                                                      target.dtype, lookahead=k) for m in self.modules]
        # hidden[d]: depth d's hidden state by position (depth 0: the main model's, before its final norm)
        self.hidden = torch.zeros(len(self.modules), length, target.last_hidden.shape[-1], device=target.device,
                                  dtype=target.last_hidden.dtype)
        self.frontier = [0] * len(self.modules)  # module d's first position not yet run with true tokens only
        self.main_from = 0  # position of the first token of the target's last forward

    def catch_up(self, seq: Tensor, n: int) -> None:
        self.hidden[0, self.main_from:n] = self.target.last_hidden[0, :n - self.main_from]  # the accepted rows
        self.main_from = n  # the coming verification starts at the pending token

    def logits(self, seq: Tensor, n: int, i: int) -> Tensor:
        module, depth, low = self.modules[i], i + 1, self.frontier[i]
        ahead = seq[:, low + depth:n + depth]  # tokens t + depth for t in [low, n - 1]; the last ones are drafts
        self.state.slots = torch.arange(low, n, device=seq.device)
        self.model._route_by(f"mtp_layers.{i}.", ahead)
        out = module(self.hidden[i, low:n][None], self.model.embed_tokens(ahead), self.model.position,
                     self.state.positions(), self.caches[i])
        if depth < len(self.modules):
            self.hidden[depth, low:n] = out[0]
        self.frontier[i] = max(0, n + 1 - depth)  # positions up to n - depth saw true tokens only
        return self.model._head(module.norm(out[:, -1])).float()

    def cache_bytes(self) -> int:
        return sum(cache.nbytes() for cache in self.caches)


class _Emitted:
    """The new tokens on the host: streamed one by one, ended by a stop token or string or the length."""

    def __init__(self, max_new_tokens: int, stop_token_ids: Sequence[int], stops: StopStrings,
                 stream: StreamCallback | None):
        self.tokens: list[int] = []
        self.max_new_tokens, self.stop_ids, self.stops, self.stream = max_new_tokens, set(stop_token_ids), stops, stream

    def add(self, tokens: list[int]) -> bool:
        """Append the round's tokens up to where generation ends; True once it has."""
        for token in tokens:
            self.tokens.append(token)
            if self.stream is not None:
                self.stream([token])
            if (token in self.stop_ids or len(self.tokens) == self.max_new_tokens
                    or (self.stops.stops and self.stops.hit(self.tokens))):
                return True
        return False


def _check_request(target: Engine, draft: Engine | None, k: int | None) -> int:
    """The number of draft tokens per round, after every check that needs no work."""
    if k is not None and k < 1:
        raise ConfigError(f"k={k}: speculative decoding drafts at least one token per round")
    if draft is None:
        depth = len(target.model.mtp_layers)
        if depth == 0:
            raise ConfigError("the target has no MTP modules (model.mtp.depth=0) to draft with; give a draft model")
        if k is not None and k > depth:
            raise ConfigError(f"k={k}, but the target's {depth} MTP modules draft at most {depth} tokens a round")
        _check_rewindable([m.layer for m in target.model.mtp_layers], "MTP modules")
    else:
        if draft is target:
            raise ConfigError("the draft needs an Engine of its own: its caches hold tokens the target's do not")
        if draft.device != target.device:
            raise ConfigError(f"the draft is on {draft.device} and the target on {target.device}; put both on one device")
        check_draft(target.model, draft.model)
        _check_rewindable(draft.model.layers, "draft model")
    _check_rewindable(target.model.layers, "target")
    return (DRAFT_MODEL_K if draft is not None else len(target.model.mtp_layers)) if k is None else k


def _check_finite(target_bad: int, draft_bad: int, at: int) -> None:
    for bad, who in ((target_bad, "target"), (draft_bad, "draft")):
        if bad:
            raise GenerationError(f"the {who}'s logits turned non-finite (NaN or inf) at new token {at}; the weights or "
                                  "activations overflow (try float32, or check the checkpoint)")


def _round(target: Engine, drafter: Drafter, seq: Tensor, n: int, k: int, room: int, sampler: Sampler,
           counts: Tensor | None, generator: torch.Generator | None, beyond: Tensor | None):
    """One round launched op by op: (the host record [target non-finite, draft non-finite, drafts that stood,
    the token after them, the drafts], drafts proposed, the token counts after the round)."""
    model = target.model
    k_now = min(k, room - 1 - n)  # no drafts past the context
    if k_now:
        drafts, q = drafter.propose(seq, n, k_now, sampler, counts, generator, beyond)
    else:
        drafts, q = seq.new_zeros(0), torch.zeros(0, model.vocab_size, device=seq.device)
    ids = seq[:, n:n + k_now + 1]
    logits = target.decode(ids) if k_now in (0, k) else target.extend(ids, all_logits=True)
    per_position = None  # counts after each draft token, for the penalties
    if counts is not None:
        ahead = F.one_hot(drafts, model.vocab_size).cumsum(0)
        per_position = counts + F.pad(ahead, (0, 0, 1, 0)).to(counts.dtype)
    scores = without_padding(logits[0], beyond)
    stood, token = (greedy_accept(sampler.sample(scores, per_position), drafts) if sampler.greedy
                    else accept_and_correct(sampler.probs(scores, per_position), q, drafts, generator))
    bad = torch.stack([~torch.isfinite(logits).all(), ~torch.isfinite(q).all()])
    host = torch.cat([bad.long(), stood[None], token[None], drafts]).tolist()  # the round's one sync
    stood = host[2]
    seq[0, n + 1 + stood] = token  # the drafts that stood are in seq already
    if counts is not None:
        counts = per_position[stood:stood + 1].scatter_add(1, token.view(1, 1), torch.ones_like(counts[:, :1]))
    target.rewind(n + 1 + stood)
    return host, k_now, counts


@torch.inference_mode()
def speculative_generate(target: Engine, draft: Engine | None, prompt: Sequence[int], sampler: Sampler | None = None,
                         k: int | None = None, max_new_tokens: int = 256, stop_token_ids: Sequence[int] = (),
                         stop_strings: Sequence[str] = (), tokenizer=None, stream: StreamCallback | None = None,
                         truncate: bool = False, include_stop_str_in_output: bool = False) -> Generation:
    """Generate from one prompt (token ids) as `Engine.generate` does, drafting with `draft` (an Engine of
    a smaller model with the same tokenizer) or, with draft=None, with the target's own MTP modules.
    k: draft tokens per round (default 4 for a draft model, every MTP module for self-speculation).
    `extra` reports acceptance_rate (draft tokens that stood / proposed), tokens_per_round and rounds."""
    k = _check_request(target, draft, k)
    sampler = SAMPLERS.build("greedy") if sampler is None else sampler
    model, device = target.model, target.device
    [prompt] = prepare_prompts([prompt], max_new_tokens, model.max_seq_len, truncate)
    max_len = len(prompt) + max_new_tokens
    context = model.max_seq_len if draft is None else min(model.max_seq_len, draft.model.max_seq_len)
    room = min(max_len + k, context)  # slots for the last round's drafts past max_new_tokens
    if draft is not None and draft.model.max_seq_len < max_len:
        raise ConfigError(f"the prompt of {len(prompt)} tokens plus max_new_tokens={max_new_tokens} exceeds the draft "
                          f"model's context of {draft.model.max_seq_len} tokens; lower max_new_tokens")
    stops = StopStrings(stop_strings, tokenizer, include_stop_str_in_output)
    beyond = padding_ids(model.vocab_size, tokenizer, device)  # never sampled, by the draft nor the target
    out = _Emitted(max_new_tokens, stop_token_ids, stops, stream)
    # fixed rounds (one CUDA graph each where the engines replay graphs); not when the context cuts rounds short
    fixed = GreedyRounds.applies(draft, sampler) and room == max_len + k
    drafter = (MTPDraft(target, k) if draft is None
               else DraftModel(draft, room, DRAFT_STEPS if fixed else (1,)))
    generator = sampler.generator(device)
    counts = None

    sync()
    began = time.perf_counter()
    target.begin(1, room, lookahead=k)
    fixed_rounds = GreedyRounds.prepare(target, draft, k, room + 1, room, beyond) if fixed else None
    # a round writes up to slot n + k_now + 1 <= room
    seq = fixed_rounds.seq if fixed else torch.zeros(1, room + 1, dtype=torch.long, device=device)
    seq[0, :len(prompt)] = torch.tensor(prompt)
    prompt_ids = seq[:, :len(prompt)]
    if sampler.needs_counts:
        counts = token_counts(prompt_ids, torch.zeros(1, dtype=torch.long, device=device), model.vocab_size)
    logits = target.extend(prompt_ids)
    token = sampler.sample(without_padding(logits, beyond), counts, generator)
    bad, first = torch.stack([(~torch.isfinite(logits).all()).long(), token[0]]).tolist()
    _check_finite(bad, 0, 1)
    ttft = time.perf_counter() - began
    decode_began = time.perf_counter()
    n = len(prompt)  # the pending token's position: sampled, not yet run by the target
    seq[:, n] = token
    if counts is not None:
        counts.scatter_add_(1, token[:, None], torch.ones_like(counts[:, :1]))
    done = out.add([first])
    drafter.start(prompt_ids, k)
    if fixed:
        fixed_rounds.n.fill_(n)
    rounds = proposed = accepted = 0
    while not done:
        if fixed:
            fixed_rounds.replay()
            host, k_now = fixed_rounds.record.tolist(), k  # the round's one sync
        else:
            host, k_now, counts = _round(target, drafter, seq, n, k, room, sampler, counts, generator, beyond)
        _check_finite(host[0], host[1], len(out.tokens) + 1)
        stood = host[2]
        n += stood + 1
        rounds, proposed, accepted = rounds + 1, proposed + k_now, accepted + stood
        done = out.add(host[4:4 + stood] + [host[3]])
    if fixed:  # the engines' own bookkeeping, which the graph does not keep
        target.rewind(n)
        draft.rewind(n - 1)
    sync()
    result = build_generation([out.tokens], stop_token_ids, stops, tokenizer, ttft, time.perf_counter() - decode_began,
                     len(out.tokens) - 1, len(prompt), target.kv_cache_bytes() + drafter.cache_bytes())
    # tokens_per_round: the tokens a round added to the output (a last round's past max_new_tokens are dropped)
    result.extra.update(acceptance_rate=accepted / max(proposed, 1),
                        tokens_per_round=(len(out.tokens) - 1) / max(rounds, 1), rounds=rounds)
    return result
