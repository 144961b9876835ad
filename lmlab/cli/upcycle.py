"""`lmlab upcycle ckpt=PATH model/moe=NAME [model.moe.FIELD=VALUE ...] [out=PATH] [noise=X] [seed=N]`

Turns a dense checkpoint written by lmlab-train into an MoE one whose experts start as copies of
the dense FFN; continue training it with `lmlab-train init_from=OUT` and the same model/moe overrides.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from lmlab.atomic import atomic_write
from lmlab.cli.compose import compose_config
from lmlab.errors import ConfigError

OWN_KEYS = {"ckpt", "out", "noise", "seed"}


def _split(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    own, moe = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"expected KEY=VALUE, got '{arg}'")
        if key in OWN_KEYS:
            own[key] = value
        elif key.lstrip("+") in ("model/moe",) or key.startswith("model.moe."):
            moe.append(arg)
        else:
            raise ConfigError(f"'{key}': only model/moe and model.moe.* may change when upcycling "
                              f"(and {', '.join(sorted(OWN_KEYS))})")
    if "ckpt" not in own or not any(a.lstrip("+").startswith("model/moe=") for a in moe):
        raise ConfigError("upcycle needs ckpt=PATH and model/moe=NAME")
    return own, moe


def upcycle_checkpoint(ckpt: Path, moe_overrides: list[str], out: Path, noise: float, seed: int) -> dict:
    """Write the upcycled checkpoint to `out`; returns its config."""
    from lmlab.nn.moe.upcycle import upcycle
    from lmlab.nn.transformer import Transformer
    from lmlab.training.checkpoints import CONFIG_KEY, TOKENIZER_KEY, model_weights, read_checkpoint, with_model_prefix

    checkpoint = read_checkpoint(ckpt, "ckpt")
    config = checkpoint[CONFIG_KEY]
    if config["model"].get("moe") is not None:
        raise ConfigError(f"{ckpt} is an MoE model already (model.moe.name={config['model']['moe']['name']})")
    moe_cfg = compose_config(moe_overrides).model.moe
    state = model_weights(checkpoint)
    vocab_size = state["embed_tokens.weight"].shape[0]
    dense = Transformer(OmegaConf.create(config["model"]), vocab_size)
    dense.load_state_dict(state)
    config["model"]["moe"] = OmegaConf.to_container(moe_cfg, resolve=True)
    moe = Transformer(OmegaConf.create(config["model"]), vocab_size)
    upcycle(dense, moe, noise, seed)
    payload = {"state_dict": with_model_prefix(moe.state_dict()), CONFIG_KEY: config,
               TOKENIZER_KEY: checkpoint.get(TOKENIZER_KEY), "upcycled_from": str(ckpt)}
    atomic_write(out, lambda tmp: torch.save(payload, tmp))
    return config


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    own, moe_overrides = _split(argv)
    ckpt = Path(own["ckpt"])
    out = Path(own.get("out") or ckpt.with_name(f"{ckpt.stem}-upcycled.ckpt"))
    try:
        noise, seed = float(own.get("noise", 0.0)), int(own.get("seed", 0))
    except ValueError as err:
        raise ConfigError(f"noise must be a number and seed an integer: {err}") from None
    upcycle_checkpoint(ckpt, moe_overrides, out, noise, seed)
    print(f"wrote {out}\ncontinue training with:\n  lmlab-train init_from={out} {' '.join(moe_overrides)}")
    return 0
