"""Named registries of swappable parts, each paired with a Hydra config group.

Registering a class (or a builder function) under a name also stores its typed `Config`
dataclass in Hydra's ConfigStore under the registry's config group. A registry and a config
group are therefore one thing: `model/norm=layernorm` on the command line selects
`NORMS["layernorm"]` with that entry's fields, type-checked by OmegaConf.

    @NORMS.register("rmsnorm")
    class RMSNorm(nn.Module):
        @dataclass
        class Config:
            eps: float = 1e-6
        def __init__(self, dim: int, cfg: Config): ...

    norm = NORMS.build(cfg.model.norm, dim=256)   # cfg.model.norm.name == "rmsnorm"

The stored node carries one extra field, `name`, so a composed config says which entry it
selects and can be built without Hydra's runtime state.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from lmlab.errors import ConfigError

ENTRY_POINT_GROUP = "lmlab.plugins"

# Every registry by its short name ("norm", "optim", ...), in creation order.
REGISTRIES: dict[str, Registry] = {}


class RegistryError(ConfigError):
    """A name or config that no registry entry matches; the message says how to fix it."""


def closest(name: str, choices: Iterable[str], cutoff: float = 0.0) -> str | None:
    """The choice most like `name`; with a `cutoff` (0 to 1, difflib's ratio), None when none is that alike."""
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def unknown_name_message(what: str, name: str, choices: Iterable[str]) -> str:
    choices = sorted(choices)
    hint = closest(name, choices)
    did_you_mean = f" Did you mean '{hint}'?" if hint else ""
    return f"unknown {what} '{name}'.{did_you_mean} Available: {', '.join(choices) or '(none)'}."


@dataclass(frozen=True)
class Entry:
    name: str
    target: Callable[..., Any]
    config: type
    doc: str

    def fields(self) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(self.config) if f.name != "name"]


@dataclass
class _Empty:
    """Config of an entry that has no settings."""


class Registry:
    """Entries of one kind of part, registered by name and built from config."""

    def __init__(self, name: str, group: str, doc: str, entries_apart: bool = False):
        """entries_apart: each entry's node goes to GROUP.NAME instead of GROUP, so that a list of entries
        (`eval=[mmlu,gsm8k]`) can be selected at once, each with its own fields (`eval.mmlu.shots=0`)."""
        if name in REGISTRIES:
            raise RegistryError(f"a registry named '{name}' exists already")
        self.name = name
        self.group = group
        self.doc = doc
        self.entries_apart = entries_apart
        self._entries: dict[str, Entry] = {}
        REGISTRIES[name] = self

    def register(self, name: str, config: type | None = None) -> Callable:
        """Decorator: register `target` under `name` with `config` (default: `target.Config`)."""

        def decorator(target: Callable) -> Callable:
            cfg_cls = config or getattr(target, "Config", None) or _Empty
            if not dataclasses.is_dataclass(cfg_cls):
                raise RegistryError(f"{self.name} '{name}': Config must be a dataclass, got {cfg_cls!r}")
            if any(f.name == "name" for f in dataclasses.fields(cfg_cls)):
                raise RegistryError(f"{self.name} '{name}': 'name' is reserved in Config (it holds the entry name)")
            if name in self._entries and self._entries[name].target is not target:
                raise RegistryError(f"{self.name} '{name}' is registered already by {self._entries[name].target!r}")
            doc = (target.__doc__ or "").strip().splitlines()
            self._entries[name] = Entry(name, target, cfg_cls, doc[0] if doc else "")
            package = f"{self.group.replace('/', '.')}.{name}" if self.entries_apart else None
            ConfigStore.instance().store(group=self.group, name=name, node=_named(cfg_cls, name), package=package)
            return target

        return decorator

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self):
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise RegistryError(unknown_name_message(f"{self.name} (config group '{self.group}')", name, self._entries)) from None

    def resolve(self, cfg: str | Mapping | DictConfig | Any) -> tuple[Entry, Any]:
        """The entry a config selects and its typed Config instance.

        `cfg` is an entry name (default fields), a mapping or DictConfig with a `name` key,
        or an instance of an entry's Config dataclass.
        """
        if isinstance(cfg, str):
            entry = self.get(cfg)
            return entry, entry.config()
        if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
            name = getattr(cfg, "name", None) or self._name_of_config(type(cfg))
            return self.get(name), cfg
        values = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        if "name" not in values:
            raise RegistryError(f"{self.name} config has no 'name' field; pick one of: {', '.join(self.names())}")
        entry = self.get(values.pop("name"))
        typed = OmegaConf.merge(OmegaConf.structured(entry.config), values)
        missing = [key for key in typed if OmegaConf.is_missing(typed, key)]
        if missing:  # a field without a default (`task.data` of a post-training stage): one line, not a traceback
            group = self.group or self.name
            keys = [f"{group.replace('/', '.')}.{key}" for key in missing]
            raise RegistryError(f"{group}={entry.name} needs {', '.join(keys)}: set " + " ".join(f"{k}=..." for k in keys))
        return entry, OmegaConf.to_object(typed)

    def build(self, cfg: str | Mapping | DictConfig | Any, *args: Any, **kwargs: Any) -> Any:
        """Call the selected entry as `target(*args, cfg=<Config>, **kwargs)`."""
        entry, config = self.resolve(cfg)
        return entry.target(*args, cfg=config, **kwargs)

    def _name_of_config(self, cfg_cls: type) -> str:
        # The exact class first: an entry's Config may subclass another entry's (a subclassed layer's).
        for entry in sorted(self._entries.values(), key=lambda e: e.config is not cfg_cls):
            if issubclass(cfg_cls, entry.config):
                return entry.name
        raise RegistryError(f"{cfg_cls.__name__} is the Config of no {self.name} entry")


def _named(cfg_cls: type, name: str) -> type:
    """`cfg_cls` plus a `name` field (defaulting to `name`) that records which entry the node selects."""
    return dataclasses.make_dataclass(
        cfg_cls.__name__,
        [("name", str, field(default=name))],
        bases=(cfg_cls,),
    )


def load_plugins(modules: Iterable[str] = (), entry_point_group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Import plugin modules so that their entries register; returns what was loaded.

    Plugins come from two explicit places only: the `lmlab.plugins` entry-point group of
    installed packages, and the `plugins:` list of the config (module names).
    """
    loaded = []
    for ep in entry_points(group=entry_point_group):
        ep.load()
        loaded.append(ep.value)
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name and module.startswith(err.name):
                raise RegistryError(
                    f"plugin module '{module}' was not found; put its folder on PYTHONPATH or install its package"
                ) from None
            raise
        loaded.append(module)
    return loaded
