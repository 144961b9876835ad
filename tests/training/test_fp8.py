"""fp8=tensorwise/rowwise: torchao's Float8Linear in place of the blocks' Linears, nothing else; a short float8 run
tracks the same run in full precision; checkpoints load into a plain model; bad combinations fail first."""

import pytest
import torch

import lmlab
from lmlab.errors import ConfigError
from lmlab.nn.transformer import Transformer
from lmlab.training.fp8 import FP8
from lmlab.cli.compose import compose_config
from tests.conftest import TINY

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

FLOAT8 = [name for name in FP8.names() if name != "none"]
MOE = ["model/moe=topk", "model.moe.n_experts=4", "model.moe.k=2", "model.mtp.depth=1"]


def test_only_the_blocks_linears_turn_float8_and_keep_their_parameters(make_cfg, tiny_overrides):
    cfg = make_cfg([*tiny_overrides, *MOE, "model.attention.n_kv_heads=1"])
    model = Transformer(cfg.model, 320)
    before = dict(model.named_parameters())
    n = FP8.build("rowwise").install(model)
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    # attention's projections in every block and the MTP module's, and the MTP module's input projection (one kv
    # head gives k/v 16 wide: still float8); the experts are grouped weights, not Linears, and stay as they are
    expected = {f"{block}.self_attn.{p}" for block in ("layers.0", "layers.1", "mtp_layers.0.layer")
                for p in ("q_proj", "k_proj", "v_proj", "o_proj")} | {"mtp_layers.0.eh_proj"}
    assert converted == expected and n == len(expected)
    assert not isinstance(model.lm_head, Float8Linear)
    assert not any(isinstance(m, Float8Linear) for n_, m in model.named_modules() if "router" in n_)
    assert dict(model.named_parameters()) == before  # the same Parameter objects under the same names


def test_widths_float8_cannot_take_are_left_and_a_model_without_any_is_refused(make_cfg, tiny_overrides):
    cfg = make_cfg([*tiny_overrides, "model.d_model=24", "model.attention.n_heads=2"])
    with pytest.raises(ConfigError, match="multiples of 16"):
        FP8.build("tensorwise").install(Transformer(cfg.model, 320))


def test_fp8_with_qat_fails_before_training(make_cfg, tiny_overrides, tmp_path):
    from lmlab.training import train

    with pytest.raises(ConfigError, match="qat=int8 and fp8=rowwise both replace"):
        train(make_cfg([*tiny_overrides, "qat=int8", "fp8=rowwise"]), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_tensorwise_fast_accumulates_fast_in_the_backward_matmuls_too():
    def fast(entry):
        c = FP8.build(entry).linear_config()
        return [g.use_fast_accum for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)]

    assert fast("tensorwise") == [True, False, False] and fast("tensorwise_fast") == [True, True, True]


@pytest.mark.parametrize("recipe", FLOAT8)
def test_a_float8_run_tracks_full_precision_and_saves_a_plain_checkpoint(tmp_path, recipe):
    from lmlab.training import train

    common = [*TINY, f"cache_dir={tmp_path / 'cache'}", "model.d_model=64", "trainer.max_steps=20",
              "trainer.val_every=20", "sched.warmup_steps=2"]
    plain = train(compose_config(common), tmp_path / "plain")
    fp8 = train(compose_config([*common, f"fp8={recipe}"]), tmp_path / recipe)
    assert fp8["val_loss"] < fp8["initial_val_loss"] - 0.5  # it learns
    assert abs(fp8["val_loss"] - plain["val_loss"]) < 0.03 * plain["val_loss"]  # as full precision does
    model, _, _ = lmlab.load(tmp_path / recipe / "checkpoints" / "last.ckpt")  # the Linears' own weights, plain
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    assert torch.isfinite(model(torch.randint(0, 320, (2, 16)))).all()
