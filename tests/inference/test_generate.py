"""The generation loop: batches of mixed prompt lengths, stops, streaming, the non-finite guard,
bad requests, and token-for-token agreement with Hugging Face `generate` on a converted Llama."""

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.inference.generate import GenerationError
from lmlab.inference.samplers import SAMPLERS
from lmlab.nn import ModelConfig, Transformer

VOCAB = 64


def _model(**kw) -> Transformer:
    parts = dict(d_model=32, n_layers=2, max_seq_len=48, norm="rmsnorm", ffn="swiglu", position="rope",
                 attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2}, block="prenorm")
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**parts, **kw}), vocab_size=VOCAB).eval()


PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 20, 11], [4], [30, 31, 32, 33, 34]]


@pytest.mark.parametrize("attention", [{"name": "mha", "n_heads": 4, "n_kv_heads": 2},
                                       {"name": "mha", "n_heads": 4, "window": 4}, "mla", "linear"])
@pytest.mark.parametrize("position", ["rope", "learned", "alibi"])
def test_batch_of_mixed_lengths_equals_one_by_one(attention, position):
    if attention == "linear" and position == "alibi":
        pytest.skip("linear attention refuses ALiBi")
    engine = Engine(_model(attention=attention, position=position))
    batched = engine.generate(PROMPTS, max_new_tokens=10).tokens
    alone = [engine.generate([p], max_new_tokens=10).tokens[0] for p in PROMPTS]
    assert batched == alone


def test_sampled_batch_is_reproducible_under_seed():
    engine = Engine(_model())
    sampler = SAMPLERS.build({"name": "top_p", "p": 0.9, "seed": 3, "repetition_penalty": 1.3})
    first = engine.generate(PROMPTS, sampler, max_new_tokens=12).tokens
    assert engine.generate(PROMPTS, sampler, max_new_tokens=12).tokens == first
    other = SAMPLERS.build({"name": "top_p", "p": 0.9, "seed": 4, "repetition_penalty": 1.3})
    assert engine.generate(PROMPTS, other, max_new_tokens=12).tokens != first


def test_stop_token_ends_each_sequence_on_its_own():
    engine = Engine(_model())
    free = engine.generate(PROMPTS, max_new_tokens=12).tokens
    stop = free[1][3]
    out = engine.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[stop])
    for row, got, reason, stop_token in zip(free, out.tokens, out.finish_reasons, out.stop_tokens):
        expected = row[:row.index(stop)] if stop in row else row
        assert got == expected
        assert reason == ("stop" if stop in row else "length")
        assert stop_token == (stop if stop in row else None)


class _Letters:
    """A tokenizer whose token i is the letter chr(97 + i % 26)."""

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def test_stop_string_cuts_the_text_and_streaming_sees_every_token():
    engine = Engine(_model())
    free = engine.generate([PROMPTS[1]], max_new_tokens=12).tokens[0]
    stop = _Letters().decode(free[4:6])
    streamed = []
    out = engine.generate([PROMPTS[1]], max_new_tokens=12, stop_strings=[stop], tokenizer=_Letters(),
                          stream=lambda tokens: streamed.append(tokens[0]))
    text = _Letters().decode(free)
    assert out.texts[0] == text[:text.index(stop)]
    assert out.finish_reasons == ["stop"] and out.stop_tokens == [None]  # a string, not a token, ended it
    assert streamed == out.tokens[0] == free[:len(streamed)]
    kept = engine.generate([PROMPTS[1]], max_new_tokens=12, stop_strings=[stop], tokenizer=_Letters(),
                           include_stop_str_in_output=True)
    assert kept.tokens == out.tokens and kept.texts[0] == text[:text.index(stop) + len(stop)]


