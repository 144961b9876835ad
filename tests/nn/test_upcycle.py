"""Sparse upcycling: the MoE model starts as the dense model's function; `lmlab upcycle` on a checkpoint."""

import pytest
import torch
from omegaconf import OmegaConf

from lmlab.cli.main import main as lmlab_main
from lmlab.errors import ConfigError
from lmlab.nn.moe.upcycle import upcycle
from lmlab.nn.transformer import ModelConfig, Transformer
from lmlab.training.checkpoints import CONFIG_KEY, model_weights, with_model_prefix


def build(moe=None, seed=0, ffn="swiglu") -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, n_layers=4, max_seq_len=16, norm="rmsnorm", ffn=ffn, position="rope",
                      attention={"name": "mha", "n_heads": 2}, block="prenorm", moe=moe)
    return Transformer(cfg, vocab_size=64)


@pytest.mark.parametrize("moe", [
    {"name": "topk", "n_experts": 8, "k": 2},
    {"name": "topk", "n_experts": 4, "k": 1, "score": "sigmoid", "first_layer": 1, "every": 2, "n_shared_experts": 1},
    {"name": "aux_free", "n_experts": 4, "k": 3},
])
def test_upcycled_model_equals_the_dense_model_at_step_0(moe):
    dense, sparse = build(), build(moe, seed=1)
    ids = torch.randint(0, 64, (2, 16))
    assert not torch.allclose(dense(ids), sparse(ids))
    upcycle(dense, sparse)
    torch.testing.assert_close(sparse(ids), dense(ids), rtol=1e-5, atol=1e-5)


def test_noise_makes_the_experts_differ_slightly():
    dense, sparse = build(), build({"name": "topk", "n_experts": 4}, seed=1)
    upcycle(dense, sparse, noise=0.01)
    experts = sparse.layers[0].mlp.experts.up_proj
    assert not torch.equal(experts[0], experts[1])
    torch.testing.assert_close(experts[0], dense.layers[0].mlp.up_proj.weight, rtol=0, atol=0.01)


def test_experts_of_another_width_cannot_be_upcycled():
    with pytest.raises(ConfigError, match="the experts must have the dense FFN's width"):
        upcycle(build(), build({"name": "topk", "n_experts": 4, "d_ff": 32}))


def _dense_checkpoint(make_cfg, tiny_overrides, path):
    cfg = make_cfg(tiny_overrides)
    model = Transformer(cfg.model, vocab_size=320)
    torch.save({"state_dict": with_model_prefix(model.state_dict()),
                CONFIG_KEY: OmegaConf.to_container(cfg, resolve=True)}, path)
    return model


def test_lmlab_upcycle_writes_an_moe_checkpoint_with_the_dense_function(make_cfg, tiny_overrides, tmp_path, capsys):
    dense = _dense_checkpoint(make_cfg, tiny_overrides, tmp_path / "dense.ckpt")
    out = tmp_path / "moe.ckpt"
    code = lmlab_main(["upcycle", f"ckpt={tmp_path / 'dense.ckpt'}", "model/moe=topk", "model.moe.n_experts=4",
                       f"out={out}"])
    assert code == 0 and "lmlab-train init_from=" in capsys.readouterr().out
    saved = torch.load(out, weights_only=False)
    config = saved[CONFIG_KEY]
    assert config["model"]["moe"]["name"] == "topk" and config["model"]["moe"]["n_experts"] == 4
    sparse = Transformer(OmegaConf.create(config["model"]), vocab_size=320)
    sparse.load_state_dict(model_weights(saved))
    ids = torch.randint(0, 320, (2, 16))
    torch.testing.assert_close(sparse(ids), dense(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args,match", [
    (["model/moe=topk"], "needs ckpt=PATH and model/moe=NAME"),
    (["ckpt=CKPT", "model/moe=topk", "model.d_model=64"], "only model/moe and model.moe"),
    (["ckpt=CKPT", "model/moe=topk", "model.moe.k=9"], "k=9 must be between 1 and n_experts=8"),
    (["ckpt=/nonexistent.ckpt", "model/moe=topk"], "is not a file"),
])
def test_lmlab_upcycle_rejects_bad_input(make_cfg, tiny_overrides, tmp_path, capsys, args, match):
    _dense_checkpoint(make_cfg, tiny_overrides, tmp_path / "dense.ckpt")
    args = [a.replace("CKPT", str(tmp_path / "dense.ckpt")) for a in args]
    assert lmlab_main(["upcycle", *args]) == 2
    assert match in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense.ckpt"]
