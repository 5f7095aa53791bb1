"""benchmarks/sft_step.py: SFT steps through the loop under the named modes, one table row each (CPU, tiny)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import sft_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_mode_gets_a_row_of_figures(shared_data, capsys):
    modes = ["shipped", "defaults", "best"]
    argv = ["--tiny", "--model-dir", str(shared_data / "qwen2.5-math-1.5b"), "--modes", *modes, "--steps", "2"]
    sft_step.main([*argv, "--batch", "4", "--tokens", "64"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header, rows = table[0].strip("| ").split(" | "), [line.strip("| ").split(" | ") for line in table[1:]]
    assert [row[0] for row in rows] == modes
    by_mode = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    for row in by_mode.values():
        assert row["steps"] == "2 of 2" and row["lengths"] == "fixed"
        for column in ("first step s", "warm median s", "warm max s", "tokens/s"):
            assert float(row[column].replace(",", "")) > 0
    assert by_mode["shipped"]["training layers"] == "eager decoder layers"
    assert by_mode["shipped"]["micro-batches"] == "2 sequences"
    # The CPU: auto is eager layers and micro-batches by count; the best hand-set compiles and cuts by budget.
    assert by_mode["defaults"]["training layers"] == "compile_layers auto: eager decoder layers"
    assert by_mode["defaults"]["micro-batches"] == "auto: by count (CPU)"
    assert by_mode["best"]["training layers"] == "compiled decoder layers"
    assert by_mode["best"]["micro-batches"] == "budget 32,768"
    assert by_mode["best"]["graphs compiled: first step → last"] != "0 → 0"
