"""`lmlab eval ckpt=PATH eval=[TASK,...] [KEY=VALUE ...]`: evaluation tasks on a checkpoint.

    lmlab eval ckpt=outputs/runs/<date>/<time>/checkpoints/last.ckpt             # perplexity on its validation split
    lmlab eval ckpt=... eval=[mmlu,gsm8k] eval.mmlu.path=data/mmlu eval.gsm8k.path=data/gsm8k eval.limit=50
    lmlab eval ckpt=... eval=mmlu eval.mmlu.path=data/mmlu eval.mmlu.shots=0 eval.mmlu.subjects=[astronomy]
    lmlab eval ckpt=... eval=gsm8k eval.gsm8k.path=hf eval.gsm8k.n=8 eval.gsm8k.k=[1,4,8] eval.gsm8k.temperature=0.8
    lmlab eval ckpt=hf/my-model eval=perplexity eval.perplexity.path=book.txt        # a Hugging Face Llama folder

Tasks are the `eval` group (`lmlab list eval`); every task reads and checks its data before the model
loads. Results go to `out` (default: the checkpoint's run folder, under eval/<date>_<time>/):
results.json, results.md (tables; MMLU per subject) and records/<task>.jsonl (one line per example:
prompt, completion, parsed answer, correct). Prompts longer than the model's context keep their last
tokens (the oldest few-shot examples go first), and the results say how many.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from lmlab.cli.compose import compose_config
from lmlab.cli.generate import device_and_dtype, open_model
from lmlab.cli.listing import Section, format_section
from lmlab.errors import ConfigError
from lmlab.eval.registry import EVAL_TASKS, build_tasks, check_tasks
from lmlab.eval.report import write_results
from lmlab.eval.scoring import Scorer

@dataclass
class EvalRunConfig:
    ckpt: str | None = None  # an lmlab-train checkpoint, or a Hugging Face Llama folder (config.json, *.safetensors)
    eval: Any = field(default_factory=dict)  # the chosen tasks (eval=[mmlu,gsm8k]) and `limit`, examples per task
    out: str | None = None  # where results go; None: <the checkpoint's run folder>/eval/<date>_<time>
    batch_tokens: int = 16384  # tokens (batch x padded length) per scoring forward
    device: str = "auto"  # auto (cuda when there is one) | cpu | cuda
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16
    compile: bool = False  # torch.compile the generation step (generative tasks)
    plugins: list[str] = field(default_factory=list)  # modules imported before the config is composed


ConfigStore.instance().store(name="eval_schema", node=EvalRunConfig)


def parse_config(argv: list[str]) -> tuple[EvalRunConfig, list, int | None]:
    """The config, the built tasks (their data read and checked) and the per-task example limit."""
    if stray := [a for a in argv if "=" not in a]:
        raise ConfigError(f"unexpected argument '{stray[0]}': arguments are KEY=VALUE (lmlab eval --help)")
    cfg: EvalRunConfig = OmegaConf.to_object(compose_config(argv, config_name="eval"))
    if cfg.ckpt is None:
        raise ConfigError("no model: pass ckpt=PATH (a checkpoint lmlab-train wrote, or a Hugging Face Llama folder)")
    if cfg.batch_tokens <= 0:
        raise ConfigError(f"batch_tokens must be > 0, got {cfg.batch_tokens}")
    tasks, limit = build_tasks(cfg.eval)
    if not tasks:
        raise ConfigError(f"no task: choose some with eval=[...] (lmlab list eval: {', '.join(EVAL_TASKS.names())})")
    return cfg, tasks, limit


def output_folder(cfg: EvalRunConfig) -> Path:
    if cfg.out is not None:
        return Path(cfg.out)
    ckpt = Path(cfg.ckpt)
    run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else Path("outputs")
    return run / "eval" / time.strftime("%Y-%m-%d_%H-%M-%S")


def evaluate(cfg: EvalRunConfig, tasks: list, limit: int | None, err=None) -> Path:
    """Load the model, run the tasks, write the results; returns their folder."""
    err = err or sys.stderr
    device, dtype = device_and_dtype(cfg)
    source = open_model(cfg.ckpt, "ckpt")
    check_tasks(cfg.eval, source.max_seq_len)
    model = source.load().to(device, dtype)
    validation = (lambda: source.corpus()[1]) if source.corpus is not None else None
    scorer = Scorer(model, source.tokenizer, source.max_seq_len, source.stop_ids, cfg.batch_tokens, cfg.compile,
                    validation)
    results = []
    for task in tasks:
        result = task.run(scorer, limit)
        metrics = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v:,}" for k, v in result.metrics.items())
        print(f"lmlab eval: {result.task}: {metrics} ({result.examples:,} {result.unit}, "
              f"{result.examples_per_s:,.1f}/s)", file=err)
        results.append(result)
    meta = {"model": source.setting, "parameters": model.num_parameters(), "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "limit": limit, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    folder = write_results(results, output_folder(cfg), meta)
    print(f"lmlab eval: results in {folder}", file=err)
    return folder


def usage() -> str:
    return f"{__doc__}\n{format_section(Section('keys', EvalRunConfig, '', 'KEY=VALUE'), {'eval'}, set())}"


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    cfg, tasks, limit = parse_config(argv)
    evaluate(cfg, tasks, limit)
    return 0
