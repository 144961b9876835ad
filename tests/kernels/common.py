"""Pieces the kernel tests share: a small attention module over any attention function, and the
check every kernel's torch.compile test makes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class TinyAttention(nn.Module):
    """Projects x (batch, seq, dim) to queries and grouped keys/values (GQA) as strided views and
    returns `attend(q, k, v)` (batch, heads, seq, head_dim) merged back to (batch, seq, dim)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, attend: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.kv_proj = nn.Linear(dim, 2 * n_kv_heads * self.head_dim, bias=False)
        self.attend = attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, s, 2, self.n_kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.attend(q, k, v).transpose(1, 2).reshape(b, s, -1)


def assert_compiles_like_eager(model: nn.Module, *inputs: torch.Tensor, backend: str = "inductor",
                               rtol: float | None = None, atol: float | None = None,
                               grad_rtol: float | None = None, grad_atol: float | None = None) -> None:
    """`torch.compile(model, fullgraph=True)` gives eager's output and parameter gradients
    (tolerances default to torch.testing's for the dtype)."""
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    out, out_c = model(*inputs), compiled(*inputs)
    torch.testing.assert_close(out_c, out, rtol=rtol, atol=atol)
    params = list(model.parameters())
    grads = torch.autograd.grad(out.float().square().sum(), params)
    grads_c = torch.autograd.grad(out_c.float().square().sum(), params)
    for g, g_c in zip(grads, grads_c):
        torch.testing.assert_close(g_c, g, rtol=grad_rtol, atol=grad_atol)
