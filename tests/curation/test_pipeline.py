"""`lmlab data run`: pipelines over shards, their statistics, resuming, refusing another pipeline's output, the
executors agreeing, and bad input failing before any work."""

import json
import random

import pytest

from lmlab.cli.main import main
from lmlab.curation.executors import LocalExecutor
from lmlab.curation.pipeline import PipelineConfig, Run
from lmlab.errors import ConfigError
from lmlab.registry import RegistryError
from tests.curation.warcs import warc_bytes, wet_bytes

WORDS = ("the river ran past the old mill where children played and farmers sold their grain while the sun set "
         "over hills that had seen many seasons come and go in the quiet valley of green fields").split()


def prose(rng: random.Random, n_words: int) -> str:
    sentences, words = [], [rng.choice(WORDS) for _ in range(n_words)]
    for i in range(0, n_words, 12):
        sentences.append(" ".join(words[i:i + 12]).capitalize() + ".")
    return "\n".join(sentences)


def corpus(tmp_path, n=12):
    """Two JSONL shards with planted cases: an exact duplicate and a near duplicate of shard 0's documents in
    shard 1, a document too short for Gopher, an e-mail address, and a JSON line that does not parse."""
    rng = random.Random(0)
    docs = [prose(rng, 150) for _ in range(2 * n)]
    near = docs[3].split(" ")
    near[5] = "zebra"
    shard0 = [{"id": f"a{i}", "text": t, "source": "a"} for i, t in enumerate(docs[:n])]
    shard0.append({"id": "short", "text": "Too short to keep."})
    shard1 = [{"id": f"b{i}", "text": t} for i, t in enumerate(docs[n:])]
    shard1 += [{"id": "copy", "text": docs[0]}, {"id": "near", "text": " ".join(near)},
               {"id": "mail", "text": "Write to ann@example.org about it.\n" + prose(rng, 100)}]
    (tmp_path / "in").mkdir()
    paths = [tmp_path / "in" / "0.jsonl", tmp_path / "in" / "1.jsonl"]
    paths[0].write_text("".join(json.dumps(r) + "\n" for r in shard0))
    paths[1].write_text("".join(json.dumps(r) + "\n" for r in shard1) + "{not json\n")
    return paths


STAGES = ["gopher", "pii", "exact_dedup", {"name": "minhash", "num_hashes": 64, "num_bands": 16, "ngrams": 3}]


def run(files, out, stages=STAGES, workers=1, executor=None, **kwargs):
    r = Run(PipelineConfig(reader="jsonl", stages=stages), files, out, **kwargs)
    r.claim(overwrite=False)
    return r.execute(executor or LocalExecutor(LocalExecutor.Config(workers=workers)))


def output(out):
    return [json.loads(line) for path in sorted((out / "shards").glob("*.jsonl")) for line in path.open()]


def test_each_stage_drops_what_it_should_and_counts_it(tmp_path):
    stats = run(corpus(tmp_path), tmp_path / "out")
    assert stats["read"].docs_in == 13 + 16 and stats["read"].dropped == {"bad_json": 1}
    assert stats["gopher"].dropped == {"word_count": 1}
    assert stats["pii"].edited == 1 and stats["exact_dedup"].dropped == {"duplicate": 1}
    assert stats["minhash"].dropped == {"near_duplicate": 1}
    ids = [d["id"] for d in output(tmp_path / "out")]
    assert "short" not in ids and "copy" not in ids and "near" not in ids and "a0" in ids and "a3" in ids
    mail = next(d for d in output(tmp_path / "out") if d["id"] == "mail")
    assert "|||EMAIL_ADDRESS|||" in mail["text"] and "ann@" not in mail["text"]
    assert next(d for d in output(tmp_path / "out") if d["id"] == "a1")["source"] == "a"  # metadata kept
    assert not list((tmp_path / "out" / "work").glob("s[0-9]*"))  # segment outputs deleted once done


