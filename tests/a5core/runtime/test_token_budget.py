"""Micro-batches by token budget (``max_tokens_per_microbatch``): the packing, and the same update as
fixed-count micro-batches and as one whole batch, for every loss and length normalisation (one rank here;
two ranks in tests/a5core/runtime/test_distributed.py)."""

from __future__ import annotations

import functools
import itertools
import logging
import re
from collections.abc import Callable

import pytest
import torch
from tiny_loops import PROBLEMS, TEMPLATE, VariedLengthEngine, make_model, parity_reward, short_examples, small_config

import a5core.loops.grpo.loop
import a5core.loops.sft
from a5core.data.files import Trace
from a5core.loops import training
from a5core.loops.expert_iteration import EIConfig
from a5core.loops.grpo import grpo
from a5core.loops.sft import SFTConfig, train_sft
from a5core.runtime import distributed, token_budget
from a5core.runtime.token_budget import size_budget

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------ packing


@pytest.mark.parametrize("world", [1, 2, 3])
def test_packing_covers_every_item_once_within_the_budget_with_one_count(world, monkeypatch):
    lengths = [5, 130, 64, 65, 1, 200, 63, 128, 7, 300, 20, 90]
    budget = 256
    per_rank = []
    for rank in range(world):
        monkeypatch.setattr(distributed, "rank_and_world", lambda rank=rank: (rank, world))
        per_rank.append(distributed.rank_microbatches(range(len(lengths)), 2, lengths, budget))
    assert len({len(m) for m in per_rank}) == 1  # every rank runs the same number of passes
    items = [i for micro in itertools.chain(*per_rank) for i in micro]
    assert sorted(items) == list(range(len(lengths)))
    for micro in itertools.chain(*per_rank):
        if len(micro) > 1:  # one item alone may exceed the budget (300 tokens)
            width = max(distributed.padded_length(lengths[i]) for i in micro)
            assert len(micro) * width <= budget
            assert width == distributed.padded_length(lengths[micro[0]])  # longest first
    if world > 1:  # tokens are dealt evenly: no rank holds more than the others by more than the longest item
        loads = [sum(lengths[i] for micro in m for i in micro) for m in per_rank]
        assert max(loads) - min(loads) <= max(lengths)


def test_the_fixed_count_cut_is_unchanged(monkeypatch):
    monkeypatch.setattr(distributed, "rank_and_world", lambda: (1, 2))
    assert distributed.rank_microbatches(range(7), 2) == [[1, 3], [5]]
    monkeypatch.setattr(distributed, "rank_and_world", lambda: (0, 2))
    assert distributed.rank_microbatches(range(7), 2) == [[0, 2], [4, 6]]


# ---------------------------------------------------------------------------------- the same update


def run_grpo(tokenizer, **options):
    model = make_model(tokenizer)
    engine = VariedLengthEngine(model, tokenizer)
    history = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, small_config(**options))
    return model, history[-1]


CUTS = {
    "fixed_count": dict(gradient_accumulation_steps=4),  # micro-batches of 2 rollouts
    "whole_batch": dict(gradient_accumulation_steps=1),
    # Rollouts here are 216-226 positions (the r1_zero prompt is 215 tokens), padded to 256: one a micro-batch,
    # or four.
    "budget_256": dict(gradient_accumulation_steps=4, max_tokens_per_microbatch=256),
    "budget_1024": dict(gradient_accumulation_steps=4, max_tokens_per_microbatch=1024),
}


