"""Language identification, a registry (`lmlab list langid`): each entry answers (language code, probability).

- `py3langid` (the default): its model ships inside the package, so it works offline. Its cost grows with the
  text, so a text longer than `max_chars` is judged on three windows of it (start, middle, end): a page's
  language shows in a few thousand characters, and this keeps extraction + language ID + Gopher above 5 MB of
  HTML per second on one core.
- `fasttext`: fastText's lid.176 (`lid.176.bin` or `.ftz`, downloaded by the user) through the `fasttext` package,
  given by path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.registry import Registry

LANGUAGE_IDS = Registry("langid", group="curation/langid", doc="language identifiers: (language code, probability)")


@lru_cache(maxsize=1)
def _py3langid():
    from py3langid.langid import MODEL_DIR, MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_modelpath(MODEL_DIR / MODEL_FILE, norm_probs=True)


MAX_CHARS = 3000


def sample_windows(text: str, max_chars: int = MAX_CHARS) -> str:
    """The text, or when longer than max_chars (> 0), its start, middle and end, max_chars / 3 characters each."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    width, middle = max_chars // 3, len(text) // 2
    return " ".join((text[:width], text[middle - width // 2:middle + width // 2], text[-width:]))


def identify_language(text: str, max_chars: int = MAX_CHARS) -> tuple[str, float]:
    """(ISO 639-1 code, probability in [0, 1]) of the text's main language (py3langid, on `sample_windows` of a
    long text); newlines read as spaces."""
    language, probability = _py3langid().classify(sample_windows(text, max_chars).replace("\n", " "))
    return language, float(probability)


@LANGUAGE_IDS.register("py3langid")
class Py3LangId:
    """py3langid's naive Bayes model over byte n-grams (97 languages), shipped inside the package."""

    @dataclass
    class Config:
        max_chars: int = MAX_CHARS  # a longer text is judged on three windows (start, middle, end); 0: all of it

    def __init__(self, cfg: Config | None = None):
        self.cfg = cfg or self.Config()
        at_least("py3langid", self.cfg, 0, "max_chars")

    def __call__(self, text: str) -> tuple[str, float]:
        return identify_language(text, self.cfg.max_chars)


@LANGUAGE_IDS.register("fasttext")
class FastTextLangId:
    """fastText's lid.176 model (176 languages) from the file at `model`; needs `pip install fasttext-wheel`."""

    @dataclass
    class Config:
        model: str = ""  # lid.176.bin or lid.176.ftz

    SOURCE = ("download https://dl.fbaipublicfiles.com/fasttext/supervised-models/lid.176.bin (or the smaller "
              "lid.176.ftz beside it) and give its path; in a pipeline, a stage {name: language, identifier: "
              "{name: fasttext, model: PATH}}")

    def __init__(self, cfg: Config):
        from lmlab.curation.classifier import FastTextClassifier

        if not cfg.model:
            raise ConfigError(f"langid 'fasttext' needs model=PATH, fastText's lid.176 model: {self.SOURCE}")
        self.model = FastTextClassifier(cfg.model, self.SOURCE)

    def __call__(self, text: str) -> tuple[str, float]:
        return self.model.predict(text)
