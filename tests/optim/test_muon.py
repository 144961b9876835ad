"""Muon: the Newton-Schulz orthogonalisation, the update, and Muon + AdamW as one resumable optimizer."""

import io

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from lmlab.optim import OPTIMIZERS, SCHEDULERS, CompositeOptimizer, Muon, orthogonalise


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (4, 48, 16), (1, 1)])
def test_orthogonalise_gives_singular_values_near_one(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 5
    s = torch.linalg.svdvals(orthogonalise(g))
    # The tuned coefficients trade exactness for speed: singular values land near 1, not on it.
    assert s.min() > 0.6 and s.max() < 1.25, s


def test_orthogonalise_keeps_the_singular_vectors():
    g = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    # An odd matrix polynomial keeps the singular vectors and maps each singular value near 1.
    in_basis = u.T @ orthogonalise(g) @ vh.T
    diagonal = torch.diagonal(in_basis)
    assert (in_basis - torch.diag(diagonal)).abs().max() < 1e-4
    assert diagonal.min() > 0.6 and diagonal.max() < 1.25
    assert torch.allclose(orthogonalise(3 * g), orthogonalise(g), atol=1e-5)  # scale does not matter


def test_a_stack_is_orthogonalised_matrix_by_matrix():
    stack = torch.randn(3, 12, 20, generator=torch.Generator().manual_seed(2))
    batched = orthogonalise(stack)
    for i in range(3):
        torch.testing.assert_close(batched[i], orthogonalise(stack[i]), rtol=1e-5, atol=1e-5)


def test_first_step_moves_by_the_scaled_orthogonalised_gradient():
    w = torch.randn(8, 4, requires_grad=True)  # tall: scaled by sqrt(8 / 4)
    start = w.detach().clone()
    w.grad = torch.randn(8, 4)
    Muon([w], lr=0.1, momentum=0.95, nesterov=True).step()
    # With zero momentum, Nesterov's update is a multiple of the gradient, and the orthogonalisation ignores scale.
    torch.testing.assert_close(w.detach(), start - 0.1 * 2**0.5 * orthogonalise(w.grad), rtol=1e-5, atol=1e-5)


def test_expert_stack_steps_like_separate_matrices():
    torch.manual_seed(0)
    stack = torch.randn(3, 6, 5, requires_grad=True)
    singles = [stack[i].detach().clone().requires_grad_() for i in range(3)]
    opt_stack, opt_singles = Muon([stack], lr=0.05), Muon(singles, lr=0.05)
    for _ in range(5):
        grad = torch.randn(3, 6, 5)
        stack.grad = grad.clone()
        for i, p in enumerate(singles):
            p.grad = grad[i].clone()
        opt_stack.step(), opt_singles.step()
    for i, p in enumerate(singles):
        torch.testing.assert_close(stack[i].detach(), p.detach(), rtol=1e-5, atol=1e-6)


def test_muon_refuses_vectors():
    with pytest.raises(ValueError, match="only matrices"):
        Muon([torch.zeros(4, requires_grad=True)])


class TinyLM(nn.Module):
    """Every parameter role: embedding, matrices, a stack of experts, a gain, a bias, the head."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.experts = nn.Module()
        self.experts.up_proj = nn.Parameter(torch.randn(2, 8, 8) * 0.3)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 16, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        x = x + torch.tanh(self.proj(x))
        x = x + torch.einsum("bd,eod->bo", x, self.experts.up_proj) / 2
        return self.lm_head(self.norm(x))


def train(model, opt, sched, steps, first=0):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step)
        ids, targets = torch.randint(0, 16, (32,), generator=g), torch.randint(0, 16, (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids), targets).backward()
        opt.step()
        sched.step()


def fresh(seed=0):
    torch.manual_seed(seed)
    model = TinyLM()
    opt = OPTIMIZERS.build({"name": "muon", "weight_decay": 0.1}, model)
    lr_at = SCHEDULERS.build({"name": "wsd", "warmup_steps": 2}, 0.02, 10)
    return model, opt, LambdaLR(opt, lambda step: lr_at(step) / 0.02)


def test_muon_entry_is_one_optimizer_over_two_parts():
    model, opt, sched = fresh()
    assert isinstance(opt, CompositeOptimizer) and set(opt.parts) == {"muon", "adamw"}
    by_role = {role: g for g in opt.param_groups for role in g["roles"]}
    assert by_role["matrix"] is by_role["expert"] and by_role["matrix"]["optimizer"] == "muon"
    assert {by_role[r]["optimizer"] for r in ("embedding", "head", "norm", "bias")} == {"adamw"}
    assert by_role["norm"]["weight_decay"] == 0.0 and by_role["matrix"]["weight_decay"] == 0.1
    train(model, opt, sched, 3)  # the schedule reaches both parts
    assert by_role["matrix"]["lr"] == pytest.approx(0.02) and by_role["embedding"]["lr"] == pytest.approx(3e-3)


def test_resume_from_state_dict_continues_bit_for_bit():
    model, opt, sched = fresh()
    train(model, opt, sched, 8)

    model_a, opt_a, sched_a = fresh()
    train(model_a, opt_a, sched_a, 3)
    buffer = io.BytesIO()  # through bytes, as a checkpoint file would be
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict(), "sched": sched_a.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    model_b, opt_b, sched_b = fresh(seed=1)  # different initial weights, all overwritten by the load
    model_b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    sched_b.load_state_dict(saved["sched"])
    train(model_b, opt_b, sched_b, 5, first=3)

    for (name, p), q in zip(model.named_parameters(), model_b.parameters()):
        assert torch.equal(p, q), name