@pytest.mark.parametrize("normalization", ["masked_mean", "masked_normalize", "token_mean"])
@pytest.mark.parametrize("loss_type", ["no_baseline", "reinforce_with_baseline", "grpo_clip", "grpo_no_clip", "gspo"])
def test_grpo_update_does_not_depend_on_how_the_batch_is_cut(tokenizer, loss_type, normalization, sgd_updates):
    """Every cut of the train batch gives the same loss, gradient norm and weights (to float rounding).
    The ratio losses run off-policy: two epochs over the batch, so the second epoch's ratios are not 1."""
    options = dict(loss_type=loss_type, length_normalization=normalization, grad_clip=0.0, gspo_cliprange=0.05)
    if loss_type in ("grpo_clip", "grpo_no_clip", "gspo"):
        options["epochs_per_rollout_batch"] = 2
    runs = {name: run_grpo(tokenizer, **options, **cut) for name, cut in CUTS.items()}
    reference_model, reference = runs["fixed_count"]
    passes = {name: runs[name][1]["microbatches"] for name in ("budget_256", "whole_batch", "budget_1024")}
    epochs = options.get("epochs_per_rollout_batch", 1)
    assert passes == {"budget_256": 8 * epochs, "whole_batch": epochs, "budget_1024": 2 * epochs}
    for name, (model, last) in runs.items():
        assert last["loss"] == pytest.approx(reference["loss"], rel=1e-4, abs=1e-6), name  # a sum of ± terms
        assert last["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), name
        for (key, value), other in zip(reference_model.state_dict().items(), model.state_dict().values(), strict=True):
            torch.testing.assert_close(other, value, atol=1e-7, rtol=0, msg=f"{name}: {key}")


def test_token_budget_pads_to_few_shapes_and_logs_them(tokenizer):
    _, budget = run_grpo(tokenizer, gradient_accumulation_steps=4, max_tokens_per_microbatch=1024)
    _, fixed = run_grpo(tokenizer, gradient_accumulation_steps=4)
    assert budget["microbatch_shapes"] == 1  # (4, 256): every micro-batch padded to one shape
    assert fixed["microbatch_shapes"] >= 2  # (2, longest of the two): the lengths vary


def test_sft_update_does_not_depend_on_how_the_batch_is_cut(tokenizer, sgd_updates):
    examples = short_examples(8)
    results = {}
    for name, options in {
        "fixed_count": dict(microbatch_size=2),
        "whole_batch": dict(microbatch_size=8),
        "budget": dict(microbatch_size=2, max_tokens_per_microbatch=128),
    }.items():
        model = make_model(tokenizer)
        config = SFTConfig(learning_rate=1e-3, batch_size=8, epochs=1, grad_clip=0.0, **options)
        results[name] = (model, train_sft(model, tokenizer, examples, config))
    reference_model, reference = results["fixed_count"]
    for name, (model, metrics) in results.items():
        assert metrics["loss"] == pytest.approx(reference["loss"], rel=1e-5), name
        assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), name
        for (key, value), other in zip(reference_model.state_dict().items(), model.state_dict().values(), strict=True):
            torch.testing.assert_close(other, value, atol=1e-7, rtol=0, msg=f"{name}: {key}")


def test_expert_iteration_passes_the_budget_to_its_sft_rounds():
    assert EIConfig(max_tokens_per_microbatch=512).round_sft(0, TEMPLATE).max_tokens_per_microbatch == 512
    assert EIConfig().round_sft(1, TEMPLATE).max_tokens_per_microbatch == "auto"


# ------------------------------------------------------------------------------------------ out of memory


def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.16 GiB.")


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (dict(max_tokens_per_microbatch=128), "max_tokens_per_microbatch 128: set a lower number"),
        (dict(), "microbatch_size 2: lower it"),
    ],
)
def test_sft_out_of_memory_names_the_step_the_micro_batch_and_the_setting(tokenizer, monkeypatch, options, names):
    monkeypatch.setattr("a5core.loops.sft.get_response_log_probs", out_of_memory)
    config = SFTConfig(batch_size=8, microbatch_size=2, epochs=1, **options)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        train_sft(make_model(tokenizer), tokenizer, short_examples(8), config)
    message = str(caught.value)
    assert message.startswith("SFT step 1: out of GPU memory in a micro-batch of ")
    assert re.search(r"of \d+ sequences × \d+ positions;", message), message
    assert names in message.replace(",", "")
    assert "Tried to allocate" in str(caught.value.__cause__)


