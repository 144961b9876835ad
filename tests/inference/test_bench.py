"""`lmlab bench generate` on the CPU: lmlab and Hugging Face `generate` make the same greedy tokens
from the same weights, the byte counts behind the roofline, and the checkpoint figures (perplexity
of a quantized copy, speculative decoding against the target alone) on a model trained here."""

import copy
import json

import pytest
import torch

import lmlab
from lmlab.inference.bench import kv_bytes_by_attention, main, run_benchmark, weight_bytes_per_step
from lmlab.inference.bench_checkpoint import (CheckpointData, divergences, perplexity, quant_quality,
                                              speculative_speedup)
from lmlab.inference.quant import quantize
from tests.conftest import train_tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return train_tiny(tmp_path_factory.mktemp("run"), 3)


def test_lmlab_and_transformers_make_the_same_tokens(ckpt):
    pytest.importorskip("transformers")
    model, _, _ = lmlab.load(ckpt)
    rows = run_benchmark(model, ["eager", "hf"], batches=[1, 3], prompts=[8], new=5, repeats=1)["rows"]
    assert [(r["engine"], r["batch"]) for r in rows] == [("eager", 1), ("hf", 1), ("eager", 3), ("hf", 3)]
    assert rows[0]["tokens"] == rows[1]["tokens"] and rows[2]["tokens"] == rows[3]["tokens"]
    assert all(r["decode_tokens_per_s"] > 0 and r["ttft_s"] > 0 for r in rows)


def test_weight_bytes_count_quantized_buffers_and_skip_the_embedding(ckpt):
    model, _, _ = lmlab.load(ckpt)
    dense = weight_bytes_per_step(model)
    assert dense == 4 * (model.num_parameters() - model.embed_tokens.weight.numel())
    quantize(model, "int8")
    assert dense / 4.5 < weight_bytes_per_step(model) < dense / 3  # int8 weights, a scale per row


def test_kv_bytes_shrink_from_mha_to_mqa_and_linear_is_constant(ckpt):
    _, _, cfg = lmlab.load(ckpt)
    table = kv_bytes_by_attention(cfg, vocab=1024, length=512)
    per_token = {kind: row["bytes_per_token"] for kind, row in table.items()}
    assert per_token["mqa"] < per_token["mha"]
    assert per_token["linear"] == table["linear"]["bytes_at_length"] / 512
    assert per_token["cla (kv_share=2, mha)"] == per_token["mha"] / 2


def test_quantized_perplexity_is_measured_on_the_validation_split(ckpt, monkeypatch):
    from lmlab.inference import bench_checkpoint

    model, _, _ = lmlab.load(ckpt)
    data = CheckpointData(ckpt)
    calls = []
    monkeypatch.setattr(bench_checkpoint, "quantize", lambda *a: calls.append(a) or quantize(*a))
    rows = quant_quality(model, data, ["int8"], new=4, engines=("eager", "megakernel"))
    assert len(calls) == 1  # one quantization (a calibration, for GPTQ) re-packed for both engines' layouts
    assert [r["quant"] for r in rows] == ["none", "int8"]
    assert rows[0]["ppl"] == pytest.approx(perplexity(model, *data.val))
    assert abs(rows[1]["ppl_change"]) < 0.05 and rows[1]["speedup"]["eager"] > 0
    if not torch.cuda.is_available():  # an engine that cannot run is named with its reason, not timed
        # on a CPU: no CUDA; under Triton's interpreter: this model's head_dim of 16
        assert "megakernel" not in rows[1]["speedup"] and rows[1]["not_run"]["megakernel"]


def test_speculative_with_the_target_as_draft_accepts_everything(ckpt):
    model, _, _ = lmlab.load(ckpt)
    prompts = CheckpointData(ckpt).prompts(2, 16)
    row = speculative_speedup(model, copy.deepcopy(model), prompts, new=8, k=3, compile=False)
    assert row["identical_outputs"] == 2 and row["acceptance_rate"] == 1.0 and row["divergences"] == []
    assert row["speedup"] > 0 and row["draft_parameters"] == row["target_parameters"]
    # 8 new tokens: the first from the prefill, then rounds of k + 1 = 4 (the second's last one dropped)
    assert row["tokens_per_round"] == 7 / 2 and row["round_graph"] is False and row["ms_per_round"] > 0
    assert row["decode_speedup"] == row["speculative_decode_tokens_per_s"] / row["target_decode_tokens_per_s"]
    assert torch.is_tensor(model.lm_head.weight)


def test_divergences_name_the_first_differing_token_and_the_targets_margin_there(ckpt):
    model, _, _ = lmlab.load(ckpt)
    prompts = CheckpointData(ckpt).prompts(3, 16)
    alone = [[5, 6, 7, 8]] * 3
    found = divergences(model, prompts, alone, [[5, 6, 7, 8], [5, 6, 9, 8], [5, 6, 7]])
    assert [(d["prompt"], d["at"]) for d in found] == [(1, 2), (2, 3)]
    with torch.no_grad():
        top = model(torch.tensor([prompts[1] + [5, 6]]))[0, -1].topk(2).values
    assert found[0]["target_margin"] == pytest.approx((top[0] - top[1]).item(), rel=1e-4)


def test_bench_cli_prints_and_saves_the_speculative_comparison(ckpt, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--ckpt", ckpt, "--engines", "", "--draft", ckpt, "--draft-k", "2", "--prompt", "8", "--new", "6",
                 "--batch", "1", "--repeats", "1", "--dtype", "float32", "--spec-prompts", "2", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["speculative"]
    assert row["identical_outputs"] == 2 and row["acceptance_rate"] == 1.0
    assert f", {row['decode_speedup']:.2f}x), acceptance 100%, identical outputs 2/2" in capsys.readouterr().out


def test_bench_cli_prints_each_quantization_on_each_engine(ckpt, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--ckpt", ckpt, "--engines", "", "--quant", "int8", "--quant-engines", "eager", "megakernel",
                 "--prompt", "8", "--new", "4", "--batch", "1", "--repeats", "1", "--dtype", "float32",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["quant_quality"]
    assert [r["quant"] for r in rows] == ["none", "int8"] and set(rows[1]["speedup"]) <= {"eager", "megakernel"}
    printed = capsys.readouterr().out
    assert f"eager {rows[1]['decode_tokens_per_s']['eager']:,.0f} tokens/s ({rows[1]['speedup']['eager']:.2f}x)" \
        in printed
    if not torch.cuda.is_available():
        assert "megakernel not run: megakernel=True" in printed
