"""The built-in evaluation tasks; importing this registers them."""

from lmlab.eval.tasks import gsm8k, mmlu, perplexity  # noqa: F401