@pytest.mark.parametrize(
    ("options", "where", "names"),
    [
        (
            dict(max_tokens_per_microbatch=1024),
            "GRPO step 1, training",
            "max_tokens_per_microbatch 1,024: set a lower number",
        ),
        (
            dict(loss_type="grpo_clip", epochs_per_rollout_batch=2),
            "GRPO step 1, log-probs pass",
            "gradient_accumulation_steps 4: raise it",
        ),
    ],
)
def test_grpo_out_of_memory_names_the_pass_and_the_setting(tokenizer, monkeypatch, options, where, names):
    monkeypatch.setattr("a5core.loops.grpo.loop.get_response_log_probs", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        run_grpo(tokenizer, gradient_accumulation_steps=4, **options)
    message = str(caught.value)
    assert message.startswith(f"{where}: out of GPU memory in a micro-batch of "), message
    assert re.search(r"of \d+ sequences × \d+ positions;", message), message
    assert names in message
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)


# ---------------------------------------------------------------------------------------- auto: sizing


def test_auto_budget_is_a_power_of_two_of_the_free_memory_within_bounds():
    mib = 2**20
    assert size_budget(10 * 2**30, mib) == 8192  # 9,216 tokens fit in 90% of 10 GiB: 8,192
    assert size_budget(10 * 2**30, mib, margin=0.0) == 8192  # 10,240 → 8,192
    assert size_budget(20 * 2**30, mib, margin=0.0) == 16384
    assert size_budget(2**40, mib) == token_budget.LARGEST
    assert size_budget(0, mib) == size_budget(mib, mib) == 64  # one bucket at least
    for free in range(1, 200):
        budget = size_budget(free * 2**30 / 7, 3.4 * mib)
        assert budget & (budget - 1) == 0 and budget % 64 == 0  # halving keeps it a multiple of the bucket


class FakeMemory:
    """A device's memory as numbers: ``allocated`` before each pass, ``peak`` during it, ``free`` after."""

    def __init__(self, allocated=0, peak=0, free=2**40):
        self.allocated, self.peak_bytes, self.free_bytes, self.released = allocated, peak, free, 0

    def start(self):
        return self.allocated

    def peak(self):
        return self.peak_bytes

    def free(self):
        return self.free_bytes

    def release(self):
        self.released += 1


def test_auto_measures_a_token_from_the_first_passes_less_the_new_gradients_and_sizes_once():
    weight = torch.nn.Parameter(torch.zeros(256))  # 1 KiB of gradient, not yet allocated
    memory = FakeMemory(allocated=10_000, peak=10_000 + 1024 + 4096 * 2**10, free=9 * 2**30)
    budget = token_budget.TokenBudget("auto", torch.device("cpu"), [weight], memory=memory)
    assert budget.value == token_budget.PROBE_TOKENS and not budget.sized
    with budget.measuring(4096):
        weight.grad = torch.zeros_like(weight)
    assert budget.cost == 2**10  # (peak − before − the new gradient) ÷ tokens
    memory.peak_bytes = 10_000 + 1024 * 2**10  # a smaller pass: the larger cost stays
    with budget.measuring(1024):
        pass
    assert budget.cost == 2**10
    budget.settle()
    assert budget.value == token_budget.LARGEST and budget.sized  # 9 GiB at 1 KiB a token: capped
    memory.peak_bytes = 2**40
    with budget.measuring(64):  # sized: no more measuring, no more sizing
        pass
    budget.settle()
    assert budget.value == token_budget.LARGEST


