"""Decode steps with the RMSNorms folded into the kernels around them (lmlab.inference.folded_norms) compute what the
engine's layer-by-layer step computes: one-token and several-token steps, MHA, GQA and MQA, both RoPE layouts, left
padding; the gains are folded again at each `begin`, so weights changed since are used. Under Triton's CPU
interpreter (TRITON_INTERPRET=1) in float32, and on CUDA in float32 and bf16 with CUDA graphs and torch.compile. On
any machine: models it cannot run, and engines without the attention kernel, are refused before any work. By default
compiled CUDA engines fold the norms of the models that allow it, at batches of 2 or more."""

import importlib.util
import os

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import AUTO_FOLD_MIN_BATCH, Engine
from lmlab.inference.quant import quantize
from tests.inference.test_cache_parity import VOCAB
from tests.inference.test_megakernel import _model

kernels_run = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available()
                                                        or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton on CUDA or under its CPU interpreter (TRITON_INTERPRET=1)")
device = "cuda" if torch.cuda.is_available() else "cpu"


def test_refused_without_the_attention_kernel():
    with pytest.raises(ConfigError, match="decode-attention kernel"):
        Engine(_model(), attention_kernel=False, folded_norms=True)


@kernels_run
def test_refuses_a_model_it_cannot_run():
    with pytest.raises(ConfigError, match="QK-norm"):
        Engine(_model(device, attention={"name": "mha", "n_heads": 4, "qk_norm": True}), attention_kernel=True,
               folded_norms=True)


@kernels_run
def test_refuses_quantized_projections():
    model = _model(device, n_layers=2)
    quantize(model, "int8")
    with pytest.raises(ConfigError, match="layer 0's projections are not plain Linears"):
        Engine(model, attention_kernel=True, folded_norms=True)


@kernels_run
def test_batches_below_min_batch_and_long_steps_take_the_layer_by_layer_step():
    from lmlab.inference.folded_norms import FoldedNorms
    from lmlab.kernels.decode_attention_triton import MAX_QUERY_ROWS
    from lmlab.nn.fused import fuse_projections

    model = _model(device, n_layers=2, attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2})
    fuse_projections(model)
    folded = FoldedNorms(model, min_batch=2)
    assert [folded.takes(batch, 1) for batch in (1, 2, 64)] == [False, True, True]
    assert folded.takes(2, MAX_QUERY_ROWS // 2) and not folded.takes(2, MAX_QUERY_ROWS // 2 + 1)  # 2 q heads a kv head


def test_not_folded_by_default_off_cuda():
    assert Engine(_model("cpu", n_layers=2), compile=True).folded_norms is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_cuda_engines_fold_by_default_where_the_model_allows():
    assert Engine(_model("cuda", torch.bfloat16, n_layers=2)).folded_norms is None  # not compiled
    assert Engine(_model("cuda", torch.bfloat16, n_layers=2), compile=True).folded_norms.min_batch == AUTO_FOLD_MIN_BATCH
    qk_norm = _model("cuda", torch.bfloat16, n_layers=2, attention={"name": "mha", "n_heads": 4, "qk_norm": True})
    assert Engine(qk_norm, compile=True).folded_norms is None
    quantized = _model("cuda", torch.bfloat16, n_layers=2)
    quantize(quantized, "int8")
    assert Engine(quantized, compile=True).folded_norms is None


def _steps(model, folded: bool, batch: int, start: torch.Tensor, lookahead: int = 0, **engine_kw) -> torch.Tensor:
    """Logits of a prefill, then four one-token steps and (with lookahead) a (lookahead + 1)-token step."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (batch, 6), generator=g).to(model.embed_tokens.weight.device)
    engine = Engine(model, attention_kernel=True, folded_norms=folded, **engine_kw)
    engine.begin(batch, 16, start.to(prompt.device), lookahead=lookahead)
    logits = [engine.extend(prompt)]
    for t in range(4):
        logits.append(engine.decode(torch.full((batch,), 2 * t + 1, device=prompt.device)).clone())
    if lookahead:
        tokens = torch.arange(lookahead + 1, device=prompt.device).repeat(batch, 1)
        logits.extend(engine.decode(tokens).clone().unbind(1))
    return torch.stack(logits, 1)


@kernels_run
@pytest.mark.parametrize("attention, layout, batch", [
    ({"name": "mha", "n_heads": 4}, "half", 3),
    ({"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "interleaved", 2),
    ({"name": "mha", "n_heads": 4, "n_kv_heads": 1}, "half", 1),
])
def test_matches_the_layer_by_layer_step_fp32(attention, layout, batch):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(device, n_layers=2, attention=attention, position={"name": "rope", "layout": layout})
    start = torch.tensor([0, 3, 1][:batch])
    want = _steps(model, False, batch, start, lookahead=2)
    torch.testing.assert_close(_steps(model, True, batch, start, lookahead=2), want, atol=1e-5, rtol=1e-5)


@kernels_run
def test_weights_changed_after_the_engine_was_made_are_folded_at_begin():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(device, n_layers=2)
    engine = Engine(model, attention_kernel=True, folded_norms=True)
    with torch.no_grad():
        model.layers[1].post_attention_layernorm.weight.mul_(1.5)
        model.layers[0].self_attn.q_proj.weight.mul_(-1.0)
    engine.begin(2, 16)
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]], device=device)
    engine.extend(ids)
    got = engine.decode(torch.tensor([1, 2], device=device))
    plain = Engine(model, attention_kernel=True)
    plain.begin(2, 16)
    plain.extend(ids)
    torch.testing.assert_close(got, plain.decode(torch.tensor([1, 2], device=device)), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True])
def test_bf16_generation_follows_the_layer_by_layer_step(compile):
    """In bf16 the roundings differ, so the logits are compared loosely and the greedy tokens of a short run."""
    model = _model("cuda", torch.bfloat16, n_layers=2)
    start = torch.tensor([0, 3, 1])
    want = _steps(model, False, 3, start, lookahead=2)
    got = _steps(model, True, 3, start, lookahead=2, compile=compile, cuda_graphs=True)
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
    prompts = [[5, 9, 2, 40, 41], [7, 1, 3, 3, 8, 20, 11, 60, 2], [4]]
    tokens = Engine(model, compile=compile, cuda_graphs=True, folded_norms=True).generate(prompts, max_new_tokens=8)
    assert tokens.tokens == Engine(model, cuda_graphs=True).generate(prompts, max_new_tokens=8).tokens


@kernels_run
def test_attention_norm_rows_of_the_wrong_shape_are_refused():
    from lmlab.kernels.decode_attention_triton import decode_attention

    q, k = torch.zeros(2, 4, 1, 32, device=device), torch.zeros(2, 4, 1, 32, device=device)
    cache = torch.zeros(2, 4, 8, 32, device=device)
    slots, start = torch.tensor([3], device=device), torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=r"norm's rows must be a \(2, 1, width\) tensor"):
        decode_attention(q, cache, cache.clone(), slots, start, new_keys=k, new_values=k.clone(),
                         norm=(torch.zeros(1, 1, 64, device=device), 1e-6))
    with pytest.raises(ValueError, match="without new keys"):
        decode_attention(q, cache, cache.clone(), slots, start, norm=(torch.zeros(2, 1, 64, device=device), 1e-6))
