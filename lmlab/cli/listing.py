"""`lmlab list`: the registries and the config sections that are not registries (the top level,
model sizes, the settings every data source shares, the trainer, `lmlab data run`'s pipeline), each field
with its type, default and the comment that documents it in the dataclass; then the preset files of
the section's or group's folder in conf/ (`model=tiny`, `pipeline=web`, `experiment=NAME`), each with
the first line of its header comment."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from lmlab.cli.overrides import CONF_DIR
from lmlab.cli.schema import field_comments, type_name
from lmlab.registry import Entry, Registry


@dataclass(frozen=True)
class Section:
    name: str  # what `lmlab list NAME` takes
    schema: type | None  # None: a folder of presets with no schema of its own (experiment)
    path: str  # where its keys are in the config ("" for the top level); conf/PATH/ holds its presets
    doc: str


def sections() -> dict[str, Section]:
    from lmlab.curation.pipeline import PipelineConfig
    from lmlab.data.sources import DataConfig
    from lmlab.nn.transformer import ModelConfig
    from lmlab.training.config import TrainConfig, TrainerConfig

    return {s.name: s for s in (
        Section("top", TrainConfig, "", "the top level of lmlab-train's config: KEY=VALUE"),
        Section("model", ModelConfig, "model", "model sizes: model.FIELD=VALUE; its parts are the model/* groups"),
        Section("data", DataConfig, "data", "what every data source has: data.FIELD=VALUE"),
        Section("trainer", TrainerConfig, "trainer", "the training loop: trainer.FIELD=VALUE"),
        # folders of conf/ that are no registry: Hydra lists them among lmlab-train's groups, as the verbs share conf/
        Section("pipeline", PipelineConfig, "pipeline",
                "a data pipeline of `lmlab data run`: pipeline=NAME, pipeline.FIELD=VALUE"),
        Section("experiment", None, "experiment",
                "named studies, each a set of overrides: lmlab-train -m experiment=NAME"),
    )}


def _header(path: Path) -> str:
    """The first line of a YAML file's leading comment (Hydra's `# @package` line skipped)."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text and not text.startswith("@package"):
            return text.rstrip(":")
    return ""


def preset_lines(group: str) -> list[str]:
    """The presets in conf/GROUP/ that GROUP=NAME selects, each with its header; none: no lines."""
    presets = sorted((CONF_DIR / group).glob("*.yaml")) if group else []
    if not presets:
        return []
    width = max(len(p.stem) for p in presets)
    return [f"  presets in conf/{group}/ ({group}=NAME):"] + [f"    {p.stem:<{width}}  {_header(p)}".rstrip()
                                                            for p in presets]


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
    lines = [line for e in entries for line in format_entry(e, width)]
    return "\n".join([header, *lines, *preset_lines(registry.group)])


def format_section(section: Section, groups: set[str], section_paths: set[str]) -> str:
    """The section's own fields, then the config groups and sections inside it, which are listed on their own."""
    inside, lines = {}, [f"{section.name}  ({section.doc})"]
    if section.schema is not None:
        for f in dataclasses.fields(section.schema):
            path = f"{section.path}.{f.name}" if section.path else f.name
            if path.replace(".", "/") in groups or path in section_paths:
                inside[f.name] = path.replace(".", "/")
        lines += _aligned(_field_rows(section.schema, skip=frozenset(inside)), "  ")
    if inside:
        lines.append(f"  (also here, shown by lmlab list NAME: {', '.join(inside.values())})")
    return "\n".join(lines + preset_lines(section.path.replace(".", "/")))
