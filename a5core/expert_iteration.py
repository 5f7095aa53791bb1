"""Expert Iteration (CS336 A5 §4): sample, keep what the verifier accepts, fine-tune on it, repeat.

Each of ``n_ei_steps`` rounds:

1. sample ``questions_per_step`` (D_b) questions from the training problems (seeded per round);
2. push the policy's weights into the engine and draw ``rollouts_per_question`` (G) responses per
   question (temperature 1.0, min_tokens 4, max_tokens 1024, stop ``</answer>`` by default);
3. grade them and keep the correct ones — the round's SFT set (saved, so a resumed round trains on
   exactly the same data);
4. run the SFT loop on the kept traces for ``sft.epochs`` epochs (its own checkpoints);
5. call ``evaluate(model, round + 1)`` and log the round: kept fraction, rollout reward and format rate,
   mean response entropy and lengths, plus whatever evaluate returned.

Resuming: the round's kept set and the SFT checkpoint inside it make a killed run restart exactly where
it stopped; a finished round is recorded in ``state.json`` and not run again. Metrics leave through the
``log(metrics, step)`` callback; step k is "after k rounds": round r (from 0) logs at step r + 1 (its inner
SFT steps too, as ``sft/*``), and a run that starts fresh first evaluates the starting policy, logged at
step 0 (the "before" of the run, as the SFT and GRPO loops do).

Several ranks (torchrun; the caller has called :func:`a5core.distributed.init_from_env` before loading
the model, and gives each rank its own engine): each rank pushes the whole weights
(:func:`a5core.distributed.full_weights`) into its engine and samples its block of the round's
questions; the graded rollouts are gathered, so every rank keeps the same traces, and the SFT loop
trains on them with FSDP2 (the model is sharded in place from the first round on). Rank 0 alone calls
``log`` and writes the round files, ``model.pt`` (whole tensors, gathered) and ``state.json``; every
rank calls ``evaluate``. One process: ``distributed`` reduces to the plain loop.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from a5core import distributed, progress
from a5core.data import Problem, Trace, load_sft_traces, write_jsonl_atomic, write_text_atomic
from a5core.evaluation import grade_completions, response_entropies
from a5core.prompts import PromptTemplate
from a5core.rollout import Engine, SamplingSettings
from a5core.sft import SFTConfig, train_sft

logger = logging.getLogger(__name__)
STATUS_KEYS = ("kept_fraction", "rollout_format_rate", "sft_loss", "val_accuracy")  # the per-round status line's metrics


@dataclass(frozen=True)
class EIConfig:
    """Expert Iteration settings; names follow the handout (D_b, G, E)."""

    n_ei_steps: int = 5
    questions_per_step: int = 512  # D_b
    rollouts_per_question: int = 8  # G
    sampling: SamplingSettings = field(
        default_factory=lambda: SamplingSettings(temperature=1.0, min_tokens=4, max_tokens=1024, stop=("</answer>",))
    )
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(epochs=1))  # E = sft.epochs
    entropy_sample: int = 64  # responses whose mean token entropy is measured each round
    seed: int = 0
    checkpoint_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("n_ei_steps", "questions_per_step", "rollouts_per_question"):
            if getattr(self, name) < 1:
                raise ValueError(f"EIConfig.{name} must be ≥ 1, got {getattr(self, name)}")


def expert_iteration(
    model: torch.nn.Module,
    tokenizer: Any,
    engine: Engine,
    problems: Sequence[Problem],
    template: PromptTemplate,
    reward_fn: Callable[[str, Any], dict[str, float]],
    config: EIConfig,
    *,
    evaluate: Callable[[torch.nn.Module, int], dict[str, float]] | None = None,
    log: Callable[[dict[str, float], int], None] = lambda metrics, step: None,
) -> list[dict[str, float]]:
    """Run (or resume) Expert Iteration; returns each round's metrics (on every rank)."""
    rank = distributed.rank_and_world()[0]
    root = Path(config.checkpoint_dir) if config.checkpoint_dir else None
    state = json.loads((root / "state.json").read_text()) if root and (root / "state.json").is_file() else {"rounds": []}
    if state["rounds"]:
        _load_weights(model, root / "model.pt")
    history: list[dict[str, float]] = state["rounds"]
    if history:
        logger.info("EI: resuming from %s after round %d of %d", root, len(history), config.n_ei_steps)
    if not history and evaluate is not None:
        start = evaluate(model, 0)  # the starting policy: step 0 of the curves
        if rank == 0:
            log(start, 0)
    rounds_bar = progress.bar(desc="EI", total=config.n_ei_steps, initial=len(history), unit="round", leave=True)
    for step in range(len(history), config.n_ei_steps):
        round_dir = root / f"round-{step}" if root else None
        kept_path = round_dir / "kept.jsonl" if round_dir else None
        if kept_path is not None and kept_path.is_file():
            kept = load_sft_traces(kept_path) if kept_path.stat().st_size else []
            metrics = json.loads((round_dir / "rollouts.json").read_text())
        else:
            kept, metrics = _rollout_round(model, tokenizer, engine, problems, template, reward_fn, config, step)
            if round_dir is not None and rank == 0:
                write_jsonl_atomic(kept_path, [asdict(t) for t in kept])
                write_text_atomic(round_dir / "rollouts.json", json.dumps(metrics))
        if kept:
            sft_config = replace(config.sft, seed=config.seed + step,
                                 checkpoint_dir=str(round_dir / "sft") if round_dir else None)
            final = train_sft(model, tokenizer, kept, sft_config,
                              log=lambda m, s, step=step: log({f"sft/{k}": v for k, v in m.items()}, step + 1))
            metrics["sft_loss"] = final.get("loss", float("nan"))
        if evaluate is not None:
            metrics.update(evaluate(model, step + 1))
        history.append(metrics)
        if rank == 0:
            log(metrics, step + 1)
            progress.log_step(logger, "EI round", step + 1, config.n_ei_steps, metrics, STATUS_KEYS)
        rounds_bar.update(1)
        if root is not None:
            _save_round(model, root, history)
    rounds_bar.close()
    return history


