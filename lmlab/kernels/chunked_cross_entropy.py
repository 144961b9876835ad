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
gradient) and 256 MB float32 tiles. On CUDA each row chunk's walk over the vocabulary is one compiled
graph (forward, and again backward), so a step makes a few calls, not one per tile.

The tile's matmul runs in the inputs' dtype (under autocast, in autocast's), as the model's own head
would, and everything after it, the losses too, in float32 (float64 for float64 inputs). Gradients come
back in the input dtypes. As in PyTorch, a batch whose targets are all ignored has a NaN loss (0 / 0) and zero
gradients. `chunked_cross_entropy` is the plain form: the loss alone, no smoothing, z-loss or head.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# On an H200 at 32768 tokens x d 1024 x vocabulary 50304 (bf16, forward+backward; experiments/kernels/
# h200-2026-12-03c/linear-ce-tiles.txt): 2048 x 8192 tiles 34.9 ms and 740 MiB, these 29.4 ms and 1,162 MiB,
# 8192 x 16384 28.2 ms and 1,964 MiB; F.linear + cross-entropy compiled 18.3 ms and 3,306 MiB.
CHUNK_SIZE = 4096
VOCAB_CHUNK_SIZE = 16384


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
    kernels and a row chunk's tiles into one graph (eager, the tiles' float32 passes and launches made the loss 5x
    slower than the compiled unfused one); as written elsewhere (the CPU, where compiling each shape would cost
    more than it saves). Compiled at the first call that needs it: torch.compile imports Inductor, seconds that
    every command importing lmlab's kernels would pay otherwise. Inside a graph being compiled, `fn` is traced into
    it, as Dynamo inlines a nested torch.compile."""
    @functools.wraps(fn)
    def run(h: torch.Tensor, *args):
        return (compiled_fn() if h.is_cuda and not torch.compiler.is_compiling() else fn)(h, *args)

    compiled_fn = functools.cache(lambda: torch.compile(fn, dynamic=False))
    run.compiled = lambda *args: compiled_fn()(*args)  # what CUDA tensors get; tests run it on the CPU too
    return run


def _target_column(targets: torch.Tensor, v0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's target as a column index (N, 1) of the tile of `width` entries from vocabulary entry v0, clamped
    into it, and whether the target lies in that tile."""
    local = targets - v0
    return local.clamp(0, width - 1)[:, None], (local >= 0) & (local < width)


@_on_cuda_compiled
def _rows_forward(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, acc: torch.dtype, multiplier: float,
                  softcap: float | None, smoothing: bool, vocab_chunk_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp, target logit, logits' sum or zeros) per row of a chunk, a vocabulary tile at a time. Compiled,
    the loop over tiles unrolls into one graph: one call per row chunk, with the tiles' running statistics fused
    into their reductions."""
    lse = torch.full(h.shape[:1], float("-inf"), dtype=acc, device=h.device)
    target = torch.zeros(h.shape[:1], dtype=acc, device=h.device)
    total = torch.zeros_like(target)
    for v0 in range(0, weight.shape[0], vocab_chunk_size):
        logits = _logits(h, weight[v0:v0 + vocab_chunk_size], acc, multiplier, softcap)
        column, here = _target_column(targets, v0, logits.shape[1])
        target = target + logits.gather(1, column)[:, 0] * here
        if smoothing:
            total = total + logits.sum(dim=-1)
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
    return lse, target, total


@_on_cuda_compiled
def _rows_backward(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                   ce_scale: torch.Tensor, z_scale: torch.Tensor, acc: torch.dtype, label_smoothing: float,
                   multiplier: float, softcap: float | None, vocab_chunk_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A row chunk's d_hidden (in `acc`) and its share of d_weight, a vocabulary tile at a time (one call per chunk
    when compiled)."""
    vocab = weight.shape[0]
    d_hidden = torch.zeros(h.shape, dtype=acc, device=h.device)
    d_weight = []
    for v0 in range(0, vocab, vocab_chunk_size):
        w = weight[v0:v0 + vocab_chunk_size]
        logits = _logits(h, w, acc, multiplier, softcap)
        # d logits = softmax - (1 - eps) one_hot(target) - eps / V for the loss, 2 lse softmax for z.
        d_logits = torch.exp(logits - lse[:, None]) * (ce_scale + z_scale)[:, None]
        column, here = _target_column(targets, v0, logits.shape[1])
        d_logits = d_logits.scatter_add(1, column, (-(1 - label_smoothing) * ce_scale * here)[:, None])
        if label_smoothing:
            d_logits = d_logits - (label_smoothing / vocab) * ce_scale[:, None]
        if softcap is not None:  # d/dx c tanh(x / c) = 1 - tanh^2, with tanh = logits / c
            d_logits = d_logits * (1 - (logits / softcap).pow(2))
        d_raw = d_logits * multiplier
        d_hidden = d_hidden + (d_raw.to(w.dtype) @ w).to(acc)
        d_weight.append(d_raw.T.to(h.dtype) @ h)
    return d_hidden, torch.cat(d_weight)


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
        stats = [_rows_forward(hidden[r0:r0 + chunk_size], weight, safe_targets[r0:r0 + chunk_size], acc, multiplier,
                               softcap, bool(label_smoothing), vocab_chunk_size) for r0 in range(0, n, chunk_size)]
        lse, target_logit, logit_sum = (torch.cat(parts) for parts in zip(*stats))
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
        # clamp: with every target ignored, every row's gradient is masked to zero anyway (as in torch).
        scale = kept.to(acc) / n_kept.clamp(min=1)
        ce_scale, z_scale = scale * d_ce.to(acc), scale * d_z.to(acc) * 2 * lse  # d(lse^2) = 2 lse d(lse)
        d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        for r0 in range(0, hidden.shape[0], chunk_size):
            rows = slice(r0, r0 + chunk_size)
            d_h, d_w = _rows_backward(hidden[rows], weight, safe_targets[rows], lse[rows], ce_scale[rows],
                                      z_scale[rows], acc, label_smoothing, multiplier, softcap, vocab_chunk_size)
            d_hidden[rows] = d_h
            d_weight += d_w
        return d_hidden, d_weight.to(weight.dtype), None, None, None, None, None, None, None


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