def test_ids_past_the_tokenizers_vocabulary_are_never_sampled():
    from lmlab.tokenizers import ByteTokenizer

    tokenizer = ByteTokenizer()  # 257 ids; the model pads its vocabulary to 320
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=1, max_seq_len=48, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "mha", "n_heads": 4}, block="prenorm")
    model = Transformer(cfg, vocab_size=tokenizer.vocab_size).eval()
    with torch.no_grad():
        model.lm_head.weight[tokenizer.vocab_size:] *= 50  # an untrained model that favours the padding ids
    sampler = SAMPLERS.build({"name": "temperature", "seed": 0})
    engine = Engine(model)
    padded = engine.generate([[5, 9]] * 8, sampler, max_new_tokens=20).tokens
    assert max(max(t) for t in padded) >= tokenizer.vocab_size  # without the tokenizer nothing is known
    out = engine.generate([[5, 9]] * 8, sampler, max_new_tokens=20, tokenizer=tokenizer)
    assert max(max(t) for t in out.tokens) < tokenizer.vocab_size and len(out.texts) == 8


def test_stats_are_filled():
    out = Engine(_model()).generate(PROMPTS, max_new_tokens=6)
    s = out.stats
    assert s.prompt_tokens == sum(map(len, PROMPTS)) and s.new_tokens == 4 * 6 and s.steps == 5
    assert s.ttft_s > 0 and s.tpot_s > 0 and s.decode_tokens_per_s > 0 and s.kv_cache_bytes > 0


@pytest.mark.parametrize("sync_every", [1, 2, 16])  # each step; looks read a look late; only the last step's check
def test_non_finite_logits_stop_generation_naming_the_step(sync_every):
    model = _model()
    engine = Engine(model)
    calls = []

    def poison_after_two(module, inputs, output):
        calls.append(1)
        return output.fill_(float("nan")) if len(calls) > 2 else output

    model.lm_head.register_forward_hook(poison_after_two)
    with pytest.raises(GenerationError, match="step 2"):
        engine.generate([PROMPTS[0]], max_new_tokens=12, sync_every=sync_every)


def test_a_stop_token_seen_by_a_late_look_ends_generation_with_the_same_tokens():
    engine = Engine(_model())
    free = engine.generate([PROMPTS[1]], max_new_tokens=30).tokens[0]
    stop = free[3]
    out = engine.generate([PROMPTS[1]], max_new_tokens=30, stop_token_ids=[stop], sync_every=2)
    assert out.tokens[0] == free[:free.index(stop)] and out.finish_reasons == ["stop"]
    assert out.stats.steps < 29  # it ended early, a few steps past the stop at most


