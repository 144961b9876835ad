"""What flows through a pipeline (a Document) and what each stage counts about it (StageStats)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Document:
    id: str
    text: str
    metadata: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "text": self.text, **self.metadata}, ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Document:
        record = json.loads(line)
        return cls(record.pop("id"), record.pop("text"), record)


@dataclass
class StageStats:
    """Documents and bytes (of text; a reader counts the raw bytes it read) into and out of one stage, the drops by
    rule, and the documents whose text the stage changed (PII masked, C4 lines removed, duplicate lines cut)."""

    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    edited: int = 0
    dropped: Counter = field(default_factory=Counter)

    def drop(self, rule: str, count: int = 1) -> None:
        if count:
            self.dropped[rule] += count

    def add(self, other: StageStats) -> None:
        self.docs_in += other.docs_in
        self.docs_out += other.docs_out
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.edited += other.edited
        self.dropped.update(other.dropped)

    def to_dict(self) -> dict:
        return {"docs_in": self.docs_in, "docs_out": self.docs_out, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "edited": self.edited, "dropped": dict(self.dropped.most_common())}

    @classmethod
    def from_dict(cls, values: dict) -> StageStats:
        return cls(**{**values, "dropped": Counter(values["dropped"])})
