"""A GRPO step's micro-batches on this rank (a5core.loops.grpo.microbatches): by count or by token budget, the
stand-in an empty share runs at advantage 0, the shapes seen, and the out-of-memory error that names them."""

from __future__ import annotations

import types

import pytest
import torch

from a5core.loops.grpo.batch import RolloutBatch
from a5core.loops.grpo.microbatches import MicroBatches
from a5core.runtime.out_of_memory import MicrobatchOutOfMemoryError
from a5core.runtime.token_budget import TokenBudget

CPU = torch.device("cpu")
TOKENIZER = types.SimpleNamespace(pad_token_id=0, eos_token_id=1)


def rollouts(lengths: list[int]) -> RolloutBatch:
    """Rollouts of a 2-token prompt and responses of ``lengths`` tokens, rewards 1 and advantages 0.5."""
    n = len(lengths)
    return RolloutBatch(
        prompt_ids=[[5, 6]] * n,
        response_ids=[[7] * length for length in lengths],
        raw_rewards=torch.ones(n),
        advantages=torch.full((n,), 0.5),
        correct=torch.ones(n, dtype=torch.bool),
        truncated=torch.zeros(n, dtype=torch.bool),
    )


def test_by_count_each_micro_batch_holds_size_rollouts_padded_to_its_longest():
    batch = rollouts([3, 1, 8, 2, 5])
    microbatches = MicroBatches(2, TokenBudget(None, CPU), "gradient_accumulation_steps 4: raise it", TOKENIZER, CPU)
    assert microbatches.split(batch, [4, 0, 2, 1, 3]) == [[4, 0], [2, 1], [3]]
    mb = microbatches.tensors(batch, [2, 1], [0])
    assert mb.input_ids.shape == (2, 9) and mb.advantages.tolist() == [[0.5], [0.5]]
    microbatches.tensors(batch, [3], [0])
    assert microbatches.shapes == {(2, 9), (1, 3)} and microbatches.last_shape == (1, 3)


def test_by_budget_micro_batches_fill_the_budget_and_pad_to_few_shapes():
    """A budget of 128 padded tokens: rollouts padded to 64 positions, two a micro-batch, longest first."""
    batch = rollouts([3, 1, 8, 2, 5])
    microbatches = MicroBatches(2, TokenBudget(128, CPU), "advice", TOKENIZER, CPU)
    assert microbatches.split(batch, range(5)) == [[2, 4], [0, 3], [1]]
    assert microbatches.tensors(batch, [2, 4], [0]).input_ids.shape == (2, 64)


def test_an_empty_share_runs_its_stand_in_at_advantage_and_reward_0():
    batch = rollouts([3, 1])
    mb = MicroBatches(2, TokenBudget(None, CPU), "advice", TOKENIZER, CPU).tensors(batch, [], [1])
    assert mb.input_ids.shape == (1, 2) and (mb.advantages == 0).all() and (mb.raw_rewards == 0).all()


def test_running_out_of_memory_names_the_pass_the_micro_batch_and_the_setting():
    batch = rollouts([3, 1, 8])
    microbatches = MicroBatches(2, TokenBudget(None, CPU), "gradient_accumulation_steps 4: raise it", TOKENIZER, CPU)
    with pytest.raises(MicrobatchOutOfMemoryError) as caught:
        with microbatches.naming("GRPO step 3, training"):
            microbatches.tensors(batch, [0, 2], [0])
            raise torch.OutOfMemoryError("CUDA out of memory")
    message = str(caught.value)
    assert message.startswith("GRPO step 3, training: out of GPU memory in a micro-batch of 2 sequences × 9 positions")
    assert "gradient_accumulation_steps 4: raise it" in message