@pytest.mark.parametrize("attention", [{"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "linear"])
def test_greedy_blocks_of_steps_give_the_tokens_of_single_steps(attention):
    engine = Engine(_model(attention=attention))
    for prompt in PROMPTS:  # blocks run batches of one sequence (greedy_steps.MAX_BATCH)
        engine.greedy_steps = None
        free = engine.generate([prompt], max_new_tokens=14, sync_every=1)  # a host look each step: no blocks
        assert engine.greedy_steps is None
        stop = free.tokens[0][5]
        single = engine.generate([prompt], max_new_tokens=14, stop_token_ids=[stop], sync_every=1)
        blocked = engine.generate([prompt], max_new_tokens=14, stop_token_ids=[stop], sync_every=4)
        assert engine.greedy_steps.graphs.keys() == {4, 1}  # 13 decode steps: blocks of 4, then one of 1
        assert blocked.tokens == single.tokens and blocked.finish_reasons == single.finish_reasons == ["stop"]
        assert engine.generate([prompt], max_new_tokens=14, sync_every=4).tokens == free.tokens
    engine.greedy_steps = None
    sampled = SAMPLERS.build({"name": "top_p", "p": 0.9, "seed": 3})
    assert engine.generate([PROMPTS[0]], sampled, max_new_tokens=6).tokens == engine.generate(
        [PROMPTS[0]], sampled, max_new_tokens=6, sync_every=1).tokens
    engine.generate(PROMPTS, max_new_tokens=6)
    assert engine.greedy_steps is None  # sampled decoding and batches of several sequences run step by step


@pytest.mark.parametrize("prompts, kwargs, message", [
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens must be > 0"),
    ([[]], {}, "prompt is empty"),
    ([], {}, "no prompts"),
    ([[1] * 45], {"max_new_tokens": 5}, "truncate=true"),
    ([[1, 2]], {"max_new_tokens": 60}, "leaves no room"),
    ([[1, 2]], {"max_new_tokens": 5, "stop_strings": ["x"]}, "need the tokenizer"),
])
def test_bad_requests_fail_before_work(prompts, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Engine(_model()).generate(prompts, **kwargs)


def test_truncate_keeps_the_prompts_end():
    engine = Engine(_model())
    long = list(range(1, 46))
    out = engine.generate([long], max_new_tokens=5, truncate=True)
    assert out.tokens == engine.generate([long[-43:]], max_new_tokens=5).tokens


def test_greedy_matches_transformers_generate_on_a_converted_llama():
    transformers = pytest.importorskip("transformers")
    from lmlab.hf import from_hf_llama

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    model = from_hf_llama(config.to_dict(), hf.state_dict())
    prompt = torch.tensor([[3, 17, 99, 4, 56, 21]])
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, min_new_tokens=20,
                           do_sample=False, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert Engine(model).generate(prompt.tolist(), max_new_tokens=20).tokens[0] == expected


class _OnlyOddIds:
    """A sampler by duck typing that never picks an even id (as multimodal's RangeSampler restricts the ids)."""

    greedy, needs_counts = True, False

    def sample(self, logits, counts=None, generator=None):
        return logits.masked_fill(torch.arange(logits.shape[-1]) % 2 == 0, -torch.inf).argmax(-1)


@pytest.mark.parametrize("fused", [False, True])
def test_pick_samples_below_usable_and_writes_each_rows_peak(monkeypatch, fused):
    import importlib.util
    import os

    from lmlab.inference import generate

    if fused:  # the one-pass kernel, where Triton's CPU interpreter can run it
        if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
            pytest.skip("the fused path runs on the CPU under Triton's interpreter (TRITON_INTERPRET=1)")
        from lmlab.kernels.argmax_peak_triton import argmax_peak

        monkeypatch.setattr(generate, "optional_triton_kernel", lambda *args: argmax_peak)
    logits = torch.tensor([[0.0, 3.0, 1.0, 9.0, 2.0], [5.0, 2.0, 1.0, -7.0, float("nan")]])
    peaks = torch.zeros(2)
    beyond = torch.arange(5) >= 3  # ids 3 and 4 are padding: never picked, but their logits count for the peak
    tokens = generate.pick(SAMPLERS.build("greedy"), logits, None, None, beyond, 3, peaks)
    assert tokens.tolist() == [1, 0]
    assert peaks[0] == 9.0 and peaks[1].isnan()
    # a sampler that is not a plain greedy Sampler keeps its own rule, fused kernel or not
    assert generate.pick(_OnlyOddIds(), logits[:1], None, None, None, 5, torch.zeros(1)).tolist() == [3]
    assert generate.pick(_OnlyOddIds(), logits[:1], None, None, beyond, 3, torch.zeros(1)).tolist() == [1]
    # finished rows take token 0, written where asked
    out = torch.full((2,), -1)
    tokens = generate.pick(SAMPLERS.build("greedy"), logits, None, None, beyond, 3, peaks, torch.tensor([True, False]),
                           out)
    assert tokens.data_ptr() == out.data_ptr() and out.tolist() == [0, 0]
    out = torch.full((2,), -1)
    generate.pick(_OnlyOddIds(), logits, None, None, None, 5, peaks, torch.tensor([False, True]), out)
    assert out.tolist() == [3, 0]
