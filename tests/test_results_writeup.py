"""lab/results_writeup.py: docs/results.md generated from record archives of MLflow stores.

Each test packs a tiny MLflow store (a GRPO baseline ablation: a parent run tagged ``ablation`` and children
with validation curves, finals and params, one setting with two seeds) into a ``.tar.gz`` like the record
archives under lab/records/, runs the generator's ``main`` on it and reads the page it wrote (and the lab's index
of the archives, written beside them).
"""

import importlib.util
import math
import re
import shutil
import struct
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
N = 300  # validation problems of the final evaluation
PLOTS = "grpo_baseline_ablation"  # the figures' name prefix


def _load_module():
    spec = importlib.util.spec_from_file_location("results_writeup", ROOT / "lab" / "results_writeup.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


writeup = _load_module()


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its tables made (the slow part), copied by each test."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def _child(client, experiment_id, parent_id, setting, seed, final, finish=True, extra=None):
    """A child run: a validation curve rising to ``final`` (or no finals when not ``finish``), wall seconds,
    rewards and the final evaluation on N problems; ``extra``: more params (fields newer runs log)."""
    from mlflow.entities import Metric, Param

    run = client.create_run(experiment_id, run_name=f"grpo-{setting}", tags={"mlflow.parentRunId": parent_id})
    run_id = run.info.run_id
    params = {"setting": setting, "loss_type": setting, "seed": str(seed), "learning_rate": "2e-05", "group_size": "8"}
    params |= extra or {}
    metrics = [Metric("val_accuracy", final * s / 10, 0, s) for s in (0, 5, 10)]
    metrics += [Metric("wall_seconds", 2.0 * s, 0, s) for s in range(11)]
    metrics += [Metric("reward_mean", final * s / 10, 0, s) for s in range(1, 11)]
    if finish:
        metrics += [Metric("final_val_accuracy", final, 0, 10), Metric("final_val_n_problems", N, 0, 10)]
        metrics += [Metric("final_val_format_rate", 0.9, 0, 10), Metric("final_val_mean_response_tokens", 23.0, 0, 10)]
    client.log_batch(run_id, metrics=metrics, params=[Param(k, v) for k, v in params.items()])
    if finish:
        client.set_terminated(run_id)
    return run_id


def _pack(store: Path, archive: Path, artifacts: Path | None = None) -> Path:
    """A record archive like those under lab/records/: mlflow.db, outputs/.devrun/walls.txt, and the runs'
    artifacts (``artifacts``, where any were logged) as mlruns/."""
    walls = store.parent / "walls.txt"
    walls.write_text("grpo_baseline_ablation call=3 rc=0 wall_s=269\n")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(store, arcname="mlflow.db")
        tar.add(walls, arcname="outputs/.devrun/walls.txt")
        if artifacts is not None and artifacts.is_dir():
            tar.add(artifacts, arcname="mlruns")
    return archive


def _records(tmp_path: Path, empty_store: Path, no_baseline: float, more=None) -> Path:
    """A runs folder holding one archive: no_baseline (seed 0) ends at ``no_baseline``; reinforce_with_baseline
    at 0.6 (seed 0) and 0.5 (seed 1); ``more(client, experiment_id, parent_id)`` adds children."""
    from mlflow import MlflowClient

    store = tmp_path / "store" / "mlflow.db"
    store.parent.mkdir()
    shutil.copy(empty_store, store)
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment_id = client.create_experiment("grpo", artifact_location=str(tmp_path / "mlruns" / "grpo"))
    parent = client.create_run(experiment_id, run_name="grpo_baseline_ablation")
    parent_id = parent.info.run_id
    client.set_tag(parent_id, "ablation", "grpo_baseline_ablation")
    _child(client, experiment_id, parent_id, "no_baseline", 0, no_baseline)
    _child(client, experiment_id, parent_id, "reinforce_with_baseline", 0, 0.6)
    _child(client, experiment_id, parent_id, "reinforce_with_baseline", 1, 0.5)
    if more:
        more(client, experiment_id, parent_id)
    client.set_terminated(parent_id)
    runs = tmp_path / "runs"
    runs.mkdir()
    _pack(store, runs / "records_call1.tar.gz", tmp_path / "mlruns")
    (runs / "call0_setup.log").write_text("setup\n")
    return runs


def _generate(tmp_path: Path, runs: Path) -> str:
    """Run the generator's main on ``runs`` with a context file; the page it wrote."""
    (tmp_path / "figures").mkdir(exist_ok=True)
    (tmp_path / "context.md").write_text("# Results\n\nHand-kept: how the runs were made.\n")
    out = tmp_path / "results.md"
    argv = ["--runs", str(runs), "--out", str(out), "--figures", str(tmp_path / "figures")]
    argv += ["--context", str(tmp_path / "context.md")]
    assert writeup.main(argv) == out
    return out.read_text()


def _experiment_row(text: str, key: str) -> str:
    """The row of experiment ``key`` in the table of experiments by date, from its name on; it opens with the day
    (or days) its runs started."""
    table = text.split("## Experiments by date")[1].split("\n## ")[0]
    row = next(line for line in table.splitlines() if f"| `{key}` |" in line)
    day, rest = row.split(f" | `{key}` |", 1)
    assert re.fullmatch(r"\| \d{4}-\d\d-\d\d( – \d{4}-\d\d-\d\d)?", day)
    return f"| `{key}` |{rest}"


def _index(runs: Path) -> str:
    """The index of the archives the generator wrote beside them (its default place)."""
    return (runs / "INDEX.md").read_text()


def _pm(p: float, n: int = N) -> str:
    return f"{p:.3f} ± {math.sqrt(p * (1 - p) / n):.3f}"


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def test_section_table_seeds_and_plots(tmp_path, empty_store):
    runs = _records(tmp_path, empty_store, no_baseline=0.3)
    text = _generate(tmp_path, runs)

    assert text.startswith("> Generated by `python lab/results_writeup.py`")
    # the hand-kept part (how to repeat the runs), verbatim, after the results, which open with the findings
    assert text.index("## Findings") < text.index("## `grpo_baseline_ablation`") < text.index("Hand-kept: how")
    assert "## `grpo_baseline_ablation` (MLflow experiment `grpo`)" in text
    assert "`learning_rate=2e-05`" in text and "`group_size=8`" in text  # shared settings
    row = _line(text, "| no_baseline |")
    assert f"| {_pm(0.3)} (90 / 300) |" in row
    assert f"| {_pm(0.9)} (270 / 300) |" in row  # the format rate
    assert "| 20.0 |" in row  # wall_seconds at the last step
    # Two seeds of reinforce_with_baseline: each run's row, then their mean (s.e.: the spread between the runs,
    # sd / sqrt(2) = 0.050, larger than their binomial s.e.s combined, 0.020) and spread.
    assert f"| {_pm(0.6)} (180 / 300) |" in _line(text, "| reinforce_with_baseline (seed 0,")
    assert f"| {_pm(0.5)} (150 / 300) |" in _line(text, "| reinforce_with_baseline (seed 1,")
    mean_row = _line(text, "| reinforce_with_baseline | 2 | 0, 1 |")
    assert f"| {0.55:.3f} ± {0.05:.3f} |" in mean_row and "| 0.1000 |" in mean_row
    # The curve table: the subset evaluations by step.
    assert _line(text, "| setting | 0 | 5 | 10 |")
    assert "| 0.000 | 0.150 | 0.300 |" in _line(text.split("by step")[1], "| no_baseline |")
    # The findings at the top: the expectation, the paired difference (seed 0), the runs and the verdict.
    row = _line(text, "| `grpo_baseline_ablation` | the handout expects a baseline to help |")
    assert "= +0.300 ± " in row and "(within-run only: one pair's s.e. over problems)" in row
    assert row.endswith("| 1 pair | too few runs |")
    # Keyed by date and experiment, with the flows' own command that makes it again.
    rerun = "python -m flows.grpo --config params.yaml --profile gpu-small --ablation grpo_baseline_ablation"
    assert "| `grpo_baseline_ablation` | grpo | 1 | 3 | `" + rerun + "` |" in text
    assert _line(text, "Runs started 20").endswith(f"; re-run: `{rerun}`.")
    # The page names no archive, no device call and no log; the lab's index beside the archives does: which
    # archive holds the parent run, the archive's walls and the logs beside it.
    assert "records_call1" not in text and "call 3" not in text and "call0_setup.log" not in text
    index = _index(runs)
    parent = _line(text, "- parent run `").split("`")[1]
    assert f"| `grpo_baseline_ablation` | `{parent}` |" in index and "| `records_call1.tar.gz` |" in index
    assert "grpo_baseline_ablation (call 3, rc 0): 269 s" in index and "`call0_setup.log`" in index

    for name in ("val_accuracy_vs_step", "reward_mean_vs_step", "val_accuracy_vs_wall_seconds"):
        png = tmp_path / "figures" / f"grpo_baseline_ablation_{name}.png"
        header = png.read_bytes()[:24]
        assert header[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">I", header[16:20])[0] <= 6.4 * 100  # width: at most 100 dpi
        assert f"]({png.relative_to(tmp_path)})" in text  # linked relative to the page


def _more_seeds(no_baseline: float):
    """Seeds 1 and 2 of no_baseline (``no_baseline`` + 0.01, − 0.01) and seed 2 of reinforce_with_baseline (0.55) in
    the same parent: three pairs (seeds 0, 1, 2), three runs a setting."""

    def more(client, experiment_id, parent_id):
        _child(client, experiment_id, parent_id, "no_baseline", 1, no_baseline + 0.01)
        _child(client, experiment_id, parent_id, "no_baseline", 2, no_baseline - 0.01)
        _child(client, experiment_id, parent_id, "reinforce_with_baseline", 2, 0.55)

    return more


T_2 = 4.302653  # Student's t at 0.975 with 2 degrees of freedom: a 95% interval on three pairs


@pytest.mark.parametrize(
    ("no_baseline", "verdict"),
    [
        (0.3, "Measured: **agrees**:"),
        (0.8, "Measured: **disagrees**:"),
        (0.55, "Measured: inconclusive (±0.138):"),
    ],
)
def test_direction_follows_the_numbers(tmp_path, empty_store, no_baseline, verdict):
    """Three runs a setting, paired by seed: reinforce_with_baseline ≥ no_baseline is the expectation; its runs
    end at 0.6, 0.5, 0.55, so the pairs' differences are those less no_baseline's (which moves ±0.01 with the seed);
    the ± is Student's t interval on their mean with 2 degrees of freedom (two s.e. would be an 82% interval)."""
    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline, more=_more_seeds(no_baseline)))
    sentence = _line(text, "- Expectation: the handout expects a baseline to help")
    assert verdict in sentence and "(3 pairs, each a run of both settings from one start model" in sentence
    diffs = [0.6 - no_baseline, 0.5 - no_baseline - 0.01, 0.55 - no_baseline + 0.01]
    mean = sum(diffs) / 3
    half = T_2 * math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2 / 3)
    assert f"= {mean:+.3f} ± {half:.3f} (95% t, 2 df)" in sentence


