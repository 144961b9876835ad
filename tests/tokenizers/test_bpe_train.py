import pytest

from lmlab.errors import ConfigError
from lmlab.tokenizers import train_bpe
from lmlab.tokenizers.pretokenize import count_pretokens, pretokens, special_splitter
from tests.tokenizers.reference_bpe import naive_train, smaller_ids

EOT = "<|endoftext|>"


def _train_text(tmp_path, text, vocab_size, specials=(), **kw):
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return train_bpe(path, vocab_size, list(specials), **kw)


def test_ties_go_to_the_lexicographically_greater_pair(tmp_path):
    # Pre-tokens "ab" and " cd": the pairs (a,b), (' ',c), (c,d) all occur once.
    vocab, merges = _train_text(tmp_path, "ab cd", 256 + 3)
    assert merges == [(b"c", b"d"), (b"a", b"b"), (b" ", b"cd")]
    assert [vocab[i] for i in range(256, 259)] == [b"cd", b"ab", b" cd"]


def test_longer_byte_string_wins_a_tie_with_its_prefix(tmp_path):
    # After (a,b) -> ab, the tie between (ab, c) and (a, c) goes to (ab, c): ab > a.
    _, merges = _train_text(tmp_path, "abab ac ab", 256 + 3)
    assert merges[0] == (b"a", b"b")
    assert (b"ab", b"c") not in merges or merges.index((b"ab", b"c")) >= 1


def test_special_tokens_are_in_the_vocab_and_never_merged_across(tmp_path):
    vocab, merges = _train_text(tmp_path, f"xy{EOT}xy{EOT}yx", 300, [EOT])
    assert vocab[256] == EOT.encode()
    assert merges == [(b"x", b"y"), (b"y", b"x")]  # no pair spans <|endoftext|>, none inside it
    assert len(vocab) == 256 + 1 + 2  # stops when no pair is left


def test_matches_the_literal_definition(tmp_path, sample):
    text = sample(0, 3000) + EOT + sample(1, 500)
    _, merges = _train_text(tmp_path, text, 256 + 1 + 200, [EOT])
    expected, _ = naive_train(text, 256 + 1 + 200, [EOT])
    assert merges == expected


def test_agrees_with_hugging_face_up_to_its_documented_tie_rule(tmp_path, sample):
    """Both take the most frequent pair; on equal counts Hugging Face takes the pair of smaller
    token ids (its initial alphabet is ordered by GPT-2 byte character), lmlab the greater pair
    of byte strings. HF's merges equal the literal definition run with HF's tie rule, lmlab's
    equal it with lmlab's, and the two lists agree up to the first tie."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    from lmlab.tokenizers.gpt2_files import byte_to_char, from_text

    text = sample(2, 4000)
    vocab_size = 256 + 250
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([text], trainer)
    hf_merges = [tuple(from_text(s, "hf") for s in m) for m in _hf_merges(hf)]
    hf_ids = {bytes([b]): i for i, b in enumerate(sorted(range(256), key=lambda b: byte_to_char()[b]))}

    hf_rule, _ = naive_train(text, vocab_size, [], tie_break=smaller_ids, token_ids=hf_ids)
    lmlab_rule, tied = naive_train(text, vocab_size, [])
    _, ours = _train_text(tmp_path, text, vocab_size)
    assert hf_merges == hf_rule
    assert ours == lmlab_rule
    first_tie = tied.index(True)
    assert ours[:first_tie] == hf_merges[:first_tie] and ours != hf_merges


def _hf_merges(hf) -> list[tuple[str, str]]:
    import json

    merges = json.loads(hf.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


def test_parallel_pretoken_counts_equal_serial(tmp_path, sample):
    text = "".join(sample(i, 400) + (EOT if i % 2 else "") for i in range(8))
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    serial = count_pretokens(path, [EOT], num_workers=1)
    parallel = count_pretokens(path, [EOT], num_workers=4, min_chunk_bytes=1000)
    assert parallel == serial
    assert sum(serial.values()) == sum(1 for _ in pretokens(text, special_splitter([EOT])))


@pytest.mark.parametrize("vocab_size", [0, 256])
def test_vocab_smaller_than_bytes_plus_specials_is_rejected(tmp_path, vocab_size):
    with pytest.raises(ConfigError, match="smaller than 256 bytes \\+ 1 special"):
        _train_text(tmp_path, "abc", vocab_size, [EOT])


def test_empty_missing_and_non_utf8_files_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="empty"):
        _train_text(tmp_path, "", 300)
    with pytest.raises(ConfigError, match="is not a file"):
        train_bpe(tmp_path / "nope.txt", 300, [])
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8 text \\(byte 3"):
        train_bpe(bad, 300, [])


def test_a_corpus_too_small_for_vocab_size_is_a_warning(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="lmlab.tokenizers.bpe_train"):
        vocab, _ = _train_text(tmp_path, "ab cd ab", 1000, [EOT])
    assert len(vocab) < 1000
    assert [r.getMessage() for r in caplog.records] == [
        f"vocab_size=1000 asks for more tokens than the corpus allows: BPE training stopped at {len(vocab)} tokens, "
        "with no adjacent pair left to merge"]
    caplog.clear()
    _train_text(tmp_path, "ab cd ab", len(vocab), [EOT])
    assert not caplog.records
