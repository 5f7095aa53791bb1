"""A GRPO step's graded rollouts (a5core.loops.grpo.batch): each draw's rewards and advantages, the batch a step
trains on (uniform groups dropped where asked), and a micro-batch's tensors."""

from __future__ import annotations

import pytest
import torch
from tiny_loops import PROBLEMS, TEMPLATE, small_config

from a5core.engines import Completion
from a5core.loops.grpo.batch import MicroBatch, RolloutBatch, assemble, grade


def by_text(response: str, ground_truth: str) -> dict[str, float]:
    """Reward 1 for a response reading "right", formatted when it ends in "."."""
    right = float(response.startswith("right"))
    return {"reward": right, "format_reward": float(response.endswith(".")), "answer_reward": right}


def completion(text: str, length: int, cut: bool = False) -> Completion:
    return Completion(text, tuple(range(10, 10 + length)), "length" if cut else "stop", tuple([-0.5] * length))


class CharTokenizer:
    """One token a character (its code point): what the batch tokenises prompts with."""

    pad_token_id, eos_token_id = 0, 0

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        assert not add_special_tokens  # as the engines tokenise
        return {"input_ids": [[ord(c) for c in text] for text in texts]}


# Two questions, four rollouts each: the first group's rewards differ, the second's are all 0.
DRAW = [completion(t, n) for t, n in [("right.", 3), ("wrong.", 2), ("right", 4), ("wrong", 1)]] + [
    completion("wrong.", 2, cut=True) for _ in range(4)
]


def test_a_draw_is_graded_and_each_reward_normalised_within_its_group():
    config = small_config()
    draw = grade(config, PROBLEMS[:2], DRAW, by_text)
    assert draw.raw_rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std().item()
    expected = [0.5 / (std + config.advantage_eps), -0.5 / (std + config.advantage_eps)] * 2 + [0.0] * 4
    assert draw.advantages.tolist() == pytest.approx(expected)
    assert draw.correct.tolist() == [True, False, True, False, False, False, False, False]
    assert draw.lengths.tolist() == [3, 2, 4, 1, 2, 2, 2, 2] and draw.varied == [True, False]
    assert draw.metrics["format_reward_mean"] == 6 / 8 and draw.metrics["frac_groups_all_equal"] == 0.5


def test_the_overlong_penalty_shapes_the_rewards_but_not_what_is_correct():
    """max_tokens 12, a buffer of 8: responses of at most 4 tokens lose nothing, one of 12 its whole reward."""
    config = small_config(overlong_buffer=8)
    long = [completion("right.", 12)] + DRAW[1:]
    draw = grade(config, PROBLEMS[:2], long, by_text)
    assert draw.raw_rewards[0].item() == 0.0 and draw.correct[0].item()  # 1 − 1: shaped, still correct
    assert draw.metrics["overlong_penalty_mean"] == pytest.approx(-1 / 8)


def test_the_batch_keeps_the_groups_whose_rewards_differ_when_asked():
    draw = grade(small_config(), PROBLEMS[:2], DRAW, by_text)
    batch, metrics = assemble(small_config(), [draw], CharTokenizer(), TEMPLATE)
    assert len(batch) == 8 and "dropped_groups" not in metrics
    assert batch.truncated.tolist() == [False] * 4 + [True] * 4
    assert metrics["truncated_fraction"] == 0.5 and metrics["response_tokens_correct"] == 3.5
    dropping = small_config(drop_uniform_groups=True)
    kept, metrics = assemble(dropping, [grade(dropping, PROBLEMS[:2], DRAW, by_text)], CharTokenizer(), TEMPLATE)
    assert len(kept) == 4 and metrics["dropped_groups"] == 1.0
    assert kept.prompt_ids[0] == [ord(c) for c in TEMPLATE.format(PROBLEMS[0].problem)]
    assert kept.response_ids == [list(c.token_ids) for c in DRAW[:4]]
    assert [values.tolist() for values in kept.engine_log_probs] == [list(c.log_probs) for c in DRAW[:4]]


def test_a_micro_batch_holds_each_rollouts_tokens_rewards_and_log_probs_in_place():
    batch = RolloutBatch(
        prompt_ids=[[1, 2], [3]],
        response_ids=[[4, 5, 6], [7]],
        raw_rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.5, -0.5]),
        correct=torch.tensor([True, False]),
        truncated=torch.tensor([False, True]),
        engine_log_probs=[torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-4.0])],
    )
    assert batch.lengths == [4, 1]
    mb = batch.select([1, 0]).tensors(pad_id=0, device=torch.device("cpu"), pad_to_multiple=8)
    assert isinstance(mb, MicroBatch) and mb.input_ids.shape == mb.labels.shape == mb.response_mask.shape == (2, 8)
    assert mb.input_ids[1, :4].tolist() == [1, 2, 4, 5] and mb.labels[1, :5].tolist() == [2, 4, 5, 6, 0]
    assert mb.response_mask.tolist()[1][:4] == [False, True, True, True]
    assert mb.engine_log_probs[1, 1:4].tolist() == [-1.0, -2.0, -3.0] and mb.engine_log_probs[0, 0].item() == -4.0
    assert mb.engine_log_probs[~mb.response_mask].abs().sum() == 0
    assert mb.advantages.tolist() == [[-0.5], [0.5]] and mb.truncated.tolist() == [[True], [False]]
    assert mb.old_log_probs is None and mb.ref_log_probs is None  # not computed: no option needs them
