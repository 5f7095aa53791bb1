"""flows.report: one page from the stages' files (and the GRPO ablations in MLflow); missing stages say
"not run"; the folder is swapped in whole, and only a report folder is ever replaced; the HTML escapes what
settings and files hold; a root without pipeline outputs is an error; the report is logged to MLflow. And
plot_curves' axes: 0–1 metrics on a fixed 0–1 axis, steps on integer ticks."""

import re

import matplotlib.figure
import pytest
import yaml
from report_project import CASES, project, write

from flows.report import ReportParams, main, report
from tasks.plots import plot_curves
from tasks.report_page import _inline_html


def log_ablation(uri, name, finals):
    """A GRPO ablation as the flow logs it: a parent tagged `ablation`, children with `setting` and metrics."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("grpo")
    with mlflow.start_run(run_name=name) as parent:
        for setting, final in finals.items():
            with mlflow.start_run(run_name=f"grpo-{setting}", nested=True):
                mlflow.log_param("setting", setting)
                for step in range(3):
                    mlflow.log_metric("val_accuracy", final * step / 2, step=step)
                mlflow.log_metrics({"final_val_accuracy": final, "final_val_format_rate": 1.0, "wall_seconds": 10.0})
        mlflow.set_tag("ablation", name)
    return parent.info.run_id


def sft_run(uri, root):
    """The SFT stage's parent run as the flow leaves it: its settings as parameters (epochs 2, though the
    run stopped at max_steps), and outputs/sft_experiment/run.json naming it."""
    import mlflow

    from tasks.experiments import ensure_experiment, ui_address

    with mlflow.start_run(experiment_id=ensure_experiment("sft_experiment", uri)) as run:
        mlflow.log_params({"model": "smollm2-sft", "epochs": 2, "max_steps": 8, "train_data": "arithmetic:64:1"})
        mlflow.log_params({"validation_data": "arithmetic:16:1", "val_limit": None, "sizes": "['full']"})
    record = {
        "flow": "sft_experiment",
        "experiment": "sft_experiment",
        "tracking_uri": "sqlite:///mlflow.db",  # relative: under the report's root
        "mlflow_run_id": run.info.run_id,
        "mlflow_run_url": ui_address("sft_experiment", uri, run.info.run_id),
        "prefect_flow_run_id": None,
        "prefect_flow_run_url": None,
        "models": [{"name": "a5-sft", "version": "3", "setting": "filtered"}],
    }
    write(root / "outputs/sft_experiment/run.json", record)
    return record


def test_full_report_with_plots_ablations_and_mlflow_run(prefect_harness, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    project(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sft = sft_run(uri, tmp_path)
    log_ablation(uri, "grpo_baseline_ablation", {"no_baseline": 0.2, "reinforce_with_baseline": 0.4})  # older
    newest = log_ablation(uri, "grpo_baseline_ablation", {"no_baseline": 0.25, "reinforce_with_baseline": 0.5})

    result = report(ReportParams(tracking_uri=uri, title="Test report"))

    out = tmp_path / "outputs/report"
    md = (out / "report.md").read_text()
    assert md.startswith("# Test report")
    assert "Settings: `params.yaml` with profile `cpu`." in md
    # The headline: each stage before it trained (where it evaluated its starting model) → after, ± its standard
    # error, and the change paired on the same problems; these rows are scored on different sets, and it says so.
    assert "| stage | scored on | accuracy | change | format rate |" in md
    assert "| Zero-shot baseline |  | 0.250 |  | 0.500 |" in md
    assert "| SFT (best setting) | arithmetic:16:1 | 0.000 → 0.300 |  | 0.100 → 0.950 |" in md  # as its run recorded
    assert "| Expert Iteration (best) |  | 0.350 |  | 0.970 |" in md
    assert "| GRPO (best) | validation.jsonl | 0.200 ± 0.100 → 0.450 ± 0.110 | +0.250 ± 0.090 | 0.500 → 0.990 |" in md
    assert "The rows are scored on different problems" in md
    assert "paired on the 20 problems both scored: **+0.250 ± 0.090**" in md
    assert "Steps with no learning signal (every group's rewards equal, so every advantage 0): 1 of 2 (step 1)" in md
    assert "Settings: model `smollm2-135m-instruct`." in md  # the profile's override, as the stage ran
    assert "| format0_answer0 | format not followed | 4 | 0.500 |" in md
    assert "Of the 4 format-0 responses, 1 contain a correct answer" in md
    assert "Finish reasons: length 3, stop 5; `length` responses hit `max_tokens`." in md
    # no selection split in these rows: the best is named as chosen on the problems that score it
    assert (
        "Best: **filtered** at 0.300 (chosen on the same problems that score it" in md
        and "| teacher | 10 | 0 | 6 | 0.600 | 0.800 |" in md
    )
    assert "Settings: n_grpo_steps `2`, validation_data `../shared/data/math/validation.jsonl`. One run." in md
    assert "Final validation accuracy: **0.450**." in md
    # SFT: the settings its MLflow run recorded, the steps it ran (not "epochs 2"), a link to the run.
    assert (
        "Settings (as the run recorded them): model `smollm2-sft`, train_data `arithmetic:64:1`, "
        "validation_data `arithmetic:16:1`, sizes `['full']`. Optimizer steps run: 128 8, filtered 4." in md
    )
    assert "epochs" not in md
    assert (
        f"MLflow run [`{sft['mlflow_run_id'][:12]}`]({sft['mlflow_run_url']}) (experiment `sft_experiment`); "
        "registered model `a5-sft` version 3 (filtered)." in md
    )
    # The difficulty table.
    assert "## Questions by difficulty" in md and "mean pass rate **0.400**" in md
    assert "| sometimes solved | 0.500 |" in md
    assert "not run" not in md
    figures = re.findall(r"!\[[^\]]*\]\(figures/([^)]+)\)", md)
    assert figures == [
        "sft_experiment_accuracy_vs_step.png",
        "expert_iteration_accuracy_vs_step.png",
        "grpo_accuracy_vs_step.png",
        "grpo_accuracy_vs_wall_clock.png",
        "grpo_token_entropy_vs_step.png",
        "difficulty_pass_rate_histogram.png",
        "ablation_grpo_baseline_ablation_val_accuracy.png",
    ]
    for name in figures:
        assert (out / "figures" / name).stat().st_size > 1000
    # The ablation: its newest run only, one row per child.
    assert f"MLflow run `{newest}`, 2 settings." in md
    assert "| reinforce_with_baseline | 0.500 | 1.000 | 10.000 |" in md and "| 0.400 |" not in md
    assert (out / "baseline_cases.md").read_text() == CASES and "[baseline_cases.md](baseline_cases.md)" in md

    page = (out / "report.html").read_text()
    assert page.count('<img src="data:image/png;base64,') == len(figures)
    assert "<td>format0_answer0</td>" in page and "<strong>0.450</strong>" in page
    # The case report is in the page, rendered (a longer fence keeps the ``` inside it, escaped), so
    # report.html needs nothing beside it: every link is a web address or a data URI.
    assert '<details id="baseline-cases"><summary>Examples of each category' in page
    assert "<h2>format1_answer1 (2)</h2>" in page and "<code>4</code>" in page
    assert "<pre><code>x &lt;script&gt;alert(7)&lt;/script&gt;\n```\nstill inside</code></pre>" in page
    assert all(link.startswith(("http://", "data:image/png")) for link in re.findall(r'(?:href|src)="([^"]*)"', page))
    assert f'<a href="{sft["mlflow_run_url"]}">' in page

    assert result["sections"] == {
        "baseline": True,
        "sft": True,
        "ei": True,
        "grpo": True,
        "ablations": 1,
        "difficulty": True,
    }
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(result["mlflow_run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "report"
    assert run.data.metrics == {
        "baseline_accuracy": 0.25,
        "baseline_format_rate": 0.5,
        "sft_best_accuracy": 0.3,
        "sft_best_format_rate": 0.95,
        "sft_best_initial_accuracy": 0.0,
        "sft_best_initial_format_rate": 0.1,
        "ei_best_accuracy": 0.35,
        "ei_best_format_rate": 0.97,
        "grpo_best_accuracy": 0.45,
        "grpo_best_accuracy_se": 0.11,
        "grpo_best_format_rate": 0.99,
        "grpo_best_initial_accuracy": 0.2,
        "grpo_best_initial_accuracy_se": 0.1,
        "grpo_best_initial_format_rate": 0.5,
        "grpo_best_change": 0.25,
        "grpo_best_change_se": 0.09,
    }
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"report.md", "report.html", "figures", "baseline_cases.md"}  # not the folder's marker
    # The run spans the report's making (its start before the page was written).
    assert run.info.start_time <= (out / "report.html").stat().st_mtime * 1000 <= run.info.end_time


def test_missing_stages_say_not_run_and_a_rerun_replaces_the_folder(prefect_harness, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    project(tmp_path)
    report(ReportParams(log_to_mlflow=False))
    assert (tmp_path / "outputs/report/figures/grpo_accuracy_vs_step.png").is_file()
    assert (tmp_path / "outputs/report").stat().st_mode & 0o777 == (tmp_path / "outputs/grpo").stat().st_mode & 0o777

    for stale in (
        "metrics/sft_experiment.json",
        "outputs/sft_experiment/summary.json",
        "metrics/sft_data.json",
        "data/sft/sizes.json",
        "metrics/grpo.json",
        "outputs/grpo/summary.json",
        "outputs/grpo/accuracy_vs_step.png",
        "outputs/baseline_eval/report.md",
    ):
        (tmp_path / stale).unlink()
    result = report(ReportParams(log_to_mlflow=False))
    md = (tmp_path / "outputs/report/report.md").read_text()
    assert "SFT sweep: not run." in md and "GRPO: not run." in md and "Expert Iteration: not run." not in md
    assert "| SFT (best setting) |  | not run |" in md and "| GRPO (best) |  | not run |" in md
    assert "GRPO ablations: not run" in md  # no MLflow store here; none is created to find that out
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "outputs/report/figures/grpo_accuracy_vs_step.png").exists()  # the whole folder was replaced
    assert not (tmp_path / "outputs/report/baseline_cases.md").exists()
    assert result["sections"]["sft"] is False and result["mlflow_run_id"] is None
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == [
        "baseline_eval",
        "difficulty",
        "expert_iteration",
        "grpo",
        "report",
        "sft_experiment",
    ]


def test_nothing_run_yet(prefect_harness, tmp_path):
    (tmp_path / "metrics").mkdir()  # a pipeline begun, no stage finished
    report(
        ReportParams(
            root=str(tmp_path),
            output_dir=str(tmp_path / "r"),
            params_file=None,
            ablations_from_mlflow=False,
            log_to_mlflow=False,
        )
    )
    md = (tmp_path / "r/report.md").read_text()
    assert md.count("| not run |") == 4 and "Baseline evaluation: not run." in md and "figures/" not in md
    assert "Not read (`ablations_from_mlflow: false`)." in md


def test_cli_reads_its_section_and_refuses_to_replace_a_foreign_folder(prefect_harness, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    project(tmp_path, stages=("baseline",))
    main(["--config", "params.yaml", "--log-to-mlflow", "false"])
    printed = capsys.readouterr().out
    assert (
        "Zero-shot baseline: accuracy 0.250, format rate 0.500" in printed
        and "GRPO (best): accuracy not run" in printed
    )
    assert (tmp_path / "outputs/report/report.md").read_text().startswith("# Test report")

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere/keep.txt").write_text("mine")
    with pytest.raises(SystemExit):
        main(["--config", "params.yaml", "--log-to-mlflow", "false", "--output-dir", "elsewhere"])
    assert "output_dir elsewhere: holds files a5 did not write (keep.txt)" in capsys.readouterr().err
    assert (tmp_path / "elsewhere/keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left behind


def files_under(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cli_replaces_only_a_folder_a_report_made(prefect_harness, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    project(tmp_path, stages=("baseline",))
    write(tmp_path / "outputs/baseline_eval/records.jsonl", '{"response": "kept"}\n')
    stage = files_under(tmp_path / "outputs/baseline_eval")
    assert {"records.jsonl", "summary.json", "report.md"} <= set(stage)

    # The baseline's folder holds a report.md too: that does not make it a report folder.
    with pytest.raises(SystemExit):
        main(["--config", "params.yaml", "--log-to-mlflow", "false", "--output-dir", "outputs/baseline_eval"])
    message = capsys.readouterr().err
    assert (
        "--output-dir 'outputs/baseline_eval': Value error, output_dir outputs/baseline_eval: holds files a5 "
        in message
    )
    assert "records.jsonl, report.md, summary.json" in message
    assert files_under(tmp_path / "outputs/baseline_eval") == stage
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["baseline_eval"]  # no temporary folder left

    # Its own folder (marked) is replaced whole, whatever was added to it since.
    main(["--config", "params.yaml", "--log-to-mlflow", "false", "--output-dir", "outputs/mine"])
    assert (tmp_path / "outputs/mine/.a5-report").is_file()
    write(tmp_path / "outputs/mine/figures/stale.png", "old")
    main(["--config", "params.yaml", "--log-to-mlflow", "false", "--output-dir", "outputs/mine"])
    assert not (tmp_path / "outputs/mine/figures/stale.png").exists()
    assert (tmp_path / "outputs/mine/report.md").read_text().startswith("# Test report")

    # A user's own report.md and figures, without the marker: refused whatever the names, and kept.
    (tmp_path / "outputs/mine/.a5-report").unlink()
    write(tmp_path / "outputs/mine/figures/accuracy.png", "their plot")
    theirs = files_under(tmp_path / "outputs/mine")
    with pytest.raises(SystemExit):
        main(["--config", "params.yaml", "--log-to-mlflow", "false", "--output-dir", "outputs/mine"])
    assert (
        "output_dir outputs/mine: holds files a5 did not write (baseline_cases.md, figures" in capsys.readouterr().err
    )
    assert files_under(tmp_path / "outputs/mine") == theirs
    assert files_under(tmp_path / "outputs/baseline_eval") == stage


def test_html_escapes_what_settings_and_files_hold_and_links_only_http_and_relative(
    prefect_harness, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    project(tmp_path, stages=("baseline",))
    write(
        tmp_path / "params.yaml",
        yaml.safe_dump(
            {
                "baseline_eval": {
                    "model": "[x](javascript:alert(1))",  # in a code span: literal text
                    "prompt": "<script>alert(2)</script>",
                    "max_tokens": "a` [y](javascript:alert(3)) `b",  # closes the code span: the link stands outside it
                    "temperature": "[z](JaVaScRiPt:alert(4))",
                },
                "report": {},
            }
        ),
    )
    write(
        tmp_path / "metrics/grpo.json",
        [{"setting": "[w](data:text/html,<script>alert(5)</script>)", "final_accuracy": 0.5}],
    )
    main(["--config", "params.yaml", "--log-to-mlflow", "false", "--title", "<script>alert(6)</script>"])

    page = (tmp_path / "outputs/report/report.html").read_text()
    assert re.findall(r"href=\"([^\"]*)\"", page) == []  # no link from settings or files
    assert "<script" not in page.lower()
    assert "<code>[x](javascript:alert(1))</code>" in page and "&lt;script&gt;alert(2)&lt;/script&gt;" in page
    assert "[y](javascript:alert(3))" in page and "[z](JaVaScRiPt:alert(4))" in page
    assert "<strong>0.500</strong> ([w](data:text/html,&lt;script&gt;alert(5)&lt;/script&gt;))." in page  # best setting
    assert "<td>[w](data:text/html,&lt;script&gt;alert(5)&lt;/script&gt;)</td>" in page
    assert "<h1>&lt;script&gt;alert(6)&lt;/script&gt;</h1>" in page

    assert (
        _inline_html("[docs](https://example.com/a?b=1&c=2)") == '<a href="https://example.com/a?b=1&amp;c=2">docs</a>'
    )
    assert (
        _inline_html("see [**cases**](baseline_cases.md#top)")
        == 'see <a href="baseline_cases.md#top"><strong>cases</strong></a>'
    )
    for link in ("\x01javascript:alert(1)", "vbscript:x", "file:///etc/passwd", "http:evil"):
        assert "href" not in _inline_html(f"[a]({link})")


def test_a_root_without_pipeline_outputs_is_an_error(prefect_harness, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "no-such-checkout"
    with pytest.raises(SystemExit, match=f"flows.report: error: --root {missing} does not exist"):
        main(["--root", str(missing), "--log-to-mlflow", "false"])

    empty = tmp_path / "fresh-clone"
    write(empty / "params.yaml", yaml.safe_dump({"profile": "cpu"}))
    (empty / "outputs/report").mkdir(parents=True)  # a report's folder is not a stage's output
    with pytest.raises(
        SystemExit,
        match=re.escape(
            f"flows.report: error: {empty} holds no pipeline outputs (metrics/, "
            "outputs/): run `make pipeline` first or pass --root"
        ),
    ):
        main(["--root", str(empty), "--log-to-mlflow", "false"])
    assert not (tmp_path / "outputs").exists()  # nothing written


@pytest.fixture
def plotted(monkeypatch):
    """The figures plot_curves saves, kept for their axes to be read."""
    figures, save = [], matplotlib.figure.Figure.savefig

    def keep(figure, *args, **kwargs):
        figures.append(figure)
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return figures


def test_plots_of_0_1_metrics_span_0_to_1_and_steps_get_integer_ticks(tmp_path, plotted):
    def axes(rows, x, y):
        plot_curves(tmp_path / f"{y}.png", rows, x, y, "run", y)
        assert (tmp_path / f"{y}.png").stat().st_size > 1000
        return plotted[-1].axes[0]

    def integer_ticks(ax):
        return all(float(t).is_integer() for t in ax.get_xticks())

    flat = axes([{"run": "a", "step": s, "val_accuracy": 0.0} for s in range(3)], "step", "val_accuracy")
    assert flat.get_ylim() == pytest.approx((-0.02, 1.02)) and integer_ticks(flat)
    for y in ("format_rate", "reward_mean", "clip_fraction", "val/accuracy"):
        assert axes(
            [{"run": "a", "step": s, y: 0.9 + s / 100} for s in range(2)], "step", y
        ).get_ylim() == pytest.approx((-0.02, 1.02))
    rounds = axes([{"run": "a", "round": float(r), "train_accuracy": 1.0} for r in range(3)], "round", "train_accuracy")
    assert integer_ticks(rounds)

    # Anything else is autoscaled: other metrics, a learning rate, a "reward" outside [0, 1], wall-clock seconds.
    entropy = axes(
        [{"run": "a", "wall_seconds": s * 0.7, "token_entropy": 2.0 + s} for s in range(3)],
        "wall_seconds",
        "token_entropy",
    )
    assert entropy.get_ylim()[0] > 1.5 and not integer_ticks(entropy)
    assert (
        axes(
            [{"run": "a", "step": s, "learning_rate": 1e-5 * (s + 1)} for s in range(3)], "step", "learning_rate"
        ).get_ylim()[1]
        < 1e-3
    )
    assert (
        axes([{"run": "a", "step": s, "reward_total": 3.0 * s} for s in range(3)], "step", "reward_total").get_ylim()[1]
        > 5
    )


def test_the_best_row_is_chosen_on_the_selection_split_where_there_is_one():
    """A stage that kept a selection split: its best row is the best there, whatever the scored accuracies say."""
    from tasks.report_sections import _best, _chosen_on

    rows = [
        {"setting": "a", "selection_accuracy": 0.5, "final_accuracy": 0.1},
        {"setting": "b", "selection_accuracy": 0.2, "final_accuracy": 0.9},
    ]
    best = _best(rows)
    assert best["setting"] == "a" and "chosen on the selection split" in _chosen_on(best, rows)
    plain = [{k: v for k, v in r.items() if k != "selection_accuracy"} for r in rows]
    assert _best(plain)["setting"] == "b" and "biased upward" in _chosen_on(_best(plain), plain)


def test_the_headline_says_whether_every_row_is_scored_on_the_same_problems():
    from tasks.report_sections import headline, scored_sets_note

    same = {"validation_data": "arithmetic:32:1", "val_limit": 32}
    settings = {
        "baseline_eval": {"data": "arithmetic:32:1", "limit": 32},
        "sft_experiment": same,
        "expert_iteration": same,
        "grpo": same,
    }
    metrics = {f"{p}_accuracy": 0.5 for p in ("baseline", "sft_best", "ei_best", "grpo_best")}
    metrics |= {"grpo_best_initial_accuracy": 0.3, "grpo_best_change": 0.2, "grpo_best_change_se": 0.05}
    rows = headline(metrics, settings)
    assert {row["scored on"] for row in rows} == {"arithmetic:32:1 (first 32)"}
    assert rows[-1]["accuracy"] == "0.300 → 0.500" and rows[-1]["change"] == "+0.200 ± 0.050"
    assert scored_sets_note(rows).startswith("Every row is scored on the same problems, arithmetic:32:1 (first 32):")
    # a sweep's SFT row is scored apart from its selection split: other problems, and the table says so
    rows = headline({**metrics, "sft_best_selection_accuracy": 0.4}, settings)
    assert rows[1]["scored on"] == "arithmetic:32:1 (first 32, score split)"
    assert scored_sets_note(rows).startswith("The rows are scored on different problems")
