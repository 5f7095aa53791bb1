"""The GRPO ablations: each a name, a title and the settings of its children, built from a run's
parameters (see :mod:`flows.grpo` for what each compares). The names are the choices of ``grpo.ablation``
(:data:`flows.params.AblationName`); :data:`ABLATIONS` has one entry for each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from a5core.grading.rewards import ARITHMETIC_GRADERS
from a5core.loops.grpo.config import ONE_STEP_OFF_TIS_CAP
from a5core.runtime.settings import describe
from flows.params import AblationName, GRPOParams


def with_overrides(params: GRPOParams, overrides: dict[str, Any]) -> GRPOParams:
    """``params`` with ``overrides``, validated: ValueError in one line for an invalid combination."""
    try:
        return params.replace(**overrides)
    except ValidationError as error:
        raise ValueError(describe(error)) from None


def _off_policy(params: GRPOParams, epochs: int, train_batch_size: int, loss_type: str) -> dict[str, Any]:
    """An off-policy setting that keeps the micro-batch size (so memory per forward stays the same)."""
    micro = params.train_batch_size // params.gradient_accumulation_steps
    return {
        "epochs_per_rollout_batch": epochs,
        "train_batch_size": train_batch_size,
        "gradient_accumulation_steps": max(1, train_batch_size // micro),
        "loss_type": loss_type,
    }


_RATIO_PAIR = ("grpo_clip", "gspo")  # the GSPO ablation compares token and sequence ratios


def _off_policy_sweep(p: GRPOParams) -> dict[str, dict[str, Any]]:
    settings = {"on_policy": {**_off_policy(p, 1, p.rollout_batch_size, "reinforce_with_baseline")}}
    for epochs in p.sweep_epochs_per_rollout_batch:
        for size in p.sweep_train_batch_sizes:
            settings[f"E{epochs}_tb{size}"] = _off_policy(p, epochs, size, "grpo_clip")
    return settings


def _prompt_grader(p: GRPOParams, prompt: str) -> str | None:
    """The grader of ``prompt``'s answers: on the arithmetic task (an arithmetic ``reward_fn``) the task's grader
    for that prompt's format, else the prompt's own (None). The MATH graders accept a copied expression, so
    graded by them an arithmetic run learns to copy the question (see docs/results.md)."""
    return ARITHMETIC_GRADERS[prompt] if p.reward_fn in ARITHMETIC_GRADERS.values() else None


ABLATIONS: dict[AblationName, tuple[str, Callable[[GRPOParams], dict[str, dict[str, Any]]]]] = {
    "grpo_lr_sweep": (
        "learning rate",
        lambda p: {f"lr_{lr:g}": {"learning_rate": lr} for lr in p.sweep_learning_rates},
    ),
    "grpo_baseline_ablation": (
        "baseline",
        lambda p: {t: {"loss_type": t} for t in ("no_baseline", "reinforce_with_baseline")},
    ),
    "grpo_length_norm_ablation": (
        "length normalisation",
        lambda p: {n: {"length_normalization": n} for n in ("masked_mean", "masked_normalize")},
    ),
    "grpo_std_norm_ablation": (
        "std normalisation",
        lambda p: {
            "std_normalization": {"use_std_normalization": True},
            "no_std_normalization": {"use_std_normalization": False},
        },
    ),
    "grpo_off_policy_sweep": ("off-policy", _off_policy_sweep),
    "grpo_clip_ablation": (
        "clipping",
        lambda p: {
            t: _off_policy(p, p.clip_epochs_per_rollout_batch, p.clip_train_batch_size, t)
            for t in ("grpo_clip", "grpo_no_clip")
        },
    ),
    "grpo_prompt_ablation": (
        "prompt",
        lambda p: {name: {"prompt": name, "reward_fn": _prompt_grader(p, name)} for name in ARITHMETIC_GRADERS},
    ),
    "grpo_dapo_ablation": ("DAPO", lambda p: _dapo(p)),
    "grpo_gspo_ablation": (
        "GSPO",
        lambda p: {t: _off_policy(p, p.clip_epochs_per_rollout_batch, p.clip_train_batch_size, t) for t in _RATIO_PAIR},
    ),
    "grpo_kl_ablation": (
        "KL penalty",
        lambda p: {f"kl_{coef:g}": {"kl_coef": coef} for coef in (0.0, *p.sweep_kl_coefs)},
    ),
    "grpo_question_sampling_ablation": (
        "question sampling",
        lambda p: {mode: {"question_sampling": mode} for mode in ("uniform", "learnable")},
    ),
    "grpo_async_ablation": (
        "one-step-off",
        lambda p: {
            name: {"pipeline_depth": depth, "tis_cap": ONE_STEP_OFF_TIS_CAP if p.tis_cap is None else p.tis_cap}
            for name, depth in (("synchronous", 0), ("one_step_off", 1))
        },
    ),
}


def _dapo(p: GRPOParams) -> dict[str, dict[str, Any]]:
    """Today's GRPO, each DAPO technique alone, and all of them (clip-higher aside: it needs an
    off-policy ratio loss; see grpo_clip_ablation)."""
    overlong = {"overlong_buffer": max(1, p.max_tokens // 4), "mask_truncated": True}
    dynamic = {"dynamic_sampling": True, "drop_uniform_groups": False}
    token_mean = {"length_normalization": "token_mean"}
    return {
        "grpo": {},
        "dynamic_sampling": dynamic,
        "token_mean": token_mean,
        "overlong": overlong,
        "dapo": {**dynamic, **token_mean, **overlong},
    }


def ablation_overrides(name: str, params: GRPOParams) -> dict[str, dict[str, Any]]:
    """What each child of ablation ``name`` sets: setting name → the settings it changes; only those
    ``params.ablation_only`` names, in the ablation's order, when set."""
    _, build = ABLATIONS[name]
    settings = build(params)
    if params.ablation_only is not None:
        unknown = [setting for setting in params.ablation_only if setting not in settings]
        if unknown:
            raise ValueError(
                f"ablation_only: {', '.join(map(repr, unknown))} not among {name}'s settings ({', '.join(settings)})"
            )
        settings = {setting: overrides for setting, overrides in settings.items() if setting in params.ablation_only}
    return settings


def ablation_settings(name: str, params: GRPOParams) -> dict[str, GRPOParams]:
    """The children of ablation ``name``: setting name → validated parameters (an invalid one fails
    before anything runs); only those ``params.ablation_only`` names, in the ablation's order, when set."""
    reset = {"ablation": None, "ablation_only": None}
    return {
        setting: with_overrides(params, {**overrides, **reset})
        for setting, overrides in ablation_overrides(name, params).items()
    }
