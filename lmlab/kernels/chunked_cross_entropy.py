"""Cross-entropy fused with the output projection, a (rows x vocabulary) tile at a time.

`linear_cross_entropy(hidden, weight, targets, ...)` returns what `cross_entropy` in
lmlab.training.losses returns for the logits `head(hidden @ weight.T)`: the mean cross-entropy over
the non-ignored rows (with label smoothing) and, asked for, the mean squared log-normaliser
(z-loss). `head` is the model's own: a muP output `multiplier`, then an optional `softcap`
(`softcap * tanh(logits / softcap)`). The (N, V) logits never exist: the forward walks tiles of
`chunk_size` rows by `vocab_chunk_size` columns, keeping per row a running log-sum-exp, the target's
logit and (for label smoothing) the logits' sum; the backward recomputes each tile's softmax from
the saved log-sum-exp and adds its share to d_hidden and d_weight. With 32k tokens and a 50k
vocabulary that is the difference between 3.3 GB of bf16 logits (and as much again for their
gradient) and one 64 MB float32 tile.

The tile's matmul runs in the inputs' dtype (under autocast, in autocast's), as the model's own head
would, and everything after it, the losses too, in float32 (float64 for float64 inputs). Gradients come
back in the input dtypes. As in PyTorch, a batch whose targets are all ignored has a NaN loss (0 / 0) and zero
gradients. `chunked_cross_entropy` is the plain form: the loss alone, no smoothing, z-loss or head.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

CHUNK_SIZE = 2048
VOCAB_CHUNK_SIZE = 8192


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
           chunk_size: int, vocab_chunk_size: int, label_smoothing: float, softcap: float | None) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"hidden must be (N, d) and weight (V, d); "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden and weight must share d; got {hidden.shape[1]} and {weight.shape[1]}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be ({hidden.shape[0]},) to match hidden; got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class indices; got {targets.dtype}")
    if chunk_size < 1 or vocab_chunk_size < 1:
        raise ValueError(f"chunk_size and vocab_chunk_size must be at least 1; got {chunk_size} and {vocab_chunk_size}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1]; got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive; got {softcap}")
    kept = targets[targets != ignore_index]
    if kept.numel() and (kept.min() < 0 or kept.max() >= weight.shape[0]):
        raise ValueError(f"targets must lie in [0, {weight.shape[0]}) or equal ignore_index={ignore_index}")


def _logits(h: torch.Tensor, w: torch.Tensor, acc: torch.dtype, multiplier: float, softcap: float | None
            ) -> torch.Tensor:
    """The head's logits of one tile, in `acc`: the matmul in the inputs' (or autocast's) dtype, as the model's."""
    logits = (h @ w.T).to(acc)
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _on_cuda_compiled(fn):
    """`fn` under torch.compile for CUDA tensors, where Inductor fuses a tile's softmax passes into one or two
    kernels (eager, the tile's float32 passes made the loss 5x slower than the compiled unfused one); as written
    elsewhere (the CPU, where compiling each tile shape would cost more than it saves)."""
    compiled = torch.compile(fn, dynamic=False)

    @functools.wraps(fn)
    def run(h: torch.Tensor, *args):
        return (compiled if h.is_cuda else fn)(h, *args)

    run.compiled = compiled  # what CUDA tensors get; tests run it on the CPU too
    return run


@_on_cuda_compiled
def _tile_forward(h: torch.Tensor, w: torch.Tensor, local: torch.Tensor, acc: torch.dtype, multiplier: float,
                  softcap: float | None, smoothing: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile's (log-sum-exp, target logit or 0 where the target lies in another tile, logits' sum) per row."""
    logits = _logits(h, w, acc, multiplier, softcap)
    here = (local >= 0) & (local < logits.shape[1])
    target = logits.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None])[:, 0] * here
    total = logits.sum(dim=-1) if smoothing else torch.zeros_like(target)
    return torch.logsumexp(logits, dim=-1), target, total


