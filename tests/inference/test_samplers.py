"""The sampler registry: truncation rules, logit bias, penalties and their order, and `sample` drawing from `probs`."""

import math

import pytest
import torch

from lmlab.cli.main import main
from lmlab.errors import ConfigError
from lmlab.inference.generate import plain_greedy
from lmlab.inference.samplers import SAMPLERS

# Fields that make each entry's truncation drop tokens of a 5-token vocabulary; other entries use their defaults.
TRUNCATING = {"top_k": {"top_k": 3}, "top_p": {"p": 0.8}, "min_p": {"min_p": 0.3}}


def build(name: str, **fields):
    return SAMPLERS.build({"name": name, **TRUNCATING.get(name, {}), **fields})


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log().float()


def kept(processed: torch.Tensor) -> list[list[int]]:
    return [row.isfinite().nonzero().flatten().tolist() for row in processed]


def test_top_p_keeps_the_smallest_set_of_most_likely_tokens_whose_mass_reaches_p_per_row():
    logits = logits_of([0.1, 0.4, 0.2, 0.3], [0.3, 0.1, 0.2, 0.4])
    # Ranked 0.4, 0.3, 0.2, 0.1: the mass above each is 0, 0.4, 0.7, 0.9.
    expected = {0.35: [[1], [3]], 0.5: [[1, 3], [0, 3]], 0.75: [[1, 2, 3], [0, 2, 3]], 0.95: [[0, 1, 2, 3]] * 2,
                1.0: [[0, 1, 2, 3]] * 2}
    for p, rows in expected.items():
        assert kept(build("top_p", p=p).process(logits)) == rows, p


def test_top_p_at_the_boundary_keeps_exactly_mass_p_and_always_the_top_token():
    logits = torch.zeros(1, 64)  # 64 tied tokens of probability 1/64, exact in float32
    assert kept(build("top_p", p=0.5).process(logits)) == [list(range(32))]  # mass 0.5 reached; ties keep low ids
    assert kept(build("top_p", p=1 / 64).process(logits)) == [[0]]
    assert kept(build("top_p", p=0.01).process(torch.tensor([[0.0, 9.0, 0.0]]))) == [[1]]


def test_top_p_set_is_the_smallest_on_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(64, 100) * 3
    probs = logits.softmax(-1)
    for p in (0.1, 0.5, 0.9, 0.99):
        keep = build("top_p", p=p).process(logits).isfinite()
        mass = (probs * keep).sum(-1)
        smallest_kept = probs.masked_fill(~keep, 1.0).amin(-1)
        assert (mass >= p - 1e-6).all() and (mass - smallest_kept < p + 1e-6).all()
        assert (probs.masked_fill(keep, 0.0).amax(-1) <= smallest_kept).all()  # the kept tokens are the likeliest


def test_top_k_keeps_the_k_largest_and_ties_with_the_kth():
    assert kept(build("top_k", top_k=2).process(torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]]))) == [[1, 3]]
    assert kept(build("top_k", top_k=1).process(torch.tensor([[3.0, 1.0, 3.0]]))) == [[0, 2]]
    assert kept(build("top_k", top_k=50).process(torch.zeros(1, 5))) == [[0, 1, 2, 3, 4]]


def test_min_p_keeps_tokens_at_least_min_p_times_the_largest_probability():
    logits = logits_of([0.05, 0.5, 0.3, 0.15])
    assert kept(build("min_p", min_p=0.2).process(logits)) == [[1, 2, 3]]  # threshold 0.1
    assert kept(build("min_p", min_p=0.5).process(logits)) == [[1, 2]]  # threshold 0.25
    assert kept(build("min_p", min_p=0.0).process(logits)) == [[0, 1, 2, 3]]
    assert kept(build("min_p", min_p=1.0).process(torch.tensor([[3.0, 1.0, 3.0]]))) == [[0, 2]]  # ties with the top stay


LOGITS = torch.tensor([[2.0, -2.0, 0.5, 1.0]])
COUNTS = torch.tensor([[1, 2, 0, 3]])


