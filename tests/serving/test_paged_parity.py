"""Paged caches compute what a full forward pass computes: sequences of different lengths in one batch,
prompts read in chunks, then one token at a time, over blocks scattered through the pool, for every
attention entry that has a paged cache (the others are refused with a clear error), every position
scheme, block layout and causal router; logits equal in fp32."""

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.nn import BLOCKS, POSITIONS, ROUTERS
from lmlab.serving.blocks import BlockTable
from lmlab.serving.paged_cache import PAGED_CACHE_FACTORIES
from lmlab.serving.runner import PagedRunner, Row
from tests.inference.test_cache_parity import ATTENTION_VARIANTS, VOCAB, _model, _router_is_causal

BLOCK = 4
LENGTHS = (13, 7)  # two sequences of different lengths in each forward
CHUNKS = {13: (6, 4), 7: (3, 2)}  # prompt chunks, then one token at a time


def _assert_paged_equals_full(model, **runner_kw) -> None:
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
    pool = 2 * sum(-(-n // BLOCK) for n in LENGTHS) + 1
    order = torch.randperm(pool - 1, generator=g).add(1).tolist()  # scattered, never the null block
    tables = [BlockTable(order[:4]), BlockTable(order[4:6])]
    runner = PagedRunner(model, pool, BLOCK, **runner_kw)
    done = [0, 0]
    steps = [list(CHUNKS[n]) + [1] * (n - sum(CHUNKS[n])) for n in LENGTHS]
    for step in range(max(map(len, steps))):
        rows, which = [], []
        for i, seq in enumerate(seqs):
            if step < len(steps[i]):
                count = steps[i][step]
                rows.append(Row(seq[done[i]:done[i] + count].tolist(), done[i], tables[i]))
                which.append(i)
        logits = runner.forward(rows)
        for row, i in zip(logits, which):
            done[i] += steps[i][step]
            torch.testing.assert_close(row, full[i][done[i] - 1], atol=1e-5, rtol=1e-5)


def _has_paged_cache(variant: str) -> bool:
    attn = _model(attention=ATTENTION_VARIANTS[variant]).layers[0].self_attn
    return any(isinstance(attn, cls) for cls in PAGED_CACHE_FACTORIES)


PAGED = [v for v in sorted(ATTENTION_VARIANTS) if _has_paged_cache(v)]


@pytest.mark.parametrize("variant", PAGED)
def test_every_attention_with_a_paged_cache_matches_the_full_forward(variant):
    _assert_paged_equals_full(_model(attention=ATTENTION_VARIANTS[variant]))


@pytest.mark.parametrize("variant", sorted(set(ATTENTION_VARIANTS) - set(PAGED)))
def test_attention_without_a_paged_cache_is_refused(variant):
    with pytest.raises(ConfigError, match="has no paged KV cache"):
        PagedRunner(_model(attention=ATTENTION_VARIANTS[variant]), 8, BLOCK)


def test_standard_attention_variants_have_paged_caches():
    assert {"mha", "gqa", "mqa", "sliding_window", "local_global", "softcap", "qk_norm"} <= set(PAGED)


@pytest.mark.parametrize("position", POSITIONS.names())
def test_every_position_scheme_matches(position):
    _assert_paged_equals_full(_model(position=position, attention=ATTENTION_VARIANTS["sliding_window"]))


@pytest.mark.parametrize("block", BLOCKS.names())
def test_every_block_layout_matches(block):
    _assert_paged_equals_full(_model(block=block))


@pytest.mark.parametrize("router", [n for n in ROUTERS.names() if _router_is_causal(n)])
def test_every_causal_router_matches(router):
    _assert_paged_equals_full(_model(moe={"name": router, "n_experts": 4, "k": 2, "n_shared_experts": 1}))
