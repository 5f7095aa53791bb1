"""The GRPO options beyond the handout (DAPO, GSPO, a KL penalty): each loss checked against its formula
written out here, each loop option against a whole step computed by hand, and the invalid combinations."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tiny_loops import PROBLEMS, TEMPLATE, RecordingEngine, VariedLengthEngine, make_model, parity_reward, small_config

from a5core.data.files import Problem
from a5core.grading.group_rewards import overlong_penalty
from a5core.handout import grpo_microbatch_train_step
from a5core.loops.grpo import grpo
from a5core.policy.losses import compute_kl_penalty

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------- the losses


def ragged(seed: int = 0, rows: int = 4, width: int = 6):
    """Log-probs (rows, width) with gradients, old log-probs near them, a mask of rows of lengths 6, 4, 2, 5."""
    generator = torch.Generator().manual_seed(seed)
    log_probs = (-torch.rand(rows, width, generator=generator) * 2).requires_grad_()
    old = log_probs.detach() + 0.3 * torch.randn(rows, width, generator=generator)
    lengths = torch.tensor([6, 4, 2, 5])[:rows]
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    advantages = torch.tensor([[1.0], [-0.5], [2.0], [-1.5]])[:rows]
    return log_probs, old, mask, advantages


@pytest.mark.parametrize("cliprange, cliprange_high", [(10.0, None), (0.05, 0.08), (0.05, None)])
def test_gspo_loss_is_the_sequence_level_objective(cliprange, cliprange_high):
    """GSPO: s_i = exp(mean over the response of log π − log π_old), loss mean_i −min(s_i·A_i, clip(s_i)·A_i);
    the loop's per-token form with the per-sequence mean has this value and gradient (clipped or not)."""
    log_probs, old, mask, advantages = ragged()
    loss, meta = grpo_microbatch_train_step(
        log_probs, mask, 1.0, "gspo", advantages=advantages, old_log_probs=old, cliprange=cliprange,
        cliprange_high=cliprange_high,
    )  # fmt: skip
    got = log_probs.grad.clone()

    direct = log_probs.detach().clone().requires_grad_()
    high = cliprange if cliprange_high is None else cliprange_high
    terms = []
    for i in range(4):
        n = int(mask[i].sum())
        s = torch.exp((direct[i, :n] - old[i, :n]).sum() / n)
        a = advantages[i, 0]
        terms.append(-torch.minimum(s * a, torch.clamp(s, 1 - cliprange, 1 + high) * a))
    expected = torch.stack(terms).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, direct.grad, atol=1e-6, rtol=1e-6)
    # A sequence whose clipped term is the smaller one gets no gradient at all; the others do.
    ratios = torch.exp(((log_probs.detach() - old) * mask).sum(1) / mask.sum(1))
    a = advantages[:, 0]
    chose_clipped = torch.clamp(ratios, 1 - cliprange, 1 + high) * a < ratios * a
    assert chose_clipped.any() == (cliprange < 1), "the test needs a clipped sequence (and none at a wide range)"
    assert (got.abs().sum(1) == 0).tolist() == chose_clipped.tolist()
    assert meta["clip_fraction"].item() == pytest.approx(
        (chose_clipped.unsqueeze(1) & mask).sum().item() / mask.sum().item()
    )


