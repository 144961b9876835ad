"""Greedy speculative rounds with a draft model, each replayed as one CUDA graph where the engines replay theirs.

With a greedy sampler and no bias or penalties, a round of `speculative_generate` is a fixed sequence of static
steps: the draft's two-token step over the token before the pending one and the pending one (the draft has
not run the former when every draft of the last round stood; otherwise it rewrites the same key and value),
k - 1 one-token draft steps, the target's (k+1)-token verification, and `greedy_accept`. The pending
token's position lives on the device, so the whole round, its bookkeeping included, is captured once and
replayed: the host launches one graph a round and reads the round's record at its one sync. Launched one
op at a time, a small draft's steps can be paced by the host's launches rather than by the GPU. Without CUDA
graphs (the CPU, eager engines) the same round runs op by op.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from lmlab.inference.engine import Engine, capture_cuda_graph
from lmlab.inference.generate import without_padding
from lmlab.inference.samplers import Sampler

log = logging.getLogger(__name__)

DRAFT_STEPS = (1, 2)  # the draft engine's static steps a graphed round runs


def greedy_accept(target_tokens: Tensor, draft_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """accept_and_correct for one-hot p and q: target_tokens (..., k+1) are the target's argmaxes at the k+1
    positions. The drafts stand up to the first that differs from the target's token, which replaces it (or,
    when all stand, the target's token after them follows)."""
    accepted = (target_tokens[..., :-1] == draft_tokens).long().cumprod(-1).sum(-1)
    return accepted, target_tokens.gather(-1, accepted[..., None]).squeeze(-1)


class GreedyRounds:
    """One round (its CUDA graph) for a target and draft engine, k and sequence length; see the module docstring.
    `seq` (1, length) holds the tokens, `n` (1,) the pending token's position; each `replay()` runs a round,
    advances `n` and rewrites `record`: [target logits non-finite, draft logits non-finite, drafts that
    stood, the token after them, the k drafts]."""

    @staticmethod
    def applies(draft: Engine | None, sampler: Sampler) -> bool:
        """Whether rounds are fixed sequences of static steps: a draft model and a greedy sampler without bias or
        penalties (whose token counts would change within a round), whose token is the logits' argmax."""
        return draft is not None and sampler.argmax_of_logits

    @classmethod
    def prepare(cls, target: Engine, draft: Engine, k: int, length: int, draft_len: int,
                beyond: Tensor | None) -> GreedyRounds:
        """The graph for this request, captured on the draft's first use of these shapes. After `target.begin`
        and before any prefill: capturing writes into both engines' caches, which are emptied after."""
        draft.begin(1, draft_len, lookahead=k - 1, steps=DRAFT_STEPS)
        rounds = draft.drafted_rounds
        if rounds is None or not rounds._matches(target, k, length, beyond):
            rounds = draft.drafted_rounds = cls(target, draft, k, length, beyond)
        return rounds

    def __init__(self, target: Engine, draft: Engine, k: int, length: int, beyond: Tensor | None):
        self.target, self.k, self.beyond = target, k, beyond
        self.verify, self.pair, self.single = target._steps[k + 1], draft._steps[2], draft._steps[1]
        self.seq = torch.zeros(1, length, dtype=torch.long, device=target.device)
        self.n = torch.ones(1, dtype=torch.long, device=target.device)  # >= 1: the pair step reads n - 1
        self.graph: torch.cuda.CUDAGraph | None = None
        self.record = torch.zeros(k + 4, dtype=torch.long, device=target.device)
        if target.cuda_graphs and draft.cuda_graphs:
            try:
                self.graph, self.record = capture_cuda_graph(self._warm_or_captured_round, warmups=2)
            except RuntimeError as err:  # as the engines' own steps: a host sync in a layer cannot be captured
                log.warning("speculative rounds run op by op, without a CUDA graph: %s", str(err).splitlines()[0])
            for cache in target.caches + draft.caches:
                cache.reset()

    def _matches(self, target: Engine, k: int, length: int, beyond: Tensor | None) -> bool:
        draft = self.pair.engine
        return (self.target is target and self.k == k and self.seq.shape[1] == length and self.beyond is beyond
                and self.verify is target._steps.get(k + 1)
                and self.pair is draft._steps.get(2) and self.single is draft._steps.get(1))

    def replay(self) -> None:
        """One round: advances n and rewrites record."""
        if self.graph is None:
            self.record = self._round()
        else:
            self.graph.replay()

    def _warm_or_captured_round(self) -> Tensor:
        if not torch.cuda.is_current_stream_capturing():  # a warm-up: from slot 1, so it stays within the caches
            self.n.fill_(1)
        return self._round()

    def _logits(self, step, first: Tensor) -> Tensor:
        """The step's float32 logits (1, S, V) for the tokens of seq at slots first, first + 1, ..."""
        step.place(first)
        step.ids.copy_(self.seq.gather(1, step.slots[None]))
        return step.run()[0]

    def _greedy(self, logits: Tensor) -> Tensor:
        """A greedy sampler without bias or penalties: the argmax, padding ids never."""
        return without_padding(logits, self.beyond).argmax(-1)

    def _round(self) -> Tensor:
        n, k, seq = self.n, self.k, self.seq
        logits = self._logits(self.pair, n - 1)[:, -1]  # the draft's distribution of the token at n + 1
        rows = []
        for i in range(1, k + 1):
            rows.append(logits)
            seq.scatter_(1, (n + i).view(1, 1), self._greedy(logits).view(1, 1))
            if i < k:
                logits = self._logits(self.single, n + i)[:, -1]
        scores = self._logits(self.verify, n)[0]  # (k + 1, V)
        drafts = seq.gather(1, (n + 1 + self.verify.offsets[:k])[None])[0]
        stood, token = greedy_accept(self._greedy(scores), drafts)
        seq.scatter_(1, (n + 1 + stood).view(1, 1), token.view(1, 1))
        bad = torch.stack([~torch.isfinite(scores).all(), ~torch.isfinite(torch.cat(rows)).all()])
        record = torch.cat([bad.long(), stood.view(1), token.view(1), drafts])
        n.add_(stood + 1)
        return record
