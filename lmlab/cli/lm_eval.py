"""`lmlab lm-eval ARGS...`: lm-evaluation-harness's command line (`lm-eval run`'s arguments), with lmlab's model
`lmlab` registered, for lm-eval releases that load no models from other packages (0.4.13 loads none).

    lmlab lm-eval --model lmlab --model_args ckpt=outputs/runs/<date>/<time>/checkpoints/last.ckpt --tasks hellaswag
    lmlab lm-eval --model lmlab --model_args ckpt=hf/my-llama,dtype=bfloat16 --tasks mmlu --num_fewshot 5 --batch_size 32
    lmlab lm-eval --model lmlab --model_args ckpt=... --tasks my_task --include_path my_tasks/ --device cpu

The model's arguments are lmlab.eval.harness's; everything else is lm-eval's (lmlab lm-eval run --help).
"""

from __future__ import annotations

import importlib.util
import sys

from lmlab.errors import ConfigError


def main(argv: list[str]) -> int:
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("lmlab lm-eval runs lm-evaluation-harness, which is not installed: pip install 'lmlab[eval]'")
    import lmlab.eval.harness  # noqa: F401  registers the model `lmlab`
    from lm_eval.__main__ import cli_evaluate

    saved, sys.argv = sys.argv, ["lm-eval", *argv]  # lm-eval's CLI parses sys.argv itself
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0
