"""a5core: the library under the a5 pipeline (data, prompts, grading, losses, policy, rollouts, loops).

Knows nothing of Prefect, MLflow or DVC. The CS336 A5 training primitives are importable from here.
"""

from a5core.data import DataError, Problem, Trace, load_gsm8k, load_math, load_sft_traces
from a5core.grading import answers_equivalent, grade_batch, question_only_reward_fn, r1_zero_reward_fn
from a5core.grpo.objective import grpo_microbatch_train_step
from a5core.losses import (
    compute_entropy,
    compute_group_normalized_rewards,
    compute_grpo_clip_loss,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    masked_mean,
    masked_normalize,
)
from a5core.policy import get_response_log_probs, load_policy, sft_microbatch_train_step, tokenize_prompt_and_output
from a5core.prompts import PromptTemplate, PromptTemplateError, load_prompt

__all__ = [
    "DataError",
    "Problem",
    "PromptTemplate",
    "PromptTemplateError",
    "Trace",
    "answers_equivalent",
    "compute_entropy",
    "compute_grpo_clip_loss",
    "compute_group_normalized_rewards",
    "compute_naive_policy_gradient_loss",
    "compute_policy_gradient_loss",
    "get_response_log_probs",
    "grade_batch",
    "grpo_microbatch_train_step",
    "load_gsm8k",
    "load_math",
    "load_policy",
    "load_prompt",
    "load_sft_traces",
    "masked_mean",
    "masked_normalize",
    "question_only_reward_fn",
    "r1_zero_reward_fn",
    "sft_microbatch_train_step",
    "tokenize_prompt_and_output",
]
