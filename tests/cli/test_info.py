import pytest

from lmlab.cli.main import main


def test_info_prints_the_cost_model_of_a_config(capsys):
    args = ["info", "model.d_model=64", "model.n_layers=2", "model.attention.n_heads=4", "data.context_length=32",
            "data.batch_size=8", "tokenizer.vocab_size=320", "trainer.max_steps=1000", "--accelerator", "H100",
            "--mfu", "0.5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # 2 layers x (4 x 64^2 attention + 3 x 64 x 192 swiglu) + 320 x 64 head, times 6, plus 12 x 2 x 64 x 32
    flops = 6 * (2 * (4 * 64 * 64 + 3 * 64 * 192) + 320 * 64) + 12 * 2 * 64 * 32
    assert f"{flops / 1e6:,.2f} MFLOP" in out
    assert "KV cache per token        0.50 KiB" in out  # 2 bytes x (k, v) x 2 layers x 64
    step_ms = flops * 8 * 32 / (989e12 * 0.5) * 1e3
    assert f"{step_ms:,.3f} ms" in out and "run of 1,000 steps" in out


def test_info_rejects_unknown_names(capsys):
    assert main(["info", "model/ffn=swiglux"]) == 2
    assert "Did you mean 'swiglu'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["info", "--mfu", "1.5"])
