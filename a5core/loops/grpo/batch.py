"""A GRPO step's rollouts, graded: each draw's rewards and group-normalised advantages (:func:`grade`), the
batch the step trains on (:func:`assemble`), with the rollout metrics, and its micro-batches as tensors
(:class:`MicroBatch`).

Shapes: ``N`` rollouts, groups of ``group_size`` consecutive ones (question order); ``b`` rollouts of a
micro-batch, ``T`` its token positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from a5core.data.files import Problem
from a5core.data.prompts import PromptTemplate
from a5core.engines import Completion
from a5core.grading.group_rewards import (
    compute_group_normalized_rewards,
    overlong_penalty,
    reward_statistics,
    uniform_groups,
)
from a5core.loops.grpo.config import GRPOConfig
from a5core.policy.causal_lm import pack_prompt_and_output_ids

PER_TOKEN = ("old_log_probs", "engine_log_probs", "ref_log_probs")  # RolloutBatch's per-token log-probs


class MicroBatch(NamedTuple):
    """One micro-batch's tensors, on the policy's device: ``b`` rollouts, ``T`` token positions.

    response_mask: (b, T) bool, the response tokens; input_ids, labels: (b, T) long, the policy's input and the
    tokens it predicts; raw_rewards, advantages: (b, 1) float32; truncated: (b, 1) bool, cut at max_tokens;
    old_log_probs, engine_log_probs, ref_log_probs: (b, T) float32, zero outside the response, where the step
    computed them. A field is None where nothing was computed; the handout's micro-batch step, which is given
    log-probs rather than tokens, leaves input_ids, labels, truncated and the rewards its loss does not read None.
    """

    response_mask: torch.Tensor
    input_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    raw_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    engine_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None


@dataclass
class RolloutBatch:
    """One step's graded rollouts, N of them, groups consecutive.

    prompt_ids, response_ids: N token-id lists; raw_rewards, advantages: (N,); correct, truncated: (N,)
    bool (truncated: cut at max_tokens); old_log_probs, engine_log_probs, ref_log_probs: None or N 1-D
    fp32 tensors of the response's length (the engine's own: every step, from :func:`assemble`).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    raw_rewards: torch.Tensor
    advantages: torch.Tensor
    correct: torch.Tensor
    truncated: torch.Tensor
    old_log_probs: list[torch.Tensor] | None = None
    engine_log_probs: list[torch.Tensor] | None = None
    ref_log_probs: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def lengths(self) -> list[int]:
        """Each rollout's trained positions, prompt and response (T before padding)."""
        return [len(p) + len(r) - 1 for p, r in zip(self.prompt_ids, self.response_ids, strict=True)]

    def select(self, index: Sequence[int]) -> RolloutBatch:
        pick = torch.as_tensor(list(index), dtype=torch.long)
        return RolloutBatch(
            [self.prompt_ids[i] for i in index],
            [self.response_ids[i] for i in index],
            self.raw_rewards[pick],
            self.advantages[pick],
            self.correct[pick],
            self.truncated[pick],
            *(None if values is None else [values[i] for i in index] for values in self._per_token()),
        )

    def _per_token(self) -> tuple[list[torch.Tensor] | None, ...]:
        return tuple(getattr(self, name) for name in PER_TOKEN)

    def tensors(self, pad_id: int, device: torch.device, pad_to_multiple: int = 1) -> MicroBatch:
        """These rollouts as one micro-batch on ``device``, T padded up to a multiple of ``pad_to_multiple``."""
        packed = pack_prompt_and_output_ids(self.prompt_ids, self.response_ids, pad_id, pad_to_multiple)
        mask = packed["response_mask"]

        def per_token(values: list[torch.Tensor] | None) -> torch.Tensor | None:
            if values is None:
                return None
            out = torch.zeros(mask.shape, dtype=torch.float32)
            out[mask] = torch.cat(values)  # row-major: each row's response positions, in order
            return out.to(device)

        return MicroBatch(
            response_mask=mask.to(device),
            input_ids=packed["input_ids"].to(device),
            labels=packed["labels"].to(device),
            raw_rewards=self.raw_rewards.view(-1, 1).to(device),
            advantages=self.advantages.view(-1, 1).to(device),
            truncated=self.truncated.view(-1, 1).to(device),
            **{name: per_token(values) for name, values in zip(PER_TOKEN, self._per_token(), strict=True)},
        )


