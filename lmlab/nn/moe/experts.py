"""E experts of one FFN, stored as stacked matrices and run on contiguous slices of sorted tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError
from lmlab.nn.ffn import FFN

# One kernel for all experts where PyTorch has one (CUDA, bf16); public name first, older private one after.
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def uses_grouped_mm(x: torch.Tensor) -> bool:
    return x.is_cuda and _GROUPED_MM is not None and x.dtype == torch.bfloat16


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Rows of `x` (N, in) sorted by expert, `counts[e]` of them for expert e -> (N, out), each
    block of rows times its expert's `weight[e]` (E, out, in) transposed, in x's dtype.

    On CUDA in bf16 this is one grouped GEMM; elsewhere one matmul per expert on its slice
    (autocast casts those as it casts any Linear). `offsets` (int32 cumulative counts) may be
    passed in when several projections share them.
    """
    if uses_grouped_mm(x):
        offsets = counts.cumsum(0).to(torch.int32) if offsets is None else offsets
        return _GROUPED_MM(x, weight.to(x.dtype).transpose(-2, -1), offs=offsets)
    slices = x.split(counts.tolist())
    return torch.cat([F.linear(rows, w) for rows, w in zip(slices, weight)])


class Experts(nn.Module):
    """`n_experts` copies of `ffn`: each of its projections becomes a parameter of shape
    (n_experts, out, in) under the same name, and `ffn.combine` runs with grouped projections,
    so any FFN written as `combine(x, proj)` works as an expert."""

    def __init__(self, ffn: FFN, n_experts: int):
        super().__init__()
        if not isinstance(ffn, FFN) or not ffn.projections:
            raise ConfigError(f"{type(ffn).__name__} cannot be an expert: an FFN needs `projections` and `combine`")
        for name in ffn.projections:
            linear = getattr(ffn, name)
            if linear.bias is not None:
                raise ConfigError(f"{type(ffn).__name__}.{name} has a bias; experts use bias-free projections")
            self.register_parameter(name, nn.Parameter(linear.weight.detach().expand(n_experts, -1, -1).clone()))
            delattr(ffn, name)
        self.ffn = ffn  # left holding only its formula and activation
        self.n_experts = n_experts

    def params_per_expert(self) -> int:
        return sum(p[0].numel() for p in self.parameters())

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x` (N, d) sorted by expert with `counts` (E,) rows each -> (N, d)."""
        offsets = counts.cumsum(0).to(torch.int32) if uses_grouped_mm(x) else None
        return self.ffn.combine(x, lambda name, h: grouped_linear(h, getattr(self, name), counts, offsets))
