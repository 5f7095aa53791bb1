"""a5core: the library under the a5 pipeline, in rooms that import downward only: runtime < grading < data <
policy < engines < evaluation < loops < verdicts (tests/system/test_import_graph.py).

Knows nothing of Prefect, MLflow or DVC. The CS336 A5 training primitives are importable from here
(``from a5core import compute_grpo_clip_loss``); each is imported when first asked for, so importing a part of
the library (a loop, an engine) does not import the handout's functional API with it.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_EXPORTS = {
    "DataError": "a5core.data.files",
    "Problem": "a5core.data.files",
    "Trace": "a5core.data.files",
    "load_gsm8k": "a5core.data.files",
    "load_math": "a5core.data.files",
    "load_sft_traces": "a5core.data.files",
    "answers_equivalent": "a5core.grading.grader",
    "grade_batch": "a5core.grading.grader",
    "question_only_reward_fn": "a5core.grading.grader",
    "r1_zero_reward_fn": "a5core.grading.grader",
    "compute_entropy": "a5core.policy.losses",
    "compute_group_normalized_rewards": "a5core.grading.group_rewards",
    "compute_grpo_clip_loss": "a5core.policy.losses",
    "compute_naive_policy_gradient_loss": "a5core.policy.losses",
    "compute_policy_gradient_loss": "a5core.policy.losses",
    "masked_mean": "a5core.policy.losses",
    "masked_normalize": "a5core.policy.losses",
    "get_response_log_probs": "a5core.policy.causal_lm",
    "grpo_microbatch_train_step": "a5core.handout",
    "load_policy": "a5core.policy.causal_lm",
    "sft_microbatch_train_step": "a5core.policy.causal_lm",
    "tokenize_prompt_and_output": "a5core.policy.causal_lm",
    "PromptTemplate": "a5core.data.prompts",
    "PromptTemplateError": "a5core.data.prompts",
    "load_prompt": "a5core.data.prompts",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'a5core' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
