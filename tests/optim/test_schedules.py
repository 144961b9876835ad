import math

import pytest

from lmlab.errors import ConfigError
from lmlab.optim import SCHEDULERS
from lmlab.optim.schedules import cosine


def build(name, max_lr=2.0, total_steps=100, **fields):
    return SCHEDULERS.build({"name": name, **fields}, max_lr, total_steps)


def test_cosine_key_points():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, cosine_steps=110)
    assert cosine(0, **kw) == 0.0
    assert cosine(5, **kw) == pytest.approx(0.5)
    assert cosine(10, **kw) == pytest.approx(1.0)
    assert cosine(60, **kw) == pytest.approx(0.1 + 0.5 * 0.9)
    assert cosine(110, **kw) == pytest.approx(0.1)
    assert cosine(500, **kw) == 0.1
    assert cosine(35, **kw) == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi / 4)) * 0.9)


def test_registered_cosine_uses_run_length_and_floor():
    lr_at = build("cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(10) == pytest.approx(2.0) and lr_at(100) == pytest.approx(0.2)


def test_constant_key_points():
    lr_at = build("constant", warmup_steps=10)
    assert [lr_at(s) for s in (0, 5, 10, 55, 100)] == pytest.approx([0.0, 1.0, 2.0, 2.0, 2.0])


def test_linear_key_points():
    lr_at = build("linear", warmup_steps=10, min_lr_ratio=0.1)  # decays from 2.0 at step 10 to 0.2 at 100
    assert [lr_at(s) for s in (0, 5, 10, 55, 100)] == pytest.approx([0.0, 1.0, 2.0, 1.1, 0.2])


@pytest.mark.parametrize("shape,at_half", [("linear", 0.5), ("cosine", 0.5), ("sqrt", 1 - math.sqrt(0.5))])
def test_wsd_key_points(shape, at_half):
    # 20% of 100 steps decay: stable from 10 to 80, then down to the floor 0.2 at 100.
    lr_at = build("wsd", warmup_steps=10, decay_fraction=0.2, decay_shape=shape, min_lr_ratio=0.1)
    assert [lr_at(s) for s in (0, 5, 10, 45, 80)] == pytest.approx([0.0, 1.0, 2.0, 2.0, 2.0])
    assert lr_at(90) == pytest.approx(0.2 + 1.8 * at_half)
    assert lr_at(100) == pytest.approx(0.2)
    if shape == "cosine":
        assert lr_at(85) == pytest.approx(0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi / 4)))


def test_wsd_decay_from_a_stable_phase_checkpoint():
    # The decay starts where the stable run was saved and ends at the run's (new) total steps.
    lr_at = build("wsd", total_steps=1300, warmup_steps=10, decay_shape="linear", decay_start=1000)
    assert lr_at(999) == pytest.approx(2.0) and lr_at(1000) == pytest.approx(2.0)
    assert lr_at(1150) == pytest.approx(1.0) and lr_at(1300) == 0.0


def test_wsd_without_decay_stays_at_the_peak():
    lr_at = build("wsd", warmup_steps=10, decay_fraction=0.0)
    assert lr_at(99) == 2.0


def test_inverse_sqrt_key_points():
    lr_at = build("inverse_sqrt", warmup_steps=25)
    assert [lr_at(s) for s in (0, 5, 25, 100)] == pytest.approx([0.0, 0.4, 2.0, 1.0])


@pytest.mark.parametrize("name", SCHEDULERS.names())
def test_every_schedule_stays_between_zero_and_peak(name):
    lr_at = build(name, total_steps=1000)
    values = [lr_at(s) for s in range(1001)]
    assert values[0] == 0.0 and max(values) == pytest.approx(2.0) and min(values) >= 0.0


@pytest.mark.parametrize("name", SCHEDULERS.names())
def test_warmup_longer_than_run_is_rejected(name):
    with pytest.raises(ConfigError, match="longer than the run"):
        build(name, warmup_steps=200)


@pytest.mark.parametrize("name,fields,match", [
    ("constant", {"warmup_steps": -1}, "warmup_steps must be >= 0"),
    ("cosine", {"min_lr_ratio": 1.5}, r"min_lr_ratio must be in \[0, 1\]"),
    ("linear", {"min_lr_ratio": -0.1}, "min_lr_ratio"),
    ("wsd", {"decay_fraction": 1.2}, r"decay_fraction must be in \[0, 1\]"),
    ("wsd", {"decay_shape": "cosin"}, "Did you mean 'cosine'"),
    ("wsd", {"warmup_steps": 50, "decay_fraction": 0.6}, "overlaps the decay"),
    ("wsd", {"warmup_steps": 10, "decay_start": 5}, "decay_start=5 is outside the stable phase"),
    ("wsd", {"decay_start": 100}, "outside the stable phase"),
    ("inverse_sqrt", {"warmup_steps": 0}, "must be >= 1 for inverse_sqrt"),
])
def test_bad_schedule_settings_are_config_errors(name, fields, match):
    with pytest.raises(ConfigError, match=match):
        build(name, **fields)


@pytest.mark.parametrize("name", ["cosine", "constant", "linear", "wsd", "inverse_sqrt"])
@pytest.mark.parametrize("total,warmup", [(1000, 50), (100, 50), (60, 30), (12, 6), (3, 1)])
def test_default_warmup_is_fifty_steps_or_half_a_shorter_run(name, total, warmup):
    """Runs shorter than the old fixed 50-step warmup were refused unless the user set it."""
    lr_at = build(name, max_lr=1.0, total_steps=total)
    assert lr_at(warmup) == pytest.approx(1.0) and lr_at(warmup - 1) < 1.0