@pytest.mark.parametrize("setting", ["auto", None, 512])
def test_auto_on_the_cpu_is_count_based_and_a_number_or_null_is_kept(setting):
    budget = token_budget.TokenBudget(setting, torch.device("cpu"))
    assert budget.value == (None if setting == "auto" else setting) and budget.sized
    with budget.measuring(100):
        pass
    budget.settle()
    assert budget.value == (None if setting == "auto" else setting)
    with pytest.raises(torch.OutOfMemoryError):  # no retry but under auto on CUDA, no engine asked
        budget.retrying(out_of_memory, "here", [100], release=lambda: pytest.fail("the engine was asked"))


def test_compile_layers_auto_compiles_on_cuda_only():
    assert SFTConfig().compile_layers == "auto"
    assert SFTConfig().compiles(torch.device("cuda")) and not SFTConfig().compiles(torch.device("cpu"))
    assert SFTConfig(compile_layers=True).compiles(torch.device("cpu"))
    assert not SFTConfig(compile_layers=False).compiles(torch.device("cuda"))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("fast", "max_tokens_per_microbatch must be a whole number >= 1 .*, auto .* or null"),
        (0, "max_tokens_per_microbatch must be a whole number >= 1"),
        (True, "max_tokens_per_microbatch must be a whole number >= 1"),
        (1.5, "max_tokens_per_microbatch must be a whole number >= 1"),
    ],
)
def test_a_bad_budget_is_refused_with_what_is_allowed(value, message):
    with pytest.raises(ValueError, match=message):
        SFTConfig(max_tokens_per_microbatch=value)
    assert SFTConfig(max_tokens_per_microbatch="2048").max_tokens_per_microbatch == 2048  # a flag's text


def test_auto_on_the_cpu_updates_exactly_as_micro_batches_by_count(tokenizer):
    auto_model, auto = run_grpo(tokenizer, gradient_accumulation_steps=4)
    count_model, count = run_grpo(tokenizer, gradient_accumulation_steps=4, max_tokens_per_microbatch=None)
    assert auto["microbatches"] == count["microbatches"] == 4
    for value, other in zip(auto_model.state_dict().values(), count_model.state_dict().values(), strict=True):
        assert torch.equal(value, other)


# ----------------------------------------------------------------------------------- auto: out of memory


def failing_on_call(module, monkeypatch, failing: int) -> list[int]:
    """``module``'s forward runs out of memory on its ``failing``-th call (counting from 1), once."""
    real, calls = module.get_response_log_probs, []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == failing:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.16 GiB.")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "get_response_log_probs", forward)
    return calls


def auto_on_the_cpu(monkeypatch, module, memory, probe):
    """``auto`` sized on the CPU as on CUDA, from ``memory``, starting at ``probe`` tokens."""
    monkeypatch.setattr(token_budget, "PROBE_TOKENS", probe)
    monkeypatch.setattr(module, "TokenBudget", functools.partial(token_budget.TokenBudget, memory=memory))


def grpo_history(tokenizer, **options):
    model = make_model(tokenizer)
    engine = VariedLengthEngine(model, tokenizer)
    history = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, small_config(**options))
    return model, history


