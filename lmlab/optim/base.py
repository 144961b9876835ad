"""The base of lmlab's optimizers: one `step` loop, so each optimizer writes only its update rule."""

from __future__ import annotations

from collections.abc import Callable

import torch


def keep_state_dtypes(optimizer: torch.optim.Optimizer) -> None:
    """Make `optimizer.load_state_dict` keep each floating state tensor in the dtype it was saved in.

    torch casts every state tensor to its parameter's dtype on load, so Adam's float32 moments of bf16 weights
    (`state_dtype=float32`) would come back rounded to bf16 on every resume. A tensor whose dtype differs from its
    parameter's is taken out of the dict torch loads, and put back afterwards, moved to the parameter's device as
    torch moves the rest."""
    kept: list[tuple[torch.Tensor, str, torch.Tensor]] = []  # (parameter, state key, the saved tensor)

    def take_out(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        kept.clear()
        params = {saved_id: p for saved, group in zip(state_dict["param_groups"], opt.param_groups)
                  for saved_id, p in zip(saved["params"], group["params"])}
        state = {}
        for saved_id, values in state_dict["state"].items():
            p = params.get(saved_id)
            differs = {key for key, value in values.items() if p is not None and isinstance(value, torch.Tensor)
                       and value.is_floating_point() and value.dtype != p.dtype}
            kept.extend((p, key, values[key]) for key in differs)
            state[saved_id] = {key: value for key, value in values.items() if key not in differs}
        return {**state_dict, "state": state}

    def put_back(opt: torch.optim.Optimizer) -> None:
        for p, key, value in kept:
            opt.state[p][key] = value.to(device=p.device)
        kept.clear()

    optimizer.register_load_state_dict_pre_hook(take_out)
    optimizer.register_load_state_dict_post_hook(put_back)


def evaluate_closure(closure: Callable[[], float] | None) -> float | None:
    """The loss a `step(closure)` returns: the closure re-evaluated with gradients on, or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class ParamwiseOptimizer(torch.optim.Optimizer):
    """`step` evaluates the closure (if any), then calls `update` for every parameter with a gradient."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, p.grad, self.state[p], group)
        return loss

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        """Change `p` in place from its gradient, its optimizer state and its group's settings."""
        raise NotImplementedError
