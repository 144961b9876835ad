"""Stochastic rounding to bf16 and Adam's bf16 updates: unbiased, keyed, reproducible, and what nearest loses."""

import copy

import pytest
import torch

from lmlab.optim import SGD, Adam, AdamW
from lmlab.optim.composite import CompositeOptimizer
from lmlab.optim import stochastic_rounding
from lmlab.optim.stochastic_rounding import (_mix32_tensor, mix32, nearest_rounded_parameters, round_key,
                                             rounded_bits, rounded_bits_each, stochastic_round_,
                                             stochastic_round_each_)


def test_the_tensor_hash_is_the_scalar_hash():
    values = [0, 1, 2**16 - 1, 2**31, 2**32 - 1, 123456789, 3999999999]
    assert _mix32_tensor(torch.tensor(values)).tolist() == [mix32(v) for v in values]


def test_each_value_goes_to_a_bf16_neighbour_and_the_mean_is_kept():
    torch.manual_seed(0)
    x = torch.randn(4000) * torch.logspace(-3, 3, 4000)
    below = x.bfloat16()  # round to nearest, then the neighbour on the other side of x
    below = torch.where(below.float() > x, torch.nextafter(below, torch.tensor(-float("inf"), dtype=below.dtype)),
                        below)
    above = torch.nextafter(below, torch.tensor(float("inf"), dtype=below.dtype))
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    total = torch.zeros_like(x, dtype=torch.float64)
    draws = 400
    for key in range(draws):
        stochastic_round_(out, x, round_key(0, 0, key), 0)
        assert ((out == below) | (out == above)).all()
        total += out.double()
    # Each mean is x up to the spread of `draws` coin flips: a sigma of at most 0.5 / sqrt(400) = 0.025 of a step.
    # Rounding to nearest errs by 0.25 of a step on average, and always in the same direction.
    error = (total / draws - x.double()).abs() / (above.double() - below.double())
    assert error.max() < 5 * 0.025 and error.mean() < 0.03


def test_bf16_values_stay_and_the_noise_depends_on_key_and_stream():
    exact = torch.randn(1000).bfloat16().float()
    out = torch.empty(1000, dtype=torch.bfloat16)
    assert torch.equal(stochastic_round_(out, exact, 7, 0).float(), exact)
    x = torch.rand(10000) + 1  # in [1, 2): a step of 2^-7
    draws = {(key, stream): stochastic_round_(out.new_empty(10000), x, key, stream)
             for key, stream in ((1, 0), (1, 1), (2, 0))}
    assert torch.equal(draws[1, 0], stochastic_round_(out.new_empty(10000), x, 1, 0))  # reproducible
    assert not torch.equal(draws[1, 0], draws[1, 1]) and not torch.equal(draws[1, 0], draws[2, 0])
    with pytest.raises(ValueError, match="float32 to bfloat16"):
        stochastic_round_(torch.empty(3, dtype=torch.float16), torch.ones(3), 0, 0)


def test_the_compiled_rounding_draws_the_eager_bits_and_falls_back_to_them(monkeypatch):
    x = torch.cat([torch.randn(5000) * torch.logspace(-30, 30, 5000), torch.tensor([0.0, -0.0, 3.3895e38, -1e-40])])
    offset = round_key(3, 5, 7) + 1
    eager = rounded_bits(x, offset)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    assert torch.equal(stochastic_round_(out, x, offset - 1, 1).view(torch.int16), (eager >> 16).to(torch.int16))

    def broken(flats, offsets):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(stochastic_rounding._round, "fn", broken)
    with pytest.warns(UserWarning, match="runs eagerly .* no C\\+\\+ compiler"):
        assert torch.equal(stochastic_round_(torch.empty_like(out), x, offset - 1, 1), out)
    assert stochastic_rounding._round.fn is rounded_bits_each  # once: later calls round eagerly without a warning


def test_rounding_several_at_once_draws_what_each_draws_alone():
    srcs = [torch.randn(3, 7), torch.randn(50), torch.randn(2, 2, 5)]
    dsts = [torch.empty(x.shape, dtype=torch.bfloat16) for x in srcs]
    stochastic_round_each_(dsts, srcs, 1234, [0, 1, 2])
    for dst, src, stream in zip(dsts, srcs, [0, 1, 2]):
        assert torch.equal(dst, stochastic_round_(torch.empty_like(dst), src, 1234, stream))
    kept = [d.clone() for d in dsts]
    with pytest.raises(ValueError, match="float32 to bfloat16"):  # before any is written
        stochastic_round_each_(dsts + [torch.empty(3, dtype=torch.float16)], srcs + [torch.ones(3)], 9, [0, 1, 2, 0])
    assert all(torch.equal(d, k) for d, k in zip(dsts, kept))


