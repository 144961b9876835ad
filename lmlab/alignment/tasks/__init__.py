"""The post-training entries of the `task` group (sft, dpo, reward_model, grpo, ppo) and the `reward`
entry of a trained reward model."""

from lmlab.alignment import learned_reward  # noqa: F401 - registers reward=reward_model
from lmlab.alignment.tasks import preference, rl, sft  # noqa: F401 - registers the entries
