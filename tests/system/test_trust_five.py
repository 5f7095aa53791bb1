"""What the flows that only read (verdicts, compare, reproduce) and the settings file do with hostile input, through
the commands a user types: a file that is no MLflow store is refused and left byte for byte as it was, a missing
store is never created, special files (FIFOs, /proc, devices) are refused before they are opened, one damaged or
non-finite run is left out and named rather than spoiling its store or its verdict, what a store says is escaped
in the pages, a folder's link is not written through, a run started from a deployment reads nothing outside the
project, and `dvc repro` runs from a shell that never activated the project's environment.

Each command runs in this process (``main(argv)``) where nothing can hang; a FIFO and a fresh shell run as child
processes, each with a generous deadline against a hang (never a timing assertion).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_bad_input import flags, inputs, user_error  # noqa: F401  (inputs: a fixture)
from verdict_runs import BASE

REPO = Path(__file__).resolve().parents[2]
EXPECT = "reinforce_with_baseline >= no_baseline"
SETTINGS = {"no_baseline": {"loss_type": "no_baseline"}, "reinforce_with_baseline": {}}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------------------ helpers


def users_database(path: Path) -> Path:
    """A user's own SQLite file, no MLflow store: a ``people`` table with a row."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE people (name TEXT)")
        db.execute("INSERT INTO people VALUES ('ann')")
        db.commit()
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tables(path: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return sorted(row[0] for row in db.execute("SELECT name FROM sqlite_master"))


def accuracy(seed: int, setting: str) -> float:
    """A run's planted result: reinforce_with_baseline ahead of no_baseline by 0.07 or 0.09 (even, odd seeds)."""
    return 0.4 + seed / 100 + (0.08 + (0.01 if seed % 2 else -0.01) if setting == "reinforce_with_baseline" else 0)


def planted_store(database: Path, bad=None, group: str = "grpo_baseline_ablation", seeds=range(5), records=None):
    """An MLflow store at ``database``: an ablation's parent run and, for each seed, a ``no_baseline`` and a
    ``reinforce_with_baseline`` child with ``final_val_accuracy`` :func:`accuracy` (else ``bad[seed, setting]``; and
    val_accuracy at steps 0 and 5); ``records(seed, setting)``: the text of a child's provenance.json (None: none).
    Returns the child run ids by (seed, setting)."""
    import mlflow

    value = lambda seed, setting: (bad or {}).get((seed, setting), accuracy(seed, setting))  # noqa: E731
    database.parent.mkdir(parents=True, exist_ok=True)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{database}")
    experiment = client.create_experiment("grpo", artifact_location=str(database.parent / "mlruns"))
    parent = client.create_run(experiment, run_name=group, tags={"ablation": group}).info.run_id
    ids = {}
    for seed in seeds:
        for setting, changes in SETTINGS.items():
            run = client.create_run(experiment, run_name=f"grpo-{setting}", tags={"mlflow.parentRunId": parent})
            rid = run.info.run_id
            for key, val in {**BASE, **changes, "setting": setting, "seed": str(seed)}.items():
                client.log_param(rid, key, val)
            final = value(seed, setting)
            client.log_metric(rid, "final_val_accuracy", final, step=5)
            client.log_metric(rid, "val_accuracy", 0.1, step=0)
            client.log_metric(rid, "val_accuracy", final, step=5)
            text = records(seed, setting) if records else None
            if text is not None:
                client.log_text(rid, text, "provenance.json")
            client.set_terminated(rid)
            ids[seed, setting] = rid
    client.set_terminated(parent)
    return ids


def command_error(module: str, argv: list[str], capsys) -> str:
    """Run ``flows.<module>``'s main, which must end with one line on stderr (status 1, or 2 for a parameter a
    flag gave): that line."""
    import importlib

    main = importlib.import_module(f"flows.{module}").main
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    code = stopped.value.code
    err = capsys.readouterr().err
    if isinstance(code, str):  # status 1: the message is the exit's
        assert code.startswith(f"flows.{module}: error: ") and "\n" not in code, code
        return code
    assert code == 2, (code, err[-3000:])
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def strict_json(path: Path) -> object:
    """A JSON file read strictly: a bare NaN or Infinity in it fails the test."""
    return json.loads(path.read_text(), parse_constant=lambda word: pytest.fail(f"{path} holds a bare {word}"))


# ------------------------------------------------------------------------------------ stores opened read-only


def test_the_flows_that_read_leave_a_users_own_database_as_it_was(prefect_harness, tmp_path, monkeypatch, capsys):
    """A user's SQLite file named as a store: each flow refuses it in one line, and the file keeps its bytes and
    its one table (MLflow opened it and wrote its sixty-odd tables into it); no mlflow.db appears."""
    monkeypatch.chdir(tmp_path)
    users = users_database(tmp_path / "users.sqlite")
    before = digest(users)
    out = ["--output-dir", str(tmp_path / "out")]
    for module, argv, said in (
        (
            "verdicts",
            ["--stores", "users.sqlite", "--expect", EXPECT, *out],
            "not an MLflow store (its tables: people)",
        ),
        ("verdicts", ["--stores", "sqlite:///users.sqlite", "--expect", EXPECT, *out], "not an MLflow store"),
        ("verdicts", ["--expect", EXPECT, "--tracking-uri", "sqlite:///users.sqlite", *out], "a database of something"),
        ("compare", ["--experiment", "grpo", "--tracking-uri", "sqlite:///users.sqlite", *out], "a database of some"),
        ("reproduce", ["--run-id", "abc", "--tracking-uri", "sqlite:///users.sqlite"], "a database of something else"),
    ):
        line = command_error(module, argv, capsys)
        assert "users.sqlite" in line and said in line, line
    assert digest(users) == before and tables(users) == ["people"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["users.sqlite"]  # no mlflow.db, no out/, no mlruns/


def test_a_store_that_is_missing_or_empty_is_refused_and_never_created(prefect_harness, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = command_error("verdicts", ["--expect", EXPECT], capsys)  # the default store: sqlite:///mlflow.db
    assert f"stores sqlite:///mlflow.db: no such database file ({tmp_path / 'mlflow.db'})" in line
    assert not (tmp_path / "mlflow.db").exists()
    (tmp_path / "mlflow.db").touch()
    for module, argv in (
        ("verdicts", ["--expect", EXPECT]),
        ("compare", ["--experiment", "grpo", "--log-to-mlflow", "false"]),
        ("reproduce", ["--run-id", "abc"]),
    ):
        line = command_error(module, argv, capsys)
        assert "sqlite:///mlflow.db: not an MLflow store (an empty database); left as it is" in line, line
    assert (tmp_path / "mlflow.db").stat().st_size == 0 and sorted(os.listdir(tmp_path)) == ["mlflow.db"]


def test_a_store_verdicts_read_keeps_its_bytes(prefect_harness, tmp_path, monkeypatch):
    from flows.verdicts import main

    monkeypatch.chdir(tmp_path)
    store = tmp_path / "records/mlflow.db"
    planted_store(store)
    before = digest(store)
    main(["--stores", "records", "--expect", EXPECT, "--tracking-uri", f"sqlite:///{tmp_path / 'mine.db'}"])
    (verdict,) = strict_json(tmp_path / "outputs/verdicts/verdicts.json")["verdicts"]
    assert verdict["pairs"] == 5 and verdict["verdict"] == "agrees"
    assert digest(store) == before and not (tmp_path / "records/mlflow.db.lock").exists()


# ----------------------------------------------------------------------------------------------- special files


def test_special_files_are_refused_before_they_are_opened(inputs, tmp_path, monkeypatch, capsys):  # noqa: F811
    """/proc/self/pagemap as data (read, it grew to 13 GB), /proc/self/environ appended to a page, /dev/null and a
    FIFO as stores: one line each, nothing opened."""
    message = user_error("baseline_eval", flags("baseline_eval", inputs, tmp_path, data="/proc/self/pagemap"))
    assert "/proc/self/pagemap: a file of the operating system (/proc), not an input; not read" in message
    assert not (tmp_path / "out").exists()
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "fifo.db")
    for module, argv, said in (
        ("verdicts", ["--expect", EXPECT, "--append", "/proc/self/environ"], "append /proc/self/environ: a file of"),
        ("compare", ["--experiment", "g", "--tracking-uri", "sqlite:////dev/null"], "/dev/null: a file of the operat"),
        ("compare", ["--experiment", "g", "--tracking-uri", "sqlite:///fifo.db"], "fifo.db: a FIFO (a named pipe"),
    ):
        assert said in command_error(module, argv, capsys)


def test_a_fifo_as_a_store_is_refused_at_once(tmp_path):
    """Given a FIFO, verdicts waited on it for ever (SQLite opens it, and blocks until a writer comes)."""
    os.mkfifo(tmp_path / "runs.db")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "flows.verdicts", "--stores", "runs.db", "--expect", EXPECT]
    try:
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as expired:  # a guard against the hang, not a timing assertion
        raise AssertionError(f"verdicts waited on a FIFO:\n{expired.stderr}") from None
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("flows.verdicts: error: ")]
    assert errors == [
        "flows.verdicts: error: stores: runs.db: a FIFO (a named pipe: reading it waits for a writer), not a "
        "regular file; not read"
    ], result.stderr[-3000:]


