"""Shared fixtures: composing lmlab's real config tree with small, fast overrides."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from lmlab.catalog import load_catalog
from lmlab.cli.compose import compose_config

load_catalog()

# A model and run small enough for a test to train in seconds on a CPU.
TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.max_seq_len=32",
    "model.attention.n_heads=2",
    "data.context_length=32",
    "data.batch_size=8",
    "trainer.max_steps=30",
    "trainer.val_every=15",
    "trainer.val_batches=2",
    "trainer.log_every=5",
    "trainer.checkpoint_every=10",
    "trainer.progress_bar=false",
    "sched.warmup_steps=5",
    "optim.lr=1e-2",
    "tokenizer.vocab_size=320",
]


@pytest.fixture
def tiny_overrides(tmp_path: Path) -> list[str]:
    return [*TINY, f"cache_dir={tmp_path / 'cache'}"]


@pytest.fixture
def make_cfg():
    """The config lmlab-train composes from these overrides, checked like on the command line."""
    return compose_config


def train_tiny(folder: Path, steps: int, *overrides: str) -> str:
    """A TINY run of `steps` steps in `folder` (validated at the end); returns its last checkpoint."""
    from lmlab.training import train

    train(compose_config([*TINY, f"cache_dir={folder / 'cache'}", f"trainer.max_steps={steps}", "sched.warmup_steps=1",
                          f"trainer.val_every={steps}", *overrides]), folder)
    return str(folder / "checkpoints" / "last.ckpt")


def next_token_losses(model, ids, steps: int, lr: float) -> list[float]:
    """`steps` AdamW steps of next-token cross-entropy on `ids` (batch, seq): the loss before each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def run_cli(args: list[str], cwd: Path, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run an lmlab console entry point the way a user does, in a fresh process."""
    env = {**os.environ, **(env_extra or {})}
    script = Path(sys.executable).parent / args[0]
    return subprocess.run([str(script), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


class OpCounts(TorchDispatchMode):
    """How many times each aten op runs while the mode is on."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
