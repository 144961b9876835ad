from lmlab.errors import ConfigError
from lmlab.tokenizers import EOT, TOKENIZERS, ByteTokenizer


def test_roundtrip_and_special_tokens():
    tok = TOKENIZERS.build("byte")
    text = f"héllo{EOT}wörld 🙂"
    ids = tok.encode(text)
    assert tok.vocab_size == 257 and tok.eot_id == 256
    assert ids.count(256) == 1 and all(i < 256 for i in ids if i != 256)
    assert tok.decode(ids) == text
    assert tok.encode_array(text).tolist() == ids


def test_invalid_utf8_decodes_to_replacement_character():
    assert TOKENIZERS.build("byte").decode([0xFF, ord("a")]) == "\ufffda"


def test_longest_overlapping_special_token_wins():
    tok = ByteTokenizer(ByteTokenizer.Config(special_tokens=["<|a|>", "<|a|><|a|>"]))
    assert tok.encode("<|a|><|a|>") == [tok.special_id("<|a|><|a|>")]


def test_fingerprint_depends_on_special_tokens(tmp_path):
    a = ByteTokenizer()
    b = ByteTokenizer(ByteTokenizer.Config(special_tokens=[]))
    assert a.fingerprint() != b.fingerprint() and b.eot_id is None
    assert EOT in a.save(tmp_path).read_text()


def test_text_bytes_without_a_byte_level_form_reads_each_ids_text():
    class Words(ByteTokenizer):  # a plugin's tokenizer whose ids are not byte pieces
        def to_bpe(self):
            raise ConfigError("no byte-level form")

    tok = Words()
    assert tok.text_bytes(tok.encode("plain " + EOT + "text")) == len("plain text")
