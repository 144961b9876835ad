"""The planner: N*, D* and an lmlab model of that size whose steps spend the budget by the cost model, and
the over-trained model that serves many tokens for less."""

import json
import re

import pytest

from lmlab.cli.compose import compose_config
from lmlab.cli.main import main
from lmlab.errors import ConfigError
from lmlab.scaling.laws import law_from_json, law_to_json
from lmlab.scaling.plan import CHINCHILLA, ShapeRule, model_shape, overtrain
from tests.scaling.test_laws import isoflop_points


def test_model_shape_matches_the_parameter_target_with_exact_counts():
    cfg = compose_config(["model.vocab_size=1024"])
    shape = model_shape(cfg, 1024, 2e6, ShapeRule(aspect=32))
    assert shape.params == pytest.approx(2e6, rel=0.1)
    assert 16 <= shape.d_model / shape.n_layers <= 64 and shape.d_model % 64 == 0
    assert shape.n_heads == shape.d_model // 64
    with pytest.raises(ConfigError, match="too small for the smallest model"):
        model_shape(cfg, 1024, 1e3)


def test_model_shape_reaches_the_narrowest_width_when_the_head_dominates():
    # with a 4,096-token head, d_model 32 has ~1.5e5 parameters, d_model 64 twice that: a width guessed from
    # 12 d^2 alone would start at 64 and miss the smaller model
    cfg = compose_config(["model.vocab_size=4096"])
    narrow = model_shape(cfg, 4096, 1.5e5, ShapeRule(head_dim=32))
    assert narrow.d_model == 32 and narrow.params == pytest.approx(1.5e5, rel=0.1)
    assert model_shape(cfg, 4096, 3.2e5, ShapeRule(head_dim=32)).d_model == 64


def test_a_narrow_aspect_tolerance_keeps_one_family_of_shapes():
    cfg = compose_config(["model.vocab_size=4096"])
    rule = ShapeRule(aspect=32, aspect_tolerance=1.3, head_dim=32)
    shapes = [model_shape(cfg, 4096, n, rule) for n in (3e5, 1e6, 3e6, 1e7)]
    assert all(32 / 1.3 <= s.d_model / s.n_layers <= 32 * 1.3 for s in shapes)
    assert [s.n_layers for s in shapes] == sorted(s.n_layers for s in shapes)  # deeper as they grow
    assert shapes[-1].n_layers > shapes[0].n_layers
    with pytest.raises(ConfigError, match="tolerance >= 1"):
        ShapeRule(aspect_tolerance=0.5)


def test_overtraining_reaches_the_same_loss_for_fewer_total_flops():
    c, served = 1e20, 1e12
    best = overtrain(CHINCHILLA, c, served)
    n_opt = CHINCHILLA.n_opt(c)
    assert CHINCHILLA.loss(best.n, best.d) == pytest.approx(CHINCHILLA.predicted_loss(c), rel=1e-6)
    assert best.n < n_opt and best.total < c + 2 * n_opt * served
    # with almost nothing served the compute-optimal model is the cheapest
    assert overtrain(CHINCHILLA, c, 1.0).n == pytest.approx(n_opt, rel=0.01)


def test_laws_round_trip_through_json():
    assert law_from_json(json.loads(json.dumps(law_to_json(CHINCHILLA)))) == CHINCHILLA


def test_plan_cli_from_a_fit_file(tmp_path, capsys):
    from lmlab.scaling import write_points

    write_points(isoflop_points(), tmp_path / "points.csv")
    assert main(["scaling", "fit", str(tmp_path / "points.csv"), "--out", str(tmp_path), "--bootstrap", "0"]) == 0
    capsys.readouterr()
    assert main(["scaling", "plan", "flops=1e15", f"fit={tmp_path / 'fits.json'}", "method=isoflop",
                 "model.vocab_size=1024"]) == 0
    out = capsys.readouterr().out
    assert "  lmlab-train model.vocab_size=1024 model.d_model=" in out  # the line trains the model planned
    fits = json.loads((tmp_path / "fits.json").read_text())
    n_opt = law_from_json(fits["isoflop"]["law"]).n_opt(1e15)
    assert f"N* = {n_opt:.3g}" in out
    cfg = compose_config(["model.vocab_size=1024"])
    steps = int(re.search(r"trainer.max_steps=(\d+)", out).group(1))
    d_model, n_layers = (int(v) for v in re.search(r"model.d_model=(\d+) model.n_layers=(\d+)", out).groups())
    shape = model_shape(cfg, 1024, n_opt)
    assert (shape.d_model, shape.n_layers) == (d_model, n_layers)
    tokens_per_step = cfg.data.batch_size * cfg.data.context_length
    # the steps spend the budget's 6 N* D* by lmlab's own cost model, to within one step
    assert abs(steps * tokens_per_step * shape.flops_per_token - 1e15) <= tokens_per_step * shape.flops_per_token
    assert main(["scaling", "plan", "flops=1e15", f"fit={tmp_path / 'fits.json'}", "method=isoflop",
                 "inference_tokens=1e9"]) == 2
    assert "inference_tokens needs the joint law" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["model.vocab_size=1024"], "flops= is missing: lmlab scaling plan flops=1e20"),
    (["flops=lots"], "flops='lots' is not a float"),
    (["flops=1e20", "fit=missing.json"], "no such fit file"),
    (["flops=1e20", "method=isoflop"], "method=isoflop picks a law of fit=FILE"),  # was Chinchilla's, silently
])
def test_plan_bad_input(args, message, capsys):
    assert main(["scaling", "plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_plan_errors_come_before_any_line_and_its_command_trains_the_planned_shape(capsys):
    assert main(["scaling", "plan", "flops=-1"]) == 2
    assert capsys.readouterr().out == ""
    assert main(["scaling", "plan", "flops=1e15", "model.vocab_size=1024", "model.n_layers=2"]) == 0
    command = next(line for line in capsys.readouterr().out.splitlines() if "lmlab-train" in line)
    assert command.count("model.n_layers=") == 1 and "model.vocab_size=1024" in command
