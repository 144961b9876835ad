"""The serving engine against the inference engine: greedy outputs of mixed-length prompts equal
one-by-one generation under both schedulers, under preemption, with a shared prefix, and for n > 1
samples forked from one prompt (copy-on-write); chunked prefill keeps decodes going; seeds repeat;
stops; cancellation frees blocks; bad requests fail before they are queued. Log-probabilities of sampled
and prompt tokens equal a full forward's, through chunked prefill, the prefix cache, preemption and forks."""

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.nn import ModelConfig, Transformer
from lmlab.serving import SamplingParams, ServingConfig, ServingEngine
from lmlab.serving.engine import RequestError
from lmlab.tokenizers import ByteTokenizer

VOCAB = 259
NEW = 10


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=96, norm="rmsnorm", ffn="swiglu", position="rope",
                      block="prenorm", attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2})
    return Transformer(cfg, vocab_size=VOCAB).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1, 16, 24)]


def one_by_one(model, prompts, new=NEW) -> list[list[int]]:
    return [Engine(model).generate([p], max_new_tokens=new).tokens[0] for p in prompts]


def serve(model, prompts, params=None, tokenizer=None, **cfg) -> tuple[list[list[int]], ServingEngine]:
    engine = ServingEngine(model, tokenizer, ServingConfig(**{"block_size": 4, **cfg}))
    out = engine.generate(prompts, params or SamplingParams(max_tokens=NEW))
    return [c[0].token_ids for c in out], engine


def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of one full forward over `ids`: row p is the distribution of the token at p + 1."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


def assert_logprobs_match(reference: torch.Tensor, ids: list[int], positions: range, entries, top: int) -> None:
    """entries[i] is the token at positions[i] of `ids`, with its logprob and `top` most likely under the reference
    row before it."""
    assert len(entries) == len(positions)
    for position, entry in zip(positions, entries):
        row = reference[position - 1]
        assert entry.token == ids[position]
        assert entry.logprob == pytest.approx(row[ids[position]].item(), abs=1e-4)
        values, order = row.topk(top)
        assert [t for t, _ in entry.top] == order.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_greedy_outputs_equal_one_by_one_generation(model, prompts, scheduler):
    got, engine = serve(model, prompts, scheduler={"name": scheduler, "max_num_seqs": 4, "max_num_batched_tokens": 12})
    assert got == one_by_one(model, prompts)
    assert engine.blocks.num_used() == 0 and engine.stats()["running"] == 0


def test_preemption_under_block_pressure_gives_the_same_outputs(model, prompts):
    got, engine = serve(model, prompts, num_blocks=13, scheduler={"name": "continuous", "max_num_batched_tokens": 16})
    assert engine.scheduler.preemptions > 0
    assert got == one_by_one(model, prompts)
    assert engine.blocks.num_used() == 0


def test_a_shared_prefix_is_computed_once_and_changes_nothing(model, prompts):
    system = list(range(40, 72))  # 8 full blocks
    shared = [system + p for p in prompts[:4]]
    cached, with_cache = serve(model, shared, scheduler={"name": "continuous", "max_num_seqs": 1})
    plain, _ = serve(model, shared, prefix_caching=False, scheduler={"name": "continuous", "max_num_seqs": 1})
    assert cached == plain == one_by_one(model, shared)
    assert with_cache.blocks.hits == 3 * 8  # every later request found the system prompt's blocks


def test_n_samples_fork_one_prompt_and_copy_the_block_they_share(model, prompts):
    prompt = prompts[1]  # 17 tokens: its last block holds one token, shared by the forks
    engine = ServingEngine(model, None, ServingConfig(block_size=4))
    (completions,) = engine.generate([prompt], SamplingParams(max_tokens=NEW, n=3))
    assert [c.index for c in completions] == [0, 1, 2]
    assert all(c.token_ids == one_by_one(model, [prompt])[0] for c in completions)  # greedy: all the same
    assert engine.totals["prompt_tokens"] == len(prompt) and engine.blocks.copies == 2
    assert engine.blocks.num_used() == 0


def test_chunked_prefill_keeps_decodes_running(model, prompts):
    engine = ServingEngine(model, None, ServingConfig(block_size=4, scheduler={"name": "continuous",
                                                                                "max_num_batched_tokens": 8}))
    engine.add_request(prompts[0], SamplingParams(max_tokens=NEW))
    engine.step()  # its prompt is read and its first token sampled
    engine.add_request(prompts[3], SamplingParams(max_tokens=NEW))  # 30 tokens: four chunks
    plans, schedule = [], engine.scheduler.schedule

    def recorded():
        plan = schedule()
        plans.append(([w.count for w in plan.decodes], [w.count for w in plan.prefills]))
        return plan

    engine.scheduler.schedule = recorded
    for _ in range(3):
        engine.step()
    assert plans == [([1], [7]), ([1], [7]), ([1], [7])]  # a decode every step, the prompt in chunks beside it