@pytest.mark.parametrize("fields, expected", [
    ({"repetition_penalty": 2.0}, [1.0, -4.0, 0.5, 0.5]),  # seen: positive / 2, negative * 2
    ({"frequency_penalty": 0.5}, [1.5, -3.0, 0.5, -0.5]),  # - 0.5 * count
    ({"presence_penalty": 1.0}, [1.0, -3.0, 0.5, 0.0]),  # - 1 if seen
    # repetition, then frequency and presence, then temperature: any other order gives other numbers.
    ({"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 1.0, "temperature": 0.5},
     [-1.0, -12.0, 1.0, -4.0]),
    ({"logit_bias": {1: 3.0, 2: -0.5}}, [2.0, 1.0, 0.0, 1.0]),  # added to the listed tokens' logits
    # the bias comes first: -2 + 3 = 1 is then positive, so the penalty divides it (after it: -2 * 2 + 3 = -1)
    ({"logit_bias": {1: 3.0}, "repetition_penalty": 2.0}, [1.0, 0.5, 0.5, 0.5]),
])
def test_penalties_on_hand_computed_values_and_their_order(fields, expected):
    sampler = SAMPLERS.build({"name": "temperature", **fields})
    assert sampler.needs_counts == any(k.endswith("penalty") for k in fields)
    assert sampler.process(LOGITS, COUNTS).tolist() == [expected]


def test_truncation_comes_after_penalties_and_temperature():
    sampler = SAMPLERS.build({"name": "top_k", "top_k": 2, "repetition_penalty": 2.0, "frequency_penalty": 0.5,
                              "presence_penalty": 1.0, "temperature": 0.5})
    assert sampler.process(LOGITS, COUNTS).tolist() == [[-1.0, -math.inf, 1.0, -math.inf]]


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_a_logit_bias_steers_greedy_decoding_and_turns_off_the_raw_argmax_paths(name):
    plain, biased = build(name, temperature=0.0), build(name, temperature=0.0, logit_bias={2: 100.0})
    assert plain.argmax_of_logits and plain_greedy(plain)  # fused kernels and greedy rounds may take the argmax
    assert not biased.argmax_of_logits and not plain_greedy(biased)  # they would skip the bias
    assert plain.sample(LOGITS).tolist() == [0] and biased.sample(LOGITS).tolist() == [2]
    assert build(name, temperature=0.0, logit_bias={0: -100.0}).sample(LOGITS).tolist() == [3]  # banned
    assert build(name, temperature=0.0, logit_bias={"2": 100.0}).sample(LOGITS).tolist() == [2]  # JSON's, Hydra's keys
    assert not build(name, temperature=0.0, presence_penalty=0.5).argmax_of_logits


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_penalties_need_counts_and_none_are_applied_by_default(name):
    assert not build(name).needs_counts
    with pytest.raises(ValueError, match="pass counts"):
        build(name, presence_penalty=0.5).process(LOGITS)


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_temperature_zero_is_greedy_with_penalties_and_one_hot_probs(name):
    sampler = build(name, temperature=0.0, repetition_penalty=4.0)
    logits = torch.tensor([[2.0, 1.5, 1.5, 0.0], [0.0, 3.0, 3.0, 1.0]])
    counts = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]])
    # Row 0: the penalty lowers token 0 to 0.5, so tokens 1 and 2 tie and the lowest id wins; row 1 ties too.
    assert sampler.greedy
    assert sampler.probs(logits, counts).tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    assert sampler.sample(logits, counts, generator=torch.Generator().manual_seed(0)).tolist() == [1, 1]


