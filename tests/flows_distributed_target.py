"""Training flows' command lines with rollouts that do not depend on the number of ranks, for
tests/system/test_flows_distributed.py: ``python -m torch.distributed.run --nproc-per-node N
tests/flows_distributed_target.py RUNS`` (or :func:`main` in-process), RUNS a JSON list of
``[module, flags]`` pairs (``["flows.grpo", ["--model", ...]]``) run one after the other.

Why the two patches: a real sampler draws one random stream per call, and the loops seed each rank's
call differently, so N ranks sample other rollouts than one process and their runs could not be
compared. Here the engine a flow starts (whatever ``rollout_engine`` starts: hf in the trainer's
process, or a RemoteEngine) is wrapped so that each prompt is sampled alone, seeded by the prompt and
the number of weight pushes so far: rollouts then depend only on the prompt and the weights pushed.
And the tiny test model never writes the r1_zero format, so every reward would be 0 and nothing would
train: the ``arithmetic`` reward is replaced by one that rewards an even response length.

Each rank writes how many pushes its engine received to ``OUTPUT_DIR/pushes-<rank>.json`` (the
flow's ``--output-dir``) when the flow closes the engine.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from a5core.runtime import distributed


class PromptSeeded:
    """An engine whose completions of a prompt depend only on the prompt and the pushed weights."""

    def __init__(self, engine, output_dir: Path):
        self.engine, self.output_dir, self.pushes = engine, output_dir, 0

    def load_weights(self, policy) -> None:
        self.engine.load_weights(policy)
        self.pushes += 1

    def release_memory(self) -> bool:
        return self.engine.release_memory()

    def generate(self, prompts, sampling):
        return [
            self.engine.generate([prompt], replace(sampling, seed=zlib.crc32(prompt.encode()) + 7919 * self.pushes))[0]
            for prompt in prompts
        ]

    def close(self) -> None:
        rank = distributed.rank_and_world()[0]
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / f"pushes-{rank}.json").write_text(json.dumps(self.pushes))
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()


def even_length_reward(response: str, ground_truth: str) -> dict[str, float]:
    reward = float(len(response) % 2 == 0)
    return {"reward": reward, "format_reward": reward, "answer_reward": reward}


@contextlib.contextmanager
def patched(output_dir: Path) -> Iterator[None]:
    """The two patches above (on :func:`tasks.engines.rollout_engine`, which every training flow's
    engine comes from, and on the ``arithmetic`` grader), undone on exit."""
    from a5core.grading.rewards import REWARD_FNS
    from tasks import engines

    start, reward = engines.rollout_engine, REWARD_FNS["arithmetic"]
    engines.rollout_engine = lambda *args, **kwargs: PromptSeeded(start(*args, **kwargs), output_dir)
    REWARD_FNS["arithmetic"] = even_length_reward
    try:
        yield
    finally:
        engines.rollout_engine, REWARD_FNS["arithmetic"] = start, reward


def main(runs: list[tuple[str, list[str]]]) -> None:
    """Each flow module's ``main(flags)``, patched."""
    for name, flags in runs:
        module = importlib.import_module(name)
        with patched(Path(flags[flags.index("--output-dir") + 1])):
            module.main(flags)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(json.loads(sys.argv[1]))
