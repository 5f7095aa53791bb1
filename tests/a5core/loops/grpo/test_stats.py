"""The engine mismatch every GRPO step logs (``mismatch_*``, :class:`a5core.loops.grpo.stats.EngineMismatch`): its
arithmetic against the definitions (k3 from Schulman's "Approximating KL divergence"), and GRPO on the CPU at
learning rate 0 with the hf engine: on the policy's own weights no mismatch, on perturbed weights the mismatch
computed here from the rollouts the engine returned."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_loops import PROBLEMS, TEMPLATE, RecordingEngine, parity_reward, small_config

from a5core.loops.grpo import grpo
from a5core.loops.grpo.batch import MicroBatch
from a5core.loops.grpo.stats import MISMATCH_RATIO_CAP, EngineMismatch, StepStats
from a5core.policy.causal_lm import get_response_log_probs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEYS = ("mismatch_log_ratio_mean", "mismatch_log_ratio_max", "mismatch_kl_k3", "mismatch_over_cap")
# Policy and engine in fp32 on the CPU decode the same weights; their log-probs can differ only by rounding: the
# engine's come from its own pass over left-padded prompts, the trainer's from right-padded micro-batches, whose
# matrix products another CPU may sum in other orders (a few fp32 spacings of logits ~8: ~5e-6). Here they are
# equal to the bit. |d| ≤ 1e-4 (so k3 ≈ d²/2 ≤ 5e-9) leaves twentyfold margin, and an engine in bf16 on the CPU
# (max d 8e-4, k3 8e-8 on this model) and one on noisy weights (max d > 1) both fall outside it (tested below).
SAME_WEIGHTS_TOL = 1e-4
SAME_WEIGHTS_K3 = SAME_WEIGHTS_TOL**2 / 2

# The loop's three ways to the trainer's log-probs: the first optimizer step's training forward (no old
# log-probs), the old log-probs pass of tis_cap (the cap is then tis_cap), and of an off-policy ratio loss, whose
# first optimizer step holds half the rollouts (so only the old log-probs cover them all).
PATHS = {
    "training_forward": ({}, MISMATCH_RATIO_CAP),
    "old_log_probs_tis": ({"tis_cap": 1.5}, 1.5),
    "old_log_probs_grpo_clip": (
        {
            "loss_type": "grpo_clip",
            "epochs_per_rollout_batch": 2,
            "train_batch_size": 4,
            "gradient_accumulation_steps": 2,
        },
        MISMATCH_RATIO_CAP,
    ),
}


def planted_model(tokenizer):
    """The planted tiny LM (tests/tiny_lm.py): peaked next-token distributions, as a trained model's are."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tokenizer.name_or_path)


def direct_mismatch(policy, tokenizer, prompts, groups, cap: float) -> dict[str, float]:
    """The metrics from their definitions, over every sampled token of one step's rollouts: d = log π_train −
    log π_engine, r = π_train/π_engine, k3 = r − 1 − log r; π_train from one sequence at a time."""
    d = []
    for prompt, group in zip(prompts, groups, strict=True):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for completion in group:
            ids = torch.tensor([prompt_ids + list(completion.token_ids)])
            with torch.no_grad():
                train = get_response_log_probs(policy, ids[:, :-1], ids[:, 1:])["log_probs"][0, len(prompt_ids) - 1 :]
            d.append(train.double() - torch.tensor(completion.log_probs, dtype=torch.float64))
    d = torch.cat(d)
    r = torch.exp(d)
    return {
        "mismatch_log_ratio_mean": d.mean().item(),
        "mismatch_log_ratio_max": d.max().item(),
        "mismatch_kl_k3": (r - 1 - torch.log(r)).mean().item(),
        "mismatch_over_cap": (r > cap).double().mean().item(),
    }


# ------------------------------------------------------------------------------------------ arithmetic


