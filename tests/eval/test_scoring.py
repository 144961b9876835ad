"""The scorer against brute force: log-likelihoods of continuations (shared contexts, several tokens,
truncation, any batching, ring-buffer and GQA caches forked per continuation) and the sliding-window
rolling log-likelihood."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.eval.scoring import Scorer
from lmlab.inference.samplers import SAMPLERS
from lmlab.nn import ModelConfig, Transformer
from lmlab.tokenizers import ByteTokenizer

ATTENTIONS = [{"name": "mha", "n_heads": 4}, {"name": "mha", "n_heads": 4, "n_kv_heads": 2, "window": 6}, "mla", "linear"]


def _model(attention, max_seq_len=48) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=max_seq_len, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention=attention, block="prenorm")
    return Transformer(cfg, vocab_size=ByteTokenizer().vocab_size).eval()


def _reference(model, context, continuation) -> tuple[float, bool]:
    with torch.no_grad():
        logprobs = model(torch.tensor([context + continuation])).float().log_softmax(-1)[0]
    rows = logprobs[len(context) - 1:len(context) - 1 + len(continuation)]
    picked = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
    return picked.sum().item(), bool((rows.argmax(-1) == torch.tensor(continuation)).all())


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("batch_tokens", [20, 4096])
def test_loglikelihoods_equal_a_full_forward(attention, batch_tokens):
    model = _model(attention)
    scorer = Scorer(model, ByteTokenizer(), 48, batch_tokens=batch_tokens)
    context = [5, 9, 2, 40, 41, 7]
    greedy = model(torch.tensor([context])).argmax(-1)[0, -1].item()  # the model's own next token
    requests = [(context, [3]), (context, [3, 4, 5]), (context, [greedy]), ([1, 2], [8, 9]),
                (list(range(10, 30)), [70, 71, 72, 73]), (context, [11, 12])]
    for (c, k), got in zip(requests, scorer.loglikelihoods(requests)):
        logprob, is_greedy = _reference(model, c, k)
        assert got.logprob == pytest.approx(logprob, abs=1e-4)
        assert got.greedy == is_greedy and got.tokens == len(k)
    assert scorer.loglikelihoods([(context, [greedy])])[0].greedy


def test_a_shared_context_runs_once():
    scorer = Scorer(_model(ATTENTIONS[0]), ByteTokenizer(), 48)
    calls = []
    extend = scorer.scoring.extend
    scorer.scoring.extend = lambda ids, all_logits=False: calls.append(ids.shape) or extend(ids, all_logits)
    scorer.loglikelihoods([([1, 2, 3, 4], [c]) for c in (65, 66, 67, 68)])
    assert calls == [torch.Size([1, 4])]  # one prefill of one context; one-token continuations need no more


def test_long_contexts_lose_their_oldest_tokens():
    model = _model(ATTENTIONS[0], max_seq_len=16)
    scorer = Scorer(model, ByteTokenizer(), 16)
    context, continuation = list(range(1, 30)), [50, 51]
    got = scorer.loglikelihoods([(context, continuation)])[0]
    assert got.logprob == pytest.approx(_reference(model, context[-14:], continuation)[0], abs=1e-4)
    assert scorer.truncated == 1


def test_long_contexts_with_continuations_of_different_lengths():
    model = _model(ATTENTIONS[0], max_seq_len=16)
    scorer = Scorer(model, ByteTokenizer(), 16)
    context, short, long = list(range(1, 20)), [50], [50, 51, 52, 53]
    got = scorer.loglikelihoods([(context, short), (context, long), ([7, 8], long)])
    for (c, k), result in zip([(context[-15:], short), (context[-12:], long), ([7, 8], long)], got):
        assert result.logprob == pytest.approx(_reference(model, c, k)[0], abs=1e-4)
    assert scorer.truncated == 1  # one prompt was cut, whatever its continuations


def test_a_prompt_generated_from_many_times_counts_once_as_cut():
    scorer = Scorer(_model(ATTENTIONS[0], max_seq_len=16), ByteTokenizer(), 16)
    scorer.generate([list(range(1, 30))] * 3 + [[5, 6]], SAMPLERS.build("greedy"), 4)
    assert scorer.truncated == 1


def test_an_empty_context_conditions_on_end_of_text():
    model = _model(ATTENTIONS[0])
    tokenizer = ByteTokenizer()
    got = Scorer(model, tokenizer, 48).loglikelihoods([([], [70, 71])])[0]
    assert got.logprob == pytest.approx(_reference(model, [tokenizer.eot_id], [70, 71])[0], abs=1e-4)


@pytest.mark.parametrize("stride", [16, 5, None])
def test_rolling_nll_scores_every_token_once_with_the_context_its_window_gives(stride):
    model = _model(ATTENTIONS[0], max_seq_len=16)
    tokens = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    total, count = Scorer(model, ByteTokenizer(), 16).rolling_nll(tokens, stride)
    assert count == len(tokens) - 1
    stride = stride or 8
    expected, scored_to = 0.0, 0  # window by window, as the docstring says
    for begin in range(0, len(tokens) - 1, stride):
        end = min(begin + 16, len(tokens) - 1)
        with torch.no_grad():
            nll = F.cross_entropy(model(torch.tensor([tokens[begin:end]])).float()[0],
                                  torch.tensor(tokens[begin + 1:end + 1]), reduction="none")
        expected += nll[max(begin, scored_to) - begin:].sum().item()
        scored_to = end
        if end == len(tokens) - 1:
            break
    assert total == pytest.approx(expected, rel=1e-5)
    assert math.isfinite(total)


def test_bad_requests_say_what_is_wrong():
    scorer = Scorer(_model(ATTENTIONS[0], max_seq_len=16), ByteTokenizer(), 16)
    with pytest.raises(ValueError, match="empty"):
        scorer.loglikelihoods([([1], [])])
    with pytest.raises(ValueError, match="does not fit"):
        scorer.loglikelihoods([([1], list(range(20)))])
    with pytest.raises(ValueError, match="stride"):
        scorer.rolling_nll([1, 2, 3], stride=17)
