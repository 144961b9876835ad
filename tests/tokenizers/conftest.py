import random

import pytest

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "café", "Straße", "日本語",
         "привет", "мир", "🙂", "🚀", "I'll", "you're", "it's", "123", "4.56", "--", "!!", "...", "\t"]


def sample_text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n_words):
        out.append(rng.choice(WORDS))
        out.append(rng.choice([" ", " ", " ", "  ", "\n", "\n\n", ", ", ". "]))
    return "".join(out)


@pytest.fixture
def sample():
    return sample_text
