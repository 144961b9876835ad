"""`lmlab export-hf`: transformers loads the folder, with lmlab's logits and token ids."""

import pytest
import torch

import lmlab
from lmlab.cli.compose import compose_config
from lmlab.cli.export_hf import main
from lmlab.errors import ConfigError
from lmlab.tokenizers import EOT, BPETokenizer, ByteTokenizer, train_bpe
from lmlab.tokenizers.hf_files import save_hf_tokenizer
from lmlab.training import train
from tests.conftest import TINY, run_cli
from tests.tokenizers.conftest import sample_text

transformers = pytest.importorskip("transformers")

TEXT = "Hello, wörld 🙂  日本語\n\n  def f(x):\treturn x<|endoftext|>naïve <|im_start|>café's 4.56 …<|endoftext|>"
SPECIALS = [EOT, "<|pad|>", "<|im_start|>"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def checkpoint(folder, *extra) -> str:
    overrides = [*TINY, f"cache_dir={folder / 'cache'}", "trainer.max_steps=3", "sched.warmup_steps=1",
                 "trainer.val_every=3", *extra]
    train(compose_config(overrides), folder)
    return str(folder / "checkpoints" / "last.ckpt")


def hf_ids(folder, text: str) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_auto_tokenizer_gives_lmlabs_ids(tmp_path, kind):
    if kind == "bpe":
        (tmp_path / "corpus.txt").write_text(sample_text(0, 3000) + EOT + sample_text(1, 3000), encoding="utf-8")
        tokenizer = BPETokenizer(*train_bpe(tmp_path / "corpus.txt", 400, SPECIALS), SPECIALS)
    else:
        tokenizer = ByteTokenizer(ByteTokenizer.Config(special_tokens=SPECIALS))
    save_hf_tokenizer(tokenizer, tmp_path / "hf", model_max_length=64)
    text = TEXT + sample_text(2, 200)
    assert hf_ids(tmp_path / "hf", text) == tokenizer.encode(text)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf.eos_token_id == tokenizer.eot_id and hf.decode(tokenizer.encode(text)) == text
    assert hf.decode(tokenizer.encode(TEXT), skip_special_tokens=True) == TEXT.replace(EOT, "").replace(SPECIALS[2], "")


def test_export_of_a_trained_checkpoint_loads_in_transformers(tmp_path):
    ckpt = checkpoint(tmp_path / "run")
    assert main([f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"]) == 0
    model, tokenizer, _ = lmlab.load(ckpt)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert hf_model.config.eos_token_id == tokenizer.eot_id  # generate stops at <|endoftext|>
    ids = tokenizer.encode(TEXT)
    assert hf_ids(tmp_path / "hf", TEXT) == ids
    window = torch.tensor([ids[: model.max_seq_len]])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(window).logits, model(window), rtol=1e-5, atol=1e-5)


def test_a_non_llama_checkpoint_is_one_error_and_writes_nothing(tmp_path):
    ckpt = checkpoint(tmp_path / "run", "model/norm=layernorm")
    with pytest.raises(ConfigError, match="model/norm=layernorm has no Hugging Face Llama equivalent"):
        main([f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"])
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("argv,match", [([], "ckpt and out are both needed"), (["ckpt=a", "model=b"], "'model=b'"),
                                        (["ckpt=/missing.ckpt", "out=o"], "ckpt=/missing.ckpt is not a file")])
def test_bad_arguments_are_one_error(argv, match):
    with pytest.raises(ConfigError, match=match):
        main(argv)


def test_an_out_that_is_a_file_is_one_error_before_loading(tmp_path):
    (tmp_path / "afile").write_text("keep me")
    with pytest.raises(ConfigError, match="is a file; give a folder"):
        main(["ckpt=/missing.ckpt", f"out={tmp_path / 'afile'}"])
    assert (tmp_path / "afile").read_text() == "keep me"


def test_help(capsys):
    assert main(["--help"]) == 0
    assert "lmlab export-hf ckpt=PATH out=DIR" in capsys.readouterr().out


@pytest.mark.slow
def test_lmlab_export_hf_console_script(tmp_path):
    ckpt = checkpoint(tmp_path / "run")
    proc = run_cli(["lmlab", "export-hf", f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer_config.json").is_file()
    bad = run_cli(["lmlab", "export-hf", "ckpt=/missing.ckpt", f"out={tmp_path / 'x'}"], cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip() == "lmlab export-hf: error: ckpt=/missing.ckpt is not a file"
