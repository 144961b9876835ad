"""Language identification: py3langid (its model ships inside the package, so it works offline)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _identifier():
    from py3langid.langid import MODEL_DIR, MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_modelpath(MODEL_DIR / MODEL_FILE, norm_probs=True)


def identify_language(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, probability in [0, 1]) of the text's main language; newlines are read as spaces."""
    language, probability = _identifier().classify(text.replace("\n", " "))
    return language, float(probability)
