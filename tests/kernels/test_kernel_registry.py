"""The `kernels` group: fallback without CUDA, installation into the model's modules, bad input."""

import logging

import pytest
import torch
import torch.nn.functional as F

from lmlab.errors import ConfigError
from lmlab.kernels import FlashAttentionReference
from lmlab.kernels.registry import KERNELS, KernelOps, _warn_fallback, install_kernels, triton_unavailable
from lmlab.nn.ffn import swiglu
from lmlab.nn.norms import add_rms_norm, rms_norm
from lmlab.nn.transformer import Transformer
from lmlab.training.losses import LOSSES, cross_entropy

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")


def tiny_model(make_cfg, tiny_overrides, *extra):
    cfg = make_cfg([*tiny_overrides, *extra])
    torch.manual_seed(0)
    return Transformer(cfg.model, 320), LOSSES.build(cfg.loss)


def counting(fn, calls: dict, name: str):
    def wrapped(*args):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args)
    return wrapped


def sdpa(q, k, v, causal, scale):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@needs_no_cuda
def test_triton_without_cuda_falls_back_with_one_warning(caplog):
    _warn_fallback.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert KERNELS.build("triton") == KernelOps()
        assert KERNELS.build("triton") == KernelOps()
    warnings = [r for r in caplog.records if "kernels=triton" in r.getMessage()]
    assert len(warnings) == 1 and "no CUDA GPU" in warnings[0].getMessage()


@needs_no_cuda
def test_strict_triton_without_cuda_fails_before_training(make_cfg, tiny_overrides, tmp_path):
    from lmlab.training import train

    with pytest.raises(ConfigError, match="kernels.strict=true, but this machine has no CUDA GPU"):
        train(make_cfg([*tiny_overrides, "kernels=triton", "kernels.strict=true"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_reference_entry_changes_nothing(make_cfg, tiny_overrides):
    model, loss = tiny_model(make_cfg, tiny_overrides)
    assert install_kernels(KERNELS.build("reference"), model, loss) == []
    assert all(m.kernel is rms_norm for m in model.modules() if hasattr(m, "eps") and hasattr(m, "kernel"))
    assert loss.kernel is cross_entropy


def test_installed_ops_run_in_every_module_and_match_the_reference(make_cfg, tiny_overrides):
    model, loss = tiny_model(make_cfg, tiny_overrides, "model.attention.n_kv_heads=1", "loss.z_loss=1e-3")
    tokens = torch.randint(0, 320, (2, 16))
    expected = loss(model(tokens), tokens)
    calls = {}
    ops = KernelOps(rms_norm=counting(rms_norm, calls, "rms_norm"), attention=counting(sdpa, calls, "attention"),
                    add_rms_norm=counting(add_rms_norm, calls, "add_rms_norm"),
                    attention_head_dims=(16,), swiglu=counting(swiglu, calls, "swiglu"),
                    cross_entropy=counting(cross_entropy, calls, "cross_entropy"))
    assert install_kernels(ops, model, loss) == []
    got = loss(model(tokens), tokens)
    # 2 pre-norm layers: a norm before attention, the attention residual add fused into the norm before
    # the FFN, one attention and one FFN each; the final norm; one loss.
    assert calls == {"rms_norm": 3, "add_rms_norm": 2, "attention": 2, "swiglu": 2, "cross_entropy": 1}
    for key in expected:
        torch.testing.assert_close(got[key], expected[key])


def test_the_tiled_pytorch_attention_plugs_in_as_a_kernel(make_cfg, tiny_overrides):
    model, loss = tiny_model(make_cfg, tiny_overrides, "model.attention.n_heads=2", "model.attention.n_kv_heads=1")
    tokens = torch.randint(0, 320, (2, 32))
    expected = model(tokens)
    tiled = KernelOps(attention=lambda q, k, v, causal, scale: FlashAttentionReference.apply(q, k, v, causal),
                      attention_head_dims=(16,))
    install_kernels(tiled, model)
    torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra,note", [
    (["model.attention.window=8"], "no a sliding window"),
    (["model.attention.softcap=30"], "no soft-capped scores"),
    (["model/position=alibi"], "ALiBi adds a score bias"),
])
def test_layers_the_kernel_cannot_serve_keep_sdpa_and_say_why(make_cfg, tiny_overrides, extra, note):
    model, loss = tiny_model(make_cfg, tiny_overrides, *extra)
    tokens = torch.randint(0, 320, (2, 16))
    expected = model(tokens)
    ops = KernelOps(attention=lambda *args: pytest.fail("the fused attention must not run here"),
                    attention_head_dims=(16,))
    notes = install_kernels(ops, model, loss)
    assert len(notes) == 1 and note in notes[0]
    torch.testing.assert_close(model(tokens), expected)


def test_unsupported_head_dim_names_the_supported_ones(make_cfg, tiny_overrides):
    model, loss = tiny_model(make_cfg, tiny_overrides, "model.d_model=48", "model.attention.n_heads=2")
    ops = KernelOps(attention=sdpa, attention_head_dims=(16, 32, 64, 128))
    with pytest.raises(ConfigError, match=r"head_dim 24 .* supported: 16, 32, 64, 128"):
        install_kernels(ops, model, loss)


@pytest.mark.skipif(triton_unavailable() is None, reason="checks the CPU fallback")
def test_lmlab_train_with_triton_kernels_compile_and_profile_runs_on_cpu(make_cfg, tiny_overrides, tmp_path):
    from lmlab.training import train

    out = tmp_path / "run"
    results = train(make_cfg([*tiny_overrides, "kernels=triton", "trainer.compile=true", "profile=true",
                              "trainer.max_steps=10", "trainer.val_every=10"]), out)
    assert results["val_loss"] < results["initial_val_loss"]
    table = (out / "profile.txt").read_text()
    assert "aten::mm" in table and "CPU total" in table
    assert '"traceEvents"' in (out / "trace.json").read_text()[:1000]
