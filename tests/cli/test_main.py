"""`lmlab VERB ARGS...`: a verb that parses its own arguments gets all of them, flags first or not."""

import sys
import types

import pytest

from lmlab.cli.main import main


def test_info_takes_its_flags_before_the_overrides(capsys):
    assert main(["info", "--accelerator", "A100", "--mfu", "0.5", "model.d_model=64", "tokenizer.vocab_size=320"]) == 0
    assert "step on A100 at 50% MFU" in capsys.readouterr().out


def test_plot_lr_takes_out_before_the_overrides(tmp_path, capsys):
    assert main(["plot-lr", "--out", str(tmp_path / "lr.png"), "trainer.max_steps=40"]) == 0
    assert (tmp_path / "lr.png").stat().st_size > 0


@pytest.mark.parametrize("verb", ["info", "plot-lr", "upcycle"])
def test_help_of_a_verb_is_its_own(verb, capsys):
    try:
        code = main([verb, "--help"])
    except SystemExit as stop:  # argparse's --help
        code = stop.code
    assert code == 0 and f"lmlab {verb}" in capsys.readouterr().out


def test_export_hf_runs_the_export_module_with_its_arguments(monkeypatch):
    seen = []
    fake = types.SimpleNamespace(main=lambda argv: seen.append(argv) or 0)
    monkeypatch.setitem(sys.modules, "lmlab.cli.export_hf", fake)
    assert main(["export-hf", "--out", "hf_model", "run/checkpoints/last.ckpt"]) == 0
    assert seen == [["--out", "hf_model", "run/checkpoints/last.ckpt"]]
