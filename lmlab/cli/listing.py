"""`lmlab list`: the registries and the config sections that are not registries (the top level,
model sizes, the settings every data source shares, the trainer), each field with its type,
default and the comment that documents it in the dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from omegaconf import MISSING

from lmlab.cli.schema import field_comments, type_name
from lmlab.registry import Entry, Registry


@dataclass(frozen=True)
class Section:
    name: str  # what `lmlab list NAME` takes
    schema: type
    path: str  # where its keys are in the config ("" for the top level)
    doc: str


def sections() -> dict[str, Section]:
    from lmlab.data.sources import DataConfig
    from lmlab.nn.transformer import ModelConfig
    from lmlab.training.config import TrainConfig, TrainerConfig

    return {s.name: s for s in (
        Section("top", TrainConfig, "", "the top level of lmlab-train's config: KEY=VALUE"),
        Section("model", ModelConfig, "model", "model sizes: model.FIELD=VALUE; its parts are the model/* groups"),
        Section("data", DataConfig, "data", "what every data source has: data.FIELD=VALUE"),
        Section("trainer", TrainerConfig, "trainer", "the training loop: trainer.FIELD=VALUE"),
    )}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _field_rows(schema: type, prefix: str = "", skip: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(`name: type = default`, comment) per field not in `skip`; a nested dataclass's fields as `name.field`."""
    comments = field_comments(schema)
    rows = []
    for f in (f for f in dataclasses.fields(schema) if f.name not in skip):
        default = _default(f)
        if dataclasses.is_dataclass(default):
            rows += _field_rows(type(default), f"{prefix}{f.name}.")
            continue
        shown = "required" if default is dataclasses.MISSING or default == MISSING else repr(default)
        rows.append((f"{prefix}{f.name}: {type_name(f)} = {shown}", comments.get(f.name, "")))
    return rows


ALIGN_UP_TO = 48  # characters of `name: type = default`; a longer one's comment just follows it


def _aligned(rows: list[tuple[str, str]], indent: str) -> list[str]:
    width = max((len(text) for text, _ in rows if len(text) <= ALIGN_UP_TO), default=0)
    return [f"{indent}{text:<{width}}  {comment}".rstrip() for text, comment in rows]


def format_entry(entry: Entry, width: int) -> list[str]:
    rows = _aligned(_field_rows(entry.config), f"  {'':<{width}}    ")
    return [f"  {entry.name:<{width}}  {entry.doc}"] + (rows or [f"  {'':<{width}}    (no fields)"])


def format_registry(registry: Registry) -> str:
    entries = list(registry)
    width = max((len(e.name) for e in entries), default=0)
    header = f"{registry.name}  (config group '{registry.group}': {registry.doc})"
    return "\n".join([header] + [line for e in entries for line in format_entry(e, width)])


def format_section(section: Section, groups: set[str], section_paths: set[str]) -> str:
    """The section's own fields, then the config groups and sections inside it, which are listed on their own."""
    inside = {}
    for f in dataclasses.fields(section.schema):
        path = f"{section.path}.{f.name}" if section.path else f.name
        if path.replace(".", "/") in groups or path in section_paths:
            inside[f.name] = path.replace(".", "/")
    lines = [f"{section.name}  ({section.doc})", *_aligned(_field_rows(section.schema, skip=frozenset(inside)), "  ")]
    if inside:
        lines.append(f"  (also here, shown by lmlab list NAME: {', '.join(inside.values())})")
    return "\n".join(lines)
