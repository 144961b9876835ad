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
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from lmlab.errors import ConfigError
from lmlab.tokenizers.pretokenize import count_pretokens


def _desc_key(token: bytes) -> tuple[int, ...]:
    """A key under which byte strings sort in *descending* order (a heap then pops the greatest).

    Each byte c becomes 255 - c; a terminator 256 makes a prefix sort after its extensions.
    """
    return (*(255 - c for c in token), 256)


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
    `vocab_size` tokens or when no adjacent pair is left to merge.
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
    try:
        word_counts = count_pretokens(path, special_tokens, num_workers)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    merges = _merge(word_counts, vocab, vocab_size, progress)
    return vocab, merges


def _merge(word_counts, vocab: dict[int, bytes], vocab_size: int, progress: bool) -> list[tuple[bytes, bytes]]:
    words = [list(w.encode("utf-8")) for w in word_counts]
    freqs = list(word_counts.values())
    token_bytes = [vocab[i] for i in range(len(vocab))]
    id_of = {b: i for i, b in enumerate(token_bytes)}
    keys = [_desc_key(b) for b in token_bytes]

    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    pair_words: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freq
            pair_words[pair].add(wi)
    heap = [(-c, keys[a], keys[b], a, b) for (a, b), c in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[bytes, bytes]] = []
    bar = tqdm(total=vocab_size - len(vocab), desc="BPE merges", unit="merge", disable=not progress)
    while len(vocab) < vocab_size and heap:
        neg_count, _, _, a, b = heapq.heappop(heap)
        if pair_counts.get((a, b), 0) != -neg_count:
            continue  # stale entry: the pair's count changed after this entry was pushed
        merged = token_bytes[a] + token_bytes[b]
        new_id = id_of.get(merged)
        if new_id is None:
            new_id = len(token_bytes)
            token_bytes.append(merged)
            keys.append(_desc_key(merged))
            id_of[merged] = new_id
            vocab[new_id] = merged
            bar.update()
        merges.append((token_bytes[a], token_bytes[b]))

        changed: set[tuple[int, int]] = set()
        for wi in pair_words.pop((a, b)):
            word, freq = words[wi], freqs[wi]
            new_word = _apply_merge(word, a, b, new_id)
            if len(new_word) == len(word):
                continue
            for pair in zip(word, word[1:]):
                pair_counts[pair] -= freq
                changed.add(pair)
            for pair in zip(new_word, new_word[1:]):
                pair_counts[pair] += freq
                pair_words[pair].add(wi)
                changed.add(pair)
            words[wi] = new_word
        del pair_counts[(a, b)]
        changed.discard((a, b))
        for pair in changed:
            count = pair_counts[pair]
            if count > 0:
                heapq.heappush(heap, (-count, keys[pair[0]], keys[pair[1]], pair[0], pair[1]))
            else:
                del pair_counts[pair]
    bar.close()
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
