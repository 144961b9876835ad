"""`lmlab scaling fit` on a points table written in the test."""

import json

import pytest

from lmlab.cli.main import main
from lmlab.scaling import Point, write_points
from tests.scaling.test_laws import CHINCHILLA, isoflop_points


def test_fit_writes_every_applicable_fit_with_predictions_and_plots(tmp_path, capsys):
    points = isoflop_points()
    # two short training curves besides the IsoFLOP runs, so the envelope and Kaplan fits apply too
    for n in (3e6, 3e7, 3e8):
        points += [Point(f"curve{n:.0e}@{d:.0e}", n, d, float(CHINCHILLA.loss(n, d))) for d in (1e8, 1e9, 1e10)]
    write_points(points, tmp_path / "points.csv")
    assert main(["scaling", "fit", str(tmp_path / "points.csv"), "--out", str(tmp_path / "fit"),
                 "--bootstrap", "10", "--at", "1e20"]) == 0
    printed = capsys.readouterr().out
    assert "isoflop" in printed and "joint law" in printed
    # the curves' intermediate points would bias the joint law: it reads each run's last, and says so
    assert printed.startswith("30 points of 24 runs; read by joint 24, isoflop 21, envelope 30, kaplan 30 "
                              "(joint: each run's final point)\n")
    fits = json.loads((tmp_path / "fit" / "fits.json").read_text())
    assert set(fits) == {"joint", "isoflop", "envelope", "kaplan"}
    assert fits["isoflop"]["n_opt"] == pytest.approx(CHINCHILLA.n_opt(1e20), rel=0.1)
    low, high = fits["isoflop"]["intervals"]["a"]
    assert low <= fits["isoflop"]["params"]["a"] <= high
    kaplan = fits["kaplan"]["params"]  # Kaplan's L(C) predicts too: (C_c / C)^alpha_C, with its interval
    assert fits["kaplan"]["predicted_loss"] == pytest.approx((kaplan["C_c"] / 1e20) ** kaplan["alpha_C"], rel=1e-6)
    for name, entry in fits.items():
        low, high = entry["predicted_loss_interval"]
        assert entry["at"] == 1e20 and low <= high, name
    assert (tmp_path / "fit" / "fit.txt").read_text().splitlines()[1].startswith("method")
    for png in ("isoflop.png", "frontier.png", "envelope.png", "residuals.png"):
        assert (tmp_path / "fit" / png).stat().st_size > 1000


def test_fit_with_too_few_points_is_one_clear_error(tmp_path, capsys):
    write_points(isoflop_points()[:2], tmp_path / "points.csv")
    assert main(["scaling", "fit", str(tmp_path / "points.csv"), "--out", str(tmp_path / "fit")]) == 2
    err = capsys.readouterr().err
    assert "no fit applies" in err and "at least 6 points" in err
    assert not (tmp_path / "fit").exists()
