"""What the handout's ``log_generations`` reports at each evaluation: a sample of the records with the mean
token entropy of each response under the policy, and response lengths overall, correct and incorrect."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from a5core.policy.causal_lm import get_response_log_probs, tokenize_prompt_and_output


def response_entropies(
    model: Any, tokenizer: Any, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 8
) -> list[float]:
    """Mean next-token entropy over each response's tokens under ``model`` (no gradient).

    prompts, responses: N strings → N floats (NaN for an empty response). Responses are re-tokenised
    from text, so the ids can differ slightly from those the engine sampled; fine for a logged statistic.
    """
    device = next(model.parameters()).device
    out: list[float] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            batch = tokenize_prompt_and_output(
                list(prompts[start : start + batch_size]), list(responses[start : start + batch_size]), tokenizer
            )
            entropy = get_response_log_probs(
                model, batch["input_ids"].to(device), batch["labels"].to(device), return_token_entropy=True
            )["token_entropy"]
            mask = batch["response_mask"].to(device)
            per_row = (entropy * mask).sum(-1) / mask.sum(-1)
            out.extend(per_row.tolist())
    return out


def log_generations(
    model: Any, tokenizer: Any, records: Sequence[dict[str, Any]], sample_size: int = 16, seed: int = 0
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """What the handout's log_generations reports at each evaluation.

    Returns (rows, metrics): ``rows`` is a random sample of ``sample_size`` records with prompt,
    response, ground truth, format/answer reward, mean token entropy of the response and its length;
    ``metrics`` has the mean response length overall, of correct and of incorrect responses, and the
    sample's mean token entropy.
    """
    sample = random.Random(seed).sample(list(records), min(sample_size, len(records)))
    entropies = response_entropies(model, tokenizer, [r["prompt"] for r in sample], [r["response"] for r in sample])
    rows = [
        {
            k: r[k]
            for k in (
                "unique_id",
                "prompt",
                "response",
                "ground_truth",
                "format_reward",
                "answer_reward",
                "response_tokens",
            )
        }
        | {"mean_token_entropy": e}
        for r, e in zip(sample, entropies, strict=True)
    ]

    def mean_length(rs: list[dict[str, Any]]) -> float:
        return sum(r["response_tokens"] for r in rs) / len(rs) if rs else float("nan")

    correct = [r for r in records if r["answer_reward"]]
    incorrect = [r for r in records if not r["answer_reward"]]
    finite = [e for e in entropies if e == e]
    metrics = {
        "mean_response_tokens": mean_length(list(records)),
        "mean_response_tokens_correct": mean_length(correct),
        "mean_response_tokens_incorrect": mean_length(incorrect),
        "mean_token_entropy": sum(finite) / len(finite) if finite else float("nan"),
    }
    return rows, metrics
