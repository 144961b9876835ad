"""The post-training entries of the `task` group: sft, dpo, reward_model, grpo, ppo."""

from lmlab.alignment.tasks import preference, rl, sft  # noqa: F401 - registers the entries
