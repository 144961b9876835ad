"""The commands that use a trained model (generate, serve, eval, export-hf) start without importing Lightning or
Inductor, seconds that only training and compiling need."""

import subprocess
import sys

HEAVY = ("lightning", "torch._inductor.compile_fx")


def test_model_commands_import_neither_lightning_nor_inductor():
    code = ("import sys, lmlab.cli.generate, lmlab.cli.serve, lmlab.cli.eval, lmlab.cli.export_hf; "
            f"print(sorted({{m.split('.')[0] if m.startswith('lightning') else m for m in sys.modules}} & {set(HEAVY)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