def test_a_difference_inside_the_margin_is_within_noise(tmp_path, empty_store):
    """Pairs that differ by +0.005, −0.005 and 0: the interval (±0.012) lies inside ±0.05: within noise; the
    findings row says so with the interval."""

    def close(client, experiment_id, parent_id):
        _child(client, experiment_id, parent_id, "no_baseline", 1, 0.505)
        _child(client, experiment_id, parent_id, "no_baseline", 2, 0.55)
        _child(client, experiment_id, parent_id, "reinforce_with_baseline", 2, 0.55)

    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.595, more=close))
    half = T_2 * math.sqrt((0.005**2 + 0.005**2) / 2 / 3)
    row = _line(text, "| `grpo_baseline_ablation` | the handout")
    assert f"= +0.000 ± {half:.3f} (95% t, 2 df) | 3 pairs | within noise |" in row


def test_a_verdict_needs_three_runs_a_setting(tmp_path, empty_store):
    """Two runs of one setting and one of the other: however large the difference (0.6 − 0.1, fifteen standard
    errors), no verdict word, "too few runs", the difference still shown."""
    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.1))
    sentence = _line(text, "- Expectation: the handout expects a baseline to help")
    assert "Measured: too few runs: reinforce_with_baseline − no_baseline = +0.500 ±" in sentence
    assert "agrees" not in sentence and "a verdict needs 3 pairs" in sentence
    assert _line(text, "| `grpo_baseline_ablation` | the handout").endswith("| too few runs |")