def test_kl_estimators_are_their_formulas():
    """With r = log π_ref − log π: k1 = −r, k2 = r²/2, k3 = e^r − r − 1 ≥ 0; all 0 where π = π_ref."""
    policy = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -2.0, -0.1]])
    r = ref - policy
    torch.testing.assert_close(compute_kl_penalty(policy, ref, "k1"), -r)
    torch.testing.assert_close(compute_kl_penalty(policy, ref, "k2"), r * r / 2)
    k3 = compute_kl_penalty(policy, ref, "k3")
    torch.testing.assert_close(k3, torch.exp(r) - r - 1)
    assert (k3 >= 0).all() and k3[0, 1] == 0
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; expected one of k1, k2, k3"):
        compute_kl_penalty(policy, ref, "k4")


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_adds_to_each_tokens_loss(estimator):
    log_probs, _, mask, advantages = ragged(1)
    ref = log_probs.detach() - 0.2
    loss, meta = grpo_microbatch_train_step(
        log_probs, mask, 2.0, "reinforce_with_baseline", advantages=advantages, ref_log_probs=ref, kl_coef=0.1,
        kl_estimator=estimator,
    )  # fmt: skip
    direct = log_probs.detach().clone().requires_grad_()
    r = ref - direct
    kl = -r if estimator == "k1" else torch.exp(r) - r - 1
    per_token = -advantages * direct + 0.1 * kl
    expected = ((per_token * mask).sum(1) / mask.sum(1)).mean() / 2.0
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(log_probs.grad, direct.grad)
    torch.testing.assert_close(meta["kl"], (kl.detach() * mask).sum() / mask.sum())
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_log_probs"):
        grpo_microbatch_train_step(log_probs, mask, 1.0, "no_baseline", raw_rewards=advantages, kl_coef=0.1)


def test_token_mean_weighs_every_token_of_the_batch_alike_however_it_is_cut():
    """DAPO's token-level loss: Σ over every response token of the batch / their count. Cut into
    micro-batches of 1, 2 or 4 rows (each divided as the loop divides it), the gradient is the same."""
    log_probs, _, mask, advantages = ragged(2)
    direct = log_probs.detach().clone().requires_grad_()
    expected = -(advantages * direct * mask).sum() / mask.sum()
    expected.backward()
    per_sequence = mask.sum().item() / 4  # the train batch's tokens per sequence
    for micro in (1, 2, 4):
        log_probs.grad = None
        total = 0.0
        for start in range(0, 4, micro):
            rows = slice(start, start + micro)
            loss, _ = grpo_microbatch_train_step(
                log_probs[rows], mask[rows], 4 / micro, "reinforce_with_baseline", advantages=advantages[rows],
                length_normalization="token_mean", normalize_constant=per_sequence,
            )  # fmt: skip
            total += loss.item()
        assert total == pytest.approx(expected.item(), abs=1e-6)
        torch.testing.assert_close(log_probs.grad, direct.grad)


# ------------------------------------------------------------------------------- one step, by hand


