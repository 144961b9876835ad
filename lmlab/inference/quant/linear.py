"""Weight-only quantized Linear modules, and the kernels that multiply by their weights.

Each module picks its kernel once, at construction, from the device, dtype and shape of the weight
it replaces; `module.kernel` says which. `dequant` (dequantize to the input's dtype, then a plain
matmul) runs anywhere and is the reference the packed kernels are tested against. The forward pass
has no Python branch on tensor values, so a compiled decode step can capture it in a CUDA graph.

Measured on an H200 with torch 2.11 (bf16, 4096 x 4096 weight, batch of 1 row / 32 / 512 rows,
microseconds, eager): bf16 F.linear 15 / 14 / 25; `_weight_int8pack_mm` 128 / 1214 / 18835 (a naive
kernel); int8 dequant 62 / 64 / 80 (torch.compile with coordinate-descent tuning fuses the int8 read
into the GEMV at one row, as in gpt-fast); tinygemm `_weight_int4pack_mm` 7.4 / 42 / 591. So `auto`
takes tinygemm for int4 on CUDA, and dequant for int8; `int8pack_mm` runs only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError
from lmlab.inference.quant.grid import INT4


@dataclass(frozen=True)
class Kernel:
    """One way to multiply by a quantized weight."""

    matmul: Callable[[torch.Tensor, nn.Module], torch.Tensor]  # (x (M, K), module) -> (M, N)
    unfit: Callable[[int, int, torch.device, torch.dtype], str | None]  # (N, K, ...) -> why it cannot run; None: it can
    pack: Callable[[torch.Tensor], torch.Tensor] = lambda codes: codes  # codes (N, K) -> the stored weight
    dequantize: Callable[[nn.Module], torch.Tensor] | None = None  # module -> weight (N, K) in float32 or bf16
    # the stored weight -> codes (N, K); None where the layout is the kernel's own and does not give them back
    unpack: Callable[[torch.Tensor], torch.Tensor] | None = lambda weight: weight


def _runs_anywhere(n: int, k: int, device: torch.device, dtype: torch.dtype) -> str | None:
    return None


def choose_kernel(kernels: dict[str, Kernel], auto: tuple[str, ...], requested: str, name: str,
                  weight: torch.Tensor) -> str:
    """`requested`, or with "auto" the first of `auto` that can run `weight` (N, K) of Linear `name`."""
    n, k = weight.shape
    if requested == "auto":
        return next(key for key in auto if kernels[key].unfit(n, k, weight.device, weight.dtype) is None)
    reason = kernels[requested].unfit(n, k, weight.device, weight.dtype)
    if reason:
        raise ConfigError(f"quant.kernel={requested} cannot run {name}: {reason}; use quant.kernel=auto")
    return requested


class QuantLinear(nn.Module):
    """y = x W^T (+ bias) for x of any leading shape, in x's dtype; W is stored quantized."""

    kernels: dict[str, Kernel]
    auto: tuple[str, ...]  # kernels `quant.kernel=auto` tries in order; the last runs anywhere

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, kernel: str):
        super().__init__()
        self.out_features, self.in_features, self.kernel = out_features, in_features, kernel
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels[self.kernel].matmul(x.reshape(-1, self.in_features), self).to(x.dtype)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def set_kernel(self, kernel: str, name: str = "") -> str:
        """Store the weight for `kernel` (with "auto", the first of `auto` that runs it) instead: the same codes
        re-packed, exactly, not quantized again. Returns the kernel; `name` is the Linear's, for errors."""
        unpack = self.kernels[self.kernel].unpack
        if unpack is None:
            raise ConfigError(f"{name or 'a Linear'}: the {self.kernel} kernel's layout does not give its codes back "
                              "to re-pack; quantize with quant.kernel=dequant")
        # the kernels' checks read the replaced weight's shape, device and dtype: a broadcast scalar has them
        like = torch.empty((), dtype=self.dtype, device=self.weight.device).expand(self.out_features, self.in_features)
        kernel = choose_kernel(self.kernels, self.auto, kernel, name, like)
        self.weight = self.kernels[kernel].pack(unpack(self.weight))
        self.kernel = kernel
        return kernel

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


# ---- int8: codes (N, K) int8, one scale per output row ----

def _int8_dequant_mm(x: torch.Tensor, m: Int8Linear) -> torch.Tensor:
    # The scale multiplies the N outputs rather than the N x K weight; the int8 codes are exact in bf16.
    return F.linear(x, m.weight.to(x.dtype)) * m.scales.to(x.dtype)