def test_a_record_naming_a_special_file_is_refused_before_it_is_hashed(prefect_harness, tmp_path, monkeypatch):
    """A record whose data is /proc/self/pagemap: reproduce hashed it for minutes; now one line, nothing hashed."""
    import mlflow

    from flows.params import BaselineEvalParams
    from flows.reproduce import main
    from tasks.provenance import build_record

    (tmp_path / "project").mkdir()
    monkeypatch.chdir(tmp_path / "project")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("records")
    record = build_record(BaselineEvalParams(model="no-such-model-folder/", output_dir="out"))
    record["flow"] = {"name": "baseline_eval", "entrypoint": "flows.baseline_eval:baseline_eval"}
    record["settings"]["data"] = "/proc/self/pagemap"
    with mlflow.start_run() as run:
        mlflow.log_dict(record, "provenance.json")
    with pytest.raises(SystemExit) as stopped:
        main(["--run-id", run.info.run_id, "--tracking-uri", uri])
    assert stopped.value.code == (
        "flows.reproduce: error: data /proc/self/pagemap: a file of the operating system (/proc), not an input; "
        "not read"
    )
    assert not (tmp_path / "project/out").exists()


# --------------------------------------------------------------------------- one bad value, one bad record


def test_nan_and_inf_runs_are_left_out_named_and_the_json_is_strict(prefect_harness, tmp_path, monkeypatch):
    """One NaN and one inf among five pairs turned a decided comparison into "+nan ± nan, inconclusive, over 200
    pairs" and a bare NaN in verdicts.json. Now the verdict is made over the three finite pairs, the two runs are
    named in Runs left out, and the JSON is strict."""
    from flows.verdicts import main

    monkeypatch.chdir(tmp_path)
    bad = {(3, "reinforce_with_baseline"): float("nan"), (4, "no_baseline"): float("inf")}
    ids = planted_store(tmp_path / "mlflow.db", bad=bad)
    # three pairs: a confidence sequence is unbounded there, so the fixed-sample rule shows the decision
    main(["--expect", EXPECT, "--log-to-mlflow", "false", "--method", "fixed"])
    found = strict_json(tmp_path / "outputs/verdicts/verdicts.json")
    (verdict,) = found["verdicts"]
    assert verdict["pairs"] == 3 and verdict["verdict"] == "agrees"
    assert abs(verdict["mean"] - (0.07 + 0.09 + 0.07) / 3) < 1e-9  # seeds 0, 1, 2
    why = {entry["run_id"]: entry["why"] for entry in found["left_out"]}
    assert why[ids[3, "reinforce_with_baseline"]] == "final_val_accuracy is nan: not a number a verdict can use"
    assert why[ids[4, "no_baseline"]] == "final_val_accuracy is +inf: not a number a verdict can use"
    page = (tmp_path / "outputs/verdicts/verdicts.md").read_text()
    assert "## Runs left out" in page and "final_val_accuracy is nan" in page and "nan ±" not in page


