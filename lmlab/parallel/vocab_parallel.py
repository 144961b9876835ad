"""Cross-entropy over logits split by vocabulary across a tensor-parallel group (Megatron-LM's).

Under tensor parallelism the output head is split by vocabulary columns, so rank r holds the logits of tokens
[r V/tp, (r + 1) V/tp). Gathering them would hold the whole (rows x V) matrix on every rank. Three
all-reduces of one number per row give the loss instead:
- the max over the vocabulary, for a stable exponent;
- the sum of exp(logit - max), the softmax's normaliser;
- the target's logit, which only the rank holding the target contributes.

The loss of a row is log(sum) + max - target logit. Backward needs no communication: each rank's gradient is
its slice of softmax - one-hot. Label smoothing adds the mean logit over the vocabulary, one more all-reduce
of a sum. The z-loss is logsumexp^2, which the same normaliser gives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group, ignore_index: int, smoothing: float):
        """Per-row loss terms of (N, V/tp) local logits: (cross-entropy (N,), logsumexp (N,))."""
        ctx.dtype = logits.dtype
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: float32 math
        vocab_local = logits.shape[-1]
        first = dist.get_rank(group) * vocab_local
        top = logits.max(dim=-1).values
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
        exp = torch.exp(logits - top[:, None])
        total = exp.sum(dim=-1)
        local = targets - first
        mine = (local >= 0) & (local < vocab_local) & (targets != ignore_index)
        target_logit = torch.where(mine, logits.gather(1, local.clamp(0, vocab_local - 1)[:, None])[:, 0], 0.0)
        sums = torch.stack([total, target_logit])
        if smoothing:
            sums = torch.cat([sums, logits.sum(dim=-1)[None]])
        dist.all_reduce(sums, group=group)
        lse = sums[0].log() + top
        ce = lse - sums[1]
        vocab = vocab_local * dist.get_world_size(group)
        if smoothing:  # (1 - s) * nll + s * mean over the vocabulary of -log p
            ce = (1 - smoothing) * ce + smoothing * (lse - sums[2] / vocab)
        ctx.save_for_backward(exp / sums[0][:, None], local, mine, lse)
        ctx.smoothing, ctx.vocab = smoothing, vocab
        return ce, lse

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, grad_lse: torch.Tensor):
        softmax, local, mine, lse = ctx.saved_tensors
        # d ce / d logits = softmax - (1 - s) one-hot - s / V; d lse / d logits = softmax
        grad = softmax * (grad_ce + grad_lse)[:, None]
        rows = torch.arange(len(local), device=local.device)[mine]
        grad[rows, local[mine]] -= (1 - ctx.smoothing) * grad_ce[mine]
        if ctx.smoothing:
            grad -= (ctx.smoothing / ctx.vocab) * grad_ce[:, None]
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                                 label_smoothing: float, z_loss: bool, *, group) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`lmlab.training.losses.cross_entropy` for (N, V/tp) logits split by vocabulary over `group`: the mean
    cross-entropy over the non-ignored rows, and with `z_loss` the mean squared logsumexp over them."""
    ce, lse = _VocabParallelCrossEntropy.apply(logits, targets, group, ignore_index, label_smoothing)
    keep = (targets != ignore_index).float()
    count = keep.sum().clamp(min=1)
    mean_ce = (ce * keep).sum() / count
    return mean_ce, ((lse ** 2) * keep).sum() / count if z_loss else None