def _int8pack_mm(x: torch.Tensor, m: Int8Linear) -> torch.Tensor:
    return torch._weight_int8pack_mm(x.contiguous(), m.weight, m.scales.to(x.dtype))


def _cpu_or_cuda(n: int, k: int, device: torch.device, dtype: torch.dtype) -> str | None:
    return None if device.type in ("cpu", "cuda") else f"it runs on CPU and CUDA, not {device.type}"


class Int8Linear(QuantLinear):
    """Per-output-channel symmetric int8 weight: W[n, k] = weight[n, k] * scales[n]."""

    kernels = {"dequant": Kernel(_int8_dequant_mm, _runs_anywhere), "int8pack_mm": Kernel(_int8pack_mm, _cpu_or_cuda)}
    auto = ("dequant",)  # see the module docstring: torch 2.11's CUDA int8pack_mm is slower than dequant

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, kernel: str):
        super().__init__(*codes.shape, bias, kernel)
        self.register_buffer("weight", codes.to(torch.int8))
        self.register_buffer("scales", scales)  # (N,), in the replaced weight's dtype

    @property
    def dtype(self) -> torch.dtype:
        """The replaced weight's dtype."""
        return self.scales.dtype

    def dequantize(self) -> torch.Tensor:
        return self.weight.to(self.scales.dtype) * self.scales[:, None]


# ---- int4: codes (N, K) in 0..15, a scale and zero per group of `group_size` input columns ----

def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K / 2) uint8, the even column in the high nibble (the tinygemm packer's input)."""
    codes = codes.to(torch.uint8)
    return (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed >> 4, packed & 15], dim=-1).flatten(-2)


def _dequantize_nibbles(m: Int4Linear) -> torch.Tensor:
    codes = unpack_nibbles(m.weight).float().view(m.out_features, -1, m.group_size)
    scale, zero = m.scales_and_zeros.float().transpose(0, 1).unbind(-1)  # (N, groups) each
    return INT4.values(codes, scale[..., None], zero[..., None]).view(m.out_features, m.in_features)


def _int4_dequant_mm(x: torch.Tensor, m: Int4Linear) -> torch.Tensor:
    return F.linear(x, _dequantize_nibbles(m).to(x.dtype))


def _inner_k_tiles(k: int) -> int:
    """K-tiles of 16 columns tinygemm packs together: the most of 8, 4, 2 that K allows."""
    return next(tiles for tiles in (8, 4, 2) if k % (16 * tiles) == 0)


def _tinygemm_pack(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack(pack_nibbles(codes), _inner_k_tiles(codes.shape[1]))


def _tinygemm_mm(x: torch.Tensor, m: Int4Linear) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), m.weight, m.group_size,
                                              m.scales_and_zeros)


def _tinygemm_dequantize(m: Int4Linear) -> torch.Tensor:
    # The packed layout is the kernel's own; multiplying the identity by it reads the weight back exactly.
    eye = torch.eye(m.in_features, dtype=torch.bfloat16, device=m.weight.device)
    return _tinygemm_mm(eye, m).t()


def _tinygemm_unfit(n: int, k: int, device: torch.device, dtype: torch.dtype) -> str | None:
    # K is a multiple of the group size (>= 32), which is all the packer needs of it.
    if device.type != "cuda":
        return f"it needs CUDA, not {device.type}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "it needs a GPU of compute capability 8.0 or newer"
    if dtype != torch.bfloat16:
        return f"it needs bfloat16 weights, not {dtype}"
    if n % 8:
        return f"it needs out_features divisible by 8, not {n}"
    return None


class Int4Linear(QuantLinear):
    """Group-wise asymmetric int4 weight: W[n, k] = (code - 8) * scale + zero of the group of column k."""

    kernels = {
        "dequant": Kernel(_int4_dequant_mm, _runs_anywhere, pack_nibbles, _dequantize_nibbles, unpack_nibbles),
        "int4pack_mm": Kernel(_tinygemm_mm, _tinygemm_unfit, _tinygemm_pack, _tinygemm_dequantize, unpack=None),
    }
    auto = ("int4pack_mm", "dequant")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, kernel: str):
        super().__init__(*codes.shape, bias, kernel)
        self.group_size = group_size
        self.register_buffer("weight", self.kernels[kernel].pack(codes))
        # (groups, N, 2) in the replaced weight's dtype: tinygemm's layout, also read by dequant.
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous())

    @property
    def dtype(self) -> torch.dtype:
        """The replaced weight's dtype."""
        return self.scales_and_zeros.dtype

    def dequantize(self) -> torch.Tensor:
        return self.kernels[self.kernel].dequantize(self).to(self.scales_and_zeros.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"
