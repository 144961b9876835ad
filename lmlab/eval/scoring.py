"""What the evaluation tasks ask of a model: log-likelihoods of continuations, rolling (sliding-window)
log-likelihood of long texts, and generations, on lmlab's inference engine.

`Scorer.loglikelihoods([(context_ids, continuation_ids), ...])` groups the requests by context and
runs each distinct context once: a batch of contexts (longest first, left-padded, at most
`batch_tokens` tokens per batch) is prefilled, the last position's logits score every
continuation's first token, and where continuations are longer the engine forks each context's
cache into one sequence per continuation (`Engine.select`) and runs them all in one more forward.
So the four answer letters of a multiple-choice question cost one forward of the question.

Contexts longer than the model's context are cut from the left (the question stays, the oldest
few-shot examples go); `truncated` counts the distinct prompts so cut (a question scored against four
answers, or sampled n times, counts once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lmlab.inference.engine import Engine
from lmlab.inference.generate import left_pad, prepare_prompts
from lmlab.nn.transformer import Transformer
from lmlab.tokenizers.base import Tokenizer

LOGITS_BUDGET = 1 << 27  # float32 logits held at once by the rolling log-likelihood (512 MiB)


@dataclass(frozen=True)
class LogLikelihood:
    logprob: float  # sum of log p over the continuation's tokens
    greedy: bool  # every continuation token is the most likely one
    tokens: int


class Scorer:
    """One model, its tokenizer and context, and the engines the tasks run on."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, max_len: int, stop_ids: Sequence[int] = (),
                 batch_tokens: int = 16384, compile: bool = False,
                 validation: Callable[[], np.ndarray] | None = None):
        """batch_tokens: tokens (batch x padded length) per scoring forward. validation: the token ids of the
        model's own validation split, for perplexity without a file (None: none known)."""
        self.model, self.tokenizer, self.max_len = model, tokenizer, max_len
        self.stop_ids = list(stop_ids)
        self.batch_tokens = batch_tokens
        self.validation = validation
        self.device = model.embed_tokens.weight.device
        self.scoring = Engine(model, cuda_graphs=False)  # shapes change every batch: nothing to replay
        self.generating = Engine(model, compile=compile, cuda_graphs=self.device.type == "cuda")
        self.truncated = 0

    # -- log-likelihoods of continuations ----------------------------------------------------------
    def loglikelihoods(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]],
                       progress: Callable[[int], None] | None = None) -> list[LogLikelihood]:
        """log p(continuation | context) for each (context ids, continuation ids) pair; `progress` is
        called with the number of requests each batch finished."""
        groups: dict[tuple[int, ...], list[int]] = {}
        cut = set()
        for i, (context, continuation) in enumerate(requests):
            fitted = self._fit(context, continuation)
            if len(fitted) < len(context):
                cut.add(tuple(context))
            groups.setdefault(fitted, []).append(i)
        self.truncated += len(cut)
        results: list[LogLikelihood | None] = [None] * len(requests)
        contexts = sorted(groups, key=len, reverse=True)
        longest_after = {c: max(len(requests[i][1]) for i in groups[c]) for c in contexts}
        start = 0
        while start < len(contexts):
            batch = self._batch(contexts[start:], longest_after)
            count = len(batch)
            pairs = [(b, i) for b, context in enumerate(batch) for i in groups[context]]
            for (_, i), result in zip(pairs, self._score(batch, [requests[i][1] for _, i in pairs],
                                                         [b for b, _ in pairs])):
                results[i] = result
            if progress is not None:
                progress(len(pairs))
            start += count
        return results

    def _batch(self, contexts: list[tuple[int, ...]], longest_after: dict) -> list[tuple[int, ...]]:
        """The next batch: contexts (longest first) while the padded batch stays within `batch_tokens` and
        every row's continuation stays within the context (rows are padded to the batch's longest one)."""
        width, longest = len(contexts[0]), longest_after[contexts[0]]
        count = 1
        for context in contexts[1:]:
            longer = max(longest, longest_after[context])
            if (count + 1) * (width + longer) > self.batch_tokens or width + longer > self.max_len + 1:
                break
            longest, count = longer, count + 1
        return contexts[:count]

    def _fit(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[int, ...]:
        """The context, started with end-of-text when empty and cut from the left to fit."""
        if not continuation:
            raise ValueError("a continuation to score is empty")
        if len(continuation) >= self.max_len:
            raise ValueError(f"a continuation of {len(continuation)} tokens does not fit the model's context "
                             f"of {self.max_len}")
        if not context:
            if self.tokenizer.eot_id is None:
                raise ValueError("an empty context needs an end-of-text token to condition on; this tokenizer has none")
            context = [self.tokenizer.eot_id]
        room = self.max_len - len(continuation)
        return tuple(context[-room:])

    @torch.inference_mode()
    def _score(self, contexts: list[tuple[int, ...]], continuations: list[Sequence[int]],
               owners: list[int]) -> list[LogLikelihood]:
        engine = self.scoring
        ids, start = left_pad([list(c) for c in contexts], self.device)
        longest = max(len(c) for c in continuations)
        engine.begin(len(contexts), ids.shape[1] + longest - 1, start)
        first = engine.extend(ids).log_softmax(-1)  # (contexts, V): each continuation's first token
        index = torch.tensor(owners, device=self.device)
        tokens = torch.zeros(len(continuations), longest, dtype=torch.long)
        for row, c in enumerate(continuations):
            tokens[row, :len(c)] = torch.tensor(list(c))
        tokens = tokens.to(self.device)
        lengths = torch.tensor([len(c) for c in continuations], device=self.device)
        logprobs = first[index, tokens[:, 0]][:, None]  # (N, 1), without copying a context's row per continuation
        greedy = (first.argmax(-1)[index] == tokens[:, 0])[:, None]
        if longest > 1:  # the rest in one forward of every continuation, each on its context's cache
            engine.select(index)
            rest = engine.extend(tokens[:, :-1], all_logits=True).log_softmax(-1)  # (N, longest - 1, V)
            logprobs = torch.cat([logprobs, rest.gather(-1, tokens[:, 1:, None])[..., 0]], dim=1)
            greedy = torch.cat([greedy, rest.argmax(-1) == tokens[:, 1:]], dim=1)
        real = torch.arange(longest, device=self.device)[None, :] < lengths[:, None]
        totals = (logprobs * real).sum(1).tolist()
        greedy_all = (greedy | ~real).all(1).tolist()
        return [LogLikelihood(t, g, len(c)) for t, g, c in zip(totals, greedy_all, continuations)]

    # -- rolling log-likelihood (perplexity) -------------------------------------------------------
    @torch.inference_mode()
    def rolling_nll(self, tokens: Sequence[int] | np.ndarray, stride: int | None = None) -> tuple[float, int]:
        """(sum of -log p, count) over tokens[1:], each predicted from up to max_len tokens before it.

        Windows of max_len tokens start every `stride` tokens (default max_len // 2); each scores only
        the targets earlier windows have not, so every target has at least max_len - stride tokens of
        context except those of the first window."""
        stride = stride or max(1, self.max_len // 2)
        if not 0 < stride <= self.max_len:
            raise ValueError(f"stride must be in 1..{self.max_len} (the model's context), got {stride}")
        tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
        windows, scored_to = [], 0  # (begin, end, first new target) over inputs tokens[begin:end]
        for begin in range(0, max(len(tokens) - 1, 0), stride):
            end = min(begin + self.max_len, len(tokens) - 1)
            windows.append((begin, end, max(begin, scored_to)))
            scored_to = end
            if end == len(tokens) - 1:
                break
        total, count = 0.0, 0
        per_batch = max(1, LOGITS_BUDGET // (self.max_len * self.model.vocab_size))
        for length in sorted({end - begin for begin, end, _ in windows}):
            same = [w for w in windows if w[1] - w[0] == length]
            for i in range(0, len(same), per_batch):
                chunk = same[i:i + per_batch]
                x = torch.stack([tokens[b:e] for b, e, _ in chunk]).to(self.device)
                y = torch.stack([tokens[b + 1:e + 1] for b, e, _ in chunk]).to(self.device)
                nll = F.cross_entropy(self.model(x).float().transpose(1, 2), y, reduction="none")  # (B, length)
                new = torch.arange(length, device=self.device)[None, :] >= torch.tensor(
                    [n - b for b, _, n in chunk], device=self.device)[:, None]
                total += nll[new].sum().item()
                count += int(new.sum())
        return total, count

    # -- generation --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampler, max_new_tokens: int, stop_strings: Sequence[str] = (),
                 batch_size: int = 32, desc: str = "generate") -> list[str]:
        """Completions of `prompts` (token ids), cut at end-of-text or a stop string, with a progress bar;
        prompts too long for the context keep their last tokens (counted in `truncated`)."""
        room = self.max_len - max_new_tokens
        self.truncated += len({tuple(p) for p in prompts if len(p) > room})
        prompts = prepare_prompts(prompts, max_new_tokens, self.max_len, truncate=True)
        texts = []
        with tqdm(total=len(prompts), desc=desc, unit="ex") as bar:
            for i in range(0, len(prompts), batch_size):
                out = self.generating.generate(prompts[i:i + batch_size], sampler, max_new_tokens,
                                               stop_token_ids=self.stop_ids, stop_strings=list(stop_strings),
                                               tokenizer=self.tokenizer)
                texts.extend(out.texts)
                bar.update(len(out.texts))
        return texts