@_on_cuda_compiled
def _tile_backward(h: torch.Tensor, w: torch.Tensor, local: torch.Tensor, lse: torch.Tensor, ce_scale: torch.Tensor,
                   z_scale: torch.Tensor, acc: torch.dtype, label_smoothing: float, vocab: int, multiplier: float,
                   softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's shares of d_hidden and d_weight."""
    logits = _logits(h, w, acc, multiplier, softcap)
    # d logits = softmax - (1 - eps) one_hot(target) - eps / V for the loss, 2 lse softmax for z.
    d_logits = torch.exp(logits - lse[:, None]) * (ce_scale + z_scale)[:, None]
    here = (local >= 0) & (local < logits.shape[1])
    d_logits = d_logits.scatter_add(1, local.clamp(0, logits.shape[1] - 1)[:, None],
                                    (-(1 - label_smoothing) * ce_scale * here)[:, None])
    if label_smoothing:
        d_logits = d_logits - (label_smoothing / vocab) * ce_scale[:, None]
    if softcap is not None:  # d/dx c tanh(x / c) = 1 - tanh^2, with tanh = logits / c
        d_logits = d_logits * (1 - (logits / softcap).pow(2))
    d_raw = d_logits * multiplier
    return d_raw.to(w.dtype) @ w, d_raw.T.to(h.dtype) @ h


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # the backward's matmuls run under the forward's autocast
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                label_smoothing: float, multiplier: float, softcap: float | None, chunk_size: int,
                vocab_chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.promote_types(hidden.dtype, torch.float32)
        n, vocab = hidden.shape[0], weight.shape[0]
        kept = targets != ignore_index
        safe_targets = targets.masked_fill(~kept, 0)  # any valid index; those rows are masked out
        lse = torch.full((n,), float("-inf"), dtype=acc, device=hidden.device)
        target_logit = torch.zeros(n, dtype=acc, device=hidden.device)
        logit_sum = torch.zeros(n, dtype=acc, device=hidden.device)
        for r0 in range(0, n, chunk_size):
            rows = slice(r0, r0 + chunk_size)
            for v0 in range(0, vocab, vocab_chunk_size):
                tile_lse, target, total = _tile_forward(hidden[rows], weight[v0:v0 + vocab_chunk_size],
                                                        safe_targets[rows] - v0, acc, multiplier, softcap,
                                                        bool(label_smoothing))
                lse[rows] = torch.logaddexp(lse[rows], tile_lse)
                target_logit[rows] += target
                logit_sum[rows] += total
        # Label smoothing mixes in the uniform target: (1 - eps) (lse - x_t) + eps (lse - mean_j x_j).
        ce_rows = lse - (1 - label_smoothing) * target_logit - label_smoothing * logit_sum / vocab
        n_kept = kept.sum()
        ce = (ce_rows * kept).sum() / n_kept
        z = (lse.pow(2) * kept).sum() / n_kept
        ctx.save_for_backward(hidden, weight, safe_targets, kept, lse, n_kept)
        ctx.settings = (label_smoothing, multiplier, softcap, chunk_size, vocab_chunk_size)
        return ce, z

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx: Any, d_ce: torch.Tensor, d_z: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, safe_targets, kept, lse, n_kept = ctx.saved_tensors
        label_smoothing, multiplier, softcap, chunk_size, vocab_chunk_size = ctx.settings
        acc = lse.dtype
        vocab = weight.shape[0]
        # clamp: with every target ignored, every row's gradient is masked to zero anyway (as in torch).
        scale = kept.to(acc) / n_kept.clamp(min=1)
        ce_scale, z_scale = scale * d_ce.to(acc), scale * d_z.to(acc) * 2 * lse  # d(lse^2) = 2 lse d(lse)
        d_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        for r0 in range(0, hidden.shape[0], chunk_size):
            rows = slice(r0, r0 + chunk_size)
            for v0 in range(0, vocab, vocab_chunk_size):
                cols = slice(v0, v0 + vocab_chunk_size)
                d_h, d_w = _tile_backward(hidden[rows], weight[cols], safe_targets[rows] - v0, lse[rows],
                                          ce_scale[rows], z_scale[rows], acc, label_smoothing, vocab, multiplier,
                                          softcap)
                d_hidden[rows] += d_h
                d_weight[cols] += d_w
        return d_hidden.to(hidden.dtype), d_weight.to(weight.dtype), None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: bool = False, multiplier: float = 1.0,
                         softcap: float | None = None, chunk_size: int = CHUNK_SIZE,
                         vocab_chunk_size: int = VOCAB_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean cross-entropy, mean logsumexp^2 if `z_loss` else None) of the logits `head(hidden @ weight.T)`.

    hidden: (N, d), weight: (V, d) (the lm_head, or the tied embedding), targets: (N,) class indices. See the
    module docstring for the head, the tiles and the dtypes.
    """
    _check(hidden, weight, targets, ignore_index, chunk_size, vocab_chunk_size, label_smoothing, softcap)
    ce, z = _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, label_smoothing, multiplier, softcap,
                                      chunk_size, vocab_chunk_size)
    return ce, (z if z_loss else None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          ignore_index: int = -100, chunk_size: int = CHUNK_SIZE,
                          vocab_chunk_size: int = VOCAB_CHUNK_SIZE) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` over the non-ignored rows.

    hidden: (N, d), weight: (V, d) (the lm_head / tied embedding), targets: (N,) class indices.
    """
    return linear_cross_entropy(hidden, weight, targets, ignore_index, chunk_size=chunk_size,
                                vocab_chunk_size=vocab_chunk_size)[0]
