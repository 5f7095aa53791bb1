"""`dvc repro` runs the whole pipeline (prepare_data → … → grpo → report) on a tiny model from a copy of the project,
and a second repro only re-checks the data (prepare_data runs every time) and runs nothing else."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_dvc_repro_then_nothing_to_do(tmp_path, tiny_lm_dir, shared_data):
    repo = tmp_path / "a5"
    shutil.copytree(
        ROOT,
        repo,
        ignore=shutil.ignore_patterns(
            ".venv",
            ".git",
            "outputs",
            "mlruns",
            "mlflow.db",
            "tmp",
            "cache",
            "data",
            "metrics",
            "dvc.lock",
            "__pycache__",
            ".whl",
        ),
    )
    (tmp_path / "shared").symlink_to(shared_data.parent, target_is_directory=True)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["profile"] = "test"
    tiny = {"model": str(tiny_lm_dir), "backend": "hf", "max_tokens": 8}
    params["profiles"]["test"] = {
        "baseline_eval": {**tiny, "limit": 2},
        "sft_data": params["profiles"]["cpu"]["sft_data"]
        | {"distill": {**params["profiles"]["cpu"]["sft_data"]["distill"], "model": str(tiny_lm_dir), "max_tokens": 8}},
        "sft_experiment": {
            **tiny,
            "sizes": [4],
            "max_steps": 1,
            "batch_size": 2,
            "microbatch_size": 2,
            "max_seq_len": 512,  # r1_zero prompts are 215+ tiny-tokenizer tokens
            "val_subset": 2,
            "val_limit": 2,
            "eval_every": 1,
        },
        "expert_iteration": {
            **tiny,
            "train_data": "arithmetic:20:1",
            "validation_data": "arithmetic:2:1",
            "val_subset": 2,
            "val_limit": 2,
            "n_ei_steps": 1,
            "questions_per_step": 2,
            "rollouts_per_question": 2,
            "batch_size": 2,
            "microbatch_size": 2,
            "max_seq_len": 512,
        },
        "difficulty": {**tiny, "train_data": "arithmetic:20:1", "reward_fn": "arithmetic", "limit": 2, "n": 2},
        "grpo": {
            **tiny,
            "train_data": "arithmetic:20:1",
            "validation_data": "arithmetic:2:1",
            "val_subset": 2,
            "val_limit": 2,
            "eval_every": 1,
            "n_grpo_steps": 1,
            "rollout_batch_size": 4,
            "group_size": 2,
            "train_batch_size": 4,
            "gradient_accumulation_steps": 2,
        },
    }
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "DVC_NO_ANALYTICS": "1",
        "PYTHONPATH": str(repo),
    }
    env |= {"GIT_AUTHOR_NAME": "a5", "GIT_AUTHOR_EMAIL": "a5@localhost"}
    env |= {"GIT_COMMITTER_NAME": "a5", "GIT_COMMITTER_EMAIL": "a5@localhost"}
    for command in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "a clone"]):
        subprocess.run(command, cwd=repo, env=env, check=True)

    def repro():
        result = subprocess.run(["dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    first = repro()
    runs_record_a_clean_commit(repo)
    stages = ("prepare_data", "baseline_eval", "sft_data", "sft_filter", "sft", "ei", "difficulty", "grpo", "report")
    for stage in stages:
        assert f"Running stage '{stage}'" in first
    assert json.loads((repo / "outputs/baseline_eval/summary.json").read_text())["n_records"] == 2
    assert (repo / "outputs/baseline_eval/records.jsonl").is_file() and (repo / "mlflow.db").is_file()
    assert json.loads((repo / "outputs/sft_experiment/summary.json").read_text())[0]["setting"] == "4"
    assert (repo / "outputs/sft_experiment/accuracy_vs_step.png").is_file()
    assert json.loads((repo / "outputs/expert_iteration/summary.json").read_text())[0]["setting"] == "single"
    assert json.loads((repo / "outputs/grpo/summary.json").read_text())[0]["setting"] == "single"
    for metrics in (repo / "metrics").glob("*.json"):  # flat mappings of numbers: a row each in `dvc metrics show`
        values = json.loads(metrics.read_text()).values()
        assert values and all(isinstance(v, (int, float)) for v in values), metrics
    assert (repo / "data/difficulty/pass_rates.csv").read_text().count("\n") == 3  # a header and 2 questions
    assert (repo / "outputs/grpo/accuracy_vs_wall_clock.png").is_file()
    report = (repo / "outputs/report/report.md").read_text()
    assert "| GRPO (best) |" in report and "not run" not in report.split("## GRPO ablations")[0]
    assert (repo / "outputs/report/figures/grpo_accuracy_vs_step.png").is_file() and (
        repo / "outputs/report/report.html"
    ).is_file()

    def stages_run(output: str) -> list[str]:
        return re.findall(r"Running stage '(\w+)'", output)

    assert stages_run(repro()) == ["prepare_data"]  # the data check; its unchanged manifest re-runs nothing

    def dvc(*args):
        result = subprocess.run(["dvc", *args], cwd=repo, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    screens_read_at_120_columns(repo, env)

    # The learning curves render (`dvc plots show`), and a local remote round-trips every cached output.
    dvc("plots", "show", "-o", str(tmp_path / "plots"))
    assert (tmp_path / "plots/index.html").stat().st_size > 0
    dvc("remote", "add", "-d", "local", str(tmp_path / "remote"))
    dvc("push")
    records = (repo / "outputs/baseline_eval/records.jsonl").read_bytes()
    shutil.rmtree(repo / ".dvc/cache")
    (repo / "outputs/baseline_eval/records.jsonl").unlink()
    (repo / "data/sft/math_solutions.jsonl").unlink()
    dvc("pull")
    assert (repo / "outputs/baseline_eval/records.jsonl").read_bytes() == records
    assert (repo / "data/sft/math_solutions.jsonl").stat().st_size > 0
    assert stages_run(repro()) == ["prepare_data"]  # what was pulled is what the pipeline made


def runs_record_a_clean_commit(repo: Path) -> None:
    """After the pipeline, git sees nothing changed but DVC's lock file (untracked: DVC refuses a git-ignored one,
    and what it records differs from machine to machine), and every MLflow run names its commit as clean."""
    import sqlite3

    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, check=True)
    assert status.stdout.splitlines() == ["?? dvc.lock"], status.stdout
    with sqlite3.connect(repo / "mlflow.db") as store:
        dirty = store.execute("select run_uuid, value from tags where key = 'git.dirty'").fetchall()
        runs = store.execute("select count(*) from runs").fetchone()[0]
    assert len(dirty) == runs > 0 and {value for _, value in dirty} == {"false"}, dirty


def screens_read_at_120_columns(repo: Path, env: dict[str, str]) -> None:
    """What a user reads in a terminal of 120 columns once the pipeline ran: `dvc metrics show`, every stage's
    headline numbers (no "-" row); and, with the run committed and an experiment that changed a setting, `make
    exps` (dvc exp show, narrowed): the experiments with the setting that differs and GRPO's accuracy and change.
    Nothing wider than the terminal, no column folded to "…"."""
    env = {**env, "COLUMNS": "120", "GIT_AUTHOR_NAME": "a5", "GIT_AUTHOR_EMAIL": "a5@localhost"}
    env |= {"GIT_COMMITTER_NAME": "a5", "GIT_COMMITTER_EMAIL": "a5@localhost"}

    def run(*command: str) -> list[str]:
        result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout.splitlines()

    shown = run("dvc", "metrics", "show")
    assert max(map(len, shown)) <= 120, "\n".join(shown)
    for stage in ("baseline_eval", "sft_data", "sft_experiment", "expert_iteration", "difficulty", "grpo"):
        (row,) = [line for line in shown if line.startswith(f"metrics/{stage}.json")]
        assert re.search(r"\d", row.split(None, 1)[1]), row
    run("git", "add", "-A")
    run("git", "commit", "-qm", "the pipeline, run")
    run("dvc", "exp", "save", "-n", "first")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["profiles"]["test"]["grpo"]["learning_rate"] = 3e-4
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run("dvc", "exp", "save", "-n", "faster")
    table = run("make", "-s", "exps")
    assert max(map(len, table)) <= 120 and "…" not in "\n".join(table), "\n".join(table)
    assert "metrics/grpo.json:accuracy" in table[1] and "profiles.test.grpo.learning_rate" in table[1], table[1]
    assert any("[faster]" in line and "0.0003" in line for line in table), "\n".join(table)


# ------------------------------------------------------------------------------ what a stage depends on


def project_imports(module: str) -> set[str]:
    """The project's files (a5core, tasks, flows) that ``module`` imports, transitively, at any depth of a
    function (a lazy import decides the code path too), packages' __init__ included."""
    import ast

    def file_of(name: str) -> Path | None:
        path = ROOT / Path(*name.split("."))
        return next((p for p in (path / "__init__.py", path.with_suffix(".py")) if p.is_file()), None)

    seen: set[Path] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        path = file_of(name)
        if path is None or path in seen:
            continue
        seen.add(path)
        todo += [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]  # the packages above
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                todo += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return {str(path.relative_to(ROOT)) for path in seen}


