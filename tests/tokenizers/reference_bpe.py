"""A slow, literal BPE trainer straight from the definition, to check the fast one against."""

from collections import Counter

from lmlab.tokenizers.pretokenize import pretokens, special_splitter


def greater_bytes(tied_pairs, token_ids):
    """lmlab's rule: the lexicographically greater pair of byte strings."""
    return max(tied_pairs)


def smaller_ids(tied_pairs, token_ids):
    """Hugging Face tokenizers' rule: the pair of smaller token ids."""
    return min(tied_pairs, key=lambda p: (token_ids[p[0]], token_ids[p[1]]))


def naive_train(text: str, vocab_size: int, special_tokens: list[str], tie_break=greater_bytes, token_ids=None):
    """Merges, and for each merge whether its count was tied with another pair's.

    `token_ids` (bytes -> id) is what `tie_break` may consult; merged tokens get the next ids.
    """
    token_ids = dict(token_ids or {})
    words = Counter(tuple(bytes([b]) for b in p.encode()) for p in pretokens(text, special_splitter(special_tokens)))
    n_tokens = 256 + len(special_tokens)
    merges, tied = [], []
    while n_tokens < vocab_size:
        counts = Counter()
        for word, freq in words.items():
            for pair in zip(word, word[1:]):
                counts[pair] += freq
        if not counts:
            break
        top = max(counts.values())
        best = tie_break([p for p, c in counts.items() if c == top], token_ids)
        merges.append(best)
        tied.append(sum(c == top for c in counts.values()) > 1)
        merged = best[0] + best[1]
        token_ids.setdefault(merged, len(token_ids))
        new_words = Counter()
        for word, freq in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += freq
        words = new_words
        n_tokens += 1
    return merges, tied