def test_a_damaged_record_is_left_out_and_named_not_fatal_to_its_store(prefect_harness, tmp_path, monkeypatch):
    """provenance.json as a list, nested past Python's reader, or a FIFO: verdicts stopped on the whole store (or
    waited on the FIFO); now those runs are left out, each named with what is wrong, and the rest decide."""
    from flows.verdicts import main

    monkeypatch.chdir(tmp_path)
    damage = {(0, "no_baseline"): "[1, 2]", (1, "no_baseline"): "[" * 100_000 + "]" * 100_000}
    ids = planted_store(tmp_path / "mlflow.db", records=lambda seed, setting: damage.get((seed, setting)))
    import mlflow

    artifacts = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(ids[2, "no_baseline"]).info
    folder = Path(artifacts.artifact_uri.removeprefix("file://"))
    folder.mkdir(parents=True, exist_ok=True)
    os.mkfifo(folder / "provenance.json")
    main(["--expect", EXPECT, "--log-to-mlflow", "false"])
    found = strict_json(tmp_path / "outputs/verdicts/verdicts.json")
    why = {entry["run_id"]: entry["why"] for entry in found["left_out"]}
    assert "provenance.json is damaged (a JSON list, not an object)" in why[ids[0, "no_baseline"]]
    assert "provenance.json is damaged (JSON nested too deeply to read)" in why[ids[1, "no_baseline"]]
    assert (
        "provenance.json is damaged (the file" in why[ids[2, "no_baseline"]] and "a FIFO" in why[ids[2, "no_baseline"]]
    )
    assert found["verdicts"][0]["pairs"] == 2  # seeds 3 and 4: the others' no_baseline run is left out


