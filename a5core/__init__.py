"""a5core: the library under the a5 pipeline (data, prompts, grading, losses, policy, rollouts, loops).

Knows nothing of Prefect, MLflow or DVC. The CS336 A5 training primitives are importable from here
(``from a5core import compute_grpo_clip_loss``); each is imported when first asked for, so importing a part of
the library (a loop, an engine) does not import the handout's functional API with it.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_EXPORTS = {
    "DataError": "a5core.data",
    "Problem": "a5core.data",
    "Trace": "a5core.data",
    "load_gsm8k": "a5core.data",
    "load_math": "a5core.data",
    "load_sft_traces": "a5core.data",
    "answers_equivalent": "a5core.grading",
    "grade_batch": "a5core.grading",
    "question_only_reward_fn": "a5core.grading",
    "r1_zero_reward_fn": "a5core.grading",
    "compute_entropy": "a5core.losses",
    "compute_group_normalized_rewards": "a5core.losses",
    "compute_grpo_clip_loss": "a5core.losses",
    "compute_naive_policy_gradient_loss": "a5core.losses",
    "compute_policy_gradient_loss": "a5core.losses",
    "masked_mean": "a5core.losses",
    "masked_normalize": "a5core.losses",
    "get_response_log_probs": "a5core.policy",
    "grpo_microbatch_train_step": "a5core.grpo.objective",
    "load_policy": "a5core.policy",
    "sft_microbatch_train_step": "a5core.policy",
    "tokenize_prompt_and_output": "a5core.policy",
    "PromptTemplate": "a5core.prompts",
    "PromptTemplateError": "a5core.prompts",
    "load_prompt": "a5core.prompts",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'a5core' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
