"""Several optimizers acting as one, so that Muon and AdamW can share a run.

The composite's `param_groups` are the parts' own group dicts, and every part shares the
composite's `state`. Everything that handles "the optimizer" therefore works unchanged: an LR
scheduler rescales each group's lr, gradient clipping and zero_grad see every parameter, and
`state_dict` / `load_state_dict` save and restore all parts at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmlab.optim.base import evaluate_closure, keep_state_dtypes


class CompositeOptimizer(torch.optim.Optimizer):
    """Steps each param group with the part named by the group's "optimizer" key."""

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        self.parts = parts
        for name, part in parts.items():
            for group in part.param_groups:
                group["optimizer"] = name
        super().__init__([group for part in parts.values() for group in part.param_groups], defaults={})
        self._share_with_parts()
        keep_state_dtypes(self)  # its load, not the parts', restores their state

    def _share_with_parts(self) -> None:
        # load_state_dict replaces `state` and the group dicts; the parts must follow.
        for name, part in self.parts.items():
            part.param_groups = [group for group in self.param_groups if group["optimizer"] == name]
            part.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share_with_parts()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = evaluate_closure(closure)  # once, not once per part
        for part in self.parts.values():
            part.step()
        return loss