def test_an_experiment_name_too_long_for_a_folder_leaves_no_run_behind(prefect_harness, tmp_path, monkeypatch, capsys):
    """compare with a 300-character experiment failed after making a run whose folder name was too long, and that
    run broke every later verdicts on the store. Now it is refused before anything is written."""
    from flows.verdicts import main

    monkeypatch.chdir(tmp_path)
    planted_store(tmp_path / "mlflow.db")
    before = digest(tmp_path / "mlflow.db")
    line = command_error("compare", ["--experiment", "grpo", "--comparison-experiment", "x" * 300], capsys)
    assert "an experiment's name of at most 200 bytes (300 given)" in line
    assert digest(tmp_path / "mlflow.db") == before and not (tmp_path / "outputs").exists()
    main(["--expect", EXPECT, "--log-to-mlflow", "false"])
    assert strict_json(tmp_path / "outputs/verdicts/verdicts.json")["verdicts"][0]["pairs"] == 5


# -------------------------------------------------------------------------------------- what a store says


INJECTED = "x\n# Injected <script>alert(1)</script> [click](javascript:alert(1)) <img src=x onerror=alert(1)>"


def test_what_a_store_or_a_flag_says_is_shown_never_run_as_markup(prefect_harness, tmp_path, monkeypatch):
    """An ablation's name made a heading, raw HTML and a javascript: link in verdicts.md; --title and compare's
    tables passed <script> through; groups g/1 and g_1 wrote one figure file."""
    from flows.compare import main as compare
    from flows.verdicts import main

    monkeypatch.chdir(tmp_path)
    for name in (INJECTED, "g/1", "g_1"):
        planted_store(tmp_path / "stores" / hashlib.sha256(name.encode()).hexdigest()[:8] / "mlflow.db", group=name)
    main(["--stores", "stores", "--expect", EXPECT, "--title", "<script>alert(2)</script>", "--log-to-mlflow", "false"])
    out = tmp_path / "outputs/verdicts"
    page = (out / "verdicts.md").read_text()
    assert page.startswith("# &lt;script&gt;alert(2)&lt;/script&gt;\n") and "\n# Injected" not in page
    assert "x # Injected &lt;script&gt;alert(1)&lt;/script&gt; \\[click\\](javascript:alert(1))" in page  # a table
    assert_inert(page)
    figures = sorted(p.name for p in (out / "figures").iterdir())
    assert len(figures) == 3 and "g_1_val_accuracy.png" in figures, figures
    store = tmp_path / "stores" / hashlib.sha256(INJECTED.encode()).hexdigest()[:8] / "mlflow.db"
    compare(["--experiment", "grpo", "--tracking-uri", f"sqlite:///{store}", "--log-to-mlflow", "false"])
    compared = (tmp_path / "outputs/compare/comparison.md").read_text()
    assert "x # Injected &lt;script&gt;" in compared
    assert_inert(compared)