def test_greedy_ignores_temperature():
    sampler = SAMPLERS.build({"name": "greedy", "temperature": 5.0})
    assert sampler.probs(torch.tensor([[0.0, 0.1, -1.0]])).tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_sample_draws_from_probs(name):
    sampler = build(name, temperature=0.8, repetition_penalty=1.3, presence_penalty=0.2)
    draws = 20_000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 1.5]]).expand(draws, -1)
    counts = torch.tensor([[0, 1, 0, 2, 1]]).expand(draws, -1)
    probs = sampler.probs(logits[:1], counts[:1])[0]
    tokens = sampler.sample(logits, counts, generator=torch.Generator().manual_seed(0))
    frequencies = torch.bincount(tokens, minlength=5) / draws
    # A frequency's standard deviation is at most 0.0036 here; the seed fixes the draws, so this never flakes.
    assert (frequencies - probs).abs().max() < 0.02
    assert (frequencies[probs == 0] == 0).all()  # a dropped token is never drawn


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_the_seed_makes_sampling_reproducible(name):
    logits = torch.randn(256, 5, generator=torch.Generator().manual_seed(1))

    def tokens(seed: int) -> torch.Tensor:
        sampler = build(name, seed=seed)
        return sampler.sample(logits, generator=sampler.generator("cpu"))

    assert torch.equal(tokens(0), tokens(0))
    assert build(name).greedy or not torch.equal(tokens(0), tokens(1))
    assert build(name).generator("cpu") is None


def test_sampling_reads_bfloat16_logits_in_float32():
    sampler = build("top_p")
    assert sampler.process(torch.zeros(2, 5, dtype=torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("config, message", [
    ({"name": "temperature", "temperature": -0.5}, "sampler.temperature=-0.5 is negative"),
    ({"name": "greedy", "repetition_penalty": 0.0}, "sampler.repetition_penalty=0.0 must be > 0"),
    ({"name": "top_k", "top_k": 0}, "sampler.top_k=0 must be >= 1"),
    ({"name": "top_p", "p": 0.0}, r"sampler.p=0.0 must be in \(0, 1\]"),
    ({"name": "top_p", "p": 1.5, "temperature": 0.0}, r"sampler.p=1.5 must be in \(0, 1\]"),
    ({"name": "min_p", "min_p": -0.1}, r"sampler.min_p=-0.1 must be in \[0, 1\]"),
    ({"name": "min_p", "min_p": 1.1}, r"sampler.min_p=1.1 must be in \[0, 1\]"),
    ({"name": "greedy", "logit_bias": {-1: 5.0}}, r"sampler.logit_bias=\{-1: 5.0\} holds a key that is not a token id"),
    ({"name": "greedy", "logit_bias": {3: math.inf}}, r"sampler.logit_bias=\{3: inf\} holds a bias that is not finite"),
    ({"name": "greedy", "logit_bias": {"x2": 1.0}}, r"sampler.logit_bias=\{'x2': 1.0\} holds a key that is not a token id"),
    ({"name": "greedy", "logit_bias": {True: 1.0}}, "holds a key that is not a token id"),
])
def test_bad_values_fail_at_construction_with_one_line(config, message):
    with pytest.raises(ConfigError, match=message) as err:
        SAMPLERS.build(config)
    assert "\n" not in str(err.value)


def test_lmlab_list_sampler_shows_every_entry(capsys):
    assert main(["list", "sampler"]) == 0
    out = capsys.readouterr().out
    assert set(SAMPLERS.names()) >= {"greedy", "temperature", "top_k", "top_p", "min_p"}
    for name in SAMPLERS.names():
        assert f"\n  {name} " in out


def test_truncation_matches_hugging_face_warpers():
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    torch.manual_seed(0)
    logits = torch.randn(8, 300) * 2
    ids = torch.randint(0, 300, (8, 40))
    counts = torch.zeros(8, 300, dtype=torch.long).scatter_add_(1, ids, torch.ones_like(ids))
    peers = [({"name": "top_k", "top_k": 20}, logits_process.TopKLogitsWarper(20)),
             ({"name": "top_p", "p": 0.7}, logits_process.TopPLogitsWarper(0.7)),
             ({"name": "min_p", "min_p": 0.05}, logits_process.MinPLogitsWarper(0.05)),
             ({"name": "temperature", "repetition_penalty": 1.5},
              logits_process.RepetitionPenaltyLogitsProcessor(1.5))]
    for config, peer in peers:
        assert torch.equal(SAMPLERS.build(config).process(logits, counts), peer(ids, logits.clone())), config
