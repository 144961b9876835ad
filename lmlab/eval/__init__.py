"""Evaluation: the `eval` task registry, the scorer the tasks run on, and the results they write.

    from lmlab.eval import EVAL_TASKS, Scorer
    scorer = Scorer(model, tokenizer, max_len=model.max_seq_len)
    result = EVAL_TASKS.build({"name": "mmlu", "path": "data/mmlu", "shots": 5}).run(scorer, limit=None)

`lmlab eval` (lmlab.cli.eval) is the command line.
"""

from lmlab.eval.registry import EVAL_TASKS, TaskResult
from lmlab.eval.scoring import LogLikelihood, Scorer

__all__ = ["EVAL_TASKS", "LogLikelihood", "Scorer", "TaskResult"]
