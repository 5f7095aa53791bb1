"""`dvc plots show` as dvc.yaml and .dvc/ define it: a plot for every stage with a curve, titles and axis labels
that say what is plotted, one line per setting, and a page that carries its chart library (no network needed).
The browser test (tests/system/test_browser.py) opens such a page with the network off."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DVC = str(Path(sys.executable).parent / "dvc")
CURVES = "setting,step,wall_seconds,val_accuracy\n8,0,1.0,0.1\n8,2,4.0,0.5\nfull,0,1.0,0.1\nfull,2,9.0,0.7\n"
TRENDS = "setting,step,reward_mean,token_entropy,response_tokens_mean\nsingle,1,0.2,1.5,30\nsingle,2,0.3,1.2,28\n"


def plotted_project(folder: Path) -> Path:
    """A project folder holding dvc.yaml, .dvc/ (config and plot templates) and the files the stages' plots read."""
    folder.mkdir()
    shutil.copytree(ROOT / ".dvc", folder / ".dvc", ignore=shutil.ignore_patterns("cache", "tmp", "config.local"))
    shutil.copy(ROOT / "dvc.yaml", folder)
    shutil.copy(ROOT / "params.yaml", folder)
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    for stage in ("sft_experiment", "expert_iteration", "grpo"):
        (folder / "outputs" / stage).mkdir(parents=True)
        (folder / "outputs" / stage / "curves.csv").write_text(CURVES)
    (folder / "outputs/grpo/train_curves.csv").write_text(TRENDS)
    from tasks.plots import plot_histogram

    histogram = folder / "outputs/difficulty/pass_rate_histogram.png"
    plot_histogram(histogram, [0.0, 0.5, 1.0], [0, 0.5, 1], "pass rate", "pass rates")
    return folder


def show_plots(project: Path, out: Path) -> str:
    done = subprocess.run([DVC, "plots", "show", "-o", str(out)], cwd=project, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "failed to load" not in done.stdout + done.stderr  # every plot's file was found
    return (out / "index.html").read_text()


def specs(page: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"var spec = (\{.*?\});\n", page, flags=re.S)]


def test_every_stage_with_a_curve_has_a_titled_labelled_plot_on_a_page_that_needs_no_network(tmp_path):
    page = show_plots(plotted_project(tmp_path / "project"), tmp_path / "plots")

    # The chart library is in the page: no script is loaded from anywhere.
    assert not re.search(r"<script[^>]+src=", page)
    assert "vegaEmbed" in page and "vega-lite 5.2.0" in page
    charts = {s["title"]["text"]: s for s in specs(page)}
    assert set(charts) == {
        "SFT: validation accuracy by optimizer step, one line per training set",
        "Expert Iteration: validation accuracy after each round",
        "GRPO: validation accuracy by step",
        "GRPO: validation accuracy by wall-clock time",
        "GRPO: mean reward of each step's rollouts",
        "GRPO: mean token entropy of the rollouts",
        "GRPO: mean response length",
    }
    for title, spec in charts.items():
        axes = spec["encoding"]
        assert axes["x"]["title"] and axes["y"]["title"] not in ("0", "val_accuracy", ""), title
        assert axes["color"]["field"] == "setting"  # a sweep's settings are lines of their own
        assert {row["setting"] for row in spec["data"]["values"]} <= {"8", "full", "single"}
    assert charts["GRPO: validation accuracy by step"]["encoding"]["y"]["title"] == "validation accuracy"
    assert charts["GRPO: validation accuracy by step"]["encoding"]["y"]["scale"]["domain"] == [0, 1]
    # The difficulty stage's histogram is an image, copied beside the page.
    assert '<img src="static/workspace_outputs_difficulty_pass_rate_histogram.png">' in page
    assert (tmp_path / "plots/static/workspace_outputs_difficulty_pass_rate_histogram.png").stat().st_size > 1000


def test_dvc_plots_output_is_ignored_by_git():
    ignored = subprocess.run(["git", "check-ignore", "-q", "dvc_plots/index.html"], cwd=ROOT)
    assert ignored.returncode == 0
