"""Command-line checks that must run before Hydra composes the config.

Hydra composes the config before any lmlab code runs, so plugin modules have to be imported
first (their entries must be in the ConfigStore), and a misspelt group or choice is caught here,
where the error can name the closest one.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import OmegaConf

from lmlab.errors import ConfigError
from lmlab.registry import REGISTRIES, unknown_name_message

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def parse(argv: list[str]) -> list[Override]:
    """The `key=value` overrides among Hydra's arguments (flags and their values are skipped)."""
    args = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        return OverridesParser.create().parse_overrides(args)
    except Exception as err:  # Hydra's parser reports its own error types
        raise ConfigError(f"cannot parse the command line: {err}") from None


def _values(override: Override) -> list[str]:
    if override.is_sweep_override():
        return [str(v) for v in override.sweep_string_iterator()]
    value = override.value()
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def plugin_modules(overrides: list[Override], conf_dir: Path = CONF_DIR, config_name: str = "train") -> list[str]:
    """Plugins named in the primary config file and on the command line (`plugins=[pkg.parts]`)."""
    modules = list(OmegaConf.load(conf_dir / f"{config_name}.yaml").get("plugins", []))
    for override in overrides:
        if override.key_or_group == "plugins" and not override.is_delete():
            modules.extend(_values(override))
    return list(dict.fromkeys(modules))


def config_groups(conf_dir: Path = CONF_DIR) -> set[str]:
    """lmlab's config groups: the registries' and the folders of conf/ (Hydra's own hydra/* left out)."""
    folders = {p.relative_to(conf_dir).as_posix() for p in conf_dir.rglob("*") if p.is_dir()}
    return {r.group for r in REGISTRIES.values()} | {f for f in folders if f != "hydra" and not f.startswith("hydra/")}


def check_choices(overrides: list[Override], conf_dir: Path = CONF_DIR) -> None:
    """Every `GROUP=NAME` names a config group, and in it a registry entry or a preset file in conf/GROUP/."""
    registries = {r.group: r for r in REGISTRIES.values()}
    groups = config_groups(conf_dir)
    for override in overrides:
        group = override.key_or_group
        # A key path has dots, so a slash means a group; Hydra would suggest `+GROUP=...`, which adds a stray key.
        if "/" in group and group not in groups and not group.startswith("hydra/"):
            raise ConfigError(unknown_name_message("config group", group, groups))
        folder = conf_dir / group
        if override.is_delete() or (group not in registries and not folder.is_dir()):
            continue
        choices = set(registries[group].names()) if group in registries else set()
        choices |= {p.stem for p in folder.glob("*.yaml")} if folder.is_dir() else set()
        for name in _values(override):
            if name not in choices:
                raise ConfigError(unknown_name_message(f"choice for config group '{group}'", name, choices))


def prepare(argv: list[str], config_name: str = "train") -> list[Override]:
    """Everything before Hydra composes `config_name`: import lmlab's parts and the plugins, then
    check every `GROUP=NAME` of `argv`. Returns the parsed overrides."""
    from lmlab.catalog import load_catalog

    overrides = parse(argv)
    load_catalog(plugin_modules(overrides, config_name=config_name))
    check_choices(overrides)
    return overrides
