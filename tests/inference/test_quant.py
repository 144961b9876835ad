"""Weight-only quantization: rounding error bounds, the quantized modules against their dequantized
weights, GPTQ against round-to-nearest, `quantize` on small models, and bad input."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.inference.quant import QUANTS, Int4Linear, Int8Linear, quantize, set_kernels
from lmlab.inference.quant.gptq import collect_hessians, gptq
from lmlab.inference.quant.grid import INT4, INT8, round_to_nearest
from lmlab.nn import ModelConfig, Transformer

VOCAB = 101


def tiny_model(**parts) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_layers=2, max_seq_len=32, vocab_size=VOCAB, norm="rmsnorm",
                      ffn={"name": "swiglu", "d_ff": 96}, position="rope",
                      attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2}, block="prenorm")
    for group, value in parts.items():
        setattr(cfg, group, value)
    return Transformer(cfg, VOCAB).eval()


def token_batches(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, 32), generator=g) for _ in range(n)]


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def correlated_inputs(n: int, k: int, seed: int) -> torch.Tensor:
    """Rows from one fixed low-rank-plus-noise distribution: the structure GPTQ exploits."""
    mixing = torch.randn(16, k, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g) @ mixing + 0.1 * torch.randn(n, k, generator=g)


@pytest.mark.parametrize("grid, group_size", [(INT8, 256), (INT4, 32), (INT4, 64), (INT4, 128)])
def test_round_to_nearest_is_within_half_a_step_per_weight_and_bounded_in_the_output(grid, group_size):
    torch.manual_seed(0)
    w, x = torch.randn(48, 256), torch.randn(8, 256)
    codes, scale, zero = round_to_nearest(w, grid, group_size, None, 0.0)
    assert codes.min() >= grid.qmin and codes.max() <= grid.qmax and torch.equal(codes, codes.round())
    step = scale.repeat_interleave(group_size, dim=1)  # (N, K): each weight's own step
    deq = grid.values(codes.view(48, -1, group_size), scale[..., None], zero[..., None]).view(48, 256)
    assert ((w - deq).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (w - deq).abs().max() > step.min() / 4  # the bound is tight, not vacuous
    bound = x.abs() @ (step / 2).T  # |sum_k x_k (W - deq)_nk| <= sum_k |x_k| step_nk / 2
    assert ((x @ w.T - x @ deq.T).abs() <= bound * (1 + 1e-4)).all()


def test_int8_linear_matches_its_dequantized_weight_with_either_kernel_and_keeps_the_dtype():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    codes, scale, _ = round_to_nearest(linear.weight.detach(), INT8, 64, None, 0.0)
    for kernel in Int8Linear.kernels:
        m = Int8Linear(codes, scale[:, 0], linear.bias, kernel)
        assert torch.equal(m.dequantize(), codes * scale)
        for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
            x = torch.randn(2, 3, 64, dtype=dtype)
            ref = F.linear(x.double(), m.dequantize().double(), linear.bias.double())
            y = m(x)
            assert y.dtype == dtype and y.shape == (2, 3, 48)
            assert rel_error(y, ref) < tol, (kernel, dtype)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_matches_its_dequantized_weight(group_size):
    torch.manual_seed(0)
    w = torch.randn(40, 256)
    codes, scale, zero = round_to_nearest(w, INT4, group_size, None, 0.0)
    m = Int4Linear(codes, scale, zero, group_size, None, "dequant")
    assert m.weight.dtype == torch.uint8 and m.weight.shape == (40, 128)  # two codes a byte
    assert m.scales_and_zeros.shape == (256 // group_size, 40, 2)  # tinygemm's layout
    deq = INT4.values(codes.view(40, -1, group_size), scale[..., None], zero[..., None]).view(40, 256)
    torch.testing.assert_close(m.dequantize(), deq)
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
        x = torch.randn(3, 7, 256, dtype=dtype)
        y = m(x)
        assert y.dtype == dtype and rel_error(y, x.double() @ deq.double().T) < tol


def test_quantized_linears_trace_whole_for_torch_compile():
    torch.manual_seed(0)
    w, x = torch.randn(32, 64), torch.randn(2, 5, 64)
    codes8, scale8, _ = round_to_nearest(w, INT8, 64, None, 0.0)
    codes4, scale4, zero4 = round_to_nearest(w, INT4, 32, None, 0.0)
    for m in [Int8Linear(codes8, scale8[:, 0], None, "dequant"), Int8Linear(codes8, scale8[:, 0], None, "int8pack_mm"),
              Int4Linear(codes4, scale4, zero4, 32, None, "dequant")]:
        torch.testing.assert_close(torch.compile(m, backend="eager", fullgraph=True)(x), m(x))


@pytest.mark.parametrize("grid, group_size", [(INT4, 32), (INT8, 128)])
def test_gptq_lowers_the_layer_output_error_of_round_to_nearest(grid, group_size):
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    calib, held_out = correlated_inputs(2048, 128, seed=1), correlated_inputs(512, 128, seed=2)
    hessian = 2 * calib.T @ calib / len(calib)
    mse = {}
    for name, method in [("rtn", round_to_nearest), ("gptq", gptq)]:
        codes, scale, zero = method(w, grid, group_size, hessian, 0.01)
        deq = grid.values(codes.view(64, -1, group_size), scale[..., None], zero[..., None]).view(64, 128)
        mse[name] = (held_out @ (w - deq).T).square().mean().item()
    assert mse["gptq"] < 0.8 * mse["rtn"], mse


def test_quantize_int8_replaces_every_layer_linear_and_the_head_and_keeps_logits_close():
    model = tiny_model()
    ids = token_batches(1, seed=3)[0]
    with torch.no_grad():
        ref = model(ids)
    embed = model.embed_tokens.weight
    report = quantize(model, "int8")
    names = {n for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    expected = {f"layers.{i}.{p}" for i in range(2) for p in
                ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]} | {"lm_head"}
    assert names == expected
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.embed_tokens.weight is embed and model.embed_tokens.weight.dtype == torch.float32
    assert report["layers"] == 15 and report["kernels"] == {"dequant": 15}  # CPU: the dequantising path
    assert report["bytes_after"] < 0.3 * report["bytes_before"]  # int8 + one fp32 scale per row vs fp32
    with torch.no_grad():
        assert rel_error(model(ids), ref) < 0.02


def test_set_kernels_repacks_the_same_codes_for_another_kernel_without_quantizing_again():
    model = tiny_model()
    quantize(model, {"name": "int8", "method": "rtn"})
    ids = token_batches(1, seed=3)[0]
    with torch.no_grad():
        before = model(ids)
    codes = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert set_kernels(model, "int8pack_mm") == {"int8pack_mm": 15}
    assert all(torch.equal(m.weight, codes[n]) for n, m in model.named_modules() if isinstance(m, Int8Linear))
    assert set_kernels(model) == {"dequant": 15}  # auto on a CPU
    with torch.no_grad():
        assert torch.equal(model(ids), before)


def test_set_kernels_refuses_a_layout_that_does_not_give_its_codes_back(monkeypatch):
    linear = Int4Linear(torch.randint(0, 16, (8, 64)), torch.ones(8, 2), torch.zeros(8, 2), 32, None, "dequant")
    assert linear.set_kernel("dequant", "layers.0.mlp.up_proj") == "dequant"
    monkeypatch.setitem(Int4Linear.kernels, "dequant",  # as tinygemm's packed layout is
                        dataclasses.replace(Int4Linear.kernels["dequant"], unpack=None))
    with pytest.raises(ConfigError, match="layers.0.mlp.up_proj: the dequant kernel's layout does not give its codes"):
        linear.set_kernel("dequant", "layers.0.mlp.up_proj")


def test_quantize_int4_keeps_the_head_and_logits_near_and_gptq_beats_rtn_on_held_out_tokens():
    ids = token_batches(1, seed=3)[0]  # calibration batches come from other seeds
    errors = {}
    for method in ["rtn", "gptq"]:
        model = tiny_model()
        with torch.no_grad():
            ref = model(ids)
        cfg = {"name": "int4", "group_size": 32, "method": method}
        report = quantize(model, cfg, calibration=token_batches(4, seed=4))
        assert isinstance(model.lm_head, nn.Linear) and isinstance(model.layers[1].mlp.down_proj, Int4Linear)
        assert report["layers"] == 14 and report["kernels"] == {"dequant": 14} and report["method"] == method
        assert report["bytes_after"] < 0.2 * report["bytes_before"]
        with torch.no_grad():
            errors[method] = rel_error(model(ids), ref)
    assert errors["rtn"] < 0.1 and errors["gptq"] < errors["rtn"], errors


def test_gptq_calibrates_a_model_an_engine_has_fused_like_a_fresh_one():
    fused, fresh = tiny_model(), tiny_model()
    Engine(fused)  # fuses q/k/v and gate/up; GPTQ's input hooks must still see those Linears
    cfg = {"name": "int4", "group_size": 32, "method": "gptq"}
    for model in (fused, fresh):
        quantize(model, cfg, calibration=token_batches(2, seed=4))
    for (name, a), b in zip(fused.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_gptq_refuses_a_linear_the_calibration_pass_never_called():
    model = tiny_model()
    linears = {"layers.0.mlp.up_proj": model.layers[0].mlp.up_proj, "stray": nn.Linear(64, 8)}
    with pytest.raises(ConfigError, match="1 Linear.*no calibration input, e.g. stray"):
        collect_hessians(model, linears, token_batches(1, seed=0))


def test_moe_gates_mtp_modules_and_routed_experts_stay_in_full_precision():
    from lmlab.nn import MTPConfig

    model = tiny_model(moe={"name": "topk", "n_experts": 4, "k": 2, "n_shared_experts": 1},
                       attention={"name": "mla", "n_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8},
                       mtp=MTPConfig(depth=1))
    ids = token_batches(1, seed=3)[0]
    quantize(model, "int8")
    kept = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    mtp = {n for n, m in model.mtp_layers.named_modules(prefix="mtp_layers") if isinstance(m, nn.Linear)}
    assert kept == {"layers.0.mlp.gate", "layers.1.mlp.gate"} | mtp and "mtp_layers.0.eh_proj" in mtp
    assert isinstance(model.layers[0].self_attn.kv_b_proj, Int8Linear)
    assert isinstance(model.layers[0].mlp.shared_experts.down_proj, Int8Linear)
    with torch.no_grad():
        assert torch.isfinite(model(ids)).all()


@pytest.mark.parametrize("cfg, calibration, match", [
    ("int3", None, "unknown quant .*'int3'.*Did you mean"),
    ({"name": "int4", "group_size": 48}, None, "group_size must be one of 32, 64, 128, got 48"),
    ({"name": "int4", "group_size": 64}, None, r"layers.0.mlp.down_proj has in_features=96, not a multiple of "
                                               r"quant.group_size=64; use quant.group_size=32"),
    ({"name": "int4", "method": "awq", "group_size": 32}, None, "unknown quant.method 'awq'"),
    ({"name": "int8", "kernel": "int4pack_mm"}, None, "unknown quant.kernel 'int4pack_mm'"),
    ({"name": "int4", "kernel": "int4pack_mm", "group_size": 32}, None,
     "quant.kernel=int4pack_mm cannot run layers.0.self_attn.q_proj: it needs CUDA"),
    ({"name": "int4", "group_size": 32}, None, "quant.method=gptq needs calibration batches"),
    ({"name": "int4", "group_size": 32}, [], "got no calibration batches"),
    ({"name": "int4", "group_size": 32}, [torch.randn(2, 8)], r"token ids of shape \(batch, seq\)"),
    ({"name": "int8", "damp": 0.0}, None, "quant.damp must be > 0"),
])
def test_bad_input_fails_with_one_clear_line_and_leaves_the_model_alone(cfg, calibration, match):
    model = tiny_model()
    with pytest.raises(ConfigError, match=match) as err:
        quantize(model, cfg, calibration)
    assert "\n" not in str(err.value)
    assert isinstance(model.layers[0].self_attn.q_proj, nn.Linear)


def test_the_registry_lists_both_entries_with_their_defaults():
    assert QUANTS.names() == ["int4", "int8"]
    int4 = QUANTS.resolve("int4")[1]
    assert (int4.group_size, int4.method, int4.quantize_head) == (128, "gptq", False)
    assert QUANTS.resolve("int8")[1].quantize_head is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_cuda_kernels_match_the_dequantizing_path():
    torch.manual_seed(0)
    w = (0.02 * torch.randn(1024, 1024, device="cuda")).to(torch.bfloat16)
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    codes, scale, zero = round_to_nearest(w, INT4, 128, None, 0.0)
    scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)
    packed, plain = (Int4Linear(codes, scale, zero, 128, None, k) for k in ("int4pack_mm", "dequant"))
    # A layout mix-up is off by many steps; the two kernels may differ by bf16 rounding only.
    assert (packed.dequantize().float() - plain.dequantize().float()).abs().max() <= scale.float().max() / 16
    assert rel_error(packed(x), plain(x)) < 1e-2
    codes, scale, _ = round_to_nearest(w, INT8, 1024, None, 0.0)
    packed, plain = (Int8Linear(codes, scale[:, 0].to(torch.bfloat16), None, k) for k in ("int8pack_mm", "dequant"))
    assert rel_error(packed(x), plain(x)) < 1e-2
    model = tiny_model().to("cuda", torch.bfloat16)
    readable = copy.deepcopy(model)
    assert quantize(model, {"name": "int4", "group_size": 32, "method": "rtn"})["kernels"] == {"int4pack_mm": 14}
    # one quantization in the codes' own layout, re-packed for tinygemm: the same stored weights
    quantize(readable, {"name": "int4", "group_size": 32, "method": "rtn", "kernel": "dequant"})
    assert set_kernels(readable) == {"int4pack_mm": 14}
    for (name, a), b in zip(model.state_dict().items(), readable.state_dict().values()):
        assert torch.equal(a, b), name
