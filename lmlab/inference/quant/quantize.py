"""`quantize`: replace a Transformer's Linear layers with weight-only quantized ones, in place."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from lmlab.errors import ConfigError
from lmlab.inference.quant.gptq import collect_hessians
from lmlab.inference.quant.linear import QuantLinear
from lmlab.inference.quant.registry import QUANTS
from lmlab.nn.moe import MoELayer
from lmlab.nn.transformer import Transformer


def quantize(model: Transformer, cfg: Any, calibration: Iterable[torch.Tensor] | None = None,
             progress: bool = False) -> dict[str, Any]:
    """Quantize the Linear weights of `model`'s layers (and `lm_head` if `quant.quantize_head`) in place.

    `cfg` selects a `quant` entry (a name, a mapping with `name`, or an entry's Config). What is
    quantized: every `nn.Linear` under `model.layers`: attention (q/k/v/o, MLA's and linear
    attention's projections), dense FFNs and MoE shared experts. What stays in full precision:
    `embed_tokens`; MoE routed experts (stacked parameters, not nn.Linear); MoE router gates (a
    rounding error there flips which experts a token goes to); MTP modules (plain decoding does not
    run them); the head unless `quantize_head`.

    `calibration` yields token-id batches (B, S); `method=gptq` needs them. GPTQ's Hessians are all
    collected in one forward pass per batch of the unquantized model, then every Linear is quantized
    from them. Quantize on the device and in the dtype the model will run in: the kernel, and with
    it the weight's packed layout, is chosen per Linear from them.

    Returns a report: the entry and method, how many Linears were quantized, how many run each
    kernel, and their weights' bytes before and after.
    """
    entry, config = QUANTS.resolve(cfg)
    quant = entry.target(cfg=config)
    targets = quantize_targets(model, quant.cfg.quantize_head)
    # Every check a user's choice can fail runs here, before the calibration pass.
    plan = {name: (quant.group_size(name, m), quant.kernel(name, m)) for name, m in targets.items()}
    hessians: dict[str, torch.Tensor] = {}
    if quant.method.calibrated:
        if calibration is None:
            raise ConfigError(f"quant.method={quant.cfg.method} needs calibration batches of token ids; "
                              "pass some or use quant.method=rtn")
        hessians = collect_hessians(model, targets, calibration)
    before = after = 0
    for name, linear in tqdm(targets.items(), desc=f"quantizing ({quant.cfg.method})", unit="layer",
                             disable=not progress):
        group_size, kernel = plan[name]
        with torch.no_grad():
            module = quant.replace(linear, group_size, kernel, hessians.pop(name, None))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
        before += sum(t.nbytes for t in (*linear.parameters(), *linear.buffers()))
        after += sum(t.nbytes for t in module.buffers())
    return {"quant": entry.name, "method": quant.cfg.method, "layers": len(targets),
            "kernels": dict(Counter(kernel for _, kernel in plan.values())), "bytes_before": before,
            "bytes_after": after}


def set_kernels(model: nn.Module, kernel: str = "auto") -> dict[str, int]:
    """Re-pack every quantized Linear of `model` for `kernel` (with "auto", each for the first of its kernels that
    runs it), in place; the model must have been quantized with quant.kernel=dequant, whose layout gives the codes
    back. One calibration so serves engines that read different layouts. Returns how many Linears run each kernel."""
    return dict(Counter(module.set_kernel(kernel, name) for name, module in model.named_modules()
                        if isinstance(module, QuantLinear)))


def quantize_targets(model: Transformer, quantize_head: bool) -> dict[str, nn.Linear]:
    """The Linears to quantize by module name (see `quantize`)."""
    gates = {id(moe.gate) for moe in model.modules() if isinstance(moe, MoELayer)}
    targets = {name: m for name, m in model.named_modules()
               if name.startswith("layers.") and isinstance(m, nn.Linear) and id(m) not in gates}
    if quantize_head and isinstance(model.lm_head, nn.Linear):
        targets["lm_head"] = model.lm_head
    return targets