def test_repeats_group_runs_by_effective_settings_params_and_tags(tmp_path, empty_store):
    """A run that logged compile_layers (and the like) as params and a newer one that logged them as tags ran the
    same settings: one group of repeats, with their real spread (0.1), not two groups of one."""
    effective = {"compile_layers": "False", "fsdp_reshard_after_forward": "True", "max_tokens_per_microbatch": "None"}
    made = []

    def again(client, experiment_id, parent_id):
        other = client.create_run(experiment_id, run_name="grpo_clip_ablation").info.run_id
        client.set_tag(other, "ablation", "grpo_clip_ablation")
        made.append(_child(client, experiment_id, other, "no_baseline", 0, 0.4, extra=effective))
        for key, value in effective.items():
            client.set_tag(made[0], key, value)
        first = client.create_run(experiment_id, run_name="grpo_prompt_ablation").info.run_id
        client.set_tag(first, "ablation", "grpo_prompt_ablation")
        made.append(_child(client, experiment_id, first, "no_baseline", 0, 0.3, extra=effective))

    runs = _records(tmp_path, empty_store, no_baseline=0.3, more=again)
    # the first copy logged them as params, the second as tags only: drop its params
    import sqlite3

    store = tmp_path / "store" / "mlflow.db"
    with sqlite3.connect(store) as con:
        con.execute(f"delete from params where run_uuid = '{made[0]}' and key in {tuple(effective)}")
    _pack(store, runs / "records_call1.tar.gz")
    text = _generate(tmp_path, runs)
    repeats = text.split("## Repeated configurations")[1].split("\n## ")[0]
    row = next(line for line in repeats.splitlines() if made[0][:8] in line)
    assert made[0][:8] in row and made[1][:8] in row and row.endswith("| 0.1000 |")


def test_plots_scale_small_values_and_style_past_ten_series(tmp_path, monkeypatch):
    """All accuracies under 0.03: the axis is scaled to them, not 0–1; twelve series: no two look alike."""
    import matplotlib.pyplot as plt

    shown = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda figure: shown.append(figure.axes[0]) or real_close(figure))
    series = {f"s{i}": [(0, 0.001 * i), (10, 0.002 * i)] for i in range(12)}
    writeup.plot(tmp_path / "p.png", series, "step", "val_accuracy", "small")
    (axes,) = shown
    assert 0.022 <= axes.get_ylim()[1] < 0.05
    assert len({(line.get_color(), line.get_linestyle(), line.get_marker()) for line in axes.lines}) == 12


