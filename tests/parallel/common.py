"""Shared by the parallel tests: small models, the global batches of a short run, optimizer recipes,
and the single-process reference that every data-parallel run must reproduce.

A data-parallel rank r of n trains on rows [r*B/n, (r+1)*B/n) of each global batch of B rows with a
mean loss; averaging the gradients then gives the gradient of the mean loss over all B rows, so the
weights must match those of one process trained on the whole batches, to float32 round-off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from lmlab.nn import ModelConfig, Transformer
from lmlab.optim import OPTIMIZERS, AdamW
from lmlab.parallel import ZeRO1

GLOBAL_BATCH = 8  # rows per step, split evenly among 2 or 4 ranks
STEPS = 4
SEED = 100  # rank r builds its model from SEED + r: only the broadcast from rank 0 makes them equal
VOCAB = 64


class Toy(nn.Module):
    """An MLP with the cases a data-parallel wrapper must get right: a frozen layer, a random buffer,
    a weight shared by two layers, and a branch that only rows whose first feature is > 0 take."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.register_buffer("scale", torch.rand(16) + 0.5)
        self.shared_a = nn.Linear(16, 16)
        self.shared_b = nn.Linear(16, 16)
        self.shared_b.weight = self.shared_a.weight
        self.branch = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.frozen(h)) * self.scale
        h = torch.tanh(self.shared_b(torch.tanh(self.shared_a(h))))
        routed = x[:, :1] > 0
        if routed.any():  # a rank none of whose rows take the branch gives it no gradient at all
            h = h + torch.where(routed, self.branch(h), 0.0)
        return self.out(h)


def tiny_transformer() -> Transformer:
    """lmlab's Transformer at d_model 32 with tied embeddings (one weight, two uses)."""
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=16, norm="rmsnorm", ffn={"name": "swiglu", "d_ff": 64},
                      position="rope", attention={"name": "mha", "n_heads": 2}, block="prenorm",
                      vocab_size=VOCAB, tie_embeddings=True)
    return Transformer(cfg, VOCAB)


def tiny_moe_transformer() -> Transformer:
    """tiny_transformer with MoE FFNs: 4 experts of which each token takes 2, chosen by the aux-loss-free router
    (its balancing bias steps with the batch's expert load), and a shared expert."""
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=16, norm="rmsnorm", ffn={"name": "swiglu", "d_ff": 64},
                      position="rope", attention={"name": "mha", "n_heads": 2}, block="prenorm", vocab_size=VOCAB,
                      moe={"name": "aux_free", "n_experts": 4, "k": 2, "d_ff": 32, "n_shared_experts": 1})
    return Transformer(cfg, VOCAB)


def _toy_batches(g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Rows taking the branch, per step: only rank 0's, none (no gradient anywhere), only the last rank's, all.
    routed = [[0], [], [GLOBAL_BATCH - 1], list(range(GLOBAL_BATCH))]
    batches = []
    for step in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 8, generator=g)
        x[:, 0] = -1.0
        x[routed[step % len(routed)], 0] = 1.0
        batches.append((x, torch.randn(GLOBAL_BATCH, 4, generator=g)))
    return batches


def _token_batches(g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, 17), generator=g)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# name -> (build, batches from a generator, mean loss)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable, Callable]] = {
    "toy": (Toy, _toy_batches, F.mse_loss),
    "transformer": (tiny_transformer, _token_batches, _next_token_loss),
    "moe": (tiny_moe_transformer, _token_batches, _next_token_loss),
}


def _adamw_groups(model: nn.Module) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3}]


# name -> optimizer for a model; "zero1_X" is X sharded. Names, not callables, cross into the ranks.
RECIPES: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
    "zero1_sgd": lambda m: ZeRO1(m.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda m: AdamW(_adamw_groups(m), lr=1e-2),
    "zero1_adamw": lambda m: ZeRO1(_adamw_groups(m), AdamW, lr=1e-2),
    "muon": lambda m: OPTIMIZERS.build({"name": "muon", "weight_decay": 0.01}, m),
    "zero1_muon": lambda m: ZeRO1.from_registry({"name": "muon", "weight_decay": 0.01}, m),
}


def build(model: str, rank: int = 0) -> nn.Module:
    torch.manual_seed(SEED + rank)
    return MODELS[model][0]()


def batches(model: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return MODELS[model][1](torch.Generator().manual_seed(1234))


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    rows = t.shape[0] // world_size
    return t[rank * rows:(rank + 1) * rows]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, name: str, rank: int = 0, world_size: int = 1,
          sync: Callable[[], None] = lambda: None) -> None:
    """STEPS steps on this rank's shards, with a decaying LambdaLR (so schedules must reach every rank's
    optimizer); `sync` runs between backward and the optimizer step."""
    loss_fn = MODELS[name][2]
    schedule = LambdaLR(optimizer, lambda step: 1 / (1 + step))
    for x, y in batches(name):
        optimizer.zero_grad()
        loss_fn(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        sync()
        optimizer.step()
        schedule.step()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, detached copies."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(model: str, recipe: str) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
    """Weights after training in one process on the whole batches, and its optimizer."""
    threads = torch.get_num_threads()
    # One thread, as each rank has: these tensors are tiny, and on a busy 2-core machine a second
    # thread spends its time waiting for a core (a 16x slower reference).
    torch.set_num_threads(1)
    try:
        net = build(model)
        optimizer = RECIPES[recipe](net)
        train(net, optimizer, model)
    finally:
        torch.set_num_threads(threads)
    return weights(net), optimizer


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Equal to float32 round-off (assert_close's float32 tolerances: rtol 1.3e-6, atol 1e-5)."""
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{what}, {k}: {m}")