def assert_inert(markdown: str) -> None:
    """``markdown`` rendered (CommonMark and tables, every link taken as a renderer might) holds no script, image,
    javascript: link or heading of a store's making (the page's own figures aside)."""
    from markdown_it import MarkdownIt

    renderer = MarkdownIt("commonmark").enable("table")
    renderer.validateLink = lambda url: True
    html = renderer.render(markdown)
    for raw in ("<script", "<img src=x", 'href="javascript:', "<h1>Injected", "<h1>x"):
        assert raw not in html, (raw, html)


def test_a_figures_link_is_not_written_through(prefect_harness, tmp_path, monkeypatch, capsys):
    from flows.verdicts import main

    monkeypatch.chdir(tmp_path)
    planted_store(tmp_path / "mlflow.db")
    argv = ["--expect", EXPECT, "--log-to-mlflow", "false"]
    main(argv)
    figures = tmp_path / "outputs/verdicts/figures"
    shutil.rmtree(figures)
    (tmp_path / "elsewhere").mkdir()
    figures.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    line = command_error("verdicts", argv, capsys)
    assert f"output_dir outputs/verdicts: figures is a link (to {tmp_path / 'elsewhere'})" in line
    assert list((tmp_path / "elsewhere").iterdir()) == []


# ----------------------------------------------------------------------------------- one line, not a traceback


@contextlib.contextmanager
def health_only_server(api_answers: bool) -> Iterator[str]:
    """A server whose /health says OK as MLflow's does, and whose API answers with a web page (or not at all)."""
    hang = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path != "/health" and not api_answers:
                hang.wait(60)
                return
            body = b"OK" if self.path == "/health" else b"<html><body>Welcome</body></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        hang.set()
        server.shutdown()
        server.server_close()


def test_what_gave_tracebacks_ends_in_one_line(prefect_harness, tmp_path, monkeypatch, capsys):
    """An output folder under a file, a record whose output folder is a file, a folder or file:// as a store, a
    server whose /health answers but whose API is a web page or never answers."""
    import mlflow

    from flows.params import BaselineEvalParams
    from tasks.provenance import build_record

    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("mine\n")
    planted_store(tmp_path / "mlflow.db")
    cases = [
        ("verdicts", ["--expect", EXPECT, "--output-dir", "README.md/sub"], f"{tmp_path / 'README.md'} is a file"),
        ("compare", ["--experiment", "grpo", "--output-dir", "README.md/sub"], f"{tmp_path / 'README.md'} is a file"),
        ("compare", ["--experiment", "grpo", "--tracking-uri", "mlruns"], "not the address of an MLflow store"),
        ("compare", ["--experiment", "grpo", "--tracking-uri", f"file://{tmp_path}/mlruns"], "not the address of an"),
        ("verdicts", ["--expect", EXPECT, "--stores", "file:///x"], "not the address of an MLflow store"),
    ]
    with health_only_server(api_answers=True) as web:
        cases.append(("compare", ["--experiment", "g", "--tracking-uri", web], "GET its API (/api/2.0/mlflow/exp"))
        for module, argv, said in cases:
            line = command_error(module, argv, capsys)
            assert said in line, line
    with health_only_server(api_answers=False) as hung:
        for module, argv in (
            ("compare", ["--experiment", "g", "--tracking-uri", hung]),
            ("verdicts", ["--expect", EXPECT, "--tracking-uri", hung]),  # where it logs: checked before it reads
        ):
            line = command_error(module, argv, capsys)
            assert f"MLflow tracking server {hung}: /health answers, but its API gives no answer within 10 s" in line
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_experiment("records")
    record = build_record(BaselineEvalParams(model="no-such-model-folder/", output_dir="out"))
    record["flow"] = {"name": "baseline_eval", "entrypoint": "flows.baseline_eval:baseline_eval"}
    record["settings"]["output_dir"] = "README.md"
    with mlflow.start_run() as run:
        mlflow.log_dict(record, "provenance.json")
    line = command_error("reproduce", ["--run-id", run.info.run_id, "--allow-differences"], capsys)
    assert "the run's record puts its outputs in 'README.md', a file, not a folder; give the re-run's folder" in line
    assert (tmp_path / "README.md").read_text() == "mine\n"


