"""A data pipeline: a reader, then a list of stages (FILTERS entries), run over shards of the input on an executor.

The stages run in segments that end at each corpus-level filter (deduplication). Segment 0 reads a shard's files
and runs the document filters up to the first corpus filter, whose `scan` it also runs on what is left; the
driver then makes that filter's global decision, and segment 1 applies it, runs the next document filters, and
so on. The last segment writes the output shards.

    OUTPUT/pipeline.json        the run's settings: a folder holding another pipeline's shards is refused
    OUTPUT/shards/00000.jsonl   the documents kept (or .parquet), one output shard per input shard
    OUTPUT/stats.json           per stage: documents and bytes in and out, edits, drops by rule
    OUTPUT/funnel.png           the same as a plot
    OUTPUT/work/                segment outputs, scans and decisions, and a done-marker per (segment, shard)

Every file is written atomically and each (segment, shard) writes its marker last, so a killed run run again
skips what finished and loses nothing; segment outputs are deleted once the run completes.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import shutil
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lmlab.atomic import atomic_write, atomic_write_text
from lmlab.curation.corpus_filters import CorpusFilter
from lmlab.curation.document import Document, StageStats
from lmlab.curation.filters import FILTERS
from lmlab.curation.readers import READERS
from lmlab.errors import ConfigError
from lmlab.registry import REGISTRIES, Registry

READ_STAGE = "read"
FORMATS = ("jsonl", "parquet")


@dataclass
class PipelineConfig:
    """A `pipeline` preset (conf/pipeline/NAME.yaml): a reader and the stages after it."""

    reader: Any = "jsonl"  # an entry of `lmlab list reader`: its name or {name: warc, extractor: trafilatura}
    stages: list[Any] = field(default_factory=list)  # entries of `lmlab list filter`: names or {name: ..., field: ...}


@dataclass
class Segment:
    apply: int | None  # the index (in stages) of the corpus filter this segment applies first
    stages: list[int]  # the document filters it runs after it
    scan: int | None  # the corpus filter it scans for at its end


def stage_labels(stages: list[Any]) -> list[str]:
    """Each stage's name, numbered where a name repeats (classifier, classifier#2): the keys of the statistics."""
    labels, seen = [], {}
    for cfg in stages:
        name = _name(cfg)
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return labels


def _name(cfg: Any) -> str:
    return cfg if isinstance(cfg, str) else dict(cfg).get("name", "?")


