"""Hybrid stacks: a per-layer pattern of sequence mixers (Jamba, Qwen3-Next, Nemotron-H style).

    model.layer_pattern=[mamba2,mamba2,mamba2,mha]      # repeated to model.n_layers: a 3:1 hybrid
    +model.mixers.mamba2.d_state=64                     # fields of the pattern's other entries

Each item names an entry of the attention registry. An item equal to `model.attention`'s name uses
`model.attention`'s config; any other takes `model.mixers[item]` over that entry's defaults. The
pattern repeats, so its length must divide `model.n_layers`. MTP modules keep `model.attention`.
The layers share one position module, sized by `model.attention`: entries that use positions must
agree with it on (rotary head_dim, n_heads); entries with `uses_positions = False` (state-space and
delta-rule layers, which know order through their recurrence) are free.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from lmlab.errors import ConfigError
from lmlab.nn.attention import ATTENTION


def check_layer_pattern(model_cfg) -> None:
    """One clear error for a pattern that names unknown entries or does not tile the layers."""
    pattern = model_cfg.layer_pattern
    if pattern is None:
        return
    if not pattern:
        raise ConfigError("model.layer_pattern is empty; give at least one attention entry, or null for no pattern")
    for item in pattern:
        ATTENTION.get(item)  # an unknown name fails here, listing the choices
    if model_cfg.n_layers % len(pattern):
        raise ConfigError(f"model.layer_pattern has {len(pattern)} entries, which does not divide "
                          f"model.n_layers={model_cfg.n_layers}; the pattern repeats to fill the layers")
    unused = set(model_cfg.mixers or {}) - set(pattern)
    if unused:
        raise ConfigError(f"model.mixers sets {', '.join(sorted(unused))}, which model.layer_pattern does not name")
    # The layers share one position module, sized by model.attention's (rotary head_dim, heads)
    main = _shape(model_cfg, model_cfg.attention)
    for layer_idx, name in enumerate(pattern):
        entry, cfg = ATTENTION.resolve(layer_attention(model_cfg, layer_idx))
        if getattr(entry.target, "uses_positions", True) and _shape(model_cfg, cfg, entry) != main:
            raise ConfigError(f"model.layer_pattern: {name} has (rotary head_dim, n_heads) = "
                              f"{_shape(model_cfg, cfg, entry)} but model.attention has {main}, and the layers share "
                              f"one position module; set model.mixers.{name} so that they agree")


def _shape(model_cfg, cfg, entry=None) -> tuple[int, int]:
    if entry is None:
        entry, cfg = ATTENTION.resolve(cfg)
    return entry.target.shape_for(model_cfg.d_model, cfg)


def layer_attention(model_cfg, layer_idx: int) -> Any:
    """The attention config of layer `layer_idx`: model.attention, or the pattern's entry there."""
    pattern = model_cfg.layer_pattern
    if pattern is None or layer_idx >= model_cfg.n_layers:
        return model_cfg.attention
    name = pattern[layer_idx % len(pattern)]
    if name == ATTENTION.resolve(model_cfg.attention)[0].name:
        return model_cfg.attention
    fields = (model_cfg.mixers or {}).get(name) or {}
    if isinstance(fields, DictConfig):
        fields = OmegaConf.to_container(fields, resolve=True)
    return {**fields, "name": name}
