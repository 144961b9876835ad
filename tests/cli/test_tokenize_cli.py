"""lmlab-tokenize and `lmlab bench tokenizer`, run as a user runs them."""

import pytest

from tests.conftest import TINY, run_cli

pytestmark = pytest.mark.slow


def test_train_then_encode_then_train_a_model_with_the_saved_tokenizer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat; the dog sat on the log.\n" * 400, encoding="utf-8")
    data = ["data=text_files", f"data.paths=[{corpus}]", "data.context_length=32", f"cache_dir={tmp_path / 'cache'}"]
    tok_dir = tmp_path / "tok"
    proc = run_cli(["lmlab-tokenize", "train", *data, "tokenizer.vocab_size=300", f"hydra.run.dir={tok_dir}"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tok_dir / "vocab.json").is_file() and (tok_dir / "merges.txt").is_file()
    assert f"lmlab-train tokenizer.path={tok_dir}" in proc.stderr + proc.stdout

    proc = run_cli(["lmlab-tokenize", "encode", *data, f"tokenizer.path={tok_dir}", f"hydra.run.dir={tmp_path / 'enc'}"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (cached,) = (tmp_path / "cache").glob("*.bin")
    mtime = cached.stat().st_mtime_ns

    overrides = [o for o in TINY if not o.startswith(("tokenizer.", "data."))]
    proc = run_cli(["lmlab-train", *overrides, *data, "trainer.max_steps=6", f"tokenizer.path={tok_dir}",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert cached.stat().st_mtime_ns == mtime and len(list((tmp_path / "cache").glob("*.bin"))) == 1  # cache hit
    assert (tmp_path / "run" / "merges.txt").read_text() == (tok_dir / "merges.txt").read_text()


def test_tokenize_rejects_bad_input(tmp_path):
    usage = run_cli(["lmlab-tokenize"], cwd=tmp_path)
    assert usage.returncode == 2 and "usage: lmlab-tokenize {train,encode}" in usage.stderr
    byte = run_cli(["lmlab-tokenize", "train", "tokenizer=byte"], cwd=tmp_path)
    assert byte.returncode == 2 and "tokenizer=byte needs no training" in byte.stderr
    small = run_cli(["lmlab-tokenize", "train", "tokenizer.vocab_size=100", f"cache_dir={tmp_path}"], cwd=tmp_path)
    assert small.returncode == 2 and "vocab_size=100 is smaller than 256 bytes + 1 special" in small.stderr


def test_bench_tokenizer_compares_with_hugging_face_in_one_run(tmp_path):
    pytest.importorskip("tokenizers")
    corpus = tmp_path / "c.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 300, encoding="utf-8")
    proc = run_cli(["lmlab", "bench", "tokenizer", str(corpus), "--vocab-size", "300", "--repeats", "1",
                    "--json", str(tmp_path / "r.json")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for line in ("ratio lmlab / HF", "lmlab peak memory", "HF tokenizers encode_batch", "lmlab pure Python"):
        assert line in proc.stdout
    assert (tmp_path / "r.json").is_file()


def test_encode_writes_only_into_the_cache(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat.\n" * 100, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    proc = run_cli(["lmlab-tokenize", "encode", "data=text_files", f"data.paths=[{corpus}]", "tokenizer=byte",
                    f"cache_dir={tmp_path / 'cache'}"], cwd=work)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2401 tokens" in proc.stdout + proc.stderr  # 2400 bytes and the end-of-text token
    assert list(work.iterdir()) == [] and len(list((tmp_path / "cache").glob("*.bin"))) == 1