def test_an_infinite_point_of_a_compared_curve_is_left_out_of_its_plot(prefect_harness, tmp_path, monkeypatch):
    """±inf in a curve stopped compare with numpy's "arange: cannot compute length"."""
    import mlflow

    from flows.compare import main

    monkeypatch.chdir(tmp_path)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("grpo", artifact_location=str(tmp_path / "mlruns"))
    for name, points in (("a", [0.1, float("inf"), 0.3]), ("b", [0.2, float("-inf"), float("nan")])):
        rid = client.create_run(experiment, run_name=name).info.run_id
        for step, point in enumerate(points):
            client.log_metric(rid, "val_accuracy", point, step=step)
        client.log_metric(rid, "final_val_accuracy", points[-1])
        client.set_terminated(rid)
    main(["--experiment", "grpo", "--log-to-mlflow", "false"])
    assert (tmp_path / "outputs/compare/val_accuracy_vs_step.png").stat().st_size > 1000
    rows = strict_json(tmp_path / "outputs/compare/comparison.json")
    assert sorted((row["final_val_accuracy"] is None, row["final_val_accuracy"]) for row in rows) == [
        (False, 0.3),
        (True, None),
    ]


# ------------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "text, said",
    [
        ("compare: {}\ngrpoo: {}\n", "unknown section `grpoo`, read by no flow (did you mean grpo?)"),
        (
            "compare: {}\nprofile: cpu\nprofiles:\n  cpu:\n    baseline_evl: {limit: 4}\n",
            "unknown section `profiles.cpu.baseline_evl`, read by no flow (did you mean profiles.cpu.baseline_eval?)",
        ),
    ],
)
def test_a_misspelt_section_is_refused_with_the_nearest_name(text, said, tmp_path, capsys):
    """A section no flow reads (at the top, or in a profile) changed nothing, with status 0: `dvc exp run -S
    profiles.cpu.<typo>.x=...` did nothing."""
    (tmp_path / "p.yaml").write_text(text)
    line = command_error("compare", ["--config", str(tmp_path / "p.yaml"), "--experiment", "g"], capsys)
    assert said in line, line