def hand_step(start, tokenizer, engine, config, reward_fn, answers) -> tuple[torch.nn.Module, list, list]:
    """One GRPO step written out from the rollouts the engine returned: rewards (+ overlong penalty),
    group-normalised advantages, per-token loss (REINFORCE, GSPO's sequence ratio, + KL to the starting
    weights), the length normalisation, truncation masking, the shuffled optimizer steps of each epoch
    (the loops' optimizer, ``config.adamw``; clipped gradients). Returns the updated copy of ``start``, and
    each optimizer step's loss and gradient norm (before clipping)."""
    model = copy.deepcopy(start)
    reference = copy.deepcopy(start)
    optimizer = config.adamw(list(model.parameters()))
    losses, norms = [], []
    ((prompts, groups, _),) = engine.calls
    completions = [c for group in groups for c in group]
    G = config.group_size
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    rewards = torch.tensor([reward_fn(c.text, answers[i // G])["reward"] for i, c in enumerate(completions)])
    rewards = rewards + overlong_penalty(lengths, config.max_tokens, config.overlong_buffer, config.overlong_penalty)
    grouped = rewards.view(-1, G)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).flatten()
    masked = [config.mask_truncated and c.finish_reason == "length" for c in completions]
    sequences = []
    for i, c in enumerate(completions):
        prompt = tokenizer(prompts[i // G], add_special_tokens=False)["input_ids"]
        sequences.append((torch.tensor([prompt + list(c.token_ids)]), len(prompt)))

    def token_log_probs(net, i):
        sequence, n_prompt = sequences[i]
        log_probs = torch.log_softmax(net(sequence).logits[0, :-1].float(), dim=-1)
        return log_probs[torch.arange(sequence.shape[1] - 1), sequence[0, 1:]][n_prompt - 1 :]

    with torch.no_grad():
        old = [token_log_probs(model, i) for i in range(len(completions))]
        ref = [token_log_probs(reference, i) for i in range(len(completions))]
    for epoch in range(config.epochs_per_rollout_batch):
        order = torch.randperm(len(completions), generator=torch.Generator().manual_seed(epoch)).tolist()
        for begin in range(0, len(order), config.train_batch_size):
            batch = order[begin : begin + config.train_batch_size]
            tokens = sum(len(completions[i].token_ids) for i in batch if not masked[i])
            optimizer.zero_grad()
            loss = torch.zeros(())
            for i in batch:
                new = token_log_probs(model, i)
                if config.loss_type == "gspo":
                    s = torch.exp((new - old[i]).mean())
                    low, high = config.gspo_cliprange, config.gspo_cliprange_high
                    seq = -torch.minimum(s * advantages[i], torch.clamp(s, 1 - low, 1 + high) * advantages[i])
                    per_token = seq.expand_as(new)
                else:
                    per_token = -advantages[i] * new
                if masked[i]:
                    per_token = per_token * 0.0
                if config.kl_coef:
                    r = ref[i] - new
                    per_token = (
                        per_token
                        + config.kl_coef * {"k1": -r, "k2": r * r / 2, "k3": torch.exp(r) - r - 1}[config.kl_estimator]
                    )
                if config.length_normalization == "token_mean":
                    loss = loss + per_token.sum() / max(tokens, 1)
                else:
                    loss = loss + per_token.mean() / len(batch)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(list(model.parameters()), config.grad_clip).item())
            losses.append(loss.item())
            optimizer.step()
    return model, losses, norms


@pytest.mark.parametrize(
    "options",
    [
        dict(length_normalization="token_mean"),
        dict(kl_coef=0.5, kl_estimator="k1"),
        dict(kl_coef=0.5, kl_estimator="k2", learning_rate=1e-3),
        dict(overlong_buffer=6, mask_truncated=True),
        # SGD moves weights by lr × the (clipped) gradient: at lr 0.5 the first step moves some sequence ratios
        # past the clip range
        dict(
            loss_type="gspo", train_batch_size=4, gradient_accumulation_steps=2, gspo_cliprange=0.02, learning_rate=0.5
        ),
    ],
    ids=["token_mean", "kl_k1", "kl_k2", "overlong_and_truncation", "gspo_two_optimizer_steps"],
)
def test_one_step_with_each_option_equals_the_hand_computed_one(tokenizer, options, monkeypatch, sgd_updates):
    """The loop's step against :func:`hand_step`, both stepping SGD (``sgd_updates``: the weights then compare
    the gradients; AdamW's own step is checked in tests/a5core/loops/grpo/test_loop.py). GSPO runs off-policy (two
    optimizer steps on halves of the batch): the second step's sequence ratios are not 1, and some are clipped."""
    from a5core.loops.settings import SeedSettings

    monkeypatch.setattr(SeedSettings, "step_seed", lambda self, step: 0)  # epoch e's order: seed e
    model = make_model(tokenizer)
    start = copy.deepcopy(model)
    engine = VariedLengthEngine(model, tokenizer)
    config = small_config(grad_clip=1.0, **options)
    history = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, config)
    ((prompts, groups, _),) = engine.calls
    answers = [next(p.answer for p in PROBLEMS if TEMPLATE.format(p.problem) == prompt) for prompt in prompts]
    expected, losses, norms = hand_step(start, tokenizer, engine, config, parity_reward, answers)
    # the loss sums ± terms of size ≈ |A|·(mean log-prob) ≈ 5 to near 0: float32 rounds each at ≈ 5e-7
    assert history[-1]["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4, abs=1e-6)
    assert history[-1]["grad_norm"] == pytest.approx(sum(norms) / len(norms), rel=1e-4)
    for name, value in expected.named_parameters():
        got = dict(model.named_parameters())[name].detach()
        torch.testing.assert_close(got, value.detach(), atol=1e-4 * config.learning_rate, rtol=0)  # of a step
    if "overlong_buffer" in options:
        completions = [c for g in groups for c in g]
        truncated = [c.finish_reason == "length" for c in completions]
        assert any(truncated) and not all(truncated), "the test needs truncated and finished rollouts"
        assert history[-1]["overlong_penalty_mean"] < 0
    if "kl_coef" in options:
        assert history[-1]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step starts at the reference
    if options.get("loss_type") == "gspo":
        assert history[-1]["optimizer_steps"] == 2 and history[-1]["clip_fraction"] > 0


# ---------------------------------------------------------------------------------- dynamic sampling


def half_uniform_reward(response: str, ground_truth: str) -> dict[str, float]:
    """Questions with an even answer reward every rollout alike (their groups teach nothing); the others
    reward responses of even length."""
    reward = 1.0 if int(ground_truth) % 2 == 0 else float(len(response) % 2 == 0)
    return {"reward": reward, "format_reward": reward, "answer_reward": reward}


def test_dynamic_sampling_fills_the_batch_with_groups_that_differ(tokenizer):
    problems = [*PROBLEMS, *[Problem(f"q{i}", f"What is {i} + 1?", str(i + 1)) for i in range(8, 24)]]
    options = dict(rollout_batch_size=16, group_size=4, train_batch_size=16, gradient_accumulation_steps=4)

    def run(**extra):
        model = make_model(tokenizer)
        engine = RecordingEngine(model, tokenizer)
        return grpo(
            model, tokenizer, engine, problems, TEMPLATE, half_uniform_reward, small_config(**options, **extra)
        )[-1], engine

    dropped, _ = run(drop_uniform_groups=True)
    assert dropped["dropped_groups"] > 0  # without more draws the batch shrinks
    full, engine = run(dynamic_sampling=True, max_extra_draws=6)
    assert full["kept_groups"] == 4 and full["sampling_draws"] == len(engine.calls) > 1
    assert full["optimizer_steps"] == 1
    # Every group kept has rewards that differ: the constant-reward questions (even answers) are gone.
    assert full["frac_groups_all_equal"] > 0 and full["dropped_groups"] >= 1

    constant = lambda response, truth: {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}  # noqa: E731
    model = make_model(tokenizer)
    engine = RecordingEngine(model, tokenizer)
    capped = grpo(
        model, tokenizer, engine, PROBLEMS, TEMPLATE, constant, small_config(dynamic_sampling=True, max_extra_draws=2)
    )[-1]
    assert len(engine.calls) == 3 and capped["sampling_draws"] == 3  # the first draw and at most 2 more
    assert capped["kept_groups"] == 0 and capped["optimizer_steps"] == 0


# ------------------------------------------------------------------------------------- bad settings


def test_kl_needs_an_unsharded_start_and_pipelining_an_engine_of_its_own(tokenizer):
    model = make_model(tokenizer)

    class SharingEngine(RecordingEngine):
        def __init__(self, model, tokenizer):
            super().__init__(model, tokenizer)
            self.model = model  # the policy itself, as a colocated engine holds it

    with pytest.raises(ValueError, match="pipeline_depth 1 generates while the policy trains"):
        grpo(
            model, tokenizer, SharingEngine(model, tokenizer), PROBLEMS, TEMPLATE, parity_reward,
            small_config(pipeline_depth=1, tis_cap=2.0),
        )  # fmt: skip
    assert math.isfinite(small_config(kl_coef=0.1).kl_coef)


# --------------------------------------------------------------------------- one-step-off asynchronous


class RendezvousEngine(RecordingEngine):
    """An engine of its own (a copy of the weights) that proves overlap without a clock: generate call i
    (i ≥ 1: the rollouts of step i, started in the background during step i − 1) waits until step i − 1's
    training has begun. Were generation and training one after another, it would wait in vain (60 s, then
    the test fails). It also records any two generate calls that ran at once (they must not)."""

    def __init__(self, model, tokenizer, training_started):
        super().__init__(model, tokenizer)
        self.training_started, self.busy, self.overlapping_calls, self.rollout_calls = training_started, False, 0, 0

    def generate(self, prompts, sampling):
        self.overlapping_calls += self.busy
        self.busy = True
        try:
            if sampling.n > 1:  # a step's rollouts (the evaluation samples once a problem)
                self.rollout_calls += 1
                i = self.rollout_calls - 1
                if i >= 1 and not self.training_started[i - 1].wait(timeout=60):
                    raise AssertionError(f"step {i}'s rollouts waited for step {i - 1}'s training, which never began")
            return super().generate(prompts, sampling)
        finally:
            self.busy = False


def test_one_step_off_overlaps_generation_with_training_and_records_versions(tokenizer, monkeypatch):
    """pipeline_depth 1: step k's rollouts are generated while step k − 1 trains (shown by the rendezvous),
    from the weights of one version before (0, 0, 1, 2); an evaluation after every step waits for the engine."""
    import threading

    import a5core.loops.grpo.loop as module

    started = [threading.Event() for _ in range(4)]
    real_train = module._train_batches

    def train(config, n, step):
        started[step - 1].set()  # steps count from 1
        return real_train(config, n, step)

    monkeypatch.setattr(module, "_train_batches", train)
    model = make_model(tokenizer)
    engine = RendezvousEngine(model, tokenizer, started)
    from a5core.engines import SamplingSettings

    def evaluate(net, step):
        engine.generate([TEMPLATE.format("What is 1 + 1?")], SamplingSettings(max_tokens=4, seed=0))
        return {"val_probe": float(step)}

    config = small_config(n_grpo_steps=4, pipeline_depth=1, tis_cap=2.0, eval_every=1)
    history = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, config, evaluate=evaluate)
    steps = [h for h in history if h["step"] > 0]
    assert [h["rollout_policy_version"] for h in steps] == [0, 0, 1, 2]
    assert [h["policy_lag"] for h in steps] == [0, 1, 1, 1]
    assert engine.rollout_calls == 4 and engine.overlapping_calls == 0
    assert all("time_wait_rollouts" in h for h in steps[1:]) and "time_wait_rollouts" not in steps[0]
    assert all(math.isfinite(h["loss"]) and h["optimizer_steps"] == 1 for h in steps)


def test_depth_zero_is_the_synchronous_loop(tokenizer):
    """pipeline_depth 0 (the default): every step's rollouts come from its own starting weights, and the
    engine is asked for them at the start of the step, nothing in the background."""
    model = make_model(tokenizer)
    engine = RecordingEngine(model, tokenizer)
    history = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, small_config(n_grpo_steps=3))
    assert [h["rollout_policy_version"] for h in history] == [0, 1, 2]
    assert all(h["policy_lag"] == 0 and "time_wait_rollouts" not in h for h in history)


def test_one_step_off_resumes_after_kill_9(tiny_lm_dir, tokenizer, tmp_path):
    """SIGKILL a pipelined run in step 2's log call (checkpoint 1 written, step 3's rollouts generating in
    the background). The resumed run redoes step 2 with rollouts of its own weights (the background
    ones died with the process), then pipelines again: versions 0 | 1, 1, 2; each step logged once."""
    from grpo_kill_target import ASYNC_SETTINGS
    from kill9 import kill_when_frozen
    from tiny_loops import Recorder

    checkpoint_dir, marker = tmp_path / "ckpt", tmp_path / "frozen"
    kill_when_frozen("grpo_kill_target.py", str(tiny_lm_dir), str(checkpoint_dir), str(marker), marker=marker)

    model = make_model(tokenizer, seed=1)  # other starting weights: the checkpoint replaces them
    log = Recorder()
    history = grpo(
        model,
        tokenizer,
        RecordingEngine(model, tokenizer),
        PROBLEMS,
        TEMPLATE,
        parity_reward,
        small_config(**ASYNC_SETTINGS),
        checkpoint_dir=checkpoint_dir,
        log=log,
    )
    assert log.steps == [2, 3, 4]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert [h["rollout_policy_version"] for h in history] == [0, 1, 1, 2]
    assert all(math.isfinite(h["loss"]) for h in history)