def test_newer_copy_of_a_run_wins_and_runs_count_once(tmp_path, empty_store):
    """An archive packed before a child finished and one packed after: the copy with more points is kept,
    whichever archive comes first; the ablation is found once."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    runs = _records(tmp_path, empty_store, no_baseline=0.3)
    (runs / "records_call1.tar.gz").rename(runs / "records_call2_later.tar.gz")
    store = tmp_path / "store" / "mlflow.db"
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    run_id = client.search_runs(client.get_experiment_by_name("grpo").experiment_id, "params.seed = '1'")[0].info.run_id
    client.log_batch(run_id, metrics=[Metric("final_val_accuracy", 0.7, 0, 11), Metric("val_accuracy", 0.7, 0, 11)])
    _pack(store, runs / "records_call1_first.tar.gz")  # sorts first, holds the newer copy

    text = _generate(tmp_path, runs)
    assert _experiment_row(text, "grpo_baseline_ablation").startswith("| `grpo_baseline_ablation` | grpo | 1 | 3 |")
    assert f"| {_pm(0.7)} (210 / 300) |" in _line(text, "| reinforce_with_baseline (seed 1,")


def test_write_is_atomic(tmp_path, empty_store, monkeypatch):
    """A failed write leaves the old page in place and no temporary file beside it."""
    runs = _records(tmp_path, empty_store, no_baseline=0.3)
    out = tmp_path / "results.md"
    out.write_text("old page\n")

    def broken_replace(source, target):
        raise OSError("disk full")

    monkeypatch.setattr(writeup.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        writeup.main(["--runs", str(runs), "--out", str(out), "--figures", str(tmp_path / "figures")])
    assert out.read_text() == "old page\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".results.md")) == []


def test_a_stopped_run_and_newer_fields_change_no_figure(tmp_path, empty_store):
    """A third reinforce_with_baseline run stopped before its final evaluation (a machine's time ran out),
    logging a field the older runs predate: it is listed as stopped (its store still says RUNNING: the records
    end there), but the mean over runs, their count
    and the verdict use the two finished runs, and the newer field is a shared setting, not a difference."""

    def stopped(client, experiment_id, parent_id):
        _child(
            client, experiment_id, parent_id, "reinforce_with_baseline", 2, 0.9, finish=False, extra={"lora_rank": "0"}
        )

    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.3, more=stopped))
    assert "` stopped |" in _line(text, "| reinforce_with_baseline (seed 2,") and "RUNNING" not in text
    mean_row = _line(text, "| reinforce_with_baseline | 2 | 0, 1 |")
    assert f"| {0.55:.3f} ± {0.05:.3f} |" in mean_row
    sentence = _line(text, "- Expectation: the handout expects a baseline to help")
    assert "2 runs of reinforce_with_baseline and 1 of no_baseline" in sentence and f"= {0.6 - 0.3:+.3f} ±" in sentence
    assert "`lora_rank=0`" in _line(text, "Settings every run shares:")
    assert "lora_rank" not in _line(text, "| setting |") and "fields added since: `lora_rank`" in text


def test_a_superseded_run_is_listed_apart_and_counted_nowhere(tmp_path, empty_store, monkeypatch):
    """A third reinforce_with_baseline run, made by code with a bug fixed since (``SUPERSEDED``): it ends at 0.95,
    but the mean, the runs' count and the verdict use the two others; it is listed with its reason."""
    made = []

    def buggy(client, experiment_id, parent_id):
        made.append(_child(client, experiment_id, parent_id, "reinforce_with_baseline", 2, 0.95))

    runs = _records(tmp_path, empty_store, no_baseline=0.3, more=buggy)
    monkeypatch.setattr(writeup, "SUPERSEDED", {made[0][:8]: "sampled in problem order, fixed in abc123"})
    text = _generate(tmp_path, runs)
    assert "(seed 2," not in text.split("## Superseded runs")[0]
    assert _line(text, "| reinforce_with_baseline | 2 | 0, 1 |")
    row = _line(text, f"| `{made[0][:8]}` |")
    assert "reinforce_with_baseline" in row and _pm(0.95) in row and "fixed in abc123" in row
    assert "records_call1" not in row and f"| `{made[0]}` |" in _line(_index(runs), "| superseded:")
    sentence = _line(text, "- Expectation: the handout expects a baseline to help")
    assert f"= {0.6 - 0.3:+.3f} ±" in sentence and "2 runs of reinforce_with_baseline and 1 of no_baseline" in sentence


def test_runs_scored_on_another_validation_set_are_another_experiment(tmp_path, empty_store):
    """A second parent of the same ablation whose runs were scored on arithmetic:300:2: its own section, table
    row and figures (``NAME on SET``); the first parent's section and verdict are unchanged."""

    def elsewhere(client, experiment_id, parent_id):
        other = client.create_run(experiment_id, run_name="grpo_baseline_ablation").info.run_id
        client.set_tag(other, "ablation", "grpo_baseline_ablation")
        for setting, final in (("no_baseline", 0.8), ("reinforce_with_baseline", 0.1)):
            _child(client, experiment_id, other, setting, 0, final, extra={"validation_data": "arithmetic:300:2"})
        client.set_terminated(other)

    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.3, more=elsewhere))
    assert "## `grpo_baseline_ablation on arithmetic:300:2` (MLflow experiment `grpo`)" in text
    assert _experiment_row(text, "grpo_baseline_ablation").startswith("| `grpo_baseline_ablation` | grpo | 1 | 3 |")
    other = _experiment_row(text, "grpo_baseline_ablation on arithmetic:300:2")
    assert other.startswith("| `grpo_baseline_ablation on arithmetic:300:2` | grpo |")
    assert other.endswith("--ablation grpo_baseline_ablation --validation-data arithmetic:300:2` |")  # its re-run
    first = text.split("## `grpo_baseline_ablation` (MLflow")[1].split("## `grpo_baseline_ablation on")[0]
    assert _line(first, "| reinforce_with_baseline | 2 | 0, 1 |") and _pm(0.8) not in first and _pm(0.1) not in first
    assert (tmp_path / "figures" / "grpo_baseline_ablation_on_arithmetic_300_2_val_accuracy_vs_step.png").is_file()


def test_runs_of_a_name_in_another_mlflow_experiment_are_a_study_of_their_own(tmp_path, empty_store):
    """A parent of the same name logged to another MLflow experiment (``--experiment grpo_recipe``): a section named
    after that experiment; the first parent's section and its settings keep to their own runs."""

    def recipe(client, experiment_id, parent_id):
        other_experiment = client.create_experiment("grpo_recipe", artifact_location=str(tmp_path / "mlruns" / "r"))
        other = client.create_run(other_experiment, run_name="grpo_baseline_ablation").info.run_id
        client.set_tag(other, "ablation", "grpo_baseline_ablation")
        _child(client, other_experiment, other, "no_baseline", 0, 0.8, extra={"group_size": "16"})
        client.set_terminated(other)

    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.3, more=recipe))
    assert "## `grpo_recipe` (MLflow experiment `grpo_recipe`)" in text
    assert _experiment_row(text, "grpo_baseline_ablation").startswith("| `grpo_baseline_ablation` | grpo | 1 | 3 |")
    recipe = _experiment_row(text, "grpo_recipe")
    assert recipe.startswith("| `grpo_recipe` | grpo_recipe | 1 | 1 |")
    # the ablation's command, into the study's own MLflow experiment
    assert recipe.endswith("--ablation grpo_baseline_ablation --experiment grpo_recipe` |")
    first = text.split("## `grpo_baseline_ablation` (MLflow")[1].split("## `grpo_recipe`")[0]
    assert _pm(0.8) not in first and "`group_size=8`" in first


