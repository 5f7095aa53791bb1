"""Expert Iteration (CS336 A5 §4): sample, keep what the verifier accepts, fine-tune on it, repeat.

Each of ``n_ei_steps`` rounds:

1. sample ``questions_per_step`` (D_b) questions from the training problems (seeded per round);
2. push the policy's weights into the engine and draw ``rollouts_per_question`` (G) responses per
   question (temperature 1.0, min_tokens 4, max_tokens 1024, stop ``</answer>`` by default);
3. grade them and keep the correct ones — the round's SFT set (saved, so a resumed round trains on
   exactly the same data);
4. run the SFT loop on the kept traces for ``sft.epochs`` epochs (its own checkpoints; under a template that
   stops at EOS, each response followed by EOS);
5. call ``evaluate(model, round + 1)`` and log the round: kept fraction, rollout reward and format rate,
   mean response entropy and lengths, plus whatever evaluate returned.

Resuming: the round's kept set and the SFT checkpoint inside it make a killed run restart exactly where
it stopped; a finished round is recorded in ``state.json`` (its weights in ``model.pt``) and not run again,
so its SFT checkpoint (the weights and optimizer state again) is removed then: disk holds one round's, not
one per round. The rounds' kept sets and rollout records stay. Metrics leave through the
``log(metrics, step)`` callback; step k is "after k rounds": round r (from 0) logs at step r + 1 (its inner
SFT steps too, as ``sft/*``), and a run that starts fresh first evaluates the starting policy, logged at
step 0 (the "before" of the run, as the SFT and GRPO loops do).

Several ranks (torchrun; the caller has called :func:`a5core.runtime.distributed.init_from_env` before loading
the model, and gives each rank its own engine): each rank pushes the whole weights
(:func:`a5core.engines.full_weights`) into its engine and samples its block of the round's
questions; the graded rollouts are gathered, so every rank keeps the same traces, and the SFT loop
trains on them with FSDP2 (the model is sharded in place from the first round on). Rank 0 alone calls
``log`` and writes the round files, ``model.pt`` (whole tensors, gathered) and ``state.json``; every
rank calls ``evaluate``. One process: ``distributed`` reduces to the plain loop.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from a5core.data.files import Problem, Trace, load_sft_traces
from a5core.data.prompts import PromptTemplate
from a5core.engines import Engine, full_weights
from a5core.engines.engine import RolloutSamplingFields
from a5core.evaluation.generations import response_entropies
from a5core.evaluation.records import grade_completions
from a5core.loops.question_sampling import QuestionSampler, QuestionSamplingSettings
from a5core.loops.settings import OptimizerSettings, SeedSettings, SFTBatchSettings
from a5core.loops.sft import SFTConfig, train_sft
from a5core.policy.lora import LoRASettings, add_adapters
from a5core.runtime import distributed, progress
from a5core.runtime.checkpoint import load_tensors, read_state
from a5core.runtime.settings import Settings, SpeedSettings, group, inherited
from a5core.runtime.writing import write_jsonl_atomic, write_text_atomic

logger = logging.getLogger(__name__)
STATUS_KEYS = (
    "kept_fraction",
    "rollout_format_rate",
    "sft_loss",
    "val_accuracy",
)  # the per-round status line's metrics


class EIOptimizer(OptimizerSettings):
    learning_rate: float = inherited(1e-5)


class EIBatch(SFTBatchSettings):
    epochs: int = inherited(1)
    max_seq_len: int = inherited(1536)


class EIConfig(Settings):
    """Expert Iteration settings; names follow the handout: D_b (``questions_per_step``), G
    (``rollouts_per_question``), E (``epochs``, of each round's SFT). Each round fine-tunes with the
    optimizer, batch and speed settings here (:meth:`round_sft`)."""

    n_ei_steps: int = Field(5, ge=1, description="EI rounds")
    questions_per_step: int = Field(512, ge=1, description="D_b: questions sampled per round")
    rollouts_per_question: int = Field(8, ge=1, description="G: rollouts per question")
    entropy_sample: int = Field(64, ge=0, description="rollouts whose mean token entropy is measured each round")

    optimizer: EIOptimizer = group(EIOptimizer, "AdamW and gradient clipping of each round's SFT")
    sampling: RolloutSamplingFields = group(RolloutSamplingFields, "how rollouts are sampled")
    questions: QuestionSamplingSettings = group(QuestionSamplingSettings, "which questions a round draws")
    batch: EIBatch = group(EIBatch, "what one optimizer step of a round's SFT takes")
    lora: LoRASettings = group(LoRASettings, "LoRA adapters (rank 0: full fine-tuning)")
    speed: SpeedSettings = group(SpeedSettings, "how a step runs: memory against speed")
    seeding: SeedSettings = group(SeedSettings, "the run's seed")

    def round_sft(self, round_: int, template: PromptTemplate) -> SFTConfig:
        """Round ``round_``'s SFT settings: this config's optimizer, batch and speed settings, E epochs at a
        constant learning rate, seeded per round, one checkpoint at its end. A template whose responses end at
        EOS (no stop string: question_only) trains each kept response followed by EOS, which the rollout's text
        lacks: without it the model would never learn where to stop."""
        return SFTConfig(
            **{
                **self.values_of(SFTConfig),
                "lr_schedule": "constant",
                "seed": self.seeding.seed + round_,
                "eval_every": 0,
                "checkpoint_every": 0,
                "append_eos": not template.stop,
            }
        )


def check_round_size(config: EIConfig, problems: int) -> None:
    """ValueError unless a round's ``questions_per_step`` distinct questions can be drawn from ``problems``: a
    smaller round would run under the asked D_b, which the run records."""
    if config.questions_per_step > problems:
        raise ValueError(
            f"questions_per_step {config.questions_per_step}: more than the {problems} training problems a round "
            "draws its distinct questions from; give at most that many, or more problems"
        )


def expert_iteration(
    model: torch.nn.Module,
    tokenizer: Any,
    engine: Engine,
    problems: Sequence[Problem],
    template: PromptTemplate,
    reward_fn: Callable[[str, Any], dict[str, float]],
    config: EIConfig,
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    evaluate: Callable[[torch.nn.Module, int], dict[str, float]] | None = None,
    log: Callable[[dict[str, float], int], None] = lambda metrics, step: None,
    pass_rates: dict[str, float] | None = None,
) -> list[dict[str, float]]:
    """Run (or resume) Expert Iteration, its state under ``checkpoint_dir`` (None: not resumable);
    returns each round's metrics (on every rank). ``pass_rates``: question id → pass rate, the table
    ``question_sampling`` starts from (:mod:`a5core.loops.question_sampling`). ValueError when a round would
    sample more questions (``questions_per_step``) than there are problems."""
    check_round_size(config, len(problems))
    rank = distributed.rank_and_world()[0]
    add_adapters(model, config.lora)  # before a resume loads model.pt (the adapters' tensors are in it)
    root = Path(checkpoint_dir) if checkpoint_dir else None
    sampler = QuestionSampler(problems, config.questions, pass_rates)
    history = _resume(model, sampler, root, config)
    rounds_bar = progress.bar(desc="EI", total=config.n_ei_steps, initial=len(history), unit="round", leave=True)
    if not history and evaluate is not None:
        start = evaluate(model, 0)  # the starting policy: step 0 of the curves
        if rank == 0:
            log(start, 0)
    by_id = {p.unique_id: p for p in problems}
    for round_ in range(len(history), config.n_ei_steps):  # rounds from 0, as their folders are numbered
        step = round_ + 1  # what the round logs as: the rounds done once it is
        round_dir = root / f"round-{round_}" if root else None
        # 1-3. Sample, grade, keep the correct rollouts (or, resumed, the round's kept set as it was saved).
        kept, metrics, outcomes = _kept_set(
            round_dir,
            functools.partial(_rollout_round, model, tokenizer, engine, sampler, template, reward_fn, config, step),
        )
        sampler.observe([by_id[uid] for uid in outcomes["questions"]], outcomes["correct"], step)
        metrics.update(sampler.metrics())
        # 4. Fine-tune on them (the SFT loop's own checkpoint inside the round resumes a killed round).
        if kept:
            final = train_sft(
                model,
                tokenizer,
                kept,
                config.round_sft(round_, template),
                checkpoint_dir=round_dir / "sft" if round_dir else None,
                log=lambda m, s, step=step: log({f"sft/{k}": v for k, v in m.items()}, step),
                release_memory=engine.release_memory,
            )
            metrics["sft_loss"] = final.get("loss", float("nan"))
        # 5. Evaluate and log the round.
        if evaluate is not None:
            metrics.update(evaluate(model, step))
        history.append(metrics)
        if rank == 0:
            log(metrics, step)
            progress.log_step(logger, "EI round", step, config.n_ei_steps, metrics, STATUS_KEYS)
        rounds_bar.update(1)
        if root is not None:
            _save_round(model, root, {"rounds": history, "sampler": sampler.state()})
            if rank == 0:  # a finished round is never trained again: its SFT state is dead weight
                shutil.rmtree(round_dir / "sft", ignore_errors=True)
    rounds_bar.close()
    return history


def _resume(model: torch.nn.Module, sampler: QuestionSampler, root: Path | None, config: EIConfig) -> list[dict]:
    """The finished rounds' metrics under ``root`` (none: a fresh run), their weights loaded into ``model``
    and the question sampler's state restored."""
    state_file = root / "state.json" if root else None
    if state_file is None or not state_file.is_file():
        return []
    state = read_state(state_file, ("rounds",), f"delete {root} to run Expert Iteration again from round 0")
    if state["rounds"]:
        _load_weights(model, root / "model.pt")
        logger.info("EI: resuming from %s after round %d of %d", root, len(state["rounds"]), config.n_ei_steps)
    if "sampler" in state:
        sampler.load_state(state["sampler"])
    return state["rounds"]


def _kept_set(
    round_dir: Path | None, roll_out: Callable[[], tuple[list[Trace], dict[str, float], dict[str, list]]]
) -> tuple[list[Trace], dict[str, float], dict[str, list]]:
    """A round's kept traces, rollout metrics and outcomes: read back from ``round_dir`` if the round saved them
    (a resumed round trains on exactly the same data), else ``roll_out()`` now and saved there."""
    kept_path = round_dir / "kept.jsonl" if round_dir else None
    if kept_path is not None and kept_path.is_file():
        kept = load_sft_traces(kept_path) if kept_path.stat().st_size else []
        rollouts = read_state(
            round_dir / "rollouts.json", ("metrics", "outcomes"), f"delete {round_dir} to roll the round out again"
        )
        return kept, rollouts["metrics"], rollouts["outcomes"]
    kept, metrics, outcomes = roll_out()
    if round_dir is not None and distributed.rank_and_world()[0] == 0:
        write_jsonl_atomic(kept_path, [asdict(t) for t in kept])
        write_text_atomic(round_dir / "rollouts.json", json.dumps({"metrics": metrics, "outcomes": outcomes}))
    return kept, metrics, outcomes


def _load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load the whole weights saved at ``path`` into ``model``, sharded (each rank keeps its shards) or not.
    Tensors only (``weights_only=True``, said explicitly): a tampered file cannot run code when unpickled."""
    recovery = f"delete {path.parent} to run Expert Iteration again from round 0"
    distributed.load_whole_state_dict(model, load_tensors(path, recovery, "cpu"))


def _save_round(model: torch.nn.Module, root: Path, run_state: dict[str, Any]) -> None:
    """``model.pt`` (the whole weights) and ``state.json`` (``run_state``: the rounds' metrics, the question
    sampler) after a round (every rank calls it; rank 0 writes)."""

    def write(state: dict[str, torch.Tensor]) -> None:
        torch.save({name: tensor.cpu() for name, tensor in state.items()}, root / "model.pt.tmp")
        (root / "model.pt.tmp").replace(root / "model.pt")
        write_text_atomic(root / "state.json", json.dumps(run_state))

    distributed.write_whole(model, write)


def _rollout_round(
    model: torch.nn.Module,
    tokenizer: Any,
    engine: Engine,
    sampler: QuestionSampler,
    template: PromptTemplate,
    reward_fn: Callable[[str, Any], dict[str, float]],
    config: EIConfig,
    step: int,
) -> tuple[list[Trace], dict[str, float], dict[str, list]]:
    """Sample D_b questions, G rollouts each, grade; return the correct ones as traces, round stats and the
    outcomes (question ids, whether each rollout was right: for the sampler). Under several ranks each
    samples and grades its block of the questions; all get every record."""
    rng = random.Random(config.seeding.step_seed(step))
    questions = sampler.sample(rng, config.questions_per_step)
    rank, world = distributed.rank_and_world()
    mine = questions[distributed.rank_slice(len(questions))]
    prompts = [template.format(p.problem) for p in mine]
    engine.load_weights(full_weights(model))
    sampling = config.sampling.engine_settings(
        template.stop,
        n=config.rollouts_per_question,
        seed=(config.seeding.seed + step - 1) * world + rank,  # the round's seed, its SFT's: the rounds before
    )
    graded = grade_completions(mine, prompts, engine.generate(prompts, sampling), reward_fn) if mine else []
    records = distributed.gather_lists(graded)  # question order
    kept = [Trace(r["prompt"], r["response"], r["ground_truth"]) for r in records if r["reward"] == 1.0]
    sample = rng.sample(records, min(config.entropy_sample, len(records)))
    entropies = [
        e
        for e in response_entropies(model, tokenizer, [r["prompt"] for r in sample], [r["response"] for r in sample])
        if e == e
    ]
    correct = [r["response_tokens"] for r in records if r["reward"] == 1.0]
    incorrect = [r["response_tokens"] for r in records if r["reward"] != 1.0]
    metrics = {
        "rollouts": float(len(records)),
        "kept": float(len(kept)),
        "kept_fraction": len(kept) / len(records),
        "questions_solved_fraction": len({r["unique_id"] for r in records if r["reward"] == 1.0}) / len(questions),
        "rollout_format_rate": sum(r["format_reward"] for r in records) / len(records),
        "rollout_mean_response_tokens": sum(r["response_tokens"] for r in records) / len(records),
        "rollout_mean_response_tokens_correct": sum(correct) / len(correct) if correct else float("nan"),
        "rollout_mean_response_tokens_incorrect": sum(incorrect) / len(incorrect) if incorrect else float("nan"),
        "rollout_mean_token_entropy": sum(entropies) / len(entropies) if entropies else float("nan"),
    }
    outcomes = {"questions": [q.unique_id for q in questions], "correct": [float(r["reward"] == 1.0) for r in records]}
    return kept, metrics, outcomes