def _plain(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg


@lru_cache(maxsize=64)
def _built(registry: str, cfg_json: str) -> Any:
    """The entry a config builds, once per process (a classifier's model loads once per worker)."""
    cfg = json.loads(cfg_json)
    try:
        return REGISTRIES[registry].build(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{registry} '{_name(cfg)}': {err}".splitlines()[0]) from None


def build(registry: Registry, cfg: Any) -> Any:
    return _built(registry.name, json.dumps(_plain(cfg), sort_keys=True))


def segments_of(stages: list[Any]) -> list[Segment]:
    segments, current = [], Segment(None, [], None)
    for i, cfg in enumerate(stages):
        if isinstance(build(FILTERS, cfg), CorpusFilter):
            current.scan = i
            segments.append(current)
            current = Segment(i, [], None)
        else:
            current.stages.append(i)
    return [*segments, current]


@dataclass
class ShardTask:
    """What one worker does for one (segment, shard); picklable, so any executor can ship it."""

    shard: int
    segment: Segment
    inputs: list[str]  # the input files (segment 0) or the previous segment's output
    reader: Any
    stages: list[Any]  # the pipeline's stages, all (the segment names its own by index)
    labels: list[str]
    decision: Any  # the applied corpus filter's decision for this shard
    out: str
    fmt: str
    work: str  # the shard's folder for this segment's scan
    marker: str


def run_shard(task: ShardTask) -> None:
    stats: dict[str, StageStats] = {}
    seg = task.segment
    if seg.apply is None:
        read = stats[READ_STAGE] = StageStats()
        reader = build(READERS, task.reader)
        docs = [doc for path in task.inputs for doc in reader.read(Path(path), read)]
        read.docs_out, read.bytes_out = len(docs), _bytes(docs)
        size = read.bytes_out
    else:
        docs = list(_read_jsonl(Path(task.inputs[0])))
        docs, size = _run(task.labels[seg.apply], docs, _bytes(docs),
                          build(FILTERS, task.stages[seg.apply]).apply(docs, task.decision), stats)
    for i in seg.stages:
        stage = build(FILTERS, task.stages[i])
        docs, size = _run(task.labels[i], docs, size, [stage(d.text) for d in docs], stats)
    if seg.scan is not None:
        work = Path(task.work)
        work.mkdir(parents=True, exist_ok=True)
        scan = build(FILTERS, task.stages[seg.scan]).scan(docs, work)
        atomic_write(work / "scan.pkl", lambda tmp: tmp.write_bytes(pickle.dumps(scan)))
    _write(Path(task.out), docs, task.fmt)
    atomic_write_text(task.marker, json.dumps({k: v.to_dict() for k, v in stats.items()}))


def _bytes(docs: list[Document]) -> int:
    return sum(len(d.text.encode()) for d in docs)


def _run(label: str, docs: list[Document], size: int, decisions: list,
         stats: dict[str, StageStats]) -> tuple[list[Document], int]:
    """The documents a stage's decisions keep (edited where it edits), counted into its stats, and their bytes;
    `size` is the input's bytes, the previous stage's output already measured."""
    s = stats[label] = StageStats(docs_in=len(docs), bytes_in=size)
    kept = []
    for doc, decision in zip(docs, decisions):
        if not decision.keep:
            s.drop(decision.rule)
            continue
        if decision.text is not None and decision.text != doc.text:
            s.edited += 1
            doc = Document(doc.id, decision.text, doc.metadata)
        kept.append(doc)
    s.docs_out, s.bytes_out = len(kept), _bytes(kept)
    return kept, s.bytes_out


def _read_jsonl(path: Path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield Document.from_json(line)


def _write(path: Path, docs: list[Document], fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [{"id": d.id, "text": d.text, "metadata": json.dumps(d.metadata, ensure_ascii=False)} for d in docs]
        table = pa.Table.from_pylist(rows, schema=pa.schema([("id", pa.string()), ("text", pa.string()),
                                                             ("metadata", pa.string())]))
        atomic_write(path, lambda tmp: pq.write_table(table, tmp))
    else:
        atomic_write_text(path, "".join(d.to_json() + "\n" for d in docs))


def input_files(patterns: list[str]) -> list[Path]:
    """Files, folders (every file under them) and glob patterns, in order; none at all is an error."""
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matched:
            raise ConfigError(f"input: '{pattern}' matches no file")
        for path in map(Path, matched):
            files += sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"input: {patterns} holds no file")
    return list(dict.fromkeys(files))


@dataclass
class Run:
    """One pipeline over one input into one output folder."""

    pipeline: PipelineConfig
    files: list[Path]
    out: Path
    fmt: str = "jsonl"
    files_per_shard: int = 1

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ConfigError(f"format must be one of {', '.join(FORMATS)}, got '{self.fmt}'")
        if self.files_per_shard < 1:
            raise ConfigError(f"files_per_shard must be >= 1, got {self.files_per_shard}")
        self.reader = _plain(self.pipeline.reader)
        self.stages = [_plain(s) for s in self.pipeline.stages]
        build(READERS, self.reader)  # an unknown name, a wrong field or a missing model file fails here
        self.segments = segments_of(self.stages)
        self.labels = stage_labels(self.stages)
        self.shards = [self.files[i:i + self.files_per_shard] for i in range(0, len(self.files), self.files_per_shard)]
        self.work = self.out / "work"

    def settings(self) -> dict:
        return {"reader": self.reader, "stages": self.stages, "format": self.fmt,
                "files_per_shard": self.files_per_shard, "inputs": [str(p) for p in self.files]}

    def claim(self, overwrite: bool) -> None:
        """Take the output folder: empty, or this same pipeline's (resume); another's is refused unless overwrite."""
        record = self.out / "pipeline.json"
        if record.exists() and json.loads(record.read_text()) != self.settings():
            if not overwrite:
                raise ConfigError(f"{self.out} holds the output of another pipeline (its settings in {record} differ):"
                                  " choose another output, or pass overwrite=true to replace it")
            for name in ("shards", "work", "stats.json", "funnel.png"):
                target = self.out / name
                shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        elif not record.exists() and (self.out / "shards").exists():
            raise ConfigError(f"{self.out}/shards exists but no pipeline.json: not a pipeline's output; choose "
                              "another output folder")
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(record, json.dumps(self.settings(), indent=1))

    def _paths(self, k: int, shard: int) -> tuple[Path, Path, Path]:
        """(output, work folder, marker) of segment k's task for a shard."""
        last = k == len(self.segments) - 1
        out = self.out / "shards" / f"{shard:05d}.{self.fmt}" if last else self.work / f"s{k}" / f"{shard:05d}.jsonl"
        return out, self.work / f"s{k}" / f"{shard:05d}", self.work / "done" / f"s{k}-{shard:05d}.json"

    def execute(self, executor: Any) -> dict[str, StageStats]:
        (self.work / "done").mkdir(parents=True, exist_ok=True)
        for k, seg in enumerate(self.segments):
            decisions = self._decisions(k, seg, executor) if seg.apply is not None else [None] * len(self.shards)
            tasks = []
            for shard, files in enumerate(self.shards):
                out, work, marker = self._paths(k, shard)
                if marker.exists():
                    continue
                inputs = [str(p) for p in files] if k == 0 else [str(self._paths(k - 1, shard)[0])]
                fmt = self.fmt if k == len(self.segments) - 1 else "jsonl"  # segments pass JSONL along
                tasks.append((ShardTask(shard, seg, inputs, self.reader, self.stages, self.labels, decisions[shard],
                                        str(out), fmt, str(work), str(marker)),))
            executor.map(run_shard, tasks, f"segment {k + 1}/{len(self.segments)}")
        for k in range(len(self.segments) - 1):  # every marker is there: the segment outputs have served
            shutil.rmtree(self.work / f"s{k}", ignore_errors=True)
        return self.stats()

    def _decisions(self, k: int, seg: Segment, executor: Any) -> list:
        path = self.work / f"decision{k}.pkl"
        if path.exists():
            return pickle.loads(path.read_bytes())
        sides = [self._paths(k - 1, shard)[1] for shard in range(len(self.shards))]
        scans = [pickle.loads((side / "scan.pkl").read_bytes()) for side in sides]
        decisions = build(FILTERS, self.stages[seg.apply]).decide(scans, sides, executor)
        atomic_write(path, lambda tmp: tmp.write_bytes(pickle.dumps(decisions)))
        return decisions

    def stats(self) -> dict[str, StageStats]:
        """Per stage, in pipeline order, summed over shards."""
        total = {label: StageStats() for label in [READ_STAGE, *self.labels]}
        for marker in sorted((self.work / "done").glob("*.json")):
            for label, values in json.loads(marker.read_text()).items():
                total[label].add(StageStats.from_dict(values))
        return total
