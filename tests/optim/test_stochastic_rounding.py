"""Stochastic rounding to bf16 and Adam's bf16 updates: unbiased, keyed, reproducible, and what nearest loses."""

import copy

import pytest
import torch

from lmlab.optim import SGD, Adam, AdamW
from lmlab.optim import adam
from lmlab.optim.adam import adam_update_foreach
from lmlab.optim.composite import CompositeOptimizer
from lmlab.optim import stochastic_rounding
from lmlab.optim.stochastic_rounding import (FIRST_MOMENT, PACK_ALIGN, PARAM, SECOND_MOMENT, Float32Pack,
                                             _mix32_tensor, mix32, nearest_rounded_parameters, packed_rounded,
                                             round_key, rounded_bits, stochastic_round_)


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

    def broken(flat, tensor_of_block, starts, offsets):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(stochastic_rounding._round, "fn", broken)
    with pytest.warns(UserWarning, match="runs eagerly .* no C\\+\\+ compiler"):
        assert torch.equal(stochastic_round_(torch.empty_like(out), x, offset - 1, 1), out)
    assert stochastic_rounding._round.fn is packed_rounded  # once: later calls round eagerly without a warning


def test_a_pack_rounds_each_tensor_as_it_rounds_alone():
    """Tensors packed end to end (one longer than a block, one empty, one a block exactly) draw the bits each draws
    alone, whatever their neighbours; only the first len(dsts) are written, and a bad destination writes none."""
    srcs = [torch.randn(3, 7), torch.randn(PACK_ALIGN + 50), torch.randn(0), torch.randn(PACK_ALIGN), torch.randn(9)]
    pack = Float32Pack([src.bfloat16() if i == 4 else src for i, src in enumerate(srcs)])
    assert all(torch.equal(view, src.bfloat16().float() if i == 4 else src)
               for i, (view, src) in enumerate(zip(pack.views, srcs)))  # the values, widened to float32
    dsts = [torch.empty(x.shape, dtype=torch.bfloat16) for x in srcs[:4]]
    offsets = [round_key(1, i, 5) + i % 3 for i in range(4)]
    pack.stochastic_round_(dsts, offsets)
    for dst, src, offset in zip(dsts, srcs, offsets):
        alone = rounded_bits(src.reshape(-1), offset).view(torch.float32).bfloat16().view(src.shape)
        assert torch.equal(dst, alone)
    kept = [d.clone() for d in dsts]
    with pytest.raises(ValueError, match="float32 to bfloat16 of the same shape"):
        pack.stochastic_round_(dsts[:3] + [torch.empty(PACK_ALIGN, dtype=torch.float16)], offsets)
    assert all(torch.equal(d, k) for d, k in zip(dsts, kept))


@pytest.mark.parametrize("chunk", [adam.CHUNK_ELEMENTS, 1500])
def test_a_groups_bf16_update_draws_each_tensors_own_bits(chunk, monkeypatch):
    """Adam updates a group's bf16 tensors in float32, packed together (in chunks of `chunk` elements at most), and
    rounds each with its own noise: the bits of that tensor's float32 update rounded alone with its parameter's key
    and its stream (the contract that the Triton Adam, its twin, keeps)."""
    monkeypatch.setattr(adam, "CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in [(40, 30), (PACK_ALIGN + 3,), (5,)]]
    opt = AdamW(params, lr=0.05)
    steps = 3
    for step in range(steps):
        if step == steps - 1:  # the last step's start, in float32
            before = [[t.detach().float() for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
                      for p in params]
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).bfloat16()
        opt.step()
    for i, (p, (weight, m, v)) in enumerate(zip(params, before)):
        adam_update_foreach([weight], [p.grad.float()], [m], [v], [steps], 0.05, (0.9, 0.999), 1e-8, 1e-2, True)
        key = round_key(opt.seed, i, steps)
        for got, value, stream in zip((p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]), (weight, m, v),
                                      (PARAM, FIRST_MOMENT, SECOND_MOMENT)):
            alone = rounded_bits(value.reshape(-1), key + stream).view(torch.float32).bfloat16().view(value.shape)
            assert torch.equal(got.detach(), alone)


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
