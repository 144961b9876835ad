"""The step guard skips spikes and non-finite steps but never locks a run."""

import math

import pytest

from lmlab.training import module as module_lib
from lmlab.training import train
from lmlab.training.step_guard import StepGuard, TrainingDiverged


def test_skips_non_finite_values_and_spikes_over_the_running_median():
    guard = StepGuard(skip_nonfinite=True, spike_factor=2.0, window=10)
    assert guard.judge(math.nan, 1.0) == (True, "non-finite")
    assert guard.judge(1.0, math.inf) == (True, "non-finite")
    for i in range(10):
        assert guard.judge(3.0 + 0.01 * i, 1.0) == (False, None)
    assert guard.judge(7.0, 1.0) == (True, "loss spike")
    assert guard.judge(3.0, 2.5) == (True, "gradient-norm spike")
    assert guard.judge(5.0, 1.9) == (False, None) and guard.skipped == 4
    restored = StepGuard(True, 2.0, 10)
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()


def test_no_spike_is_judged_during_warmup():
    guard = StepGuard(skip_nonfinite=True, spike_factor=2.0, window=10, warmup=30)
    norms = [1.0] * 15 + [10.0] * 15  # the gradient norm grows tenfold while the learning rate warms up
    assert [guard.judge(5.0, n)[0] for n in norms] == [False] * 30
    assert guard.judge(5.0, 10.5) == (False, None)  # the window has the new level by now


def test_a_lasting_change_of_level_is_taken_after_max_consecutive_skips():
    """The issue's lock: a normal 10x jump of the gradient norm was skipped, so the window never saw
    it and every later step was a 'spike' too. Now it is taken after a few skips and training goes on."""
    guard = StepGuard(skip_nonfinite=True, spike_factor=5.0, window=50, warmup=0, max_consecutive=4)
    for _ in range(20):
        guard.judge(5.0, 0.7)
    verdicts = [guard.judge(5.0, 7.0) for _ in range(100)]
    assert [skip for skip, _ in verdicts[:4]] == [True] * 4
    assert verdicts[4][0] is False and "taken" in verdicts[4][1]
    assert guard.skipped == 4 and not any(skip for skip, _ in verdicts[5:])


def test_persistent_non_finite_steps_stop_the_run_with_an_error():
    guard = StepGuard(skip_nonfinite=True, spike_factor=None, window=10, max_consecutive=3)
    assert guard.judge(math.nan, 1.0)[0] and guard.judge(math.nan, 1.0)[0]
    with pytest.raises(TrainingDiverged, match="3 steps in a row had a non-finite loss"):
        guard.judge(math.nan, 1.0)


def test_a_run_whose_loss_level_jumps_for_good_keeps_training(make_cfg, tiny_overrides, tmp_path, monkeypatch):
    """From step 12 the loss (and so the gradient norm) is 10x what it was, for good: before the fix,
    every later step was skipped and the run stopped learning without an error."""
    calls = {"n": 0}
    real = module_lib.model_terms

    def tenfold_from_step_12(*args):
        terms = real(*args)
        calls["n"] += 1
        if calls["n"] > 12:
            terms["loss"] = terms["loss"] * 10
        return terms

    monkeypatch.setattr(module_lib, "model_terms", tenfold_from_step_12)
    overrides = ["trainer.spike_factor=3", "trainer.max_consecutive_skips=3", "sched.warmup_steps=2"]
    results = train(make_cfg([*tiny_overrides, *overrides]), tmp_path / "run")
    assert results["skipped_steps"] <= 6  # the jump costs 3; before the fix all 18 steps after it were skipped
    assert results["val_loss"] < results["initial_val_loss"] - 1.0