def _small_steps(rounding: bool, steps: int = 50) -> torch.Tensor:
    """bf16 weights at 1 after `steps` Adam steps of 1e-4 each, far under half of bf16's step of 2^-7 there."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.ones(20000, dtype=torch.bfloat16))
    opt = Adam([p], lr=1e-4, betas=(0.9, 0.999), stochastic_rounding=rounding)
    for _ in range(steps):
        p.grad = torch.ones_like(p)  # Adam's normalised step is then lr, every step
        opt.step()
    return p.detach().double()


def test_adam_keeps_updates_that_round_to_nearest_loses():
    assert (_small_steps(rounding=False) == 1).all()  # every step rounded back
    drift = 1 - _small_steps(rounding=True).mean()
    assert drift == pytest.approx(50 * 1e-4, rel=0.05)


@pytest.mark.parametrize("state_dtype,composite", [(None, False), (torch.float32, False), (torch.float32, True)])
def test_rounding_keys_replay_after_a_resume(state_dtype, composite):
    """The same bits after a save and load mid-run, float32 moments of bf16 weights included (which torch's load
    would cast to bf16), alone or inside a composite optimizer."""
    def make(params):
        opt = AdamW(params, lr=1e-3, state_dtype=state_dtype)
        return CompositeOptimizer({"adamw": opt}) if composite else opt

    def run(resume_at: int | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16)) for _ in range(2)]
        opt = make(params)
        for step in range(6):
            if step == resume_at:
                saved = copy.deepcopy(opt.state_dict())
                opt = make(params)
                opt.load_state_dict(saved)
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)).bfloat16()
            opt.step()
        return [p.detach().clone() for p in params] + [s["exp_avg_sq"] for s in opt.state.values()]

    straight, resumed = run(None), run(resume_at=3)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(straight, resumed))
    assert [t.dtype for t in straight] == [torch.bfloat16] * 2 + [state_dtype or torch.bfloat16] * 2


def test_float32_updates_ignore_the_setting():
    torch.manual_seed(0)
    base = [torch.randn(5, 4), torch.randn(7)]
    results = []
    for rounding in (True, False):
        params = [torch.nn.Parameter(b.clone()) for b in base]
        opt = AdamW(params, lr=1e-2, stochastic_rounding=rounding)
        for step in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            opt.step()
        results.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_nearest_rounded_parameters_counts_what_no_part_rounds_stochastically():
    bf16 = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (10, 20, 40)]
    half = torch.nn.Parameter(torch.zeros(5, dtype=torch.float16))
    wide = torch.nn.Parameter(torch.zeros(1000))
    composite = CompositeOptimizer({"adamw": AdamW([bf16[0], half, wide]), "sgd": SGD([bf16[1]], lr=0.1),
                                    "adam": Adam([bf16[2]], stochastic_rounding=False)})
    assert nearest_rounded_parameters(composite) == 5 + 20 + 40
    assert nearest_rounded_parameters(AdamW([bf16[0], wide])) == 0


@pytest.mark.parametrize("rounding", [True, False])
def test_float32_moments_under_bf16_weights(rounding):
    """state_dtype=float32 keeps the moments in float32 beside bf16 weights, with or without stochastic rounding of
    the weights, and equals the float32 update rounded once."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000).bfloat16())
    wide = torch.nn.Parameter(p.detach().float())
    opt = AdamW([p], lr=1e-2, stochastic_rounding=rounding, state_dtype=torch.float32)
    reference = AdamW([wide], lr=1e-2)
    grad = torch.randn(1000).bfloat16()
    p.grad, wide.grad = grad, grad.float()
    opt.step(), reference.step()
    state = opt.state[p]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32 and p.dtype == torch.bfloat16
    torch.testing.assert_close(state["exp_avg_sq"], reference.state[wide]["exp_avg_sq"])
    step = p.detach().float().abs() * 2.0**-7  # one bf16 step: nearest is within half, stochastic within one
    assert ((p.detach().float() - wide.detach()).abs() <= step).all()
    with pytest.raises(ValueError, match="state_dtype must be"):
        AdamW([p], state_dtype=torch.float16)


def test_an_unknown_state_dtype_is_a_config_error(make_cfg):
    from lmlab.errors import ConfigError
    from lmlab.training.run import preflight

    with pytest.raises(ConfigError, match="optim.state_dtype must be float32 or bfloat16"):
        preflight(make_cfg(["optim.state_dtype=float8"]))