@pytest.mark.parametrize("tis_cap, cap", [(None, MISMATCH_RATIO_CAP), (1.3, 1.3)])
def test_the_statistics_follow_their_definitions_over_the_response_tokens(tis_cap, cap):
    """(b, T) log-probs of sampled tokens under two distributions, some positions outside the response (where
    garbage lies): each statistic equals its definition computed from the probabilities themselves."""
    generator = torch.Generator().manual_seed(0)
    p_train = torch.softmax(2 * torch.randn(3, 7, 20, generator=generator, dtype=torch.float64), -1)
    p_engine = torch.softmax(2 * torch.randn(3, 7, 20, generator=generator, dtype=torch.float64), -1)
    tokens = torch.multinomial(p_engine.view(-1, 20), 1, generator=generator).view(3, 7, 1)
    train, engine = p_train.gather(-1, tokens)[..., 0], p_engine.gather(-1, tokens)[..., 0]
    mask = torch.rand(3, 7, generator=generator) < 0.7
    garbage = torch.full_like(train, 1e4)
    sums, peak = EngineMismatch(tis_cap).sums(
        torch.where(mask, train.log(), garbage), torch.where(mask, engine.log(), -garbage), mask
    )
    got = EngineMismatch.metrics({**{k: v.item() for k, v in sums.items()}, "mismatch_log_ratio_max": peak.item()})
    r = train[mask] / engine[mask]
    assert 0 < (r > cap).sum() < mask.sum()  # both sides of the cap are met
    assert got == pytest.approx(
        {
            "mismatch_log_ratio_mean": r.log().mean().item(),
            "mismatch_log_ratio_max": r.log().max().item(),
            "mismatch_kl_k3": (r - 1 - r.log()).mean().item(),
            "mismatch_over_cap": (r > cap).double().mean().item(),
        },
        rel=1e-9,
        abs=1e-12,
    )
    assert sums["mismatch_tokens"].item() == mask.sum().item()


def test_k3_over_the_engines_samples_estimates_the_kl_from_the_engine_to_the_policy():
    """Tokens drawn from π_engine: the mean of k3 estimates KL(π_engine ‖ π_train) (unbiased: E_engine[r] = 1),
    and the mean log ratio −KL (its direction). Seeded draws; the margin is five standard errors."""
    p_train = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    p_engine = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1], dtype=torch.float64)
    kl = (p_engine * (p_engine / p_train).log()).sum().item()
    tokens = torch.multinomial(p_engine, 200_000, replacement=True, generator=torch.Generator().manual_seed(1))
    train, engine = p_train.log()[tokens], p_engine.log()[tokens]
    mismatch = EngineMismatch(None)
    got = mismatch.of_rollouts([train.float()], [engine.float()])
    r = torch.exp(train - engine)
    se_k3 = ((r - 1 - r.log()).std() / math.sqrt(len(tokens))).item()
    se_log_ratio = ((train - engine).std() / math.sqrt(len(tokens))).item()
    assert got["mismatch_kl_k3"] == pytest.approx(kl, abs=5 * se_k3)
    assert got["mismatch_log_ratio_mean"] == pytest.approx(-kl, abs=5 * se_log_ratio)
    assert se_k3 < kl / 20  # the estimate is sharp enough to tell KL(engine ‖ train) from 0 and from other values


