"""The library reads each setting where it is declared (``config.optimizer.learning_rate``, ``config.loss_type``),
never through a model's answer to a flat name (``config.learning_rate``), which is there for users and the flows
(a5core/runtime/settings.py's docstring). Tiny GRPO (several options on), SFT and Expert Iteration runs, every flat
read recorded with the line that made it: none may come from a5core's own code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tiny_loops import (
    PROBLEMS,
    TEMPLATE,
    TRAIN,
    RecordingEngine,
    make_model,
    parity_reward,
    short_examples,
    small_config,
)

import a5core
from a5core.engines.hf import HFEngine
from a5core.loops.expert_iteration import EIConfig, expert_iteration
from a5core.loops.grpo import grpo
from a5core.loops.sft import SFTConfig, train_sft
from a5core.runtime.settings import Settings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIBRARY = Path(a5core.__file__).parent
FORWARDING = Path(sys.modules[Settings.__module__].__file__)


@pytest.fixture
def flat_reads(monkeypatch):
    """The flat reads made from a5core's code (the forwarding itself, which reads group by group, aside)."""
    reads: list[str] = []
    forward = Settings.__getattr__

    def recording(self, name):
        kind = type(self)
        caller = sys._getframe(1)
        where = Path(caller.f_code.co_filename)
        forwarded = name in kind.member_groups or kind.leaf_groups.get(name) is not None
        if forwarded and where.is_relative_to(LIBRARY) and where != FORWARDING:
            reads.append(f"{where.relative_to(LIBRARY.parent)}:{caller.f_lineno} {kind.__name__}.{name}")
        return forward(self, name)

    monkeypatch.setattr(Settings, "__getattr__", recording)
    return reads


def test_the_forwarding_is_what_the_recorder_sees(flat_reads):
    """The recorder counts a flat read: one made here from a5core's code (a frame whose file is a5core's)."""
    config = small_config()
    code = compile("config.learning_rate", str(LIBRARY / "loops" / "reader.py"), "eval")
    assert eval(code, {"config": config}) == config.optimizer.learning_rate
    assert flat_reads == ["a5core/loops/reader.py:1 GRPOConfig.learning_rate"]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {
            "loss_type": "grpo_clip",
            "epochs_per_rollout_batch": 2,
            "train_batch_size": 4,
            "gradient_accumulation_steps": 2,
        },
        {"kl_coef": 0.01, "dynamic_sampling": True, "length_normalization": "masked_normalize", "lora_rank": 4},
        {"loss_type": "gspo", "epochs_per_rollout_batch": 2, "train_batch_size": 4, "gradient_accumulation_steps": 2},
    ],
    ids=["reinforce", "grpo_clip", "kl_dynamic_lora", "gspo"],
)
def test_grpo_reads_its_settings_through_their_groups(tokenizer, tmp_path, flat_reads, options):
    model = make_model(tokenizer)
    config = small_config(n_grpo_steps=2, eval_every=1, **options)
    grpo(
        model,
        tokenizer,
        RecordingEngine(model, tokenizer),
        PROBLEMS,
        TEMPLATE,
        parity_reward,
        config,
        checkpoint_dir=tmp_path / "ckpt",
        evaluate=lambda model, step: {"val_accuracy": 0.0},
    )
    assert flat_reads == []


def test_sft_and_expert_iteration_read_their_settings_through_their_groups(tokenizer, tmp_path, flat_reads):
    model = make_model(tokenizer)
    sft = SFTConfig(learning_rate=1e-3, batch_size=4, microbatch_size=2, epochs=1, eval_every=1)
    train_sft(
        model,
        tokenizer,
        short_examples(8),
        sft,
        evaluate=lambda model, step: {"val_accuracy": 0.0},
        checkpoint_dir=tmp_path / "sft",
    )
    ei = EIConfig(
        n_ei_steps=1,
        questions_per_step=4,
        rollouts_per_question=2,
        max_tokens=8,
        batch_size=2,
        microbatch_size=2,
        epochs=1,
        entropy_sample=2,
    )
    expert_iteration(
        model,
        tokenizer,
        HFEngine(model, tokenizer),
        TRAIN[:4],
        TEMPLATE,
        parity_reward,
        ei,
        checkpoint_dir=tmp_path / "ei",
    )
    assert flat_reads == []
