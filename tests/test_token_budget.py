"""Micro-batches by token budget (``max_tokens_per_microbatch``): the packing, and the same update as
fixed-count micro-batches and as one whole batch, for every loss and length normalisation (one rank here;
two ranks in tests/test_distributed.py)."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from test_grpo import PROBLEMS, TEMPLATE, parity_reward, small_config
from test_grpo_options import VariedLengthEngine
from test_sft import make_model, short_examples

from a5core import distributed
from a5core.expert_iteration import EIConfig
from a5core.grpo import grpo
from a5core.sft import SFTConfig, train_sft

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


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
    assert EIConfig(max_tokens_per_microbatch=512).round_sft(0).max_tokens_per_microbatch == 512
    assert EIConfig().round_sft(1).max_tokens_per_microbatch is None


# ------------------------------------------------------------------------------------------ out of memory


def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.16 GiB.")


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (dict(max_tokens_per_microbatch=128), "max_tokens_per_microbatch 128: lower it"),
        (dict(), "microbatch_size 2: lower it"),
    ],
)
def test_sft_out_of_memory_names_the_step_the_micro_batch_and_the_setting(tokenizer, monkeypatch, options, names):
    monkeypatch.setattr("a5core.sft.get_response_log_probs", out_of_memory)
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
        (dict(max_tokens_per_microbatch=1024), "GRPO step 1, training", "max_tokens_per_microbatch 1,024: lower it"),
        (
            dict(loss_type="grpo_clip", epochs_per_rollout_batch=2),
            "GRPO step 1, log-probs pass",
            "gradient_accumulation_steps 4: raise it",
        ),
    ],
)
def test_grpo_out_of_memory_names_the_pass_and_the_setting(tokenizer, monkeypatch, options, where, names):
    monkeypatch.setattr("a5core.grpo.get_response_log_probs", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        run_grpo(tokenizer, gradient_accumulation_steps=4, **options)
    message = str(caught.value)
    assert message.startswith(f"{where}: out of GPU memory in a micro-batch of "), message
    assert re.search(r"of \d+ sequences × \d+ positions;", message), message
    assert names in message
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
