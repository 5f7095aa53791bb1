"""A reader follows a GRPO run from the command line to ``optimizer.step`` in few files and frames.

The path is traced, not listed: a global optimizer hook records the project's frames on the stack at the first
step of a real run through ``python -m flows.grpo``'s ``main`` (a tiny model on CPU). docs/layout.md walks the
same path; this test keeps it short.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import yaml
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flows.grpo import main

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tuple(str(ROOT / package) + "/" for package in ("flows", "tasks", "a5core"))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def project_frames() -> list[tuple[str, str]]:
    """(file relative to the project, function) of each project frame on the stack, outermost first."""
    return [
        (str(Path(frame.filename).relative_to(ROOT)), frame.name)
        for frame in traceback.extract_stack()
        if frame.filename.startswith(PROJECT)
    ]


def test_the_command_line_reaches_optimizer_step_in_four_files_and_six_frames(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch
):
    settings = dict(
        model=str(tiny_lm_dir),
        backend="hf",
        train_data="arithmetic:30:1",
        validation_data="arithmetic:6:1",
        val_subset=2,
        val_limit=2,
        n_grpo_steps=1,
        rollout_batch_size=4,
        group_size=2,
        train_batch_size=4,
        gradient_accumulation_steps=2,
        max_tokens=8,
        min_tokens=1,
        output_dir=str(tmp_path / "out"),
        metrics_path=str(tmp_path / "metrics.json"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    config = tmp_path / "params.yaml"
    config.write_text(yaml.safe_dump({"grpo": settings}))
    paths: list[list[tuple[str, str]]] = []
    handle = register_optimizer_step_pre_hook(lambda *_: paths.append(project_frames()))
    try:
        main(["--config", str(config)])
    finally:
        handle.remove()

    assert paths, "the run took no optimizer step"
    path = paths[0]
    shown = " → ".join(f"{file}:{name}" for file, name in path)
    assert path[0] == ("flows/cli.py", "main"), shown
    assert path[1] == ("flows/grpo.py", "grpo_flow"), shown
    assert len({file for file, _ in path}) <= 4, shown
    assert len(path) <= 6, shown