def test_seeded_sampling_repeats_and_different_seeds_differ(model, prompts):
    def sample(seed):
        params = SamplingParams(max_tokens=NEW, sampler={"name": "temperature", "temperature": 1.5, "seed": seed})
        return serve(model, prompts[:3], params)[0]

    assert sample(0) == sample(0) and sample(0) != sample(1)


class Letters:
    """A tokenizer whose every id is one letter, so any generated text can serve as a stop string."""

    vocab_size = VOCAB

    def decode(self, ids):
        return "".join("abcdefghijklmnopqrstuvwxyz"[i % 26] for i in ids)


def test_stop_strings_stop_tokens_and_length(model, prompts):
    letters = Letters()

    def run(**kw):
        engine = ServingEngine(model, letters, ServingConfig(block_size=4))
        return engine.generate([prompts[2]], SamplingParams(max_tokens=12, **kw))[0][0]

    free = run()
    assert free.finish_reason == "length" and len(free.token_ids) == 12 and free.text == letters.decode(free.token_ids)
    stop = free.text[4:6]
    cut = free.text.find(stop)
    by_string = run(stop=[stop])
    assert (by_string.finish_reason, by_string.text) == ("stop", free.text[:cut])
    assert by_string.token_ids == free.token_ids[:cut + 2]  # the tokens that complete the stop string stay
    assert run(stop=[stop], include_stop_str_in_output=True).text == free.text[:cut + 2]
    by_token = run(stop_token_ids=[free.token_ids[2]])
    first = free.token_ids.index(free.token_ids[2])
    assert by_token.finish_reason == "stop" and by_token.token_ids == free.token_ids[:first]  # the stop token is left out


def test_aborting_frees_blocks_at_once(model, prompts):
    engine = ServingEngine(model, None, ServingConfig(block_size=4))
    running = engine.add_request(prompts[3], SamplingParams(max_tokens=NEW))
    engine.add_request(prompts[1], SamplingParams(max_tokens=NEW))
    engine.step()
    assert engine.blocks.num_used() > 0
    queued = engine.add_request(prompts[0], SamplingParams(max_tokens=NEW))
    for request in (running, queued):
        engine.abort(request.id)
    engine.abort("no-such-request")  # a second cancel, or a finished request: nothing to do
    while engine.has_work():
        engine.step()
    assert engine.blocks.num_used() == 0 and not engine.requests


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "prompt is empty"),
    ([1, 2], SamplingParams(max_tokens=-1), "max_tokens must be >= 0"),
    ([1] * 96, SamplingParams(), "the model's context is 96"),
    ([1, 2], SamplingParams(n=0), "n must be >= 1"),
    ([1, 2], SamplingParams(sampler={"name": "top_p", "p": 1.5}), r"sampler.p=1.5 must be in \(0, 1\]"),
    ([1, 2], SamplingParams(sampler="beam"), "unknown sampler"),
    ([1, 2], SamplingParams(stop=["x"]), "stop strings need the tokenizer"),
    ([1, 2], SamplingParams(logprobs=-1), r"logprobs must be in 0\.\.320 \(the vocabulary\), got -1"),
    ([1, 2], SamplingParams(prompt_logprobs=321), r"prompt_logprobs must be in 0\.\.320"),
    ([1, 2], SamplingParams(sampler={"name": "greedy", "logit_bias": {320: 1.0}}),
     r"logit_bias holds token id 320, outside the vocabulary \(0\.\.319\)"),
    ([1, 2], SamplingParams(sampler={"name": "greedy", "logit_bias": {-1: 1.0}}), "holds a key that is not a token id"),
])
def test_bad_requests_fail_before_they_are_queued(model, prompt, params, message):
    engine = ServingEngine(model, None, ServingConfig(block_size=4))
    with pytest.raises(ConfigError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_work()


def test_a_padded_vocabularys_extra_ids_are_refused_naming_the_field():
    """The model's vocabulary padded past the tokenizer's: its extra ids have no text, and no sampler picks them."""
    tokenizer = ByteTokenizer()
    torch.manual_seed(0)
    padded = Transformer(ModelConfig(d_model=16, n_layers=1, max_seq_len=32, norm="rmsnorm", ffn="swiglu",
                                     position="rope", block="prenorm", attention={"name": "mha", "n_heads": 2}),
                         vocab_size=tokenizer.vocab_size + 64).eval()
    engine = ServingEngine(padded, tokenizer, ServingConfig(block_size=4))
    last = tokenizer.vocab_size - 1
    engine.check([1, last], SamplingParams(sampler={"name": "greedy", "logit_bias": {last: 1.0}}))
    for params, prompt, field in ((SamplingParams(), [1, last + 1], "prompt"),
                                  (SamplingParams(sampler={"name": "greedy", "logit_bias": {last + 1: 1.0}}), [1],
                                   "logit_bias")):
        with pytest.raises(RequestError, match=rf"token id {last + 1}, outside the vocabulary \(0\.\.{last}\)") as err:
            engine.check(prompt, params)
        assert err.value.param == field


def test_a_pool_too_small_for_one_sequence_is_refused(model):
    engine = ServingEngine(model, None, ServingConfig(block_size=4, num_blocks=4))
    with pytest.raises(ConfigError, match="needs 5 KV blocks and the pool has 3"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=10))