def test_repeated_configurations_pair_finished_runs_whatever_scheduled_them(tmp_path, empty_store):
    """Another ablation's child with no_baseline's parameters, run on Ray (``runner``: how it was scheduled, not
    what it ran), is a repeat of it; a third copy stopped before its final evaluation is left out of the pair."""
    made = []

    def again(client, experiment_id, parent_id):
        for name, finish in (("grpo_clip_ablation", True), ("grpo_prompt_ablation", False)):
            parent = client.create_run(experiment_id, run_name=name).info.run_id
            client.set_tag(parent, "ablation", name)
            made.append(_child(client, experiment_id, parent, "no_baseline", 0, 0.3, finish, {"runner": "ray"}))

    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.3, more=again))
    repeats = text.split("## Repeated configurations")[1].split("\n## ")[0]
    row = _line(repeats, "| grpo_baseline_ablation/no_baseline")
    assert f"`{made[0][:8]}` (parent " in row and _pm(0.3) in row and row.endswith("| 0.0000 |")
    assert made[1][:8] not in repeats


def test_a_verdict_compares_settings_within_the_parents_that_ran_both(tmp_path, empty_store):
    """A second parent (another call, another starting model) ran reinforce_with_baseline alone, at 0.9: the
    means table counts it, but the comparison pairs runs of one parent and seed only (0.6 against no_baseline's
    0.5, seed 0 of the first parent), where the plain means (0.667 against 0.5) would take in the other model."""

    def alone(client, experiment_id, parent_id):
        other = client.create_run(experiment_id, run_name="grpo_baseline_ablation").info.run_id
        client.set_tag(other, "ablation", "grpo_baseline_ablation")
        _child(client, experiment_id, other, "reinforce_with_baseline", 2, 0.9)
        client.set_terminated(other)

    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.5, more=alone))
    assert _line(text, "| reinforce_with_baseline | 3 | 0, 1, 2 |")
    sentence = _line(text, "- Expectation: the handout expects a baseline to help")
    pair = math.hypot(math.sqrt(0.6 * 0.4 / N), math.sqrt(0.5 * 0.5 / N))
    assert f"Measured: too few runs: reinforce_with_baseline − no_baseline = {0.1:+.3f} ± {pair:.3f}" in sentence
    assert "(1 pair, each a run of both settings from one start model with one seed" in sentence


def test_a_run_with_a_phase_counts_its_own_steps_and_plots_its_own_clock(tmp_path, empty_store, monkeypatch):
    """A leaderboard-like child: an SFT phase logged as ``sft/loss`` over 240 steps and the system monitor's
    ``system/*`` before GRPO's 10; its accuracy by the flow's clock (``val_accuracy_by_wall_seconds``, from 70 s:
    the SFT phase first), where its steps' ``wall_seconds`` count from GRPO's start."""
    from mlflow.entities import Metric

    def phased(client, experiment_id, parent_id):
        run_id = _child(client, experiment_id, parent_id, "no_baseline", 1, 0.4)
        metrics = [Metric("sft/loss", 1.0 / s, 0, s) for s in range(1, 241)]
        metrics += [Metric("system/cpu_utilization_percentage", 50.0, 0, s) for s in range(30)]
        metrics += [Metric("val_accuracy_by_wall_seconds", 0.04 * s, 0, 70 + 5 * s) for s in (0, 5, 10)]
        client.log_batch(run_id, metrics=metrics)

    plotted = {}
    real_plot = writeup.plot

    def capture(path, series, x, y, title):
        plotted[Path(path).name] = series
        return real_plot(path, series, x, y, title)

    monkeypatch.setattr(writeup, "plot", capture)
    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.3, more=phased))
    row = _line(text, "| no_baseline (seed 1,")
    assert row.split("|")[5].strip() == "10"  # steps: GRPO's, not the SFT phase's 240
    walls = {
        label.split(",")[0]: points for label, points in plotted[f"{PLOTS}_val_accuracy_vs_wall_seconds.png"].items()
    }
    assert walls["no_baseline (seed 1"] == [(70, 0.0), (95, 0.2), (120, 0.4)]  # the flow's clock
    assert walls["no_baseline (seed 0"] == [(0.0, 0.0), (10.0, 0.15), (20.0, 0.3)]  # none logged: wall_seconds


def test_runs_of_one_setting_on_two_backends_are_two_settings_and_a_parity_finding(tmp_path, empty_store):
    """Plain GRPO flow runs (no ablation: parents named ``grpo``, each with one child ``single``) on backend hf
    and vllm, two seeds each: the children group as ``backend=hf`` and ``backend=vllm``, and the findings hold the
    engines' parity: vllm − hf from the runs' means, unpaired (each run has its own parent)."""

    def flows(client, experiment_id, parent_id):
        for backend, seed, final in (("hf", 0, 0.37), ("hf", 1, 0.38), ("vllm", 0, 0.44), ("vllm", 1, 0.39)):
            parent = client.create_run(experiment_id, run_name="grpo").info.run_id
            _child(client, experiment_id, parent, "single", seed, final, extra={"backend": backend})
            client.set_terminated(parent)

    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.3, more=flows))
    section = text.split("## `grpo` (MLflow")[1].split("\n## ")[0]
    assert _line(section, "| backend=hf | 2 | 0, 1 |") and _line(section, "| backend=vllm | 2 | 0, 1 |")
    assert "| single |" not in section
    row = _line(text, "| `grpo` | the rollout engine does not change what GRPO learns")
    assert "backend=vllm − backend=hf = +0.040 ± " in row and "(within-run only: unpaired means) | no pairs |" in row
    assert "| backend=" not in text.split("## `grpo_baseline_ablation` (MLflow")[1].split("\n## ")[0]


