"""Integer grids a weight is rounded onto, and round-to-nearest (RTN), the baseline method.

A weight row is cut into groups of `group_size` input columns; each group has its own `scale` and
`zero`, and an integer code q in [qmin, qmax] stands for the value (q - mid) * scale + zero. Rounding
to the nearest grid point is off by at most scale / 2 for any weight inside the group's range, which
the grid spans exactly (its extreme codes are the group's extreme weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Grid:
    """Codes q in [qmin, qmax] for the values (q - mid) * scale + zero, one scale and zero per group."""

    qmin: int
    qmax: int
    mid: int
    symmetric: bool  # zero = 0 and scale = absmax / qmax; else the group's [min, max] spans the whole grid

    def params(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero of each group (the last dimension of `groups`), in float32."""
        groups = groups.float()
        if self.symmetric:
            scale = groups.abs().amax(-1) / self.qmax
            zero = torch.zeros_like(scale)
        else:
            low = groups.amin(-1)
            scale = (groups.amax(-1) - low) / (self.qmax - self.qmin)
            zero = low + (self.mid - self.qmin) * scale  # the code qmin lands on the group's minimum
        # A constant group (all weights equal) has no spread; any positive scale then rounds exactly.
        return scale.clamp(min=torch.finfo(torch.float32).tiny), zero

    def codes(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """The nearest code of each weight (float32 holding integers)."""
        return torch.clamp(torch.round((w.float() - zero) / scale) + self.mid, self.qmin, self.qmax)

    def values(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return (codes - self.mid) * scale + zero


# Per-channel int8: symmetric, -128 unused so that the grid is symmetric around 0.
INT8 = Grid(qmin=-127, qmax=127, mid=0, symmetric=True)
# Group-wise int4 in the layout of PyTorch's tinygemm kernel (`_weight_int4pack_mm`): unsigned
# codes 0..15 meaning (q - 8) * scale + zero, with a float zero so no code is wasted off the range.
INT4 = Grid(qmin=0, qmax=15, mid=8, symmetric=False)


def round_to_nearest(weight: torch.Tensor, grid: Grid, group_size: int, hessian: torch.Tensor | None,
                     damp: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (N, K) and per-group scale and zero (N, K // group_size) of `weight` (N, K), without calibration.

    `hessian` and `damp` are unused: RTN shares the signature of the methods that use them."""
    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)
    scale, zero = grid.params(groups)
    return grid.codes(groups, scale[..., None], zero[..., None]).view(n, k), scale, zero
