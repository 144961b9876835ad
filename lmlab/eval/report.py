"""What `lmlab eval` writes: results.json (every metric, per-task tables, speed), results.md (the same as
markdown tables) and records/<task>.jsonl (one line per example, for inspection)."""

from __future__ import annotations

import json
from pathlib import Path

from lmlab.atomic import atomic_write_text
from lmlab.eval.registry import TaskResult


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def markdown_table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def markdown(results: list[TaskResult], meta: dict) -> str:
    summary = [{"task": r.task, "metric": name, "value": value, "examples": f"{r.examples:,} {r.unit}",
                "per second": f"{r.examples_per_s:,.1f}"} for r in results for name, value in r.metrics.items()]
    parts = [f"# lmlab eval: {meta['model']}", "", markdown_table(summary)]
    for r in results:
        if r.table or r.notes:
            parts += ["", f"## {r.task}", *(f"- {note}" for note in r.notes)]
            parts += ["", markdown_table(r.table)] if r.table else []
    return "\n".join(parts) + "\n"


def write_results(results: list[TaskResult], folder: Path, meta: dict) -> Path:
    """Write the three outputs under `folder`; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    tasks = {r.task: {"metrics": r.metrics, "examples": r.examples, "unit": r.unit, "seconds": r.seconds,
                      "examples_per_s": r.examples_per_s, "table": r.table, "notes": r.notes} for r in results}
    atomic_write_text(folder / "results.json", json.dumps({"meta": meta, "tasks": tasks}, indent=2) + "\n")
    atomic_write_text(folder / "results.md", markdown(results, meta))
    for r in results:
        if r.records:
            (folder / "records").mkdir(exist_ok=True)
            lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in r.records)
            atomic_write_text(folder / "records" / f"{r.task}.jsonl", lines)
    return folder
