"""Cached generation computes what a full forward pass computes, for every entry of the attention,
position, block and router registries (a new entry is tested without editing this file), for the
attention variants (GQA, MQA, sliding windows, local/global, QK-norm, soft-capping, MLA's query
latent), for hybrid patterns, cross-layer K/V sharing and looped depth, and for MTP models: prefill in chunks, then one token at a time, logits equal in fp32."""

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.nn import ATTENTION, BLOCKS, POSITIONS, ROUTERS, ModelConfig, Transformer
from lmlab.nn.mtp import MTPConfig

SEQ = 12
VOCAB = 96


def _model(**kw) -> Transformer:
    parts = dict(d_model=32, n_layers=3, max_seq_len=32, norm="rmsnorm", ffn="swiglu", position="rope",
                 attention={"name": "mha", "n_heads": 4}, block="prenorm")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**parts, **kw}), vocab_size=VOCAB)
    with torch.no_grad():  # norm gains away from one, so a norm applied in the wrong place shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _assert_cached_equals_full(model: Transformer, chunks=(5, 3)) -> None:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
    engine = Engine(model)
    engine.begin(2, SEQ)
    got, at = [], 0
    for size in chunks:
        got.append(engine.extend(ids[:, at:at + size], all_logits=True))
        at += size
    for t in range(at, SEQ):
        got.append(engine.decode(ids[:, t]).clone()[:, None])
    torch.testing.assert_close(torch.cat(got, dim=1), full, atol=1e-5, rtol=1e-5)


ATTENTION_VARIANTS = {
    **{name: {"name": name} for name in ATTENTION.names()},
    "gqa": {"name": "mha", "n_heads": 4, "n_kv_heads": 2},
    "mqa": {"name": "mha", "n_heads": 4, "n_kv_heads": 1},
    "sliding_window": {"name": "mha", "n_heads": 4, "window": 4},
    "local_global": {"name": "mha", "n_heads": 4, "window": 3, "global_every": 2},
    "qk_norm": {"name": "mha", "n_heads": 4, "qk_norm": True},
    "softcap": {"name": "mha", "n_heads": 4, "softcap": 5.0},
    "mla_query_latent": {"name": "mla", "n_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8},
}


@pytest.mark.parametrize("variant", sorted(ATTENTION_VARIANTS))
def test_every_attention_caches_exactly(variant):
    _assert_cached_equals_full(_model(attention=ATTENTION_VARIANTS[variant]))


@pytest.mark.parametrize("position", POSITIONS.names())
@pytest.mark.parametrize("attention", ["mha", "mla", "sliding_window"])
def test_every_position_scheme_caches_exactly(position, attention):
    if position == "rope":
        position = {"name": "rope", "layout": "interleaved"}  # the default layout runs in every other test
    _assert_cached_equals_full(_model(position=position, attention=ATTENTION_VARIANTS[attention]))


@pytest.mark.parametrize("block", BLOCKS.names())
def test_every_block_layout_caches_exactly(block):
    _assert_cached_equals_full(_model(block=block))


def _router_is_causal(name: str) -> bool:
    return getattr(ROUTERS.get(name).target, "causal", True)


@pytest.mark.parametrize("router", [n for n in ROUTERS.names() if _router_is_causal(n)])
def test_every_causal_router_caches_exactly(router):
    _assert_cached_equals_full(_model(moe={"name": router, "n_experts": 4, "k": 2, "n_shared_experts": 1}))


@pytest.mark.parametrize("router", [n for n in ROUTERS.names() if not _router_is_causal(n)])
def test_non_causal_router_is_refused(router):
    with pytest.raises(ConfigError, match="cannot generate"):
        Engine(_model(moe={"name": router, "n_experts": 4, "k": 2}))


STACK_VARIANTS = {
    "cla": dict(kv_share=3),  # layers 1 and 2 read layer 0's keys and values
    "cla_sliding_window": dict(kv_share=3, attention=ATTENTION_VARIANTS["sliding_window"]),
    "looped": dict(loops=2, loop_inject=True),
    "hybrid_of_every_entry": dict(layer_pattern=ATTENTION.names(), n_layers=len(ATTENTION.names()),
                                  mixers={"mla": {"qk_rope_head_dim": 8}}),  # RoPE sized for mha's head_dim
}


@pytest.mark.parametrize("variant", sorted(STACK_VARIANTS))
def test_every_stack_variant_caches_exactly(variant):
    _assert_cached_equals_full(_model(**STACK_VARIANTS[variant]))


def test_mtp_model_decodes_with_its_main_head():
    _assert_cached_equals_full(_model(mtp=MTPConfig(depth=2)))


def test_cache_holds_kv_heads_and_window_only():
    model = _model(attention={"name": "mha", "n_heads": 4, "n_kv_heads": 1, "window": 4})
    engine = Engine(model)
    engine.begin(1, 500)
    # one K and one V head of 8 dims, a ring of 4 slots, float32: 2 * 8 * 4 * 4 bytes per layer
    assert engine.kv_cache_bytes() == 3 * 2 * 8 * 4 * 4
