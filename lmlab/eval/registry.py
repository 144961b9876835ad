"""The `eval_task` registry (config group `eval`) and what a task returns.

A task is an `EvalTask` registered with its typed Config. Building it (`EVAL_TASKS.build(cfg)`) reads
and checks its data, so a wrong path or setting fails before any model loads; `check(cfg, max_len)`
checks its settings against the model's context (read before the weights; no data, so a sweep runs it on
every job before the first starts: `check_tasks`), and `run(scorer, limit)` evaluates and returns a
`TaskResult`. The group's entries sit apart (`eval=[mmlu,gsm8k]` selects
two, `eval.mmlu.shots=0` sets one's field).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmlab.errors import ConfigError
from lmlab.registry import Registry

EVAL_TASKS = Registry("eval_task", group="eval", doc="evaluation tasks: perplexity, multiple choice, generative",
                      entries_apart=True)


class EvalTask:
    """Base of the tasks; see the module docstring."""

    @classmethod
    def check(cls, cfg, max_len: int) -> None:
        """Raise ConfigError when a setting of `cfg`, the entry's Config, cannot work with a model of this context
        (default: all can)."""

    def run(self, scorer, limit: int | None) -> TaskResult:
        raise NotImplementedError


def check_generation_room(setting: str, max_new_tokens: int, max_len: int) -> None:
    if max_new_tokens >= max_len:
        raise ConfigError(f"{setting}={max_new_tokens} leaves no room for a prompt in the model's context of "
                          f"{max_len} tokens; lower it")


@dataclass
class TaskResult:
    task: str
    metrics: dict[str, float]  # the headline numbers: logged as eval/<task>/<metric>
    examples: int  # what the task counts, in `unit`s
    seconds: float
    table: list[dict] = field(default_factory=list)  # rows of the task's own table (MMLU: one per subject)
    records: list[dict] = field(default_factory=list)  # one per example: prompt, completion, parsed, correct
    notes: list[str] = field(default_factory=list)  # e.g. how many prompts were cut to fit the context
    unit: str = "examples"  # perplexity counts tokens

    @property
    def examples_per_s(self) -> float:
        return self.examples / max(self.seconds, 1e-9)


def truncation_notes(count: int) -> list[str]:
    """The note for prompts cut from the left to fit the model's context."""
    return [f"{count} prompts were longer than the model's context and lost their oldest tokens"] if count else []


def eval_limit(eval_cfg) -> int | None:
    """An `eval` config node's `limit`, checked."""
    limit = eval_cfg.get("limit")
    if limit is not None and limit <= 0:
        raise ConfigError(f"eval.limit must be > 0 (examples per task), got {limit}")
    return limit


def selected(eval_cfg) -> list:
    """The task nodes of an `eval` config node."""
    return [task for key, task in eval_cfg.items() if key != "limit"]


def check_tasks(eval_cfg, max_len: int) -> None:
    """The settings of an `eval` config node's tasks against a model of `max_len` tokens, none built (no data read)."""
    eval_limit(eval_cfg)
    for node in selected(eval_cfg):
        entry, cfg = EVAL_TASKS.resolve(node)
        entry.target.check(cfg, max_len)


def build_tasks(eval_cfg) -> tuple[list[EvalTask], int | None]:
    """The tasks an `eval` config node selects, built (their data read and checked), and its `limit`."""
    limit = eval_limit(eval_cfg)
    return [EVAL_TASKS.build(task) for task in selected(eval_cfg)], limit