def test_outputs_match_between_worker_counts_and_formats(tmp_path):
    files = corpus(tmp_path)
    run(files, tmp_path / "one", workers=1)
    run(files, tmp_path / "two", workers=2)
    assert output(tmp_path / "one") == output(tmp_path / "two")
    run(files, tmp_path / "pq", fmt="parquet")
    import pyarrow.parquet as pq

    rows = [r for p in sorted((tmp_path / "pq" / "shards").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert [r["text"] for r in rows] == [d["text"] for d in output(tmp_path / "one")]


def test_a_killed_run_resumes_and_redoes_only_what_did_not_finish(tmp_path, monkeypatch):
    import lmlab.curation.pipeline as pipeline

    files, out = corpus(tmp_path), tmp_path / "out"
    real = pipeline.run_shard

    def dies_on_the_last_shard_of_the_last_segment(task):
        if task.shard == 1 and task.segment.apply is not None and task.segment.scan is None:
            raise KeyboardInterrupt
        real(task)

    monkeypatch.setattr(pipeline, "run_shard", dies_on_the_last_shard_of_the_last_segment)
    with pytest.raises(KeyboardInterrupt):
        run(files, out)
    finished = out / "shards" / "00000.jsonl"
    written = finished.stat().st_mtime_ns
    assert not (out / "shards" / "00001.jsonl").exists()
    monkeypatch.setattr(pipeline, "run_shard", real)
    run(files, out)
    assert finished.stat().st_mtime_ns == written  # not redone
    run(files, tmp_path / "clean")
    assert output(out) == output(tmp_path / "clean")


def test_another_pipelines_output_is_refused_unless_overwrite(tmp_path):
    files, out = corpus(tmp_path), tmp_path / "out"
    run(files, out)
    other = Run(PipelineConfig(reader="jsonl", stages=["gopher"]), files, out)
    with pytest.raises(ConfigError, match="another pipeline.*overwrite=true"):
        other.claim(overwrite=False)
    other.claim(overwrite=True)
    other.execute(LocalExecutor(LocalExecutor.Config(workers=1)))
    assert len(output(out)) == 27  # of 28 documents, gopher drops only the short one


def test_line_dedup_removes_lines_repeated_anywhere_in_the_corpus(tmp_path):
    rng = random.Random(1)
    footer = "Copyright the valley press, all rights reserved."
    files = []
    for k in range(2):
        path = tmp_path / f"{k}.jsonl"
        path.write_text("".join(json.dumps({"text": prose(rng, 60) + "\n" + footer}) + "\n" for _ in range(3)))
        files.append(path)
    stats = run(files, tmp_path / "out", stages=["line_dedup"])
    assert stats["line_dedup"].edited == 6
    assert all(footer not in d["text"] and d["text"].strip() for d in output(tmp_path / "out"))


def test_bad_stage_names_and_missing_models_fail_before_any_work(tmp_path):
    files = corpus(tmp_path)
    with pytest.raises(RegistryError, match="Did you mean 'gopher'"):
        Run(PipelineConfig(stages=["gopherr"]), files, tmp_path / "a")
    with pytest.raises(ConfigError, match="does not exist"):
        Run(PipelineConfig(stages=[{"name": "classifier", "model": str(tmp_path / "none.bin")}]), files, tmp_path / "b")
    with pytest.raises(ConfigError, match="num_bands"):
        Run(PipelineConfig(stages=[{"name": "minhash", "num_hashes": 10, "num_bands": 3}]), files, tmp_path / "c")
    assert not any((tmp_path / name).exists() for name in "abc")


def test_an_out_of_range_threshold_fails_before_any_work(tmp_path, capsys):
    """jaccard_threshold=2 once ran and removed nothing: no pair of documents is more than identical."""
    files, out = corpus(tmp_path), tmp_path / "out"
    assert main(["data", "run", "pipeline=text", f"input={files[0]}", f"output={out}",
                 "pipeline.stages=[{name: minhash, jaccard_threshold: 2}]"]) == 2
    assert "minhash.jaccard_threshold must be in (0, 1], got 2" in capsys.readouterr().err
    assert not out.exists()


PAGE = "<html><body><nav>Home | Docs | About</nav><article>{}</article><footer>Contact</footer></body></html>"


def test_web_pipeline_reads_warc_and_writes_shards_stats_and_funnel(tmp_path, capsys):
    rng = random.Random(2)
    english = ["".join(f"<p>{line}</p>" for line in prose(rng, 200).splitlines()) for _ in range(4)]
    german = "".join(f"<p>{s}</p>" for s in ["Der Fluss lief an der alten Mühle vorbei, wo die Kinder spielten."] * 20)
    records = [(f"https://example.org/{i}", "200 OK", "text/html", PAGE.format(body).encode())
               for i, body in enumerate(english + [english[0], german])]
    records.append(("https://example.org/logo.png", "200 OK", "image/png", b"\x89PNG"))
    records.append(("https://example.org/moved", "301 Moved Permanently", "text/html", b"<p>see elsewhere</p>"))
    (tmp_path / "crawl").mkdir()
    (tmp_path / "crawl" / "a.warc.gz").write_bytes(warc_bytes(records[:4]))
    (tmp_path / "crawl" / "b.warc.gz").write_bytes(warc_bytes(records[4:]))
    out = tmp_path / "clean"
    assert main(["data", "run", "pipeline=web", f"input={tmp_path}/crawl/*.warc.gz", f"output={out}"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["read"]["docs_in"] == 8 and stats["read"]["dropped"] == {"not_html": 1, "http_status": 1}
    assert stats["language"]["dropped"] == {"label": 1} and stats["exact_dedup"]["dropped"] == {"duplicate": 1}
    docs = output(out)
    assert sorted(d["url"] for d in docs) == [f"https://example.org/{i}" for i in range(4)]
    assert (out / "funnel.png").stat().st_size > 0 and "| minhash |" in capsys.readouterr().out


def test_wet_reader_takes_the_text_records_and_counts_bad_ones(tmp_path):
    text = prose(random.Random(3), 120)
    path = tmp_path / "a.warc.wet.gz"
    path.write_bytes(wet_bytes([("https://example.org/a", text.encode()), ("https://example.org/b", b"\xff\xfe bad"),
                                ("https://example.org/c", b"  \n")]))
    r = Run(PipelineConfig(reader="wet", stages=["gopher"]), [path], tmp_path / "out")
    r.claim(overwrite=False)
    stats = r.execute(LocalExecutor(LocalExecutor.Config(workers=1)))
    assert stats["read"].docs_in == 3 and stats["read"].dropped == {"undecodable": 1, "empty": 1}
    assert output(tmp_path / "out") == [{"id": "a.warc.wet.gz/0", "text": text, "url": "https://example.org/a",
                                         "date": output(tmp_path / "out")[0]["date"]}]


def test_ray_executor_gives_the_local_output(tmp_path):
    ray = pytest.importorskip("ray")
    from lmlab.curation.executors import RayExecutor

    files = corpus(tmp_path)
    run(files, tmp_path / "local", workers=2)
    try:
        run(files, tmp_path / "ray", executor=RayExecutor(RayExecutor.Config(num_cpus=2)))
    finally:
        ray.shutdown()
    assert output(tmp_path / "ray") == output(tmp_path / "local")
