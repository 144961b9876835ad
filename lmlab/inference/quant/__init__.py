"""Post-training weight-only quantization (config group `quant`): int8 per output channel, and int4
per group of input columns with GPTQ error compensation or round-to-nearest.

    report = quantize(model, "int8")
    report = quantize(model, {"name": "int4", "group_size": 64}, calibration=token_batches)

Each quantized `nn.Linear` becomes an `Int8Linear` or `Int4Linear` whose `kernel` says which matmul
runs it: PyTorch's packed int4 kernel (tinygemm) on CUDA in bf16, else a dequantising path.

Error bounds (tested): round-to-nearest puts each weight within scale / 2 of its value, where scale
is its row's (int8) or group's (int4) step, plus the rounding of scale and zero to the weight's dtype;
so an output y_n = sum_k x_k W_nk is off by at most sum_k |x_k| * scale_nk / 2.
"""

from lmlab.inference.quant.linear import Int4Linear, Int8Linear, QuantLinear
from lmlab.inference.quant.quantize import quantize, set_kernels
from lmlab.inference.quant.registry import QUANTS

__all__ = ["QUANTS", "Int4Linear", "Int8Linear", "QuantLinear", "quantize", "set_kernels"]
