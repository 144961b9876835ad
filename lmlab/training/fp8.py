"""Float8 training of the block matmuls (config group `fp8`), through torchao's float8 training.

    lmlab-train fp8=rowwise        # one scale per row of each operand (more accurate, the H100/H200 default)
    lmlab-train fp8=tensorwise     # one scale per tensor (fast)
    lmlab-train fp8=tensorwise_fast  # tensorwise, and the gradients' matmuls accumulate fast too (fastest: 1.32x
                                     # bf16 at ~1.4B on an H200, where tensorwise made 1.28x)

Each `nn.Linear` inside the Transformer's blocks (attention and dense FFN projections, the MTP modules' too)
becomes torchao's `Float8Linear`: its inputs, weights and gradients are cast to float8 (e4m3 forward, e5m2
for gradients in the tensorwise recipe) with dynamic scales, and the matmuls run on the GPU's float8 tensor
cores through `torch._scaled_mm`. The weights stay the same bf16/fp32 Parameter objects, so names, optimizer
roles and checkpoints are the plain model's. Left in their precision, as in the float8 recipes that train
well: the token embedding, the output head (its logits feed the loss directly), norms, routers (a gate's
small scores decide routing) and grouped MoE experts (not `nn.Linear`s). Linears whose widths are not
multiples of 16, which float8 matmuls cannot take, stay as they are and are counted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

from torch import nn

from lmlab.errors import ConfigError
from lmlab.registry import Registry

log = logging.getLogger(__name__)

FP8 = Registry("fp8", group="fp8", doc="float8 training of the block matmuls (torchao)")

FLOAT8_MULTIPLE = 16  # float8 matmuls need both widths to be multiples of this
KEPT = ("router",)  # Linears under these names keep their precision wherever they sit


@FP8.register("none")
class NoFloat8:
    """The matmuls in the run's precision (the default)."""

    def __init__(self, cfg=None):
        self.cfg = cfg

    def install(self, model: nn.Module) -> int:
        return 0


def block_linears(model: nn.Module) -> tuple[dict[str, nn.Linear], list[str]]:
    """(the blocks' Linears float8 can run, by name; the names of those it cannot: a width not a multiple of 16)."""
    chosen, skipped = {}, []
    for name, module in model.named_modules():
        inside_blocks = name.startswith(("layers.", "mtp_layers."))
        if not (isinstance(module, nn.Linear) and inside_blocks) or any(k in name.split(".") for k in KEPT):
            continue
        if module.in_features % FLOAT8_MULTIPLE or module.out_features % FLOAT8_MULTIPLE:
            skipped.append(name)
        else:
            chosen[name] = module
    return chosen, skipped


class Float8Training:
    """torchao's float8 training with the entry's scaling recipe (`recipe`)."""

    name: str  # the entry's, for messages
    recipe: str  # torchao's

    def __init__(self, cfg=None):
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError(f"fp8={self.name} needs torchao: pip install 'lmlab[fp8]'")
        self.cfg = cfg

    def linear_config(self):
        """torchao's Float8LinearConfig of the entry's recipe."""
        from torchao.float8 import Float8LinearConfig

        return Float8LinearConfig.from_recipe_name(self.recipe)

    def install(self, model: nn.Module) -> int:
        """Swap the blocks' Linears for Float8Linears, in place; returns how many."""
        from torchao.float8 import convert_to_float8_training

        chosen, skipped = block_linears(model)
        if not chosen:
            raise ConfigError(f"fp8={self.name}: no Linear in the model's blocks has widths that are multiples of "
                              f"{FLOAT8_MULTIPLE} (model.d_model and the FFN's hidden size)")
        if skipped:
            log.warning("fp8=%s: %d Linears keep their precision (a width not a multiple of %d): %s", self.name,
                        len(skipped), FLOAT8_MULTIPLE, ", ".join(skipped[:4]) + (" ..." if len(skipped) > 4 else ""))
        ids = {id(m) for m in chosen.values()}
        convert_to_float8_training(model, config=self.linear_config(),
                                   module_filter_fn=lambda module, fqn: id(module) in ids)
        return len(chosen)


@FP8.register("tensorwise")
class TensorwiseFloat8(Float8Training):
    """Float8 matmuls with one dynamic scale per tensor."""

    name = recipe = "tensorwise"


@FP8.register("tensorwise_fast")
class FastTensorwiseFloat8(TensorwiseFloat8):
    """Tensorwise, and the backward's float8 matmuls (input and weight gradients) also accumulate in the tensor
    cores' fast mode, as torchao's recipe has the forward's do; cuBLAS's slower mode adds its partial sums into
    float32 more often, which matters over the weight gradient's sum over every token of the batch."""

    name = "tensorwise_fast"

    def linear_config(self):
        from torchao.float8 import Float8GemmConfig

        fast = Float8GemmConfig(use_fast_accum=True)
        return dataclasses.replace(super().linear_config(), gemm_config_grad_input=fast, gemm_config_grad_weight=fast)


@FP8.register("rowwise")
class RowwiseFloat8(Float8Training):
    """Float8 matmuls with one dynamic scale per row (activations) and per column (weights): fewer outliers clip."""

    name = recipe = "rowwise"
