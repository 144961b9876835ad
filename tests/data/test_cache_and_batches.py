import numpy as np
import pytest
import torch

from lmlab.data import SOURCES, DataSourceError, RandomWindows, get_batch, load_or_build
from lmlab.data.batches import evenly_spaced_windows
from lmlab.data.cache import cache_key
from lmlab.tokenizers import TOKENIZERS, ByteTokenizer


@pytest.fixture
def corpus_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "b.txt").write_text("второй документ " * 20)
    return SOURCES.build({"name": "text_files", "paths": [str(tmp_path / "*.txt")]})


def test_cache_builds_memmap_with_eot_between_documents(tmp_path, corpus_files):
    tok = TOKENIZERS.build("byte")
    corpus = load_or_build(corpus_files, tok, tmp_path / "cache", progress=False)
    assert isinstance(corpus.tokens, np.memmap) and corpus.tokens.dtype == np.uint16
    texts = list(corpus_files.documents())
    expected = [t for doc in texts for t in [*tok.encode(doc), tok.eot_id]]
    assert corpus.tokens.tolist() == expected
    assert corpus.n_bytes == sum(len(t.encode()) for t in texts)


def test_cache_is_reused_and_keyed_by_tokenizer(tmp_path, corpus_files, monkeypatch):
    tok = TOKENIZERS.build("byte")
    load_or_build(corpus_files, tok, tmp_path / "cache", progress=False)
    monkeypatch.setattr(type(corpus_files), "documents", lambda self: pytest.fail("cache hit must not re-read"))
    load_or_build(corpus_files, tok, tmp_path / "cache", progress=False)
    other = ByteTokenizer(ByteTokenizer.Config(special_tokens=[]))
    assert cache_key(corpus_files, other) != cache_key(corpus_files, tok)


def test_empty_corpus_fails_and_leaves_existing_cache_intact(tmp_path, corpus_files):
    cache = tmp_path / "cache"
    tok = TOKENIZERS.build("byte")
    load_or_build(corpus_files, tok, cache, progress=False)
    before = {p.name: p.read_bytes() for p in cache.iterdir()}
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    empty = SOURCES.build({"name": "text_files", "paths": [str(tmp_path / "empty" / "*.txt")]})
    with pytest.raises(DataSourceError, match="empty"):
        load_or_build(empty, tok, cache, progress=False)
    assert {p.name: p.read_bytes() for p in cache.iterdir()} == before  # no partial files, nothing lost


def test_get_batch_targets_are_inputs_shifted():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = get_batch(tokens, 4, 16, "cpu")
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    torch.testing.assert_close(y[:, :-1], x[:, 1:])
    torch.testing.assert_close(x[:, 1:] - x[:, :-1], torch.ones(4, 15, dtype=torch.long))
    assert int(y.max()) < 1000
    xt, _ = get_batch(torch.arange(100), 2, 8, "cpu")
    assert xt.shape == (2, 8)
    with pytest.raises(ValueError, match="context_length"):
        get_batch(tokens[:16], 1, 16, "cpu")


def test_random_windows_depend_only_on_seed_and_step():
    tokens = np.arange(5000, dtype=np.uint16)
    full = RandomWindows(tokens, 2, 8, seed=3)
    it = iter(full)
    batches = [next(it) for _ in range(5)]
    resumed = next(iter(RandomWindows(tokens, 2, 8, seed=3, start_step=3)))
    torch.testing.assert_close(resumed[0], batches[3][0])
    other = next(iter(RandomWindows(tokens, 2, 8, seed=4)))
    assert not torch.equal(other[0], batches[0][0])


def test_evenly_spaced_windows_stay_inside_a_corpus_past_float32_precision():
    """Starts past 2^24 tokens: the last window ends exactly at the last token (float32 steps overran it)."""
    tokens = np.arange(38_745_888, dtype=np.uint32) % 50_000
    inputs, targets = evenly_spaced_windows(tokens, 64, 512)
    assert inputs.shape == (64, 512)
    assert targets[-1, -1] == int(tokens[-1]) and inputs[0, 0] == int(tokens[0])


def test_val_bpb_counts_the_bytes_of_the_validation_tokens_themselves(tmp_path):
    from lmlab.data.datamodule import LMDataModule
    from lmlab.data.sources import DataConfig

    # one-byte text first, two-byte text last: the validation split (the end) has more bytes per token than the
    # corpus on average, so the corpus's mean would understate its bits per byte
    (tmp_path / "a.txt").write_text("plain ascii text " * 40)
    (tmp_path / "b.txt").write_text("двухбайтовый текст " * 20)
    source = SOURCES.build({"name": "text_files", "paths": [str(tmp_path / "*.txt")]})
    tok = TOKENIZERS.build({"name": "bpe", "vocab_size": 300}, source=source, cache_dir=tmp_path / "cache",
                           progress=False)
    cfg = DataConfig(context_length=16, batch_size=4, val_fraction=0.2)
    data = LMDataModule(source, tok, cfg, tmp_path / "cache", seed=0, val_batches=2, progress=False)
    targets = torch.cat([y for _, y in data.val_dataloader()])
    text = tok.decode(targets.flatten().tolist()).replace("<|endoftext|>", "")
    assert data.val_bytes_per_token == pytest.approx(len(text.encode()) / targets.numel(), rel=0.02)
    assert data.val_bytes_per_token > 1.2 * data.bytes_per_token