def test_every_stage_depends_on_the_code_its_command_runs():
    """A stage's deps cover every project file its command imports: a5core, tasks and the flows modules,
    flows/params.py (the parameters' defaults) among them."""
    for name, stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items():
        deps = [str(d) for d in stage["deps"]]
        for module in set(re.findall(r"python -m (flows\.\w+)", stage["cmd"])):
            uncovered = [f for f in project_imports(module) if not any(f == d or f.startswith(d + "/") for d in deps)]
            assert not uncovered, (name, uncovered)


def test_a_changed_default_shows_in_dvc_status(tmp_path):
    """With the grpo stage's state recorded, changing a default it uses, in a loop's settings (a5core) or in the
    flow's parameters (flows/params.py), makes `dvc status` name the stage and the changed code (its outputs
    stand in as empty files: nothing runs)."""
    repo = tmp_path / "a5"
    for part in ("a5core", "tasks", "flows", ".dvc"):
        shutil.copytree(ROOT / part, repo / part, ignore=shutil.ignore_patterns("__pycache__", "tmp", "cache"))
    for name in ("dvc.yaml", "params.yaml", ".dvcignore"):
        shutil.copy(ROOT / name, repo / name)
    stage = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]["grpo"]
    for path in [d for d in stage["deps"] if not (repo / d).exists()] + [
        out if isinstance(out, str) else next(iter(out)) for out in stage["outs"] + stage["metrics"]
    ]:
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text("{}\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)

    def dvc(*args: str) -> str:
        result = subprocess.run(["dvc", *args], cwd=repo, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    dvc("commit", "--force", "grpo")
    assert "up to date" in dvc("status", "grpo")
    # AdamW's beta2 (every loop's, a5core/loops/settings.py), then the grpo flow's own val_subset (flows/params.py)
    for code, dep, default, changed in [
        ("a5core/loops/settings.py", "a5core", "beta2: float = Field(0.95,", "beta2: float = Field(0.9,"),
        ("flows/params.py", "flows/params.py", "val_subset: int = inherited(1024)", "val_subset: int = inherited(99)"),
    ]:
        before = (repo / code).read_text()
        assert before.count(default) == 1, (code, default)
        (repo / code).write_text(before.replace(default, changed))
        status = dvc("status", "grpo")
        assert "grpo:" in status and "modified:" in status and dep in status, status
        (repo / code).write_text(before)
        assert "up to date" in dvc("status", "grpo")
