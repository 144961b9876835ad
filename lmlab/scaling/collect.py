"""Points from lmlab-train run folders: each run's validation losses (whatever logger wrote them) with its
model size from the cost model, the tokens seen at each validation step, and their FLOPs.

Only `task=pretrain` runs count. N is the cost model's parameter count without the token embedding (`n`)
and with it (`n_total`); D is the steps taken times data.batch_size x data.context_length (the global
batch, whatever the devices and accumulation); C is the cost model's training FLOPs per token (6 per
weight plus attention) times D.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from lmlab.cli.compare import find_runs
from lmlab.errors import ConfigError
from lmlab.scaling.points import Point
from lmlab.tokenizers.base import expected_vocab_size

log = logging.getLogger(__name__)
BUDGET_TOLERANCE = 0.1  # a run planned within 10% of a given budget belongs to it


def collect(roots: Sequence[str | Path], loss_tag: str = "val/loss", budgets: Sequence[float] = ()) -> list[Point]:
    """One point per logged `loss_tag` of every run under `roots`, named "RUN@STEP". The final point of a run
    whose planned compute (max_steps of its cost) lies within 10% of one of `budgets` carries that budget."""
    from lmlab.cli.info import cost_model  # the cost model imports the model registries

    points, tokenizers = [], defaultdict(list)
    for root in roots:
        if not Path(root).is_dir():
            raise ConfigError(f"no such run folder: {root}")
        for run in find_runs(Path(root)):
            config_file = run.path / ".hydra" / "config.yaml"
            cfg = OmegaConf.load(config_file) if config_file.is_file() else None
            losses = run.scalars.get(loss_tag)
            task = cfg.get("task", {}).get("name", "pretrain") if cfg is not None else None
            why = ("no .hydra/config.yaml" if cfg is None else f"task={task}, not pretrain" if task != "pretrain"
                   else None if losses else f"no {loss_tag} logged")
            if why:
                log.warning("skipped %s: %s", run.path, why)
                continue
            cost = cost_model(cfg, cfg.model.vocab_size or expected_vocab_size(cfg.tokenizer))
            tokenizers[OmegaConf.to_yaml(cfg.tokenizer)].append(str(run.path))
            planned = cost["flops_per_token"] * cost["tokens_per_step"] * cost["steps"]
            budget = next((b for b in budgets if abs(planned / b - 1) <= BUDGET_TOLERANCE), math.nan)
            for step, loss in losses:
                if step <= 0:  # the validation before training: no tokens seen
                    continue
                d = step * cost["tokens_per_step"]  # validations are logged at the steps taken (ValidationStep)
                final = step == cost["steps"]  # only the end of a run has spent its budget
                points.append(Point(f"{run.path}@{step}", cost["non_embedding_params"], d, loss,
                                    c=cost["flops_per_token"] * d, n_total=cost["params"],
                                    budget=budget if final else math.nan))
    if len(tokenizers) > 1:
        groups = "; ".join(f"{', '.join(runs[:3])}{' ...' if len(runs) > 3 else ''}" for runs in tokenizers.values())
        log.warning("runs with %d different tokenizers: their losses are not comparable (%s)", len(tokenizers), groups)
    if not points:
        raise ConfigError(f"no run under {', '.join(map(str, roots))} logged {loss_tag} beside a .hydra/config.yaml")
    return points
