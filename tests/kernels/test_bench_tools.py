"""`lmlab bench kernels` and `lmlab bench train` run end to end (on the CPU: references only)."""

import json

import pytest
import torch

from lmlab.kernels import bench as kernel_bench
from lmlab.training import bench as train_bench
from lmlab.training.hardware import peak_bandwidth, peak_flops


def test_bench_kernels_reports_every_implementation_and_pass(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert kernel_bench.main(["--only", "rms_norm,attention", "--no-compile", "--repeats", "2", "--warmup", "1",
                              "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    impls = {(r["op"], r["pass"]): set() for r in rows}
    for r in rows:
        impls[(r["op"], r["pass"])].add(r["impl"])
        assert r["ms"] > 0 and r["gbps"] > 0 and r["flop_per_byte"] > 0
    expected_triton = {"triton"} if torch.cuda.is_available() else set()
    assert impls[("rms_norm", "fwd+bwd")] == {"reference", "F.rms_norm"} | expected_triton
    assert "sdpa" in impls[("attention", "fwd")]
    baseline = [r for r in rows if r["impl"] == "F.rms_norm"]
    assert all(r["speedup"] == 1.0 for r in baseline)
    assert "F.rms_norm" in capsys.readouterr().out


def test_bench_kernel_cases_build_inputs_of_the_shape_they_report():
    # Each case's inputs are built lazily: they must not see a later case's sizes.
    for case in kernel_bench.cases(torch.device("cpu"), compile=False):
        first = case.inputs()[0]
        if case.op == "attention":
            b, h, s, d = first.shape
            assert case.shape.startswith(f"B{b} H{h} S{s} D{d}")
        else:
            assert case.shape.split("x")[:first.dim()] == [str(n) for n in first.shape], case.op


def test_bench_kernels_rejects_an_unknown_operation(capsys):
    try:
        kernel_bench.main(["--only", "layernorm"])
    except SystemExit as exit:
        assert exit.code == 2
    assert "unknown operation(s) layernorm" in capsys.readouterr().err


def test_bench_train_times_each_variant_and_profiles(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert train_bench.main(["model.d_model=32", "model.n_layers=1", "model.attention.n_heads=2",
                             "data.context_length=32", "data.batch_size=2", "tokenizer.vocab_size=320",
                             "--variants", "reference,triton,reference+fp8-tensorwise", "--steps", "2", "--warmup", "1",
                             "--profile", str(tmp_path / "prof"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["variants"]) == {"reference", "triton", "reference+fp8-tensorwise"}
    assert all(v["tokens_per_s"] > 0 for v in result["variants"].values())
    assert result["flops_per_token"] > 6 * result["parameters"] * 0.5
    assert "aten::mm" in (tmp_path / "prof" / "reference.txt").read_text()
    assert "vs reference" in capsys.readouterr().out


def test_a_graphed_variant_reports_no_step_memory_rather_than_its_pool_as_zero():
    class Graphed:
        graphed = True

        def step(self, *batch):
            raise AssertionError("not stepped: its step memory was taken at capture")

    assert train_bench._peak_step_bytes(Graphed(), (), torch.device("cuda")) is None


def test_no_roofline_without_a_known_gpu():
    assert peak_bandwidth(torch.device("cpu")) is None and peak_flops(torch.device("cpu")) is None


def test_bench_train_variants_name_kernels_compile_fp8_compute_dtype_and_precision():
    variant = train_bench.parse_variant("triton-attention+compile+fp8-rowwise")
    assert variant == train_bench.Variant({"name": "triton", "attention": False}, True, "rowwise")
    assert variant.overrides() == ["kernels=triton", "kernels.attention=false", "trainer.compile=True", "fp8=rowwise",
                                   "trainer.cuda_graphs=False", "recompute=none", "trainer.compute_dtype=null",
                                   "trainer.precision=auto"]
    assert train_bench.parse_variant("reference+compile+recompute-selective").recompute == "selective"
    assert train_bench.parse_variant("reference") == train_bench.Variant({"name": "reference"}, False, "none")
    graphed = train_bench.parse_variant("reference+compile+graphs")
    assert graphed.graphs and graphed.compiled and "trainer.cuda_graphs=True" in graphed.overrides()
    cast = train_bench.parse_variant("triton+compile+compute-bfloat16")
    assert cast.compute == "bfloat16" and "trainer.compute_dtype=bfloat16" in cast.overrides()
    half = train_bench.parse_variant("triton+compile+bf16-true")
    assert half.precision == "bf16-true" and "trainer.precision=bf16-true" in half.overrides()
    for bad in ("reference+fast", "reference+fp8-fancy", "triton-nothing", "cuda", "reference+graphs",
                "reference+recompute-most", "triton+compute-int8", "triton+compile+recompute-full+compute-bfloat16",
                "triton+bf16-true+compute-bfloat16", "triton+bf16-mixed", "triton+bf16-true+16-true"):
        try:
            train_bench.parse_variant(bad)
        except SystemExit as exit:
            assert bad in str(exit.code)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_bench_kernels_reports_and_leaves_out_an_implementation_that_raises(capsys):
    def unavailable(x, w):
        raise RuntimeError("no such backend here\nmore detail")

    case = kernel_bench.Case("rms_norm", "8x16", lambda: [torch.randn(8, 16, requires_grad=True),
                                                          torch.ones(16, requires_grad=True)],
                             {"F.rms_norm": lambda x, w: torch.nn.functional.rms_norm(x, (16,), w),
                              "broken": unavailable}, "F.rms_norm", flops=(1, 1), bytes=(1, 1))
    rows = kernel_bench.measure(case, repeats=1, warmup=1, device=torch.device("cpu"))
    assert {r["impl"] for r in rows} == {"F.rms_norm"} and len(rows) == 2
    assert "broken skipped (no such backend here)" in capsys.readouterr().err


@pytest.mark.slow
def test_flex_attention_peer_is_causal_attention():
    q, k, v = (torch.randn(1, 2, 128, 64) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(kernel_bench._flex_causal()(q, k, v), expected, atol=1e-5, rtol=1e-5)