def test_reproductions_are_listed_apart_with_what_their_records_say_differed(tmp_path, empty_store):
    """A plain GRPO run (0.4) and two runs tagged ``reproduces`` (flows.reproduce's): one exact, of that run, one
    of another run (0.3) ending 0.1 higher. Neither reproduction counts as a run of its setting; each is a row of
    the Reproductions table with its verdict, and the differences between the two runs' provenance records
    (commit, model folder) are named."""
    import json

    made = {}

    def flows(client, experiment_id, parent_id):
        for name, final, reproduces in (("a", 0.4, None), ("b", 0.3, None), ("a2", 0.4, "a"), ("b2", 0.4, "b")):
            parent = client.create_run(experiment_id, run_name="grpo").info.run_id
            child = _child(client, experiment_id, parent, "single", 0, final, extra={"backend": "hf"})
            if reproduces:
                client.set_tag(parent, "reproduces", made[reproduces][0])
                client.set_tag(child, "reproduces", made[reproduces][1])
            client.set_terminated(parent)
            made[name] = (parent, child)

    runs = _records(tmp_path, empty_store, no_baseline=0.3, more=flows)
    records = {
        "a": ("abc", "folder:1"),
        "a2": ("abc", "folder:1"),
        "b": ("def", "folder:2"),
        "b2": ("abc", "folder:3"),
    }
    with tarfile.open(runs / "records_call1.tar.gz", "w:gz") as tar:  # again, with the provenance records
        tar.add(tmp_path / "store" / "mlflow.db", arcname="mlflow.db")
        for name, (commit, model) in records.items():
            path = tmp_path / f"{name}.json"
            path.write_text(json.dumps({"code": {"commit": commit}, "inputs": {"model": {"hash": model}}}))
            tar.add(path, arcname=f"mlruns/1/{made[name][0]}/artifacts/provenance.json")
    text = _generate(tmp_path, runs)
    assert _line(text.split("## `grpo` (MLflow")[1], "| single | 2 | 0, 0 |")  # a and b only
    table = text.split("## Reproductions")[1].split("\n## ")[0]
    exact = _line(table, f"| `{made['a'][1][:8]}`")
    assert f"`{made['a2'][1][:8]}`" in exact and "| +0.000 |" in exact and exact.endswith("| exact |")
    differs = _line(table, f"| `{made['b'][1][:8]}`")
    assert "| +0.100 |" in differs and differs.endswith("| differs |")
    said = _line(table, f"- `{made['b2'][0][:8]}` reproduces `{made['b'][0][:8]}`")
    assert "code: def → abc" in said and "data model: folder:2 → folder:3" in said
    assert "nothing (same code" in _line(table, f"- `{made['a2'][0][:8]}` reproduces")
    # which archive holds a reproduction: the lab's index, not the page
    assert "records_call1" not in table
    assert "| `records_call1.tar.gz` |" in _line(_index(runs), f"| reproduction of `{made['a'][1][:8]}` |")


def test_a_leaderboard_run_says_which_problems_chose_its_checkpoint_and_which_scored_it(tmp_path, empty_store):
    """Two leaderboard runs of different budgets: each a setting of its own (no mean over them); the one that
    logged a held-out selection split says so, the older one that its checkpoint was chosen on the scored set."""
    from mlflow.entities import Metric, Param

    def leaderboard(client, experiment_id, parent_id):
        board = client.create_experiment("leaderboard", artifact_location=str(tmp_path / "mlruns_lb"))
        for budget, score, held in (("0.14", 0.95, None), ("0.1", 0.96, 300)):
            run_id = client.create_run(board, run_name="leaderboard").info.run_id
            params = {"budget_hours": budget, "train_data": "arithmetic:4000:2", "validation_data": "arithmetic:300:2"}
            metrics = [Metric("val_accuracy", 0.9, 0, s) for s in (0, 5)]
            finals = {"final_score": score, "n_final_problems": N, "best_step": 5, "best_subset_accuracy": 0.97}
            finals |= {"budget_seconds": float(budget) * 3600, "wall_seconds": 300.0}
            finals |= {"n_selection_problems": held} if held else {}
            metrics += [Metric(k, v, 0, 5) for k, v in finals.items()]
            client.log_batch(run_id, metrics=metrics, params=[Param(k, v) for k, v in params.items()])
            client.set_terminated(run_id)

    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.3, more=leaderboard))
    section = text.split("## `leaderboard` (MLflow")[1].split("\n## ")[0]
    older = _line(section, "- `")
    assert "(leaderboard, budget_hours=0.14): final score 0.950" in older and "in 300 s of a 504 s budget" in older
    assert "chosen on the first 300 problems of `arithmetic:300:2`, the problems that score it" in older
    newer = section.split(older)[1]
    assert "(leaderboard, budget_hours=0.1): final score 0.960" in newer
    assert "chosen on 300 problems held out of `arithmetic:4000:2`'s training set" in newer
    assert "which took no part in the choice" in newer and "Runs of one setting" not in section


def test_a_pair_whose_runs_kept_their_final_evaluation_by_problem_is_paired_problem_by_problem(tmp_path, empty_store):
    """reinforce_with_baseline (0.6) and no_baseline (0.3), seed 0 of one parent, each with its final evaluation's
    per-problem table: the baseline solves every problem the other does and 90 more, so the s.e. is that of the
    per-problem differences (0.027), not the two runs' binomial s.e.s combined (0.039)."""

    def tables(client, experiment_id, parent_id):
        for run in client.search_runs([experiment_id], "params.seed = '0'"):
            solved = {"reinforce_with_baseline": 180, "no_baseline": 90}.get(run.data.params.get("setting"))
            if solved is not None:
                rows = [[f"p{i}", 0, float(i < solved), 1.0, float(i < solved), 20] for i in range(N)]
                columns = ["unique_id", "sample", "reward", "format_reward", "answer_reward", "response_tokens"]
                table = {"columns": columns, "data": rows}
                client.log_dict(run.info.run_id, table, "per_problem/full_step_000010.json")

    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.3, more=tables))
    sentence = _line(text, "- Expectation: the handout expects a baseline to help")
    assert "reinforce_with_baseline − no_baseline = +0.300 ± 0.027" in sentence
    assert "(1 pair (1 by problem)," in sentence