def test_no_tokens_give_no_metrics():
    sums, peak = EngineMismatch(None).sums(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert EngineMismatch.metrics({**{k: v.item() for k, v in sums.items()}, "mismatch_log_ratio_max": peak}) == {}


def test_the_training_forward_counts_the_first_optimizer_step_once_run_again_or_not():
    """Measured from the training passes (no old log-probs): an optimizer step whose first attempt ran out of memory
    after one of its two micro-batches counts each token once, and a later optimizer step (on updated weights, here
    log-probs shifted by 5) not at all."""
    generator = torch.Generator().manual_seed(2)
    train, engine = -torch.rand(2, 6, generator=generator) * 3, -torch.rand(2, 6, generator=generator) * 3
    mask = torch.tensor([[False, True, True, True, False, False], [False, False, True, True, True, True]])
    stats = StepStats(torch.device("cpu"), (), ratios=False, mismatch=EngineMismatch(None))

    def micro_batch(row: int, shift: float = 0.0) -> None:
        rows = slice(row, row + 1)
        mb = MicroBatch(mask[rows], input_ids=torch.zeros(1, 6, dtype=torch.long), engine_log_probs=engine[rows])
        stats.add(int(mask[row].sum()), mb, {"log_probs": train[rows] + shift}, torch.tensor(0.5), {}, 1)

    stats.begin(2)
    micro_batch(0)  # then out of memory: the optimizer step runs again
    stats.begin(2)
    micro_batch(0)
    micro_batch(1)
    stats.stepped(stats.read(torch.tensor(1.0)))
    stats.begin(1)
    micro_batch(0, shift=5.0)
    stats.stepped(stats.read(torch.tensor(1.0)))
    expected = EngineMismatch(None).of_rollouts([train[mask]], [engine[mask]])
    assert {k: stats.metrics()[k] for k in KEYS} == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------------- GRPO at learning rate 0


class LossyPushEngine(RecordingEngine):
    """An hf engine whose weight push is lossy: after each push ``perturb`` changes the engine's weights."""

    def __init__(self, model, tokenizer, perturb):
        super().__init__(model, tokenizer)
        self.perturb = perturb

    def load_weights(self, model):
        super().load_weights(model)
        with torch.no_grad():
            self.perturb(self.inner.model)


def bf16_engine(model) -> None:
    """The engine decodes in bf16, weights and arithmetic, as it does on a GPU (a push copies into bf16)."""
    model.to(torch.bfloat16)


def noisy_weights(model) -> None:
    """Seeded noise of 0.05 on every weight: an engine that decodes visibly other weights."""
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        param.add_(0.05 * torch.randn(param.shape, generator=generator))


def counting_forwards(model) -> list[int]:
    """A one-item list counting the calls of ``model``'s forward."""
    calls = [0]
    model.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.usefixtures("learning_rate_0")
@pytest.mark.parametrize("path", PATHS)
def test_at_learning_rate_0_the_engine_on_the_policys_weights_shows_no_mismatch(tokenizer, path):
    """Three steps, each with the metrics within ``SAME_WEIGHTS_TOL``, no token over the cap, and no forward
    pass of the policy beyond the step's own (its training passes, and the old log-probs pass where it runs)."""
    options, _ = PATHS[path]
    model = planted_model(tokenizer)
    engine = RecordingEngine(model, tokenizer)
    forwards = counting_forwards(model)  # after the engine copied the model: its passes are not counted
    config = small_config(n_grpo_steps=3, **options)
    history = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, config)
    for step in history:
        assert abs(step["mismatch_log_ratio_mean"]) <= SAME_WEIGHTS_TOL, step
        assert abs(step["mismatch_log_ratio_max"]) <= SAME_WEIGHTS_TOL, step
        assert 0 <= step["mismatch_kl_k3"] <= SAME_WEIGHTS_K3, step
        assert step["mismatch_over_cap"] == 0, step
    old_log_probs_passes = config.rollout_batch_size // config.microbatch_size if config.needs_old_log_probs else 0
    assert forwards[0] == sum(step["microbatches"] + old_log_probs_passes for step in history)


@pytest.mark.usefixtures("learning_rate_0")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("perturb", [bf16_engine, noisy_weights], ids=["bf16_engine", "noisy_weights"])
def test_an_engine_on_other_weights_shows_the_mismatch_computed_from_its_rollouts(tokenizer, path, perturb):
    """Each step's metrics equal their definitions over the rollouts the engine returned, against the policy's
    log-probs computed here, and fall outside the same-weights bounds (noise 0.05: tokens over the cap too)."""
    options, cap = PATHS[path]
    model = planted_model(tokenizer)
    engine = LossyPushEngine(model, tokenizer, perturb)
    history = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, small_config(n_grpo_steps=2, **options))
    assert len(engine.calls) == len(history) == 2
    for step, (prompts, groups, _) in zip(history, engine.calls, strict=True):
        expected = direct_mismatch(model, tokenizer, prompts, groups, cap)
        assert {k: step[k] for k in KEYS} == pytest.approx(expected, rel=1e-3, abs=1e-6)
        assert step["mismatch_kl_k3"] > SAME_WEIGHTS_K3
        assert step["mismatch_log_ratio_max"] > SAME_WEIGHTS_TOL
        if perturb is noisy_weights:
            assert step["mismatch_over_cap"] > 0


def test_the_engines_log_probs_are_asked_for_on_every_step(tokenizer):
    """Without tis_cap too: the mismatch needs them."""
    model = planted_model(tokenizer)
    engine = RecordingEngine(model, tokenizer)
    grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, small_config(n_grpo_steps=2))
    assert [sampling.logprobs for _, _, sampling in engine.calls] == [True, True]
    assert all(c.log_probs is not None for _, groups, _ in engine.calls for group in groups for c in group)


def test_one_step_off_counts_the_step_of_lag(tokenizer):
    """pipeline_depth 1: step 2's rollouts were sampled from the weights before step 1's update, its old
    log-probs are the weights after it, so a learning policy shows a mismatch there that step 1 has not."""
    model = planted_model(tokenizer)
    engine = RecordingEngine(model, tokenizer)  # a copy of its own, as one step off needs
    config = small_config(n_grpo_steps=2, pipeline_depth=1, tis_cap=2.0, learning_rate=1e-2)
    first, second = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, config)
    assert first["mismatch_kl_k3"] <= SAME_WEIGHTS_K3
    assert second["policy_lag"] == 1 and second["mismatch_kl_k3"] > 1e3 * SAME_WEIGHTS_K3