def test_unknown_scheduler_is_one_clear_error(model):
    with pytest.raises(ConfigError, match="unknown scheduler"):
        ServingEngine(model, None, ServingConfig(scheduler="round_robin"))


def test_prompts_admitted_together_compute_their_shared_prefix_once(model, prompts):
    system = list(range(40, 72))  # 8 full blocks, shared by four requests that arrive together
    shared = [system + p for p in prompts[:4]]
    got, engine = serve(model, shared)
    assert got == one_by_one(model, shared)
    assert engine.blocks.hits == 3 * 8 and not engine.blocks.pending


@pytest.mark.parametrize("cfg", [
    {"scheduler": {"name": "continuous", "max_num_batched_tokens": 8}},  # prompts read in chunks
    {"num_blocks": 13, "scheduler": {"name": "continuous", "max_num_batched_tokens": 16}},  # preemptions
])
def test_logprobs_of_sampled_and_prompt_tokens_equal_a_full_forward(model, prompts, cfg):
    engine = ServingEngine(model, None, ServingConfig(block_size=4, **cfg))
    engine.generate(prompts, SamplingParams(max_tokens=NEW))  # their blocks are now in the prefix cache
    # temperature 2 and a bias: the logprobs are the model's own, before any processor
    params = SamplingParams(max_tokens=NEW, logprobs=3, prompt_logprobs=2,
                            sampler={"name": "temperature", "temperature": 2.0, "seed": 0, "logit_bias": {7: 5.0}})
    outs = [c[0] for c in engine.generate(prompts, params)]
    assert "num_blocks" not in cfg or engine.scheduler.preemptions > 0
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.token_ids
        reference = model_logprobs(model, ids)
        assert out.prompt_logprobs[0] is None  # the first token has no context to be predicted from
        assert_logprobs_match(reference, ids, range(1, len(prompt)), out.prompt_logprobs[1:], top=2)
        assert_logprobs_match(reference, ids, range(len(prompt), len(ids)), out.logprobs, top=3)
    assert engine.blocks.num_used() == 0


def test_logprobs_leave_greedy_tokens_unchanged_and_cost_nothing_unasked(model, prompts):
    engine = ServingEngine(model, None, ServingConfig(block_size=4))
    asked = engine.generate(prompts, SamplingParams(max_tokens=NEW, logprobs=1, prompt_logprobs=0))
    assert [c[0].token_ids for c in asked] == one_by_one(model, prompts)
    every, forward_every = [], engine.runner.forward_every

    def recorded(rows, rows_read_whole):
        every.extend(rows_read_whole)
        return forward_every(rows, rows_read_whole)

    engine.runner.forward_every = recorded
    plain = engine.generate(prompts, SamplingParams(max_tokens=NEW))
    assert [c[0].token_ids for c in plain] == one_by_one(model, prompts)
    assert not every  # no logits past each row's last token
    assert all(c[0].logprobs == [] and c[0].prompt_logprobs is None for c in plain)


def test_max_tokens_0_reads_the_prompt_and_samples_nothing(model, prompts):
    engine = ServingEngine(model, None, ServingConfig(block_size=4))
    first, second = engine.generate([prompts[3]], SamplingParams(max_tokens=0, n=2, prompt_logprobs=1))[0]
    assert first.token_ids == second.token_ids == [] and first.finish_reason == second.finish_reason == "length"
    assert_logprobs_match(model_logprobs(model, prompts[3]), prompts[3], range(1, len(prompts[3])),
                          first.prompt_logprobs[1:], top=1)
    assert second.prompt_logprobs == first.prompt_logprobs
    whole = [1] * 96  # a prompt that is only read may fill the context
    assert len(engine.generate([whole], SamplingParams(max_tokens=0, prompt_logprobs=0))[0][0].prompt_logprobs) == 96
    assert engine.blocks.num_used() == 0 and not engine.has_work()


def test_n_samples_get_the_logprobs_of_their_own_tokens(model, prompts):
    engine = ServingEngine(model, None, ServingConfig(block_size=4))
    params = SamplingParams(max_tokens=NEW, n=3, logprobs=0, sampler={"name": "temperature", "seed": 1})
    outs = engine.generate([prompts[1]], params)[0]
    assert len({tuple(c.token_ids) for c in outs}) > 1  # the forks sampled differently
    for out in outs:
        ids = prompts[1] + out.token_ids
        assert_logprobs_match(model_logprobs(model, ids), ids, range(len(prompts[1]), len(ids)), out.logprobs, top=0)