def test_grpo_out_of_memory_under_auto_halves_the_budget_and_loses_nothing(tokenizer, monkeypatch, caplog):
    """Out of memory in the second pass (the first's gradient already accumulated): the optimizer step runs
    again at half the budget; its update and metrics are those of that budget from the start, and the
    rollouts are not drawn again."""
    options = dict(n_grpo_steps=2, gradient_accumulation_steps=4, checkpoint_every=0)
    reference_model, reference = grpo_history(tokenizer, max_tokens_per_microbatch=256, **options)
    memory = FakeMemory()
    auto_on_the_cpu(monkeypatch, training, memory, probe=512)  # rollouts of 256 positions: 2 a pass, then 1
    calls = failing_on_call(a5core.loops.grpo.loop, monkeypatch, failing=2)
    generate = VariedLengthEngine.generate
    generated = []
    monkeypatch.setattr(VariedLengthEngine, "generate", lambda *a: generated.append(1) or generate(*a))
    with caplog.at_level(logging.WARNING, logger="a5core.runtime.token_budget"):
        model, history = grpo_history(tokenizer, **options)
    assert "GRPO step 1, training: out of GPU memory; running it again with max_tokens_per_microbatch 256" in (
        caplog.text
    )
    assert memory.released == 1 and len(generated) == 2 and len(calls) == 2 + 8 + 8
    assert [h["step"] for h in history] == [1, 2]
    for got, want in zip(history, reference, strict=True):
        assert (
            (got["microbatches"], got["optimizer_steps"])
            == (want["microbatches"], want["optimizer_steps"])
            == (
                8,
                1,
            )
        )
        assert (got["loss"], got["grad_norm"], got["train_tokens"]) == (
            want["loss"],
            want["grad_norm"],
            want["train_tokens"],
        )
    for value, other in zip(reference_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(value, other)


def test_grpo_out_of_memory_after_an_update_keeps_it_and_runs_only_the_next_again(tokenizer, monkeypatch, caplog):
    """Two optimizer steps a rollout batch: sized after the first (9 GiB free: the largest budget); out of
    memory in the second's pass: only the second runs again, at half the budget, never the first."""
    options = dict(train_batch_size=4, gradient_accumulation_steps=2, grad_clip=0.0, checkpoint_every=0)
    reference_model, reference = grpo_history(tokenizer, max_tokens_per_microbatch=512, **options)
    auto_on_the_cpu(monkeypatch, training, FakeMemory(free=9 * 2**30), probe=512)
    calls = failing_on_call(a5core.loops.grpo.loop, monkeypatch, failing=3)  # the second optimizer step's first pass
    with caplog.at_level(logging.WARNING, logger="a5core.runtime.token_budget"):
        model, (last,) = grpo_history(tokenizer, **options)
    half = f"{token_budget.LARGEST // 2:,}"
    assert f"GRPO step 1, training: out of GPU memory; running it again with max_tokens_per_microbatch {half}" in (
        caplog.text
    )
    assert len(calls) == 2 + 1 + 1  # 2 passes of 2 at 512, the failed one, 1 pass of 4 at 16,384
    assert (last["optimizer_steps"], last["microbatches"]) == (2, 3)
    assert last["loss"] == pytest.approx(reference[-1]["loss"], rel=1e-5, abs=1e-7)
    for value, other in zip(reference_model.state_dict().values(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(other, value, atol=1e-7, rtol=0)


def test_sft_out_of_memory_under_auto_halves_the_budget_and_loses_nothing(tokenizer, monkeypatch, caplog):
    examples = short_examples(8)
    config = dict(learning_rate=1e-3, batch_size=8, microbatch_size=2, epochs=1)
    reference_model = make_model(tokenizer)
    reference = train_sft(reference_model, tokenizer, examples, SFTConfig(max_tokens_per_microbatch=128, **config))
    auto_on_the_cpu(monkeypatch, training, FakeMemory(), probe=256)  # sequences of 64 positions: 4 a pass, then 2
    calls = failing_on_call(a5core.loops.sft, monkeypatch, failing=2)
    model = make_model(tokenizer)
    with caplog.at_level(logging.WARNING, logger="a5core.runtime.token_budget"):
        got = train_sft(model, tokenizer, examples, SFTConfig(**config))
    assert "SFT step 1: out of GPU memory; running it again with max_tokens_per_microbatch 128" in caplog.text
    assert len(calls) == 2 + 4
    assert {k: got[k] for k in reference} == reference
    for value, other in zip(reference_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(value, other)


def failing_attempt(budget, failures: int) -> tuple[Callable[[], str], list[int]]:
    """An attempt that runs out of memory its first ``failures`` times, and the budgets it ran at."""
    tried = []

    def attempt():
        tried.append(budget.value)
        if len(tried) <= failures:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
        return "done"

    return attempt, tried


def test_auto_stops_halving_at_the_longest_row():
    """Out of memory at every budget over rows of up to 1,000 positions (1,024 padded): halved from 4,096 to
    1,024 and no further; below 1,024 that row's micro-batch is the row alone, as large as at 1,024."""
    budget = token_budget.TokenBudget("auto", torch.device("cpu"), memory=FakeMemory())
    attempt, tried = failing_attempt(budget, failures=100)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 20.00 MiB"):
        budget.retrying(attempt, "here", [30, 1000, 400])
    assert tried == [4096, 2048, 1024] and budget.value == 1024


@pytest.mark.parametrize(("freed", "budgets"), [(True, [4096, 4096, 2048, 1024]), (False, [4096, 2048, 1024, 512])])
def test_auto_asks_the_engine_once_and_runs_again_at_the_same_budget_if_it_freed_memory(freed, budgets):
    """Three failures: the engine is asked once, on the first; if it freed memory, the attempt runs again at
    the same budget before any halving; if not, halving starts at once."""
    budget = token_budget.TokenBudget("auto", torch.device("cpu"), memory=FakeMemory())
    attempt, tried = failing_attempt(budget, failures=3)
    asked = []
    assert budget.retrying(attempt, "here", [100], release=lambda: asked.append(1) or freed) == "done"
    assert tried == budgets and len(asked) == 1


@pytest.mark.parametrize("freed", [True, False])
def test_once_a_release_let_a_pass_fit_the_engine_releases_before_every_later_pass(freed):
    """A first call fails once and the engine is asked: if that freed memory, the next call asks it before
    its attempt (which then runs once, at the same budget); if it did not, later calls do not ask first."""
    budget = token_budget.TokenBudget("auto", torch.device("cpu"), memory=FakeMemory())
    events = []
    release = lambda: events.append("release") or freed  # noqa: E731

    def attempt(failures):
        tries = []

        def run():
            events.append(budget.value)
            tries.append(1)
            if len(tries) <= failures:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
            return "done"

        return run

    assert budget.retrying(attempt(failures=1), "here", [100], release=release) == "done"
    first = [4096, "release", 4096] if freed else [4096, "release", 2048]
    assert events == first
    assert budget.retrying(attempt(failures=0), "here", [100], release=release) == "done"
    assert events[len(first) :] == (["release", 4096] if freed else [2048])


class ReleasingEngine(VariedLengthEngine):
    """Keeps a cache between generate calls, as the compiled hf engine does; ``release_memory`` drops it."""

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.holding, self.released = False, 0

    def generate(self, prompts, sampling):
        self.holding = True
        return super().generate(prompts, sampling)

    def release_memory(self):
        held, self.holding = self.holding, False
        self.released += held
        return held


def test_grpo_out_of_memory_under_auto_releases_the_engine_cache_and_keeps_the_budget(tokenizer, monkeypatch, caplog):
    """Out of memory in the second pass, the engine holding its cache: the engine releases it and the optimizer
    step runs again at the same budget (512: 2 rollouts of 256 positions a pass), not halved; its update is that
    budget's."""
    options = dict(gradient_accumulation_steps=4, checkpoint_every=0)
    reference_model, (reference,) = grpo_history(tokenizer, max_tokens_per_microbatch=512, **options)
    memory = FakeMemory()
    auto_on_the_cpu(monkeypatch, training, memory, probe=512)
    calls = failing_on_call(a5core.loops.grpo.loop, monkeypatch, failing=2)
    model = make_model(tokenizer)
    engine = ReleasingEngine(model, tokenizer)
    with caplog.at_level(logging.WARNING, logger="a5core.runtime.token_budget"):
        (last,) = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, small_config(**options))
    assert (
        "GRPO step 1, training: out of GPU memory; the rollout engine released its cache; running it again with "
        "max_tokens_per_microbatch 512"
    ) in caplog.text
    assert "halved" not in caplog.text
    assert engine.released == 1 and memory.released == 1 and len(calls) == 2 + 4
    assert (last["microbatches"], last["loss"], last["grad_norm"]) == (4, reference["loss"], reference["grad_norm"])
    for value, other in zip(reference_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(value, other)


def test_grpo_after_a_release_let_training_fit_the_engine_releases_before_each_later_step(tokenizer, monkeypatch):
    """Step 1's training fits once the engine released its cache; step 2's generate rebuilds the cache, and the
    engine releases it again before step 2's training (the room step 1 needed), not after a failed pass."""
    auto_on_the_cpu(monkeypatch, training, FakeMemory(), probe=512)
    calls = failing_on_call(a5core.loops.grpo.loop, monkeypatch, failing=2)
    model = make_model(tokenizer)
    engine = ReleasingEngine(model, tokenizer)
    options = dict(n_grpo_steps=2, gradient_accumulation_steps=4, checkpoint_every=0)
    first, second = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, small_config(**options))
    assert engine.released == 2
    assert len(calls) == 2 + first["microbatches"] + second["microbatches"]  # the one failed pass: step 1's


def halvings_then_error(caplog, run) -> tuple[list[str], str]:
    """``run()``, which must end in an out-of-memory error: the budgets auto halved to (as the warnings name
    them) and the error's message."""
    with (
        caplog.at_level(logging.WARNING, logger="a5core.runtime.token_budget"),
        pytest.raises(torch.OutOfMemoryError) as caught,
    ):
        run()
    return re.findall(r"max_tokens_per_microbatch (\S+) \(auto halved it\)", caplog.text), str(caught.value)


def test_grpo_out_of_memory_at_every_budget_stops_at_the_longest_rollout_and_names_it(tokenizer, monkeypatch, caplog):
    """Rollouts of 216-226 positions (padded to 256), out of memory at any budget: 1,024, 512, 256, then the
    error, which names the one sequence no budget can split, not a budget to lower."""
    auto_on_the_cpu(monkeypatch, training, FakeMemory(), probe=1024)
    monkeypatch.setattr("a5core.loops.grpo.loop.get_response_log_probs", out_of_memory)
    halvings, message = halvings_then_error(
        caplog, lambda: grpo_history(tokenizer, gradient_accumulation_steps=4, checkpoint_every=0)
    )
    assert halvings == ["512", "256"]
    assert message.startswith(
        "GRPO step 1, training: out of GPU memory in a micro-batch of 1 sequences × 256 positions; one sequence "
        "of 256 positions does not fit in the GPU memory left beside what the process holds"
    ), message
    assert "policy_dtype: bfloat16" in message and "lower it" not in message and "a lower number" not in message


def test_sft_out_of_memory_at_every_budget_stops_at_the_longest_example_and_names_it(tokenizer, monkeypatch, caplog):
    """An example cut at max_seq_len 1,024 (1,023 positions, padded to 1,024) beside short ones, out of memory at
    any budget: 4,096, 2,048, 1,024, then the error naming that sequence."""
    examples = [*short_examples(3), Trace("What is 1 + 1?", " ok" * 1200 + " </answer>", "2")]
    auto_on_the_cpu(monkeypatch, training, FakeMemory(), probe=4096)
    monkeypatch.setattr("a5core.loops.sft.get_response_log_probs", out_of_memory)
    config = SFTConfig(batch_size=4, microbatch_size=2, epochs=1, max_seq_len=1024)
    halvings, message = halvings_then_error(
        caplog, lambda: train_sft(make_model(tokenizer), tokenizer, examples, config)
    )
    assert halvings == ["2,048", "1,024"]
    assert message.startswith(
        "SFT step 1: out of GPU memory in a micro-batch of 1 sequences × 1024 positions; one sequence of 1,024 "
        "positions does not fit"
    ), message
    assert "max_seq_len" in message and "lower it" not in message and "a lower number" not in message