def test_torchrun_leftovers_with_its_run_id_are_named_and_refused(inputs, tmp_path, monkeypatch):  # noqa: F811
    """TORCHELASTIC_RUN_ID among the variables another launch left in a shell: the run waited 30 minutes for ranks
    that never came, deaf to Ctrl-C. This process was started by no torchrun: one line naming them, before the
    command writes anything."""
    from servers import free_port

    from a5core.runtime.distributed import LAUNCH_VARIABLES

    for name in LAUNCH_VARIABLES:  # an in-process vLLM engine on the CPU sets LOCAL_WORLD_SIZE in this process
        monkeypatch.delenv(name, raising=False)
    port = str(free_port())
    leftovers = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    for name, value in {**leftovers, "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    before = sorted(os.listdir(tmp_path))
    line = user_error("baseline_eval", flags("baseline_eval", inputs, tmp_path))
    assert (
        f"RANK=0, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT={port}, TORCHELASTIC_RESTART_COUNT=0, "
        "TORCHELASTIC_RUN_ID=none in the environment, but this process was not started by torchrun" in line
    )
    assert (
        "(unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_RESTART_COUNT "
        "TORCHELASTIC_RUN_ID)" in line
    )
    assert sorted(os.listdir(tmp_path)) == before  # no out/, metrics.json or mlflow.db


# ----------------------------------------------------------------------------------------------- deployments


def test_a_run_started_from_a_deployment_reads_nothing_outside_the_project(prefect_harness, tmp_path, monkeypatch):
    """A verdicts run started from the Prefect UI with append: [/proc/self/environ] wrote the server's environment
    into the page and MLflow. A deployment's form names files inside the project and its data folders only."""
    from pydantic import ValidationError

    from flows.verdicts import VerdictParams, verdicts

    (tmp_path / "project").mkdir()
    monkeypatch.chdir(tmp_path / "project")
    planted_store(tmp_path / "project/mlflow.db")
    (tmp_path / "secret.md").write_text("the server's own notes\n")
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "7a6b5c4d-0000-0000-0000-000000000000")
    with pytest.raises(ValidationError, match=r"append /proc/self/environ: a file of the operating system \(/proc\)"):
        VerdictParams(expect=[EXPECT], append=["/proc/self/environ"])
    for params, said in (
        ({"append": [str(tmp_path / "secret.md")]}, f"append {tmp_path / 'secret.md'}: outside this project"),
        ({"stores": [f"sqlite:///{tmp_path / 'other.db'}"]}, f"stores {tmp_path / 'other.db'}: outside this project"),
    ):
        with pytest.raises(ValueError) as refused:
            verdicts(VerdictParams(expect=[EXPECT], **params))
        assert said in str(refused.value) and "a run started from a deployment reads nothing else" in str(refused.value)
    assert not (tmp_path / "project/outputs").exists()
    monkeypatch.delenv("PREFECT__RUNTIME__DEPLOYMENT__ID")  # the command line: the user's own file, read
    result = verdicts(VerdictParams(expect=[EXPECT], append=[str(tmp_path / "secret.md")], log_to_mlflow=False))
    assert "the server's own notes" in Path(result["paths"]["page"]).read_text()


# ---------------------------------------------------------------------------------------------------- dvc repro


def test_dvc_repro_runs_from_a_fresh_shell(tmp_path, shared_data):
    """`.venv/bin/dvc repro` in a new shell (no activated environment; the `python` on PATH another interpreter):
    the stages ran `python` and stopped at the first ("python: not found"). They run the project's interpreter."""
    repo = tmp_path / "a5"
    keep = ("a5core", "tasks", "flows", "bin", ".dvc", "dvc.yaml", "params.yaml", ".dvcignore", "pyproject.toml")
    repo.mkdir()
    for name in keep:
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, repo / name)
    (repo / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)  # the environment `make setup` made
    (tmp_path / "shared").symlink_to(shared_data.parent, target_is_directory=True)
    other = tmp_path / "other-python"
    other.mkdir()
    (other / "python").write_text("#!/bin/sh\necho 'an interpreter without the project' >&2\nexit 3\n")
    (other / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PATH": f"{other}:/usr/bin:/bin", "DVC_NO_ANALYTICS": "1", "HOME": str(tmp_path / "home")}
    env |= {"GIT_AUTHOR_NAME": "a5", "GIT_AUTHOR_EMAIL": "a5@localhost", "GIT_COMMITTER_NAME": "a5"}
    env |= {"GIT_COMMITTER_EMAIL": "a5@localhost"}
    for command in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "a clone"]):
        subprocess.run(command, cwd=repo, env=env, check=True)
    try:
        result = subprocess.run(
            [str(repo / ".venv/bin/dvc"), "repro", "prepare_data"],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,  # a guard against a hang, not a timing assertion
        )
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(f"dvc repro did not end:\n{expired.stdout}\n{expired.stderr}") from None
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Running stage 'prepare_data'" in result.stdout
    assert json.loads((repo / "data/prepared/manifest.json").read_text())
