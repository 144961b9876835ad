"""The gradient noise scale: the estimator recovers tr(Sigma)/|G|^2 from two batch sizes, and training logs
it from a micro-batch's gradient and the step's."""

import math

import numpy as np
import pytest

from lmlab.training import train
from lmlab.training.noise_scale import NoiseScale
from tests.training.test_optim_training import scalars


def test_estimator_recovers_the_noise_scale_of_known_gradients():
    rng = np.random.default_rng(0)
    dim, small, big = 50, 8, 64
    mean = rng.normal(size=dim)
    scales = rng.uniform(0.5, 3.0, size=dim)  # per-example gradient = mean + noise of these std devs
    truth = float((scales ** 2).sum() / (mean ** 2).sum())
    noise = NoiseScale(small, big, decay=0.999)
    for _ in range(5000):
        examples = mean + rng.normal(size=(big, dim)) * scales
        estimate = noise.update(float((examples[:small].mean(0) ** 2).sum()), float((examples.mean(0) ** 2).sum()))
    assert estimate == pytest.approx(truth, rel=0.1)


def test_identical_micro_batches_have_no_gradient_noise(make_cfg, tiny_overrides, tmp_path):
    """One byte repeated: every window is the same, so a micro-batch's gradient is the step's. This holds only
    if the micro-batch's gradient is rescaled by the K that Lightning divided its loss by."""
    corpus = tmp_path / "a.txt"
    corpus.write_text("a" * 4000)
    byte_run = [o for o in tiny_overrides if not o.startswith("tokenizer.")]  # the byte tokenizer has no vocab_size
    overrides = [*byte_run, "data=text_files", f"data.paths=[{corpus}]", "tokenizer=byte", "trainer.max_steps=6",
                 "trainer.log_every=1", "trainer.accumulate_grad_batches=2", "trainer.grad_noise_scale=true"]
    train(make_cfg(overrides), tmp_path / "run")
    logged = scalars(tmp_path / "run", "train/grad_noise_scale")
    assert len(logged) == 6 and all(abs(v) < 0.1 for v in logged.values())  # in tokens, against batches of 128


def test_training_logs_a_positive_noise_scale(make_cfg, tiny_overrides, tmp_path):
    overrides = [*tiny_overrides, "trainer.max_steps=8", "trainer.log_every=1", "trainer.accumulate_grad_batches=4",
                 "trainer.grad_noise_scale=true"]
    train(make_cfg(overrides), tmp_path / "run")
    last = scalars(tmp_path / "run", "train/grad_noise_scale")[7]
    assert math.isfinite(last) and last > 0
