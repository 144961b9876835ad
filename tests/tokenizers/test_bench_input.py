"""`lmlab bench tokenizer` without a FILE benchmarks the corpus that ships with lmlab."""

from lmlab.data.sources import SOURCES
from lmlab.tokenizers import bench


def test_the_default_input_is_the_builtin_pydocs_corpus(monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "run", lambda path, vocab_size, repeats, name=None: seen.append(
        (path.read_text(encoding="utf-8"), name)) or {})
    monkeypatch.setattr(bench, "report", lambda results: "")
    assert bench.main(["--repeats", "1"]) == 0
    assert seen == [("\n\n".join(SOURCES.build("pydocs").documents()), "data=pydocs")]
