"""The decode megakernel (every layer of a plain Llama stack in one persistent launch) computes what the
engine's layer-by-layer step computes: on CUDA, in fp32 and bf16, persistent and launched stage by stage,
under CUDA graphs and torch.compile, for MHA/GQA/MQA, both RoPE layouts, left padding and batches up to
the kernel's limit. On any machine: models it cannot run are named before any work, and its stacked
weights stay views of the model's parameters. Under Triton's CPU interpreter (TRITON_INTERPRET=1), both matmul paths
stage by stage, with several work items per program."""

import importlib.util
import os

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.inference.megakernel import Megakernel
from lmlab.inference.quant import quantize
from lmlab.nn import Transformer
from tests.inference.test_cache_parity import VOCAB
from tests.inference.test_cache_parity import _model as parity_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model(device="cpu", dtype=torch.float32, **kw) -> Transformer:
    """The cache-parity tests' model (norm gains away from one), wider and with GQA unless `kw` says otherwise."""
    parts = dict(d_model=128, max_seq_len=256, attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2})
    return parity_model(**{**parts, **kw}).to(device, dtype)


@pytest.mark.parametrize("kw, reason", [
    (dict(attention={"name": "mha", "n_heads": 4, "window": 8}), "sliding window"),
    (dict(attention={"name": "mha", "n_heads": 4, "qk_norm": True}), "QK-norm"),
    (dict(attention={"name": "mha", "n_heads": 4, "softcap": 5.0}), "soft-capped"),
    (dict(attention={"name": "mla", "n_heads": 4}), "attention other than"),
    (dict(ffn="gelu"), "FFN other than swiglu"),
    (dict(norm="layernorm"), "norms other than rmsnorm"),
    (dict(block="postnorm"), "block layout"),
    (dict(position="alibi"), "position"),
    (dict(loops=2), "looped depth"),
    (dict(d_model=64, attention={"name": "mha", "n_heads": 4}), "head_dim 16 (the kernel takes 32, 64, 128)"),
])
def test_names_what_it_cannot_run(kw, reason):
    assert reason in Megakernel.unsupported(_model(**kw))


def test_a_plain_llama_stack_is_supported():
    assert Megakernel.unsupported(_model()) is None


INT4 = {"name": "int4", "group_size": 32, "method": "rtn", "kernel": "dequant"}  # the layout the kernel reads


def test_int8_and_int4_projections_are_supported_and_other_layouts_or_mixed_ones_named():
    for quant in ("int8", INT4):
        model = _model()
        quantize(model, quant)
        assert Megakernel.unsupported(model) is None
    model.layers[1].mlp.up_proj.kernel = "int4pack_mm"  # as CUDA's tinygemm packs it
    assert "packed for another kernel than dequant" in Megakernel.unsupported(model)
    mixed = _model()
    quantize(mixed, "int8")
    mixed.layers[1].mlp.down_proj = torch.nn.Linear(mixed.layers[1].mlp.down_proj.in_features, 128, bias=False)
    assert "Int8Linear and Linear" in Megakernel.unsupported(mixed)


def test_refused_without_cuda_before_any_work():
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the refusal is for machines without CUDA (Triton's interpreter stands in for it)")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        Engine(_model(), megakernel=True)


def test_stacked_weights_are_views_of_the_parameters():
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    kernel = Megakernel(model)
    assert kernel.current()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)
    with torch.no_grad():  # an in-place update of a parameter is what the kernel reads
        model.layers[1].mlp.down_proj.weight.add_(1.0)
    assert kernel.weights.down[1].eq(model.layers[1].mlp.down_proj.weight).all()
    model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(model.layers[0].self_attn.o_proj.weight.clone())
    assert not kernel.current()
    kernel.refresh()
    assert kernel.current()