@dataclass
class Draw:
    """One draw of a step's rollouts, graded: its questions, their group_size rollouts each (question
    order), the (shaped) rewards, advantages, correctness, response lengths (N,), which groups' rewards
    differ (one bool a question), and the rollout metrics."""

    questions: list[Problem]
    completions: list[Completion]
    raw_rewards: torch.Tensor
    advantages: torch.Tensor
    correct: torch.Tensor
    lengths: torch.Tensor
    varied: list[bool]
    metrics: dict[str, float]


def grade(
    config: GRPOConfig,
    questions: list[Problem],
    completions: list[Completion],
    reward_fn: Callable[[str, Any], dict[str, float]],
) -> Draw:
    """Reward one draw of rollouts and normalise each reward within its group: A = (r − mean) / (std + eps)
    (without the division when ``use_std_normalization`` is off). DAPO's overlong penalty, if set, shapes the
    rewards first; "correct" is the unshaped reward 1."""
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    penalty = (
        overlong_penalty(lengths, config.sampling.max_tokens, config.overlong_buffer, config.overlong_penalty)
        if config.overlong_buffer
        else None
    )
    advantages, raw_rewards, metrics = compute_group_normalized_rewards(
        reward_fn,
        [c.text for c in completions],
        [q.answer for q in questions for _ in range(config.group_size)],
        config.group_size,
        config.advantage_eps,
        config.use_std_normalization,
        reward_offsets=penalty,
    )
    graded = raw_rewards if penalty is None else raw_rewards - penalty
    if penalty is not None:
        metrics["overlong_penalty_mean"] = penalty.mean().item()
    varied = (~uniform_groups(raw_rewards, config.group_size)).tolist()
    return Draw(questions, completions, raw_rewards, advantages, graded == 1.0, lengths, varied, metrics)


def assemble(
    config: GRPOConfig, draws: list[Draw], tokenizer: Any, template: PromptTemplate
) -> tuple[RolloutBatch, dict[str, float]]:
    """The rollouts a step trains on, and its rollout metrics (over every rollout drawn). With
    ``drop_uniform_groups`` or ``dynamic_sampling`` only the groups whose rewards differ are kept (at
    most rollout_batch_size rollouts, in draw order). The prompts are tokenised without special tokens, as
    the engines do, so the policy trains on exactly the tokens that were sampled."""
    group = config.group_size
    metrics = dict(draws[0].metrics) if len(draws) == 1 else _merged_metrics(draws, group)
    lengths = torch.cat([d.lengths for d in draws])
    correct = torch.cat([d.correct for d in draws])
    completions = [c for d in draws for c in d.completions]
    metrics.update(
        {
            "response_tokens_mean": lengths.mean().item(),
            "response_tokens_correct": lengths[correct].mean().item() if correct.any() else math.nan,
            "response_tokens_incorrect": lengths[~correct].mean().item() if (~correct).any() else math.nan,
            "truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
        }
    )
    keep = list(range(len(completions)))
    if config.drop_uniform_groups or config.dynamic_sampling:
        varied = [v for d in draws for v in d.varied]
        kept_groups = [g for g, v in enumerate(varied) if v][: config.prompts_per_step]
        keep = [g * group + i for g in kept_groups for i in range(group)]
        metrics["dropped_groups"] = float(len(varied) - len(kept_groups))
    if config.dynamic_sampling:
        metrics["sampling_draws"] = float(len(draws))
        metrics["kept_groups"] = float(len(keep) // group)
    questions = [q for d in draws for q in d.questions]
    prompt_ids = tokenizer([template.format(q.problem) for q in questions], add_special_tokens=False)["input_ids"]
    batch = RolloutBatch(
        [prompt_ids[i // group] for i in keep],
        [list(completions[i].token_ids) for i in keep],
        torch.cat([d.raw_rewards for d in draws])[keep],
        torch.cat([d.advantages for d in draws])[keep],
        correct[keep],
        torch.tensor([completions[i].finish_reason == "length" for i in keep], dtype=torch.bool),
        engine_log_probs=[torch.tensor(completions[i].log_probs, dtype=torch.float32) for i in keep],
    )
    return batch, metrics


def _merged_metrics(draws: list[Draw], group_size: int) -> dict[str, float]:
    """The rollout metrics of several draws (dynamic sampling), over all their rollouts."""
    rewards = torch.cat([d.raw_rewards for d in draws])
    advantages = torch.cat([d.advantages for d in draws])
    merged = {key: sum(d.metrics[key] for d in draws) / len(draws) for key in draws[0].metrics}  # equal-size draws
    merged.update(reward_statistics(rewards, advantages, group_size))
    return merged
