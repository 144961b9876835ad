"""Log-probabilities of tokens under the model, for requests that ask (SamplingParams.logprobs, prompt_logprobs).

A token's log-probability is read from the log-softmax of the model's raw logits at the position before it: before
logit_bias, the penalties, temperature and truncation, so it is the model's own distribution whatever the request's
sampling (vLLM's default, raw_logprobs), over its whole output as lmlab's eval scores it. The most likely tokens
listed beside it are taken among the tokenizer's ids: never the padding ids a model's vocabulary may add past them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmlab.inference.generate import without_padding


@dataclass
class TokenLogprobs:
    """One token's log-probability, and the most likely tokens at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


def logprobs_of(logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int],
                beyond: torch.Tensor | None = None) -> list[TokenLogprobs]:
    """Row i's token tokens[i] under log_softmax(logits[i]) (logits: (rows, vocab)), with its tops[i] most likely
    tokens other than the padding ids `beyond` marks (vocab,); one transfer to the host for all rows."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(-1, torch.tensor(list(tokens), device=logits.device)[:, None])[:, 0].tolist()
    listed = without_padding(logprobs, beyond)
    values, ids = listed.topk(min(max(tops, default=0), listed.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprobs(token, lp, list(zip(ids[i][:top], values[i][:top])))
            for i, (token, lp, top) in enumerate(zip(tokens, chosen, tops))]
