"""Byte-level BPE training with incremental pair counts.

Each unique pre-token ("word") is a list of token ids with a count. The trainer keeps, for
every adjacent pair, its total count and the words that contain it, plus a max-heap of
(count, pair) entries that are checked lazily against the live counts. A merge rewrites only
the words that contain the merged pair and pushes fresh heap entries only for the pairs whose
counts changed, so its cost follows the pair's occurrences, not the corpus size.

Ties between equally frequent pairs go to the lexicographically greater pair of byte strings.
A merge whose result equals an existing token's bytes reuses that token's id (as Hugging Face
`tokenizers` does), so every token's bytes are unique.
"""

from __future__ import annotations

import heapq
import logging
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from lmlab.errors import ConfigError
from lmlab.tokenizers.pretokenize import count_pretokens

log = logging.getLogger(__name__)


def _desc_key(token: bytes) -> bytes:
    """A key under which byte strings sort in *descending* order (a heap then pops the greatest).

    Byte c becomes the two bytes (1, 255 - c); a terminator 2 sorts above every byte, so a
    prefix comes after its extensions. Keys of a pair compare like the pair, since a key never
    is a prefix of another.
    """
    return bytes(v for c in token for v in (1, 255 - c)) + b"\x02"


def initial_vocab(special_tokens: list[str]) -> dict[int, bytes]:
    """Ids 0-255 are the bytes, then the special tokens in the order given."""
    vocab = {i: bytes([i]) for i in range(256)}
    for tok in dict.fromkeys(special_tokens):
        vocab[len(vocab)] = tok.encode("utf-8")
    return vocab


def train_bpe(
    input_path: str | Path,
    vocab_size: int,
    special_tokens: list[str] = (),
    num_workers: int | None = None,
    progress: bool = False,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE on a UTF-8 text file.

    Returns `vocab` (id -> bytes: 256 bytes, the special tokens, then merged tokens) and
    `merges` in creation order. Text is split on the special tokens first (no merge crosses
    them), then pre-tokenized with the GPT-2 regex; each step merges the most frequent adjacent
    pair, ties going to the lexicographically greater pair of byte strings. Training stops at
    `vocab_size` tokens or, with a logged warning, when no adjacent pair is left to merge.
    """
    special_tokens = list(dict.fromkeys(special_tokens))
    vocab = initial_vocab(special_tokens)
    if vocab_size < len(vocab):
        raise ConfigError(f"vocab_size={vocab_size} is smaller than 256 bytes + {len(special_tokens)} special tokens")
    path = Path(input_path)
    if not path.is_file():
        raise ConfigError(f"{path} is not a file")
    if path.stat().st_size == 0:
        raise ConfigError(f"{path} is empty: there is nothing to train a tokenizer on")
    merges = _merge(count_pretokens(path, special_tokens, num_workers, progress=progress), vocab, vocab_size,
                    progress)
    if len(vocab) < vocab_size:
        log.warning("vocab_size=%d asks for more tokens than the corpus allows: BPE training stopped at %d tokens, "
                    "with no adjacent pair left to merge", vocab_size, len(vocab))
    return vocab, merges


def _merge(word_counts, vocab: dict[int, bytes], vocab_size: int, progress: bool) -> list[tuple[bytes, bytes]]:
    words = [list(w.encode("utf-8")) for w in word_counts]
    freqs = list(word_counts.values())
    del word_counts  # the caller passes it without keeping it: free the pre-token strings now
    token_bytes = [vocab[i] for i in range(len(vocab))]
    id_of = {b: i for i, b in enumerate(token_bytes)}
    keys = [_desc_key(b) for b in token_bytes]

    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    # Words that contain (or once contained) each pair; stale members are skipped when merging.
    pair_words: dict[tuple[int, int], list[int]] = defaultdict(list)
    for wi, (word, freq) in enumerate(zip(words, freqs)):
        for pair in set(zip(word, word[1:])):
            pair_words[pair].append(wi)
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freq
    # Every live pair has an entry whose count is >= its live count; an entry that has gone
    # stale is re-pushed with the live count when it reaches the top, so counts that only fall
    # need no push at all.
    heap = [(-c, keys[a], keys[b], a, b) for (a, b), c in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[bytes, bytes]] = []
    bar = tqdm(total=vocab_size - len(token_bytes), desc="BPE merges", unit="merge", disable=not progress)
    while len(token_bytes) < vocab_size and heap:
        neg_count, key_a, key_b, a, b = heapq.heappop(heap)
        live = pair_counts.get((a, b), 0)
        if live != -neg_count:
            if live > 0:
                heapq.heappush(heap, (-live, key_a, key_b, a, b))
            continue
        merged = token_bytes[a] + token_bytes[b]
        new_id = id_of.get(merged)
        reused = new_id is not None
        if not reused:
            new_id = len(token_bytes)
            token_bytes.append(merged)
            keys.append(_desc_key(merged))
            id_of[merged] = new_id
            bar.update()
        merges.append((token_bytes[a], token_bytes[b]))

        grown: set[tuple[int, int]] = set()  # pairs whose count rose: they need a heap entry
        shrunk: set[tuple[int, int]] = set()  # pairs whose count fell: they may have died
        for wi in pair_words.pop((a, b)):
            word, freq = words[wi], freqs[wi]
            new_word = _apply_merge(word, a, b, new_id)
            if len(new_word) == len(word):
                continue  # stale member, or a duplicate already merged
            for pair in zip(word, word[1:]):
                pair_counts[pair] -= freq
                shrunk.add(pair)
            for pair in zip(new_word, new_word[1:]):
                pair_counts[pair] += freq
                if new_id in pair:  # only pairs that touch the new token can be new to this word
                    pair_words[pair].append(wi)  # (a repeat only costs a skipped visit later)
                    grown.add(pair)
            words[wi] = new_word
        for pair in shrunk:  # forget pairs that no longer occur anywhere
            if not pair_counts[pair]:
                del pair_counts[pair]
                pair_words.pop(pair, None)
        if reused:  # pairs of an old token may have risen above their heap entries
            grown.update(p for p in pair_counts if new_id in p)
        for pair in grown:
            count = pair_counts[pair]
            if count > 0:
                heapq.heappush(heap, (-count, keys[pair[0]], keys[pair[1]], pair[0], pair[1]))
    bar.close()
    del heap, pair_counts, pair_words, words, id_of, keys  # free the work space before the vocab grows
    vocab.update((i, token_bytes[i]) for i in range(len(vocab), len(token_bytes)))
    return merges


def _apply_merge(word: list[int], a: int, b: int, new_id: int) -> list[int]:
    out, i, n = [], 0, len(word)
    while i < n:
        if i < n - 1 and word[i] == a and word[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out
