"""Weights to and from Hugging Face `transformers` Llama (`LlamaForCausalLM`).

lmlab's parameter names already follow Llama's, so the adapter only adds or strips HF's
`model.` prefix and translates the config. Only the Llama combination of parts converts:
norm=rmsnorm, ffn=swiglu, position=rope (half-split layout, unscaled), attention=mha (no
window, soft-cap or qk-norm), block=prenorm, no logit soft-cap; anything else raises
`ConfigError`.

    model = from_hf_llama(json.load(open("config.json")), safetensors.torch.load_file("model.safetensors"))
    save_pretrained(model, "out/")   # then LlamaForCausalLM.from_pretrained("out/")

`transformers` itself is not needed here; `save_pretrained` needs `safetensors`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lmlab.atomic import atomic_write, atomic_write_text
from lmlab.errors import ConfigError
from lmlab.nn import (ATTENTION, BLOCKS, FFNS, NORMS, POSITIONS, ModelConfig, MoELayer, MultiHeadAttention, PreNormBlock,
                      RMSNorm, RoPE, SwiGLU, Transformer)

# LlamaConfig's defaults, used where a config.json leaves a field out.
_DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def from_hf_llama(config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Transformer:
    """An lmlab `Transformer` holding the weights of a Hugging Face Llama checkpoint.

    `config` is a Llama `config.json` as a dict (or `LlamaConfig.to_dict()`; the transformers 4
    `rope_theta`/`rope_scaling` and 5 `rope_parameters` forms both work); `state_dict` uses HF's
    names (`model.embed_tokens.weight`, ..., `lm_head.weight`). With tied embeddings
    `lm_head.weight` may be absent. Weights are copied into a float32 model (torch's default
    dtype), returned in eval mode like `from_pretrained`. Unsupported settings, missing or
    unexpected keys and wrong shapes raise `ConfigError` naming the field or key.
    """
    cfg = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if missing := [k for k in _REQUIRED if k not in cfg]:
        raise ConfigError(f"Llama config has no {', '.join(missing)}")
    if cfg.get("model_type", "llama") != "llama":
        raise ConfigError(f"model_type={cfg['model_type']!r}: only Llama checkpoints (model_type='llama') convert")
    if cfg["hidden_act"] != "silu":
        raise ConfigError(f"hidden_act={cfg['hidden_act']!r}: Llama's SwiGLU needs 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg[flag]:
            raise ConfigError(f"{flag}=true: lmlab's Llama parts have no biases")
    d, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if "head_dim" in cfg and cfg["head_dim"] * n_heads != d:
        raise ConfigError(f"head_dim={cfg['head_dim']} differs from hidden_size / num_attention_heads = "
                          f"{d}/{n_heads}; lmlab derives head_dim from them")
    tied = bool(cfg["tie_word_embeddings"])
    model_cfg = ModelConfig(
        d_model=d, n_layers=cfg["num_hidden_layers"], max_seq_len=cfg["max_position_embeddings"],
        vocab_size=cfg["vocab_size"], tie_embeddings=tied,
        norm={"name": "rmsnorm", "eps": float(cfg["rms_norm_eps"])},
        ffn={"name": "swiglu", "d_ff": cfg["intermediate_size"]},
        position={"name": "rope", "theta": _hf_rope_theta(cfg)},
        attention={"name": "mha", "n_heads": n_heads, "n_kv_heads": cfg.get("num_key_value_heads", n_heads),
                   "dropout": float(cfg["attention_dropout"])},
        block="prenorm",
    )
    model = Transformer(model_cfg, cfg["vocab_size"])
    model.load_state_dict(_from_hf_names(state_dict, model.state_dict(), tied))
    return model.eval()


def to_hf_llama(model: Transformer) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The Hugging Face Llama `config.json` dict and state dict of an lmlab `Transformer`.

    `LlamaForCausalLM(LlamaConfig(**config)).load_state_dict(state_dict)` loads it. The tensors
    share memory with the model, as `state_dict()` does; with tied embeddings `lm_head.weight`
    is the embedding tensor itself. A model with non-Llama parts raises `ConfigError`.
    Multi-token-prediction modules are left out: they only add training signal.
    """
    _check_llama_parts(model)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    d = model.embed_tokens.embedding_dim
    dtype = model.embed_tokens.weight.dtype
    theta = model.position.theta
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model.vocab_size, "hidden_size": d, "intermediate_size": mlp.gate_proj.out_features,
        "num_hidden_layers": len(model.layers), "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_kv_heads, "head_dim": attn.head_dim, "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len, "rms_norm_eps": model.norm.eps,
        # transformers 4 reads rope_theta, 5 reads rope_parameters; each ignores the other's key.
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": attn.dropout,
        "tie_word_embeddings": model.lm_head.weight is model.embed_tokens.weight,
        # Llama's defaults (1, 2) are ids of Meta's tokenizer, meaningless for lmlab's.
        "bos_token_id": None, "eos_token_id": None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    state = {k if k == "lm_head.weight" else f"model.{k}": v for k, v in _inference_state(model).items()}
    return config, state