def _load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load the whole weights saved at ``path`` into ``model``, sharded (each rank keeps its shards) or not.
    Tensors only (``weights_only=True``, said explicitly): a tampered file cannot run code when unpickled."""
    distributed.load_whole_state_dict(model, torch.load(path, map_location="cpu", weights_only=True))


def _save_round(model: torch.nn.Module, root: Path, history: list[dict[str, float]]) -> None:
    """``model.pt`` (the whole weights) and ``state.json`` after a round (every rank calls it; rank 0 writes)."""

    def write(state: dict[str, torch.Tensor]) -> None:
        torch.save({name: tensor.cpu() for name, tensor in state.items()}, root / "model.pt.tmp")
        (root / "model.pt.tmp").replace(root / "model.pt")
        write_text_atomic(root / "state.json", json.dumps({"rounds": history}))

    distributed.write_whole(model, write)


def _rollout_round(
    model: torch.nn.Module,
    tokenizer: Any,
    engine: Engine,
    problems: Sequence[Problem],
    template: PromptTemplate,
    reward_fn: Callable[[str, Any], dict[str, float]],
    config: EIConfig,
    step: int,
) -> tuple[list[Trace], dict[str, float]]:
    """Sample D_b questions, G rollouts each, grade; return the correct ones as traces and round stats.
    Under several ranks each samples and grades its block of the questions; all get every record."""
    rng = random.Random(config.seed * 1_000_003 + step)
    questions = rng.sample(list(problems), min(config.questions_per_step, len(problems)))
    rank, world = distributed.rank_and_world()
    mine = questions[distributed.rank_slice(len(questions))]
    prompts = [template.format(p.problem) for p in mine]
    engine.load_weights(distributed.full_weights(model))
    sampling = replace(config.sampling, n=config.rollouts_per_question, seed=(config.seed + step) * world + rank)
    graded = grade_completions(mine, prompts, engine.generate(prompts, sampling), reward_fn) if mine else []
    records = distributed.gather_lists(graded)  # question order
    kept = [Trace(r["prompt"], r["response"], r["ground_truth"]) for r in records if r["reward"] == 1.0]
    sample = rng.sample(records, min(config.entropy_sample, len(records)))
    entropies = [e for e in response_entropies(model, tokenizer, [r["prompt"] for r in sample], [r["response"] for r in sample]) if e == e]
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
    return kept, metrics
