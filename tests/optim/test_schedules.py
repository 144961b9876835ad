import math

import pytest

from lmlab.errors import ConfigError
from lmlab.optim import SCHEDULERS
from lmlab.optim.schedules import cosine


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
    lr_at = SCHEDULERS.build({"name": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1}, 2.0, 100)
    assert lr_at(10) == pytest.approx(2.0) and lr_at(100) == pytest.approx(0.2)


def test_warmup_longer_than_run_is_rejected():
    with pytest.raises(ConfigError, match="longer than the run"):
        SCHEDULERS.build({"name": "cosine", "warmup_steps": 200}, 1.0, 100)