def _with_records(tmp_path: Path, runs: Path, model_hash: dict[str, str]) -> None:
    """The archive packed again with a provenance record for each run of ``model_hash`` (run id → the content hash
    of the model it started from), as the newer runs' artifacts hold them."""
    import json

    with tarfile.open(runs / "records_call1.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "store" / "mlflow.db", arcname="mlflow.db")
        for run_id, model in model_hash.items():
            path = tmp_path / f"{run_id}.json"
            path.write_text(json.dumps({"code": {"commit": "abc"}, "inputs": {"model": {"hash": model}}}))
            tar.add(path, arcname=f"mlruns/1/{run_id}/artifacts/provenance.json")


def test_a_run_made_twice_counts_once_and_one_reference_serves_every_comparison(tmp_path, empty_store):
    """From one start model (its weights' hash): three seeds of today's GRPO and of DAPO (its ablation), seed 0's
    GRPO made again by a second invocation, and the KL ablation's kl_0.01 and kl_0.001 with one kl_0 of its own
    (GRPO's settings). The copy counts once: DAPO has three pairs, not four; the DAPO ablation's GRPO runs are
    kl_0's too, so kl_0 − kl_0.01 has three pairs; kl_0 − kl_0.001, which the records also support, is reported."""
    made: dict[str, str] = {}
    rwb = {"loss_type": "reinforce_with_baseline", "dynamic_sampling": "False", "kl_coef": "0.0"}

    def runs_of(client, experiment_id, name, children):
        parent = client.create_run(experiment_id, run_name=name).info.run_id
        client.set_tag(parent, "ablation", name)
        for setting, seed, final, extra in children:
            made[f"{name}/{setting}/{seed}/{len(made)}"] = _child(
                client, experiment_id, parent, setting, seed, final, extra=rwb | extra
            )
        client.set_terminated(parent)

    def more(client, experiment_id, parent_id):
        grpo = [("grpo", s, f, {}) for s, f in ((0, 0.40), (1, 0.42), (2, 0.38))]
        dapo = [("dapo", s, f, {"dynamic_sampling": "True"}) for s, f in ((0, 0.45), (1, 0.46), (2, 0.44))]
        runs_of(client, experiment_id, "grpo_dapo_ablation", grpo + dapo)
        runs_of(client, experiment_id, "grpo_dapo_ablation", [("grpo", 0, 0.40, {})])  # the same run again
        kl = [("kl_0.01", s, f, {"kl_coef": "0.01"}) for s, f in ((0, 0.35), (1, 0.36), (2, 0.30))]
        kl += [("kl_0.001", 0, 0.39, {"kl_coef": "0.001"}), ("kl_0", 0, 0.40, {})]
        runs_of(client, experiment_id, "grpo_kl_ablation", kl)

    runs = _records(tmp_path, empty_store, no_baseline=0.3, more=more)
    _with_records(tmp_path, runs, dict.fromkeys(made.values(), "folder:same-start"))
    text = _generate(tmp_path, runs)
    dapo = _line(text, "| `grpo_dapo_ablation` |")
    assert "dapo − grpo = +0.050 ± " in dapo and "| 3 pairs |" in dapo
    kl = _line(text, "| `grpo_kl_ablation` | DAPO and Dr. GRPO drop the KL term")
    diffs = [0.05, 0.06, 0.08]
    half = T_2 * math.sqrt(sum((d - sum(diffs) / 3) ** 2 for d in diffs) / 2 / 3)
    assert f"kl_0 − kl_0.01 = +0.063 ± {half:.3f} (95% t, 2 df) | 3 pairs | **agrees** |" in kl
    assert "kl_0 − kl_0.001 = +0.010 ±" in _line(text.split(kl)[1], "| `grpo_kl_ablation` |")
    # the DAPO section's mean counts seed 0's GRPO once
    assert _line(text.split("## `grpo_dapo_ablation`")[1], "| grpo | 3 | 0, 1, 2 |")
    said = _line(text, "What we learned:")  # made three times: by two DAPO invocations and as the KL ablation's kl_0
    assert "Of 1 run made more than once from one start model with the same settings and seed, 1 ended" in said


@pytest.mark.parametrize(("shift", "word"), [(0.0, "within noise"), (0.1, "**disagrees**")])
def test_a_parity_expectation_is_decided_by_an_equivalence_margin(tmp_path, empty_store, shift, word):
    """One-step-off against synchronous, three seeds of one invocation: ends within a few thousandths (the
    interval inside ±0.05): within noise, the parity holds; 0.1 lower on every seed: the interval excludes 0, and
    any side of it disagrees with a parity."""

    def pairs(client, experiment_id, parent_id):
        parent = client.create_run(experiment_id, run_name="grpo_async_ablation").info.run_id
        client.set_tag(parent, "ablation", "grpo_async_ablation")
        for seed, final in ((0, 0.40), (1, 0.42), (2, 0.41)):
            _child(client, experiment_id, parent, "synchronous", seed, final, extra={"pipeline_depth": "0"})
            late = final - shift + 0.003 * (seed - 1)
            _child(client, experiment_id, parent, "one_step_off", seed, late, extra={"pipeline_depth": "1"})
        client.set_terminated(parent)

    text = _generate(tmp_path, _records(tmp_path, empty_store, no_baseline=0.3, more=pairs))
    row = _line(text, "| `grpo_async_ablation` |")
    assert f"one_step_off − synchronous = {-shift + 0.0:+.3f} ±" in row and row.endswith(f"| 3 pairs | {word} |")


def test_the_cost_of_a_verdict_comes_from_the_pool_of_runs(tmp_path, empty_store):
    """A pool of four runs (two at a time, 240 s each, 8 minutes in all) after a 180 s SFT: 0.5 runs a GPU-minute;
    a verdict's six runs 12 GPU-minutes, three with a shared reference 6."""
    runs = _records(tmp_path, empty_store, no_baseline=0.3)
    pool = tmp_path / "pool.txt"
    pool.write_text(
        "a start 1000\nb start 1000\na end 1240 rc=0\nc start 1240\nb end 1240 rc=0\nd start 1241\n"
        "c end 1480 rc=0\nd end 1480 rc=0\ne start 1480\ne end 1490 rc=1\n"
    )
    (tmp_path / "walls.txt").write_text("sft call=2 rc=0 wall_s=180\n")
    with tarfile.open(runs / "records_call1.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "store" / "mlflow.db", arcname="mlflow.db")
        tar.add(pool, arcname="outputs/.devrun/pool.txt")
        tar.add(tmp_path / "walls.txt", arcname="outputs/.devrun/walls.txt")
    text = _generate(tmp_path, runs)
    cost = _line(text, "Cost:")
    assert cost.startswith("Cost: one GPU ran 4 GRPO runs")  # no run's record names the GPU: no guess
    assert "at most 2 at once, in 8.2 GPU-minutes (with the time of 1 attempt that exited non-zero)" in cost
    assert "a median 4.0 min" in cost and "0.5 runs a GPU-minute" in cost
    assert "take 12.2 GPU-minutes (6.1 with a shared reference), plus the start model's SFT (3.0 min)" in cost


def _pool_archive(tmp_path, store: Path, archive: Path, pool: str, sft_s: int, device: dict[str, str]) -> None:
    """``store`` packed with a ``pool.txt`` and an SFT wall, and a run started at each epoch second of ``device``
    (second → the device its record names: ``tag:`` as the run's tag ``device``, else in its provenance record)."""
    import json

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("grpo") or client.get_experiment(client.create_experiment("grpo"))
    folder = tmp_path / archive.stem
    folder.mkdir()
    records = {}
    for second, name in device.items():
        tags = {"device": name.removeprefix("tag:")} if name.startswith("tag:") else {}
        run_id = client.create_run(experiment.experiment_id, start_time=int(second) * 1000, tags=tags).info.run_id
        if not tags:
            records[run_id] = {"code": {"commit": "abc"}, "device": name}
    (folder / "pool.txt").write_text(pool)
    (folder / "walls.txt").write_text(f"sft call=2 rc=0 wall_s={sft_s}\n")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(store, arcname="mlflow.db")
        tar.add(folder / "pool.txt", arcname="outputs/.devrun/pool.txt")
        tar.add(folder / "walls.txt", arcname="outputs/.devrun/walls.txt")
        for run_id, record in records.items():
            (folder / f"{run_id}.json").write_text(json.dumps(record))
            tar.add(folder / f"{run_id}.json", arcname=f"mlruns/1/{run_id}/artifacts/provenance.json")


def test_the_cost_is_given_per_gpu_its_pools_records_name(tmp_path, empty_store):
    """Two pools, each on the GPU its runs' records name: four runs on an H200 (two at a time, 240 s each, 8 min,
    SFT 180 s; its run's provenance record says so) and three on an H100 (all at once, 600 s, 10 min, one more that
    exited non-zero, SFT 240 s; its run's tag says so, and a run copied in from before the pool, on an H200, is not
    its). Each GPU gets its own runs, rate and verdict cost: neither machine's runs are counted at the other's rate."""
    runs = _records(tmp_path, empty_store, no_baseline=0.3)
    h200 = "a start 1000\nb start 1000\na end 1240 rc=0\nc start 1240\nb end 1240 rc=0\nd start 1240\n"
    h200 += "c end 1480 rc=0\nd end 1480 rc=0\n"
    _pool_archive(
        tmp_path,
        tmp_path / "store" / "mlflow.db",
        runs / "records_call1.tar.gz",
        h200,
        180,
        {"1001": "cuda: 1 × NVIDIA H200"},
    )
    h100 = "x start 5000\ny start 5000\nz start 5000\nf start 5000\nf end 5060 rc=1\n"
    h100 += "x end 5600 rc=0\ny end 5600 rc=0\nz end 5600 rc=0\n"
    store = tmp_path / "store2" / "mlflow.db"
    store.parent.mkdir()
    shutil.copy(empty_store, store)
    _pool_archive(
        tmp_path,
        store,
        runs / "records_call2.tar.gz",
        h100,
        240,
        {"4000": "tag:cuda: 1 × NVIDIA H200", "5001": "tag:cuda: 1 × NVIDIA H100 80GB HBM3"},
    )
    cost = _line(_generate(tmp_path, runs), "Cost:")
    on_h200, on_h100 = cost.removeprefix("Cost: ").split("; ")
    assert on_h200.startswith("one H200 ran 4 GRPO runs") and "at most 2 at once, in 8.0 GPU-minutes:" in on_h200
    assert "0.5 runs a GPU-minute, so a verdict's three pairs take 12.0 GPU-minutes (6.0 with a shared" in on_h200
    assert on_h200.endswith("plus the start model's SFT (3.0 min) once per batch")
    assert (
        on_h100.startswith("one H100 ran 3 GRPO runs") and "at most 3 at once, in 10.0 GPU-minutes (with the" in on_h100
    )
    assert "0.3 runs a GPU-minute, so a verdict's three pairs take 20.0 GPU-minutes (10.0 with a shared" in on_h100
    assert "plus the start model's SFT (4.0 min) once per batch. A verdict's three pairs are six runs" in on_h100
    assert "one GPU" not in cost and "7 GRPO runs" not in cost


def test_a_starting_models_folder_is_shown_as_the_project_names_it():
    writeup = _load_module()
    assert writeup.project_relative("/work/main/outputs/sft_experiment/runs-b0/1024/model") == (
        "outputs/sft_experiment/runs-b0/1024/model"
    )
    assert writeup.project_relative("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert writeup.project_relative("outputs/sft_experiment/best_model") == "outputs/sft_experiment/best_model"
