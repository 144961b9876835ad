import json
import random
import tracemalloc

import pytest

from lmlab.data import SOURCES
from lmlab.errors import ConfigError
from lmlab.tokenizers import TOKENIZERS, BPETokenizer, train_bpe

EOT = "<|endoftext|>"
MULTILINGUAL = ("Hello, wörld! Ça va? 日本語のテキスト 你好，世界 Привет, мир! مرحبا 🙂🚀👩‍👩‍👧 "
                "I'll say you're right, it's 12345 and 6.78\n\n\tindent   spaces \u00a0nbsp" + EOT + "tail")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tests.tokenizers.conftest import sample_text

    path = tmp_path_factory.mktemp("bpe") / "corpus.txt"
    path.write_text(EOT.join(sample_text(i, 2000) for i in range(4)), encoding="utf-8")
    return train_bpe(path, 256 + 1 + 400, [EOT])


def test_round_trip_multilingual_and_emoji(trained):
    tok = BPETokenizer(*trained, special_tokens=[EOT])
    ids = tok.encode(MULTILINGUAL)
    assert tok.decode(ids) == MULTILINGUAL
    assert ids.count(tok.special_id(EOT)) == 1
    assert len(ids) < len(MULTILINGUAL.encode())  # merges apply


def test_text_bytes_counts_the_text_and_not_the_special_tokens(trained):
    tok = BPETokenizer(*trained, special_tokens=[EOT])
    ids = tok.encode(MULTILINGUAL)
    assert tok.text_bytes(ids) == len(MULTILINGUAL.replace(EOT, "").encode())
    # split mid-character: each part counts the bytes it holds, so the parts add up
    assert tok.text_bytes(ids[:7]) + tok.text_bytes(ids[7:]) == tok.text_bytes(ids)


def test_tiktoken_and_pure_python_give_identical_ids(trained):
    pytest.importorskip("tiktoken")
    from tests.tokenizers.conftest import sample_text

    fast = BPETokenizer(*trained, special_tokens=[EOT])
    assert fast.uses_tiktoken
    text = sample_text(99, 5000) + MULTILINGUAL
    pure = BPETokenizer(*trained, special_tokens=[EOT], use_tiktoken=False)
    assert not pure.uses_tiktoken
    assert fast.encode(text) == pure.encode(text)


def test_encoding_matches_hugging_face_on_its_own_files(tmp_path):
    """Load a vocab.json/merges.txt that Hugging Face trained and encode like HF does."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from tests.tokenizers.conftest import sample_text

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([sample_text(5, 3000)], trainer)
    hf.model.save(str(tmp_path))
    ours = BPETokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", [EOT])
    text = sample_text(6, 1000) + " Ça va? 日本語 🙂"
    assert ours.encode(text) == hf.encode(text).ids
    assert BPETokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt").encode_pure(text) == \
        hf.encode(text).ids


def test_longest_overlapping_special_token_wins(trained):
    specials = ["<|a|>", "<|a|><|b|>"]
    tok = BPETokenizer(*trained, special_tokens=specials)
    ids = tok.encode("x<|a|><|b|>y<|a|>")
    assert tok.special_id("<|a|><|b|>") in ids and ids.count(tok.special_id("<|a|>")) == 1
    assert tok.decode(ids) == "x<|a|><|b|>y<|a|>"


@pytest.mark.parametrize("seed", range(5))
def test_encode_iterable_equals_encode_for_any_chunking(trained, seed):
    tok = BPETokenizer(*trained, special_tokens=[EOT])
    text = (MULTILINGUAL + "   \n\n  ") * 3
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 25))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]  # cuts land inside EOT too
    assert list(tok.encode_iterable(chunks, block_chars=8)) == tok.encode(text)  # cuts after nearly every chunk
    assert list(tok.encode_iterable(chunks)) == tok.encode(text)


def test_encode_iterable_memory_is_bounded(trained, tmp_path):
    from tests.tokenizers.conftest import sample_text

    tok = BPETokenizer(*trained, special_tokens=[EOT])
    path = tmp_path / "big.txt"
    block = sample_text(7, 5000)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(200):  # ~6 MB
            f.write(block)
    size = path.stat().st_size
    tracemalloc.start()
    with path.open(encoding="utf-8") as f:
        n_ids = sum(1 for _ in tok.encode_iterable(f))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert n_ids > size / 10
    assert peak < 2_000_000, f"peak {peak} bytes while streaming a {size}-byte file"


def test_save_and_from_files_round_trip(trained, tmp_path):
    tok = BPETokenizer(*trained, special_tokens=[EOT])
    tok.save(tmp_path)
    assert json.loads((tmp_path / "vocab.json").read_text())[EOT] == 256
    assert (tmp_path / "merges.txt").read_text().startswith("#version")
    again = BPETokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", [EOT])
    assert again.vocab == tok.vocab and again.merges == tok.merges
    assert again.encode(MULTILINGUAL) == tok.encode(MULTILINGUAL)
    assert again.fingerprint() == tok.fingerprint()


def test_merges_that_do_not_match_the_vocab_are_rejected(trained, tmp_path):
    vocab, merges = trained
    with pytest.raises(ConfigError, match="does not match the vocab"):
        BPETokenizer(vocab, [*merges, (b"zz", b"qq")])
    BPETokenizer(vocab, merges).save(tmp_path)
    with (tmp_path / "merges.txt").open("a") as f:
        f.write("a b c\n")
    with pytest.raises(ConfigError, match="merges.txt:\\d+: expected two tokens"):
        BPETokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    with pytest.raises(ConfigError, match="has no vocab.json"):
        BPETokenizer.from_dir(tmp_path / "nowhere")


def test_decode_never_raises_on_vocab_ids(trained):
    tok = BPETokenizer(*trained, special_tokens=[EOT])
    rng = random.Random(0)
    ids = list(tok.vocab)
    for _ in range(200):
        out = tok.decode(rng.choices(ids, k=7))
        assert isinstance(out, str)
    assert tok.decode([0xE6]) == "\ufffd"  # a lone lead byte


def test_registered_bpe_trains_on_the_source_once_and_loads_from_path(tmp_path):
    (tmp_path / "a.txt").write_text("low lower lowest newer newest wider " * 50)
    source = SOURCES.build({"name": "text_files", "paths": [str(tmp_path / "a.txt")]})
    cfg = {"name": "bpe", "vocab_size": 280}
    tok = TOKENIZERS.build(cfg, source, tmp_path / "cache", False)
    assert 257 < tok.vocab_size <= 280 and tok.eot_id == 256  # stops early once no pair is left
    (saved,) = (tmp_path / "cache" / "tokenizers").iterdir()
    mtime = (saved / "merges.txt").stat().st_mtime_ns
    again = TOKENIZERS.build(cfg, source, tmp_path / "cache", False)
    assert again.fingerprint() == tok.fingerprint() and (saved / "merges.txt").stat().st_mtime_ns == mtime
    loaded = TOKENIZERS.build({**cfg, "path": str(saved)})
    assert loaded.fingerprint() == tok.fingerprint()
    with pytest.raises(ConfigError, match="needs a data source"):
        TOKENIZERS.build(cfg)