def test_int4_stack_runs_at_batch_1_with_its_groups():
    model = _model()
    quantize(model, INT4)
    kernel = Megakernel(model)
    weights, layer = kernel.weights, model.layers[0]
    assert kernel.max_batch == 1 and weights.group_size == 32 and weights.head_dim == 32
    assert weights.qkv.dtype == torch.uint8 and weights.qkv.shape[2] == 128 // 2
    d_ff = layer.mlp.down_proj.in_features
    rows_times_groups = weights.qkv.shape[1] * 128 // 32 + 128 * 128 // 32 + 2 * d_ff * 128 // 32 + 128 * d_ff // 32
    assert weights.scales.shape == (len(model.layers), 2 * rows_times_groups)
    with torch.no_grad():  # down's scales and zeros close each layer's block: Int4Linear's own tensor
        layer.mlp.down_proj.scales_and_zeros.mul_(3.0)
    torch.testing.assert_close(weights.scales[0, -2 * 128 * d_ff // 32:],
                               layer.mlp.down_proj.scales_and_zeros.reshape(-1), rtol=0, atol=0)
    assert kernel.current()


def test_int8_codes_and_scales_are_stacked_as_views():
    model = _model()
    quantize(model, "int8")
    kernel = Megakernel(model)
    weights = kernel.weights
    layer = model.layers[1]
    assert weights.qkv.dtype == torch.int8 and weights.dtype == torch.float32
    d_model, d_ff = 128, layer.mlp.down_proj.in_features
    assert weights.scales.shape == (len(model.layers), weights.qkv.shape[1] + 2 * d_model + 2 * d_ff)
    with torch.no_grad():  # what the kernel reads is the modules' codes and scales
        layer.mlp.down_proj.scales.mul_(2.0)
        layer.self_attn.k_proj.weight.neg_()
    torch.testing.assert_close(weights.scales[1, -d_model:], layer.mlp.down_proj.scales, rtol=0, atol=0)
    q_rows = layer.self_attn.q_proj.out_features
    k_rows = layer.self_attn.k_proj.out_features
    assert weights.qkv[1, q_rows:q_rows + k_rows].eq(layer.self_attn.k_proj.weight).all()
    assert kernel.current()


def _decode_both(model, batch, persistent=True, compile=False, steps=6):
    """Logits of the layer-by-layer engine and of the megakernel engine over a prefill and `steps` decode steps."""
    reference = Engine(model, cuda_graphs=False)
    fused = Engine(model, compile=compile, cuda_graphs=True, megakernel=True)
    fused.megakernel.persistent = persistent
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, 5, (batch,), generator=g).cuda()
    prompt = torch.randint(0, VOCAB, (batch, 9), generator=g).cuda()
    got = []
    for engine in (reference, fused):
        engine.begin(batch, 9 + steps, start)
        logits = [engine.extend(prompt)]
        for t in range(steps):
            logits.append(engine.decode(torch.full((batch,), 3 * t + 1, device="cuda")).clone())
        got.append(torch.stack(logits, 1))
    return got


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("attention, layout, batch, quant", [
    ({"name": "mha", "n_heads": 4}, "half", 1, None),
    ({"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "interleaved", 3, None),
    ({"name": "mha", "n_heads": 4, "n_kv_heads": 1}, "half", 17, None),  # MQA, a batch past one 16-row tile
    ({"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "half", 1, "int8"),  # int8 codes on both paths
    ({"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "interleaved", 3, "int8"),
    ({"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "half", 1, INT4),
])
def test_matches_the_layer_by_layer_step_fp32(attention, layout, batch, quant, persistent):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model("cuda", attention=attention, position={"name": "rope", "layout": layout})
    if quant:
        quantize(model, quant)
    reference, fused = _decode_both(model, batch, persistent)
    torch.testing.assert_close(fused, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("batch, quant", [(1, None), (4, None), (1, "int8"), (4, "int8"), (1, INT4)])
def test_bf16_generation_follows_the_layer_by_layer_step(compile, batch, quant):
    """Batch 1 takes the matrix-vector path, 4 the tensor-core tiles; quantized, the same model (codes converted by
    PTX byte moves on the GPU) in both engines."""
    model = _model("cuda", torch.bfloat16, d_model=256, n_layers=4, attention={"name": "mha", "n_heads": 4})
    if quant:
        quantize(model, quant)
    reference, fused = _decode_both(model, batch, compile=compile, steps=16)
    # bf16 rounds differently (the kernel keeps the residual stream in float32): compare in scale
    scale = reference.abs().max()
    assert (fused - reference).abs().max() <= 0.03 * scale
    assert (fused.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


@pytest.mark.gpu
@needs_cuda
def test_generate_with_the_megakernel_equals_generate_without_it_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model("cuda")
    prompts = [[5, 9, 2, 40, 41], [7, 1, 3, 3, 8, 20, 11, 60, 2], [4]]
    plain = Engine(model).generate(prompts, max_new_tokens=40).tokens
    assert Engine(model, cuda_graphs=True, megakernel=True).generate(prompts, max_new_tokens=40).tokens == plain


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                    reason="runs under Triton's CPU interpreter (TRITON_INTERPRET=1 with Triton installed)")
@pytest.mark.parametrize("batch, attention, layout, o_proj_on_counters, quant", [
    (1, {"name": "mha", "n_heads": 4}, "half", True, None),  # the matrix-vector path
    (1, {"name": "mha", "n_heads": 4}, "half", False, None),
    (1, {"name": "mha", "n_heads": 4, "n_kv_heads": 1}, "interleaved", True, None),
    (2, {"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "half", False, None),  # the tensor-core path
    (1, {"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "half", True, "int8"),  # int8 weights on both paths
    (1, {"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "half", False, "int8"),
    (2, {"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "interleaved", False, "int8"),
    (1, {"name": "mha", "n_heads": 4, "n_kv_heads": 2}, "interleaved", True, INT4),  # int4: batch 1
])
def test_matches_the_layer_by_layer_step_under_the_interpreter(batch, attention, layout, o_proj_on_counters, quant,
                                                               monkeypatch):
    """Stage by stage (the interpreter runs programs in turn), with 3 programs and small tiles, so a program takes
    several work items and prefetches across them; at batch 1 with o_proj's items on counters or after a barrier;
    with int8 and int4 weights against the layer-by-layer step of the same quantized model."""
    from lmlab.kernels import decode_layers as dl

    monkeypatch.setattr(dl, "sm_count", lambda device: 3)
    monkeypatch.setattr(dl, "GEMV_TILE_ELEMS", 256)
    monkeypatch.setattr(dl, "GEMV_GATE_UP_TILE_ELEMS", 256)
    monkeypatch.setattr(dl, "GEMV_QUANT_GATE_UP_TILE_ELEMS", 512)
    monkeypatch.setattr(dl, "GEMV_O_PROJ_ON_COUNTERS", o_proj_on_counters)
    model = _model(n_layers=2, attention=attention, position={"name": "rope", "layout": layout})  # head_dim 32
    if quant:
        quantize(model, quant)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (batch, 6), generator=g)
    start = torch.tensor([0, 3][:batch])
    got = []
    for megakernel in (False, True):
        engine = Engine(model, megakernel=megakernel)
        if megakernel:  # the stack it reads: codes and their scales, or the weights themselves
            assert (engine.megakernel.weights.scales is not None) == (quant is not None)
        engine.begin(batch, 10, start)
        logits = [engine.extend(prompt)]
        for t in range(4):
            logits.append(engine.decode(torch.full((batch,), 2 * t + 1)).clone())
        got.append(torch.stack(logits, 1))
    torch.testing.assert_close(got[1], got[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2, 3, 16])
def test_o_proj_sums_start_16_byte_aligned(kv_heads):
    """Triton loads the sums 16 bytes at a time only from a 16-byte aligned pointer: unaligned, the layer stack took
    9% longer (experiments/inference/h200-2026-12-04f/)."""
    pytest.importorskip("triton")
    from lmlab.kernels.decode_layers import plan_on_meta
    from lmlab.kernels.decode_layers_triton import layers_kernel

    layers, d_model = 2, 256
    plan = plan_on_meta(1, layers, d_model, 16, kv_heads, 16, 512, 64, torch.bfloat16)
    o_acc = dict(zip(layers_kernel.arg_names, plan.args))["OAcc"]
    assert plan.meta["SPLIT_O"] and o_acc.dtype == torch.float32 and o_acc.numel() == layers * d_model
    assert o_acc.storage_offset() * o_acc.element_size() % 16 == 0
