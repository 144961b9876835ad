"""lmlab's config composed from command-line overrides, with every mistake reported as one line.

Hydra answers a misspelt key with "Could not override 'optim.lrr'. To append to your config use
+optim.lrr=1e-3", advice that adds a key no code reads, and accepts `+trainer.foo=1` silently.
Here the config is composed before Hydra's app runs (in a sweep: every job's), a key added with
+ or ++ must be a field of the typed schema, and a wrong key or value becomes a `ConfigError`
naming the key, the closest field and the fields there are. `lmlab info`, `plot-lr`, `upcycle`
and the tests compose through `compose_config` too. Keys under `hydra.` are left to Hydra.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError, ValidationError

from lmlab.cli.overrides import CONF_DIR, config_groups, parse, prepare
from lmlab.cli.schema import schema_fields, type_name
from lmlab.errors import ConfigError
from lmlab.registry import REGISTRIES, closest

# Jobs of a sweep composed here; Hydra's basic sweeper composes all of a sweep's jobs before starting the
# first, so a longer sweep's later jobs still fail before any work, only in Hydra's words.
SWEEP_CHECK_LIMIT = 64
# The launcher that runs a sweep's jobs one after another in this process. A `check_job` judges a job on this
# machine (its GPUs and cores), so a sweep sent elsewhere (hydra/launcher=slurm) is checked job by job, there.
LOCAL_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
# A key is suggested only when it is this alike (difflib's ratio); the message lists all the fields anyway.
KEY_HINT_CUTOFF = 0.6


def compose_config(overrides: list[str], config_name: str = "train") -> DictConfig:
    """The config `lmlab-train OVERRIDES` would run with (no `hydra` node), checked as described above."""
    parsed = prepare(overrides, config_name)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return _compose(config_name, parsed)


def check_jobs(argv: list[str], config_name: str = "train", check_job: Callable[[DictConfig], object] | None = None
               ) -> None:
    """Compose the config of every job that Hydra's `argv` asks for: one, or each of a sweep's (-m) jobs; then
    `check_job(cfg)` on each of a sweep's jobs when they run on this machine (a single run checks itself as it
    starts).

    A sweep's jobs are the product of the swept overrides, including `hydra.sweeper.params` that a config
    (an experiment) sets, enumerated the way Hydra's basic sweeper does."""
    parsed = prepare(argv, config_name)
    if "-sc" in argv or "--shell-completion" in argv:  # its `install=bash` is Hydra's argument, not an override
        return
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        if "-m" not in argv and "--multirun" not in argv:
            _compose(config_name, parsed)
            return
        try:
            first_job = BasicSweeper.split_arguments(parsed, None)[0][0]
        except HydraException:  # a sweep that is no list of values (interval): a sweeper plugin's to choose
            return
        with_hydra = _compose(config_name, parse(first_job), with_hydra=True)
        swept_by_config = OmegaConf.select(with_hydra, "hydra.sweeper.params") or {}
        params = [f"{key}={value}" for key, value in swept_by_config.items()]
        sweep = parse(params + [o.input_line for o in parsed])
        every = BasicSweeper.split_arguments(sweep, None)[0]
        jobs = [parse(job) for job in every[:SWEEP_CHECK_LIMIT]]
        configs = [_compose(config_name, job) for job in jobs]
    if check_job is not None and OmegaConf.select(with_hydra, "hydra.launcher._target_") == LOCAL_LAUNCHER:
        _check_each(check_job, sweep, jobs, configs)
        if len(every) > len(jobs):
            print(f"note: checked the first {len(jobs)} of the sweep's {len(every)} jobs before starting; each later "
                  "job checks itself as it starts", file=sys.stderr)


def _check_each(check_job: Callable[[DictConfig], object], sweep: list[Override], jobs: list[list[Override]],
                configs: list[DictConfig]) -> None:
    """`check_job` on each job's config; its `ConfigError` comes back naming the job by its number (Hydra's, which
    names its folder: #0 first) and its swept values."""
    swept = {o.key_or_group for o in sweep if o.is_sweep_override()}
    for number, (job, cfg) in enumerate(zip(jobs, configs)):
        values = " ".join(o.input_line for o in job if o.key_or_group in swept)
        try:
            check_job(cfg)
        except InterpolationResolutionError:  # e.g. ${hydra:...}: only a running job resolves it, and checks itself
            continue
        except ConfigError as err:
            raise ConfigError(f"job #{number}{f' ({values})' if values else ''}: {err}") from None