def save_pretrained(model: Transformer, directory: str | os.PathLike, eos_token_id: int | None = None) -> Path:
    """Write `config.json` and `model.safetensors` that `LlamaForCausalLM.from_pretrained` loads.

    `eos_token_id` (the tokenizer's end-of-text id) is where `generate` stops. Files are written
    under temporary names and renamed into place. Returns the directory.
    """
    from safetensors.torch import save_file

    config, state = to_hf_llama(model)
    config["eos_token_id"] = eos_token_id
    if config["tie_word_embeddings"]:
        del state["lm_head.weight"]  # safetensors refuses shared tensors; HF re-ties from the config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    # HF rejects a safetensors file whose metadata lacks format=pt.
    atomic_write(directory / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    atomic_write_text(directory / "config.json", json.dumps(config, indent=2) + "\n")
    return directory


def _hf_rope_theta(cfg: Mapping[str, Any]) -> float:
    """theta of an unscaled RoPE config; scaled kinds (linear, dynamic, yarn, llama3, ...) raise."""
    theta = cfg["rope_theta"]
    # transformers 5 calls it rope_parameters and reads rope_scaling as an alias of it.
    for field in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(field)
        if rope is None:
            continue
        if not isinstance(rope, Mapping) or any(isinstance(v, Mapping) for v in rope.values()):
            raise ConfigError(f"{field}={rope!r}: only one global RoPE setting converts")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"{field}={dict(rope)}: lmlab's RoPE is unscaled and full-width; "
                              f"set {field} to null (or rope_type 'default')")
        theta = rope.get("rope_theta", theta)
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"partial_rotary_factor={cfg['partial_rotary_factor']}: lmlab's RoPE rotates every feature")
    return float(theta)


def _from_hf_names(hf_state: Mapping[str, Tensor], expected: Mapping[str, Tensor], tied: bool) -> dict[str, Tensor]:
    """HF names -> lmlab names, checking keys and shapes against the freshly built model's."""
    state, unexpected = {}, []
    for key, value in hf_state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # older checkpoints store RoPE's frequencies; lmlab recomputes them
        name = "lm_head.weight" if key == "lm_head.weight" else key[len("model."):] if key.startswith("model.") else None
        if name in expected:
            state[name] = value
        else:
            unexpected.append(key)
    if tied and (embed := state.get("embed_tokens.weight")) is not None:
        head = state.setdefault("lm_head.weight", embed)
        if head is not embed and not torch.equal(head, embed):
            raise ConfigError("tie_word_embeddings=true, but lm_head.weight differs from model.embed_tokens.weight")
    missing = [("" if k == "lm_head.weight" else "model.") + k for k in expected if k not in state]
    if missing or unexpected:
        raise ConfigError(f"state dict does not match the Llama config: missing keys {_few(missing)}, "
                          f"unexpected keys {_few(unexpected)}")
    for name, value in state.items():
        if value.shape != expected[name].shape:
            raise ConfigError(f"{name}: shape {tuple(value.shape)} in the state dict, "
                              f"{tuple(expected[name].shape)} from the config")
    return state


def _few(keys: list[str], n: int = 5) -> str:
    return "none" if not keys else ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def _inference_state(model: Transformer) -> dict[str, Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.startswith("mtp_layers.")}


def _check_llama_parts(model: Transformer) -> None:
    """Raise ConfigError unless every part is one HF Llama has (exact classes: subclasses may compute otherwise)."""
    if any(isinstance(layer.mlp, MoELayer) for layer in model.layers):
        raise ConfigError("model/moe (a mixture of experts) has no Hugging Face Llama equivalent; export a dense model")
    if model.loops > 1:
        raise ConfigError("model.loops > 1 (looped depth) has no Hugging Face Llama equivalent")
    if any(getattr(layer.self_attn, "kv_source", None) is not None for layer in model.layers):
        raise ConfigError("model.kv_share > 1 (cross-layer attention) has no Hugging Face Llama equivalent")
    parts = [(POSITIONS, model.position, RoPE), (NORMS, model.norm, RMSNorm)]
    for layer in model.layers:
        parts.append((BLOCKS, layer, PreNormBlock))
        if type(layer) is PreNormBlock:
            parts += [(NORMS, layer.input_layernorm, RMSNorm), (NORMS, layer.post_attention_layernorm, RMSNorm),
                      (ATTENTION, layer.self_attn, MultiHeadAttention), (FFNS, layer.mlp, SwiGLU)]
    for registry, module, cls in parts:
        if type(module) is not cls:
            raise ConfigError(f"{registry.group}={_entry_name(registry, type(module))} has no Hugging Face Llama "
                              f"equivalent; only {registry.group}={_entry_name(registry, cls)} converts")
    if model.position.layout != "half":
        raise ConfigError(f"model.position.layout={model.position.layout} has no Llama equivalent; HF Llama pairs "
                          "feature i with i + head_dim/2 (layout=half)")
    if getattr(model, "logit_softcap", None) is not None:
        raise ConfigError(f"model.logit_softcap={model.logit_softcap} has no Llama equivalent")
    if model.output_multiplier != 1.0 or any(getattr(m, "score_scale", None) for m in model.modules()):
        raise ConfigError("a model with muP multipliers (model/init=mup) has no Llama equivalent")
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        for option in ("window", "softcap"):  # options that change the computation without adding weights
            if getattr(attn, option, None) is not None:
                raise ConfigError(f"layer {i}: attention.{option}={getattr(attn, option)} has no Llama equivalent")
    # Extra weights (qk-norm gains, anything a future option adds) would be silently dropped.
    expected = {"embed_tokens.weight", "norm.weight", "lm_head.weight"} | {
        f"layers.{i}.{name}.weight" for i in range(len(model.layers)) for name in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")}
    if extra := sorted(set(_inference_state(model)) - expected):
        raise ConfigError(f"weights with no Llama equivalent: {_few(extra)} (e.g. attention.qk_norm=true)")
    norms = [model.norm, *(n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm))]
    if len({n.eps for n in norms}) > 1:
        raise ConfigError("Llama has one rms_norm_eps, but the model's RMSNorms use several")


def _entry_name(registry, cls: type) -> str:
    return next((e.name for e in registry if e.target is cls), cls.__name__)
