"""Post-training: the functional core on plain tensors (masks, log-probs, advantages), the loss
registries `rl_loss` (policy-gradient losses) and `pref_loss` (preference losses), the verifiers and
rewards (`reward`) and chat templates (`chat_template`). It works with lmlab models and with any causal
LM that returns logits, Hugging Face models included."""

from lmlab.alignment.chat import CHAT_TEMPLATES, Turn, tokenize_chat
from lmlab.alignment.logprobs import compute_entropy, get_response_log_probs
from lmlab.alignment.masked import masked_mean, masked_normalize, masked_sum
from lmlab.alignment.pg_losses import (KL_ESTIMATORS, RL_LOSSES, compute_grpo_clip_loss,
                                       compute_naive_policy_gradient_loss, compute_policy_gradient_loss,
                                       grpo_microbatch_train_step, sft_microbatch_train_step)
from lmlab.alignment.preference import (ALPACA_TEMPLATE, PREFERENCE_LOSSES, PreferencePair,
                                        compute_per_instance_dpo_loss, preference_loss, preference_tensors)
from lmlab.alignment.reward_model import ScalarHead, bradley_terry_loss, last_token_scores
from lmlab.alignment.rewards import compute_group_normalized_rewards, generalized_advantage_estimation
from lmlab.alignment.tokens import tokenize_prompt_and_output
from lmlab.alignment.verifiers import REWARDS

__all__ = [
    "ALPACA_TEMPLATE", "CHAT_TEMPLATES", "KL_ESTIMATORS", "PREFERENCE_LOSSES", "REWARDS", "RL_LOSSES",
    "PreferencePair", "ScalarHead", "Turn", "bradley_terry_loss", "compute_entropy",
    "compute_group_normalized_rewards", "compute_grpo_clip_loss", "compute_naive_policy_gradient_loss",
    "compute_per_instance_dpo_loss", "compute_policy_gradient_loss", "generalized_advantage_estimation",
    "get_response_log_probs", "grpo_microbatch_train_step", "last_token_scores", "masked_mean", "masked_normalize",
    "masked_sum", "preference_loss", "preference_tensors",
    "sft_microbatch_train_step", "tokenize_chat", "tokenize_prompt_and_output",
]