def _compose(config_name: str, overrides: list[Override], with_hydra: bool = False) -> DictConfig:
    try:
        cfg = compose(config_name, overrides=[o.input_line for o in overrides], return_hydra_config=with_hydra)
    except ConfigCompositionException as err:
        raise composition_error(err) from None
    groups = config_groups()
    for override in overrides:
        key = override.key_or_group
        if (override.is_add() or override.is_force_add()) and key not in groups and key.split(".")[0] != "hydra":
            check_in_schema(cfg, key)
    return cfg


def check_in_schema(cfg: DictConfig, key: str) -> None:
    """`key` (dotted, as on the command line) is a field of the typed schema at each level of `cfg`.

    Only the root may be a plain dict (a config without a schema, like lmlab-tokenize's)."""
    node, path = cfg, []
    for part in key.split("."):
        if isinstance(node, ListConfig):
            node = node._get_node(int(part))
        elif isinstance(node, DictConfig):
            fields = schema_fields(node)
            if fields is None and path and user_keyed(node):
                return
            if (fields is None and path) or (fields is not None and part not in fields):
                raise ConfigError(unknown_key_message(key, node, ".".join(path)))
            node = node._get_node(part)
        else:  # a value: Hydra refused to go further already
            return
        path.append(part)


def user_keyed(node: DictConfig) -> bool:
    """A field typed as a dict (data.sources: dict[str, Any]): its keys are the user's to name."""
    return node._metadata.object_type is dict and node._metadata.ref_type is not Any


def composition_error(err: ConfigCompositionException) -> ConfigError:
    """Hydra's composition error as one line: an unknown key, a value of the wrong type, or Hydra's own message."""
    cause = err.__cause__
    full_key = getattr(cause, "full_key", None)
    parent = getattr(cause, "parent_node", None)
    if full_key and isinstance(parent, DictConfig):
        key = re.sub(r"\[(\d+)\]", r".\1", full_key)  # optim.groups[0].lr -> optim.groups.0.lr, as typed
        parent_path = key.rpartition(".")[0]
        if isinstance(cause, ValidationError):
            return ConfigError(wrong_type_message(key, cause.value, parent, cause.msg))
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
            return ConfigError(unknown_key_message(key, parent, parent_path))
    message = " ".join(line.strip() for line in str(err).strip().splitlines())  # Hydra's advice is on later lines
    if cause is not None:
        message += f" ({str(cause).strip().splitlines()[0]})"
    return ConfigError(message)


def unknown_key_message(key: str, parent: DictConfig, parent_path: str) -> str:
    """The line for a key that `parent` has no field for, with the closest field and the fields there are."""
    fields = schema_fields(parent)
    group = parent_path.replace(".", "/")
    is_group = group in {r.group for r in REGISTRIES.values()}
    if fields is None and user_keyed(parent):
        return (f"'{parent_path}' is a dict whose keys are yours to name: add '{key}' with +{key}=VALUE "
                "(a new key needs Hydra's +)")
    if fields is None:
        pick = f"; choose an entry first with {group}=NAME (lmlab list {group})" if is_group else ""
        return f"unknown key '{key}': '{parent_path}' has no typed fields{pick}"
    is_entry = is_group and "name" in fields
    names = [name for name in fields if not (is_entry and name == "name")]
    where = f"{group}={parent.get('name')}" if is_entry else parent_path or "the top level"
    hint = closest(key.rpartition(".")[2], names, cutoff=KEY_HINT_CUTOFF)
    did_you_mean = f". Did you mean '{'.'.join(filter(None, [parent_path, hint]))}'?" if hint else ""
    return f"unknown key '{key}'{did_you_mean} ({where} has: {', '.join(names)})"


def wrong_type_message(key: str, value, parent: DictConfig, detail: str) -> str:
    field = (schema_fields(parent) or {}).get(key.rpartition(".")[2])
    expected = type_name(field) if field else detail.strip().splitlines()[0]
    return f"wrong type for '{key}': got {value!r}, expected {expected}"
