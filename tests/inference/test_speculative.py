"""Speculative decoding: greedy output identical to the target's, the rejection rule keeps the target's
distribution, the drafters' and the target's distributions equal full forward passes, and bad requests."""

import copy

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference import speculative
from lmlab.inference.engine import Engine
from lmlab.inference.samplers import SAMPLERS
from lmlab.inference.speculative import accept_and_correct, check_draft, speculative_generate
from lmlab.nn import ModelConfig, Transformer
from lmlab.nn.mtp import MTPConfig
from lmlab.tokenizers.byte import ByteTokenizer

VOCAB = 64
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 20, 11], [4]]
WINDOW = {"name": "mha", "n_heads": 4, "window": 4}  # a ring buffer that rolls back


def _model(seed: int = 0, **kw) -> Transformer:
    parts = dict(d_model=32, n_layers=2, max_seq_len=48, norm="rmsnorm", ffn="swiglu", position="rope",
                 attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2}, block="prenorm")
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**parts, **kw}), vocab_size=VOCAB).eval()


def _noisy_copy(model: Transformer, scale: float = 0.3) -> Transformer:
    """A draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().nan_to_num(0))
    return draft


@pytest.mark.parametrize(("attention", "k"), [("gqa", 1), ("gqa", 3), ("gqa", 5), ("window", 1), ("window", 3),
                                              ("window", 5), ("mla", 3)])  # MLA decodes slowly on CPU
def test_greedy_output_is_the_targets_with_a_draft_that_is_sometimes_wrong(attention, k):
    attention = {"gqa": {"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "window": WINDOW, "mla": "mla"}[attention]
    model = _model(attention=attention)
    target, draft = Engine(model), Engine(_noisy_copy(model))
    rates = []
    for prompt in PROMPTS:
        expected = target.generate([prompt], max_new_tokens=20).tokens[0]
        out = speculative_generate(target, draft, prompt, k=k, max_new_tokens=20)
        assert out.tokens[0] == expected
        assert out.finish_reasons == ["length"]
        rates.append(out.extra["acceptance_rate"])
    assert 0 < min(rates) and max(rates) < 1  # both rejections and acceptances ran


def test_greedy_output_is_the_targets_up_to_the_end_of_the_context():
    # 7 prompt tokens + 41 new = max_seq_len 48: the last rounds have no room for k drafts and run shorter
    target, draft = Engine(_model()), Engine(_noisy_copy(_model()))
    expected = target.generate([PROMPTS[1]], max_new_tokens=41).tokens[0]
    out = speculative_generate(target, draft, PROMPTS[1], k=4, max_new_tokens=41)
    assert out.tokens[0] == expected and len(expected) == 41


def test_greedy_output_is_the_targets_with_an_unrelated_draft_and_penalties():
    target, draft = Engine(_model()), Engine(_model(seed=1, n_layers=1))
    sampler = SAMPLERS.build({"name": "greedy", "repetition_penalty": 1.5, "frequency_penalty": 0.3})
    for prompt in PROMPTS:
        expected = target.generate([prompt], sampler, max_new_tokens=16).tokens[0]
        assert speculative_generate(target, draft, prompt, sampler, k=3, max_new_tokens=16).tokens[0] == expected


def test_a_draft_equal_to_the_target_always_stands():
    model = _model()
    target, draft = Engine(model), Engine(model)
    out = speculative_generate(target, draft, PROMPTS[1], k=3, max_new_tokens=20)
    assert out.tokens[0] == target.generate([PROMPTS[1]], max_new_tokens=20).tokens[0]
    # 19 tokens after the first in rounds of 4: the last round's fourth token passes max_new_tokens and is dropped
    assert out.extra == {"acceptance_rate": 1.0, "tokens_per_round": 19 / 5, "rounds": 5}


@pytest.mark.parametrize(("sampler", "fixed"), [("greedy", True), ({"name": "greedy", "repetition_penalty": 1.5}, False),
                                               ({"name": "top_k", "top_k": 5, "seed": 0}, False)])
def test_greedy_rounds_without_penalties_run_as_fixed_rounds(sampler, fixed, monkeypatch):
    """Only a greedy sampler without penalties makes every round the same static steps (one CUDA graph on CUDA)."""
    calls, real = [], speculative.GreedyRounds._round
    monkeypatch.setattr(speculative.GreedyRounds, "_round", lambda self: calls.append(1) or real(self))
    target, draft = Engine(_model()), Engine(_noisy_copy(_model()))
    out = speculative_generate(target, draft, PROMPTS[1], SAMPLERS.build(sampler), k=3, max_new_tokens=12)
    assert bool(calls) == fixed and len(calls) == (out.extra["rounds"] if fixed else 0)


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_self_speculation_gives_the_targets_greedy_output(k):
    target = Engine(_model(mtp=MTPConfig(depth=2), attention=WINDOW))
    for prompt in PROMPTS:
        expected = target.generate([prompt], max_new_tokens=20).tokens[0]
        out = speculative_generate(target, None, prompt, k=k, max_new_tokens=20)
        assert out.tokens[0] == expected
        assert 0 <= out.extra["acceptance_rate"] <= 1


def test_stop_token_stop_string_and_stream_end_where_the_targets_do():
    model = _model()
    target, draft = Engine(model), Engine(_noisy_copy(model))
    free = target.generate([PROMPTS[0]], max_new_tokens=20).tokens[0]
    streamed = []
    out = speculative_generate(target, draft, PROMPTS[0], k=3, max_new_tokens=20, stop_token_ids=[free[6]],
                               stream=lambda step: streamed.extend(step))
    end = free.index(free[6])
    assert (out.tokens[0], out.finish_reasons) == (free[:end], ["stop"])
    assert streamed == free[:end + 1]
    tokenizer = ByteTokenizer()
    stop = tokenizer.decode(free[3:5])
    out = speculative_generate(target, draft, PROMPTS[0], k=3, max_new_tokens=20, stop_strings=[stop],
                               tokenizer=tokenizer)
    assert out.finish_reasons == ["stop"] and stop not in out.texts[0]
    assert out.texts[0] == tokenizer.decode(free).split(stop)[0]


def _record_rounds(monkeypatch) -> list:
    rounds, real = [], speculative.accept_and_correct

    def spy(p, q, drafts, generator=None):
        stood, token = real(p, q, drafts, generator)
        rounds.append((p, q, drafts.tolist(), int(stood)))
        return stood, token

    monkeypatch.setattr(speculative, "accept_and_correct", spy)
    return rounds


@pytest.mark.parametrize("drafter", ["draft_model", "mtp"])
def test_every_round_scores_what_full_forward_passes_give(drafter, monkeypatch):
    """p of each round is the target's, and q the draft model's (or the MTP modules' training forward)
    on the true tokens plus the drafts: the caches roll back and catch up exactly."""
    model = _model(mtp=MTPConfig(depth=3), attention=WINDOW)
    draft_model = _noisy_copy(model)
    rounds = _record_rounds(monkeypatch)
    sampler = SAMPLERS.build({"name": "top_k", "top_k": 20, "temperature": 0.8, "seed": 0,
                              "presence_penalty": 0.5})
    draft = None if drafter == "mtp" else Engine(draft_model)
    prompt = PROMPTS[1]
    out = speculative_generate(Engine(model), draft, prompt, sampler, k=3, max_new_tokens=24)
    tokens, n = prompt + out.tokens[0], len(prompt)
    stood_counts = []
    with torch.no_grad():
        for p, q, drafts, stood in rounds:
            seq = torch.tensor([tokens[:n + 1] + drafts])
            counts = torch.stack([torch.bincount(seq[0, :i + 1], minlength=VOCAB).float()
                                  for i in range(n, seq.shape[1])])
            torch.testing.assert_close(p, sampler.probs(model(seq)[0, n:], counts), atol=1e-5, rtol=0)
            if drafter == "mtp":
                heads = model.forward_train(seq).mtp_logits
                draft_logits = torch.stack([heads[i][0, n - 1] for i in range(len(drafts))])
            else:
                draft_logits = draft_model(seq)[0, n:-1]
            torch.testing.assert_close(q, sampler.probs(draft_logits, counts[:-1]), atol=1e-5, rtol=0)
            stood_counts.append(stood)
            n += stood + 1
    assert min(stood_counts) == 0 and max(stood_counts) == 3


def _tables(seed: int, rows: int, vocab: int = 8) -> torch.Tensor:
    probs = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(seed)) ** 3
    return probs / probs.sum(-1, keepdim=True)


def test_accepted_and_corrected_tokens_follow_p_not_q():
    """Leviathan et al.'s theorem on 20k seeded draws: the first emitted token follows p_0 and, once it
    is a standing draft, the second follows p_1; the first draft stands with probability sum min(p, q)."""
    draws, k = 20_000, 2
    p, q = _tables(0, k + 1), _tables(1, k)
    assert (p[0] - q[0]).abs().max() > 0.1  # far enough apart for the test to tell them apart
    generator = torch.Generator().manual_seed(2)
    drafts = torch.stack([torch.multinomial(q[i], draws, replacement=True, generator=generator) for i in range(k)], -1)
    stood, token = accept_and_correct(p.expand(draws, -1, -1), q.expand(draws, -1, -1), drafts, generator)

    def frequencies(tokens: torch.Tensor) -> torch.Tensor:
        return torch.bincount(tokens, minlength=8) / len(tokens)

    first = torch.where(stood >= 1, drafts[:, 0], token)
    assert (frequencies(first) - p[0]).abs().max() < 0.02
    assert abs((stood >= 1).float().mean() - torch.minimum(p[0], q[0]).sum()) < 0.02
    second = torch.where(stood >= 2, drafts[:, 1], token)[stood >= 1]
    assert (frequencies(second) - p[1]).abs().max() < 0.03


def test_accept_and_correct_with_one_hot_distributions_is_greedy():
    one_hot = lambda *ids: torch.nn.functional.one_hot(torch.tensor(ids), 8).float()  # noqa: E731
    stood, token = accept_and_correct(one_hot(3, 1, 2), one_hot(3, 5), torch.tensor([3, 5]))
    assert (int(stood), int(token)) == (1, 1)  # 5 is not the target's argmax: replaced by it
    stood, token = accept_and_correct(one_hot(3, 5, 2), one_hot(3, 5), torch.tensor([3, 5]))
    assert (int(stood), int(token)) == (2, 2)  # all stand, and the bonus token is the argmax after them


def test_greedy_accept_is_accept_and_correct_on_one_hot_distributions():
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 3, (200, 5), generator=g)  # few ids, so drafts often match
    drafts = torch.randint(0, 3, (200, 4), generator=g)
    one_hot = lambda ids: torch.nn.functional.one_hot(ids, 3).float()  # noqa: E731
    want = accept_and_correct(one_hot(target), one_hot(drafts), drafts, g)
    got = speculative.greedy_accept(target, drafts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert set(got[0].tolist()) == {0, 1, 2, 3, 4}  # every outcome, from none standing to all


def test_bad_requests_fail_before_any_work():
    model = _model()
    target = Engine(model)
    cases = [
        (dict(draft=Engine(_model(vocab_size=128))), "vocabulary has 128 ids but the target's has 64"),
        (dict(draft=Engine(model), k=0), "k=0"),
        (dict(draft=target), "Engine of its own"),
        (dict(draft=None), "no MTP modules"),
        (dict(draft=Engine(_model(attention="linear"))), "draft model's LinearAttention layers .* cannot roll back"),
        (dict(draft=Engine(_model(max_seq_len=16))), "draft model's context of 16"),
        (dict(draft=Engine(model), prompt=[]), "empty"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            speculative_generate(target, **{"prompt": PROMPTS[0], "max_new_tokens": 20, **kwargs})
    with pytest.raises(ConfigError, match="target's LinearAttention layers"):
        speculative_generate(Engine(_model(attention="linear")), Engine(model), PROMPTS[0])
    with pytest.raises(ConfigError, match="2 MTP modules draft at most 2"):
        speculative_generate(Engine(_model(mtp=MTPConfig(depth=2))), None, PROMPTS[0], k=3)
    assert target.state is None  # no caches were made


def test_check_draft_compares_tokenizer_fingerprints():
    model = _model()
    check_draft(model, model, ByteTokenizer(), ByteTokenizer())
    other = ByteTokenizer(ByteTokenizer.Config(special_tokens=["<|im_end|>"]))
    with pytest.raises(ConfigError, match="tokenizer .* differs from the target's"):
        check_draft(model, model, ByteTokenizer(), other)


def test_ids_past_the_tokenizers_vocabulary_are_never_drafted_nor_sampled():
    tokenizer = ByteTokenizer()  # 257 ids; the models pad their vocabulary to 320
    cfg = dict(d_model=32, n_layers=1, max_seq_len=48, norm="rmsnorm", ffn="swiglu", position="rope",
               attention={"name": "mha", "n_heads": 4}, block="prenorm")
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = Transformer(ModelConfig(**cfg), vocab_size=tokenizer.vocab_size).eval()
        with torch.no_grad():
            model.lm_head.weight[tokenizer.vocab_size:] *= 50  # untrained models that favour the padding ids
        models.append(model)
    target, draft = Engine(models[0]), Engine(models[1])
    expected = target.generate([[5, 9]], max_new_tokens=12, tokenizer=tokenizer).tokens[0]
    assert max(target.generate([[5, 9]], max_new_tokens=12).tokens[0]) >= tokenizer.vocab_size  # unmasked
    out = speculative_generate(target, draft, [5, 9], k=3, max_new_tokens=12, tokenizer=tokenizer)
    assert out.tokens[0] == expected and max(expected) < tokenizer.vocab_size
    sampled = speculative_generate(target, draft, [5, 9], SAMPLERS.build({"name": "temperature", "seed": 0}), k=3,
                                   max_new_tokens=12, tokenizer=tokenizer)
    assert max(sampled.tokens[0]) < tokenizer.vocab_size
