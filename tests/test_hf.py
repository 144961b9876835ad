"""Weight conversion against Hugging Face `transformers` Llama, built offline from small configs."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from lmlab.errors import ConfigError  # noqa: E402
from lmlab.hf import from_hf_llama, save_pretrained, to_hf_llama  # noqa: E402
from lmlab.nn import ModelConfig, Transformer  # noqa: E402

VOCAB, SEQ = 101, 32  # a vocabulary that is no multiple of 64, so no padding may creep in


def hf_llama(**overrides) -> "transformers.LlamaForCausalLM":
    """A small random HF Llama whose weights are large enough for mix-ups to show in the logits."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                  rms_norm_eps=1e-5, rope_theta=500000.0)
    torch.manual_seed(0)
    return randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**kwargs, **overrides})))


def randomize(model):
    # Norms start at 1 and matrices at std 0.02: random gains catch swapped norms, and larger
    # weights make logits of order 1, so that 1e-4 is a real bound.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.15)
    return model.eval()


def lmlab_model(tied: bool = False, theta: float = 500000.0, **parts) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=64, n_layers=2, max_seq_len=SEQ, vocab_size=VOCAB, tie_embeddings=tied,
        norm={"name": "rmsnorm", "eps": 1e-5}, ffn={"name": "swiglu", "d_ff": 96},
        position={"name": "rope", "theta": theta}, attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2},
        block="prenorm",
    )
    for group, value in parts.items():
        setattr(cfg, group, value)
    return randomize(Transformer(cfg, VOCAB))


def max_logit_diff(hf_model, model) -> float:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (hf_model(ids).logits - model(ids)).abs().max().item()


CASES = {
    "mha": {},
    "gqa": {"num_key_value_heads": 2},
    "mqa": {"num_key_value_heads": 1},
    "tied": {"num_key_value_heads": 2, "tie_word_embeddings": True},
}


@pytest.mark.parametrize("case", CASES)
def test_hf_logits_match_after_conversion(case):
    hf = hf_llama(**CASES[case])
    model = from_hf_llama(hf.config.to_dict(), hf.state_dict())
    assert max_logit_diff(hf, model) < 1e-4
    assert (model.lm_head.weight is model.embed_tokens.weight) == (case == "tied")


def test_legacy_config_and_checkpoint_without_tied_head():
    # A transformers 4 config.json (rope_theta, rope_scaling: null) and a tied checkpoint that
    # stores no lm_head.weight, as safetensors files of tied models do.
    hf = hf_llama(num_key_value_heads=2, tie_word_embeddings=True)
    config = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    config.update(rope_theta=500000.0, rope_scaling=None)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert max_logit_diff(hf, from_hf_llama(config, state)) < 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_and_hf_runs_lmlab_weights(tied):
    model = lmlab_model(tied)
    config, state = to_hf_llama(model)
    back = from_hf_llama(config, state)
    assert to_hf_llama(back)[0] == config
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    hf.load_state_dict(state)  # strict: every HF key is there, nothing extra
    assert max_logit_diff(hf, model) < 1e-4


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_loads_in_transformers(tmp_path, tied):
    model = lmlab_model(tied)
    folder = save_pretrained(model, tmp_path / "llama")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]  # no temp files left
    hf = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    assert hf.config.tie_word_embeddings == tied and hf.dtype == torch.float32
    assert max_logit_diff(hf, model) < 1e-4
    assert json.loads((folder / "config.json").read_text())["rope_theta"] == 500000.0


@pytest.mark.parametrize("theta", [10000.0, 500000.0, 12345.6])
def test_rope_theta_goes_into_the_config(theta):
    config, _ = to_hf_llama(lmlab_model(theta=theta))
    assert config["rope_theta"] == theta and config["rope_parameters"]["rope_theta"] == theta


@pytest.mark.parametrize("field, value", [
    ("hidden_act", "gelu"),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
    ("attention_bias", True),
    ("mlp_bias", True),
    ("head_dim", 8),
    ("model_type", "mistral"),
])
def test_unsupported_hf_config_fields_raise(field, value):
    hf = hf_llama()
    with pytest.raises(ConfigError, match=field):
        from_hf_llama({**hf.config.to_dict(), field: value}, hf.state_dict())


def test_state_dict_mismatches_raise():
    hf = hf_llama()
    config, state = hf.config.to_dict(), hf.state_dict()
    with pytest.raises(ConfigError, match="missing keys model.norm.weight"):
        from_hf_llama(config, {k: v for k, v in state.items() if k != "model.norm.weight"})
    with pytest.raises(ConfigError, match="unexpected keys model.layers.2.mlp.up_proj.weight"):
        from_hf_llama(config, {**state, "model.layers.2.mlp.up_proj.weight": torch.zeros(96, 64)})
    with pytest.raises(ConfigError, match=r"shape \(96, 64\) in the state dict, \(64, 96\)"):
        from_hf_llama(config, {**state, "model.layers.0.mlp.down_proj.weight": torch.zeros(96, 64)})
    with pytest.raises(ConfigError, match="lm_head.weight differs"):
        from_hf_llama({**config, "tie_word_embeddings": True}, state)


@pytest.mark.parametrize("group, value, match", [
    ("norm", "layernorm", "model/norm=layernorm"),
    ("ffn", "gelu", "model/ffn=gelu"),
    ("position", "learned", "model/position=learned"),
    ("block", "parallel", "model/block=parallel"),
    ("position", {"name": "rope", "layout": "interleaved"}, "layout=half"),
    ("attention", {"name": "mha", "n_heads": 4, "window": 8}, "attention.window=8"),
    ("attention", {"name": "mha", "n_heads": 4, "qk_norm": True}, "q_norm"),
    ("logit_softcap", 30.0, "logit_softcap=30.0"),
    ("moe", {"name": "topk", "n_experts": 4}, "model/moe"),
])
def test_non_llama_models_are_refused(group, value, match):
    with pytest.raises(ConfigError, match=match):
        to_hf_llama(lmlab_model(**{group: value}))


def test_mtp_modules_are_left_out_of_the_llama_export():
    from lmlab.nn.mtp import MTPConfig

    model = lmlab_model(mtp=MTPConfig(depth=2))
    config, state = to_hf_llama(model)
    assert not any("mtp" in k for k in state)
    hf_model = hf_llama(**{k: config[k] for k in ("num_key_value_heads",)})
    hf_model.load_state_dict(state)
    assert max_logit_diff(hf_model.eval(), model) < 1e-5
