"""flows.reproduce: tiny SFT and GRPO runs, and an evaluation started as a command (``python -m``), re-run from
their provenance records reproduce exactly; a changed data file or a changed default is named and stops the
re-run; flows.compare shows two runs' records."""

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from a5core.runtime.writing import write_jsonl_atomic

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_sft(tmp_path, model):
    from test_training_flows import arithmetic_traces

    from a5core.data.arithmetic import arithmetic_problems
    from flows.params import SFTExperimentParams

    write_jsonl_atomic(tmp_path / "train.jsonl", [asdict(t) for t in arithmetic_traces(8)])
    validation = [p.__dict__ | {"type": "arithmetic"} for p in arithmetic_problems(4, digits=1, split="validation")]
    write_jsonl_atomic(tmp_path / "val.jsonl", validation)
    return SFTExperimentParams(
        model=str(model),
        backend="hf",
        train_data="train.jsonl",
        filtered_data=None,
        sizes=["full"],
        validation_data="val.jsonl",
        val_subset=2,
        val_limit=4,
        learning_rate=1e-3,
        batch_size=4,
        microbatch_size=2,
        epochs=1,
        eval_every=1,
        checkpoint_every=2,
        max_tokens=8,
        output_dir="out",
        metrics_path="metrics.json",
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )


def assert_exact(result):
    judged = [r for r in result["rows"] if r["verdict"] != "timing"]
    assert judged and all(r["verdict"] == "exact" for r in judged), [r for r in judged if r["verdict"] != "exact"]
    assert result["exact"] and result["reproduced"] and not result["differences"]


def test_sft_run_reproduces_exactly_and_a_changed_data_file_stops_it(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch, capsys
):
    import mlflow

    from flows.reproduce import DifferencesError, ReproduceParams, main, reproduce
    from flows.sft_experiment import sft_experiment

    monkeypatch.chdir(tmp_path)
    params = tiny_sft(tmp_path, tiny_lm_dir)
    original = sft_experiment(params)
    client = mlflow.MlflowClient(params.tracking_uri)
    record = json.loads(
        (tmp_path / client.download_artifacts(original["mlflow_run_id"], "provenance.json", str(tmp_path))).read_text()
    )
    assert record["flow"] == {"name": "sft_experiment", "entrypoint": "flows.sft_experiment:sft_experiment"}
    assert record["settings"]["learning_rate"] == 1e-3
    assert record["seeds"] == {"seed": params.seed, "seeds": None}  # every setting named *seed*: one run, no seeds list
    assert set(record["inputs"]) == {"model", "train_data", "validation_data"}
    assert record["inputs"]["train_data"]["hash"].startswith("sha256:")
    assert {"python", "torch", "transformers", "a5"} <= set(record["versions"]) and record["device"] == "cpu"

    result = reproduce(ReproduceParams(run_id=original["mlflow_run_id"], tracking_uri=params.tracking_uri))
    assert_exact(result)
    assert set(result["runs"]) == {"sft_experiment", "sft-full"}
    assert any(r["metric"] == "final_val_accuracy" and r["run"] == "sft-full" for r in result["rows"])
    new = client.get_run(result["mlflow_run_id"])
    assert new.data.tags["reproduces"] == original["mlflow_run_id"]
    assert new.info.run_id != original["mlflow_run_id"]

    # One trace edited: named, and nothing runs; with --allow-differences it runs anyway.
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    with pytest.raises(DifferencesError, match=r"data: train_data train\.jsonl: its contents differ"):
        reproduce(ReproduceParams(run_id=original["mlflow_run_id"], tracking_uri=params.tracking_uri))
    with pytest.raises(SystemExit, match="train_data train.jsonl"):
        main(["--run-id", original["mlflow_run_id"], "--tracking-uri", params.tracking_uri])
    allowed = reproduce(
        ReproduceParams(run_id=original["mlflow_run_id"], tracking_uri=params.tracking_uri, allow_differences=True)
    )
    assert any("train_data" in d for d in allowed["differences"]) and allowed["rows"]


def tiny_grpo(tmp_path, model):
    from test_grpo_flows import tiny_params

    return tiny_params(tmp_path, model, eval_every=2, val_limit=2)


def test_grpo_run_reproduces_exactly_and_a_changed_default_stops_it(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch, capsys
):
    from urllib.parse import urlparse

    import mlflow

    from flows.grpo import grpo_flow
    from flows.params import GRPOParams
    from flows.reproduce import DifferencesError, ReproduceParams, reproduce, show

    monkeypatch.chdir(tmp_path)
    params = tiny_grpo(tmp_path, tiny_lm_dir)
    original = grpo_flow(params)
    child = original["summary"][0]
    result = reproduce(ReproduceParams(run_id=original["mlflow_run_id"], tracking_uri=params.tracking_uri))
    assert_exact(result)
    assert set(result["runs"]) == {"grpo", "grpo-single"}
    assert {"reward_mean", "loss", "final_val_accuracy"} <= {r["metric"] for r in result["rows"]}
    assert child["setting"] == "single"
    show(result)  # the table as the command prints it
    printed = capsys.readouterr().out
    assert (
        "| grpo-single | final_val_accuracy |" in printed
        and f"reproduced exactly: run {result['mlflow_run_id']}" in printed
    )

    # A child of an ablation fanned out to Ray, as such records named its flow (the sub-flow it ran in): re-run as
    # one run of its flow, its new run (named by that flow) matched with it.
    client = mlflow.MlflowClient(params.tracking_uri)
    (child_run,) = client.search_runs(
        [client.get_run(original["mlflow_run_id"]).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{original['mlflow_run_id']}'",
    )
    record_file = Path(urlparse(child_run.info.artifact_uri).path) / "provenance.json"
    record = json.loads(record_file.read_text())
    record_file.write_text(
        json.dumps({**record, "flow": {"name": "children_on_ray", "entrypoint": "flows.fanout:fan_out"}})
    )
    client.update_run(child_run.info.run_id, name="grpo-dapo")
    again = reproduce(ReproduceParams(run_id=child_run.info.run_id, tracking_uri=params.tracking_uri))
    assert_exact(again)
    assert set(again["runs"]) == {"grpo-dapo"}

    # A default the run left alone changes: named (with the value the run used), and nothing runs.
    monkeypatch.setattr(GRPOParams.model_fields["clip_train_batch_size"], "default", 64)
    with pytest.raises(DifferencesError, match=r"setting clip_train_batch_size: its default was 128 .* is 64 now"):
        reproduce(ReproduceParams(run_id=original["mlflow_run_id"], tracking_uri=params.tracking_uri))


def test_unknown_run_and_run_without_record_are_named(prefect_harness, tmp_path):
    import mlflow

    from flows.reproduce import ReproduceParams, reproduce

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("bare")
    with mlflow.start_run() as bare:
        mlflow.log_param("x", 1)
    with pytest.raises(ValueError, match="no run 'nope'"):
        reproduce(ReproduceParams(run_id="nope", tracking_uri=uri))
    with pytest.raises(ValueError, match=f"run {bare.info.run_id} .* holds no provenance.json"):
        reproduce(ReproduceParams(run_id=bare.info.run_id, tracking_uri=uri))


def test_compare_shows_records_side_by_side(prefect_harness, tmp_path, monkeypatch):
    import mlflow

    from flows.compare import CompareParams, compare
    from flows.params import GRPOParams
    from tasks.provenance import log_provenance

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("records")
    ids = []
    for rate in (1e-5, 3e-5):
        with mlflow.start_run() as run:
            log_provenance(GRPOParams(learning_rate=rate, output_dir=str(tmp_path / "out")))
            mlflow.log_metric("final_val_accuracy", 0.5)
        ids.append(run.info.run_id)
    result = compare(CompareParams(runs=ids, output_dir=str(tmp_path / "cmp"), tracking_uri=uri, log_to_mlflow=False))
    assert [r["what"] for r in result["records"]] == ["setting.learning_rate"]
    text = (tmp_path / "cmp" / "comparison.md").read_text()
    assert text.index("setting.learning_rate") < text.index("final_val_accuracy")


def test_evaluation_started_as_a_command_reproduces_its_generations_again(
    prefect_harness, tiny_lm_dir, shared_data, tmp_path, monkeypatch, capsys
):
    import runpy
    import sys

    import mlflow

    import tasks.evaluation
    from flows.reproduce import ReproduceParams, reproduce

    engines = []
    real_make_engine = tasks.evaluation.make_engine
    monkeypatch.setattr(tasks.evaluation, "make_engine", lambda *a, **k: engines.append(a) or real_make_engine(*a, **k))
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    flags = {
        "model": tiny_lm_dir,
        "backend": "hf",
        "data": shared_data / "math/validation.jsonl",
        "limit": 3,
        "n": 2,
        "max-tokens": 8,
        "output-dir": tmp_path / "out",
        "metrics-path": tmp_path / "metrics.json",
        "tracking-uri": uri,
    }
    # Started the way users start it, `python -m flows.baseline_eval ...`: the flow's module is __main__.
    monkeypatch.setattr(sys, "argv", ["flows.baseline_eval", *(f"--{k}={v}" for k, v in flags.items())])
    runpy.run_module("flows.baseline_eval", run_name="__main__", alter_sys=True)
    run_id = re.search(r"mlflow +run (\w+) in", capsys.readouterr().out).group(1)
    record = json.loads(
        Path(mlflow.MlflowClient(uri).download_artifacts(run_id, "provenance.json", str(tmp_path))).read_text()
    )
    assert record["flow"] == {"name": "baseline_eval", "entrypoint": "flows.baseline_eval:baseline_eval"}
    assert record["params_model"] == "flows.params.BaselineEvalParams"

    result = reproduce(ReproduceParams(run_id=run_id, tracking_uri=uri))
    assert len(engines) == 2  # the generations were made again, not read from the cache
    assert_exact(result)
    assert any(r["metric"] == "accuracy" for r in result["rows"])


def test_a_setting_gone_or_new_other_versions_and_a_missing_input_are_named(tmp_path, monkeypatch):
    from flows.params import GRPOParams
    from tasks.provenance import build_record, differences

    monkeypatch.chdir(tmp_path)
    (tmp_path / "table.csv").write_text("question,pass_rate\n")
    params = GRPOParams(difficulty_table="table.csv", output_dir=str(tmp_path / "out"))
    record = build_record(params)
    assert record["inputs"]["difficulty_table"]["hash"].startswith("sha256:")
    assert differences(record, params) == []
    record["settings"]["old_knob"] = 1
    del record["settings"]["sweep_kl_coefs"]
    record["versions"]["torch"] = "0.0"
    record["cwd"] = "/elsewhere"
    (tmp_path / "table.csv").unlink()
    found = "\n".join(differences(record, params))
    assert "setting old_knob: recorded, but the flow has no such setting now" in found
    assert "setting sweep_kl_coefs: new since the run" in found
    assert "versions: torch 0.0 then" in found
    assert "data: difficulty_table table.csv: missing here; the run ran in /elsewhere" in found


def test_a_record_hashes_only_what_the_run_reads(tmp_path, monkeypatch):
    """The files a record hashes are those its input settings name (READS), never another setting's value that
    happens to name a file or folder: an experiment called /usr was hashed, 46,000 files, for minutes."""
    from a5core.runtime.settings import read_settings
    from flows.params import GRPOParams
    from tasks.provenance import build_record

    monkeypatch.chdir(tmp_path)
    (tmp_path / "table.csv").write_text("question,pass_rate\n")
    (tmp_path / "store").mkdir()
    params = GRPOParams(
        train_data="arithmetic:8:1",
        validation_data="arithmetic:4:1",
        difficulty_table="table.csv",
        output_dir="out",
        engine_device="cpu",
        ray_address="store",
    )
    record = build_record(params)
    assert set(record["inputs"]) == {"model", "difficulty_table"} and set(record["inputs"]) <= set(
        read_settings(GRPOParams)
    )
    assert set(read_settings(GRPOParams)) == {"model", "train_data", "difficulty_table", "validation_data", "prompt"}


def test_an_archived_run_unpacked_elsewhere_reproduces_from_its_archive(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch, capsys
):
    """A store packed with its artifacts and unpacked on another machine (its database in a folder of its own
    below the archive's root, its artifacts in another folder of the archive, as a run's records were packed)
    records its artifacts at paths that are gone: the record is found in the archive, and the re-run is logged to
    the store ``--into`` names."""
    import shutil
    import tarfile

    from flows.grpo import grpo_flow
    from flows.reproduce import main

    made = tmp_path / "made"
    (made / "store").mkdir(parents=True)
    monkeypatch.chdir(made)
    params = tiny_grpo(made, tiny_lm_dir).replace(tracking_uri="sqlite:///store/mlflow.db")
    original = grpo_flow(params)["mlflow_run_id"]
    with tarfile.open(tmp_path / "records.tar.gz", "w:gz") as tar:
        tar.add(made / "store", "store")
        tar.add(made / "mlruns", "rerun/archive/mlruns")
    shutil.rmtree(made)  # the paths the store recorded are gone
    with tarfile.open(tmp_path / "records.tar.gz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    monkeypatch.chdir(tmp_path)
    archived = f"sqlite:///{tmp_path / 'unpacked/store/mlflow.db'}"
    into = ["--into", f"sqlite:///{tmp_path / 'mine.db'}", "--output-dir", str(tmp_path / "again")]
    main(["--run-id", original, "--tracking-uri", archived, *into])
    printed = capsys.readouterr().out
    assert "reproduced exactly" in printed and "| grpo-single | final_val_accuracy |" in printed, printed


# --------------------------------------------------------------------------- a record is data, never code


@pytest.fixture
def recorded(prefect_harness, tmp_path, monkeypatch):
    """``record(edit)``: an MLflow run (in ``tmp_path/mlflow.db``) holding a provenance record of a baseline
    evaluation made here, changed by ``edit(record)`` (or, given text, that text as the record); its id."""
    import mlflow

    from flows.params import BaselineEvalParams
    from tasks.provenance import build_record

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def record(edit) -> str:
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("records")
        entry = build_record(BaselineEvalParams(model="no-such-model-folder/", output_dir="out"))
        entry["flow"] = {"name": "baseline_eval", "entrypoint": "flows.baseline_eval:baseline_eval"}
        with mlflow.start_run() as run:
            if isinstance(edit, str):
                mlflow.log_text(edit, "provenance.json")
            else:
                edit(entry)
                mlflow.log_dict(entry, "provenance.json")
        return run.info.run_id

    record.uri = uri
    return record


def reproduce_error(run_id: str, uri: str, *flags: str) -> str:
    from flows.reproduce import main

    with pytest.raises(SystemExit) as stopped:
        main(["--run-id", run_id, "--tracking-uri", uri, *flags])
    message = stopped.value.code
    assert isinstance(message, str) and message.startswith("flows.reproduce: error: "), message
    assert "\n" not in message, message
    return message


def test_a_record_naming_other_code_is_refused_before_it_is_imported(recorded, tmp_path):
    """A record whose flow is a module of its writer's choosing (here one in the working directory, which
    Python would import from) is refused, with or without --allow-differences, and the module never runs."""
    (tmp_path / "project/planted.py").write_text("from pathlib import Path\nPath('imported').write_text('ran')\n")
    for entrypoint in ("planted:flow", "os:system", "flows.cli:main", "__main__:planted"):
        run_id = recorded(lambda r, e=entrypoint: r["flow"].update(entrypoint=e))
        for flags in ([], ["--allow-differences"]):
            message = reproduce_error(run_id, recorded.uri, *flags)
            assert "not one of this project's flows" in message or "no module of the flows package" in message
    assert not (tmp_path / "project/imported").exists()


@pytest.mark.parametrize("entrypoint", ["flows.reproduce:reproduce", "flows.sft_data:sft_data"])
def test_a_record_naming_a_flow_that_records_no_runs_is_refused(entrypoint, recorded):
    """Reproduce itself (which would re-run itself without end), and flows whose runs hold no record (some of whose
    parameters are no settings): one line, nothing run."""
    run_id = recorded(lambda r: r["flow"].update(entrypoint=entrypoint))
    message = reproduce_error(run_id, recorded.uri, "--allow-differences")
    assert f"names flow {entrypoint!r}, which is not one of this project's flows that record their runs" in message


def test_a_record_says_only_what_the_run_set_never_where_it_connects_or_what_to_hash(recorded, monkeypatch):
    """The re-run takes the run's own settings from a record: not the Ray cluster it reached, not the store; the
    paths it hashes are its input settings' files, never a folder a record names (the whole disk); an experiment
    named as a path is refused."""
    import tasks.fingerprints
    import tasks.provenance
    from flows.params import GRPOParams
    from flows.reproduce import ReproduceParams, replay_params
    from tasks.provenance import build_record, differences

    record = build_record(GRPOParams(output_dir="out", runner="ray", ray_address="ray://192.0.2.1:10001"))
    replay = replay_params(record, GRPOParams, ReproduceParams(run_id="x", tracking_uri=recorded.uri))
    assert (replay.runner, replay.ray_address, replay.tracking_uri) == ("ray", None, recorded.uri)

    hashed = []
    for module in (tasks.fingerprints, tasks.provenance):
        real = module.file_digest
        monkeypatch.setattr(module, "file_digest", lambda path, real=real: hashed.append(str(path)) or real(path))
    record["settings"].update(model="/", train_data="/usr")
    record["inputs"].update(model={"path": "/", "hash": "folder:0"}, table={"path": "/etc", "hash": "sha256:0"})
    found = "\n".join(differences(record, replay_params(record, GRPOParams, ReproduceParams(run_id="x"))))
    assert hashed == [] and "data: model /: missing" in found and "data: table /etc: missing" in found

    run_id = recorded(lambda r: r["settings"].update(experiment="/usr"))
    message = reproduce_error(run_id, recorded.uri, "--allow-differences")
    assert "the run's recorded settings are not valid settings of the flow now: experiment '/usr': " in message


def test_a_run_whose_files_are_not_in_its_archive_is_named_so(recorded, tmp_path):
    import shutil

    run_id = recorded(lambda r: None)
    shutil.rmtree(tmp_path / "project/mlruns")  # packed without its artifacts
    message = reproduce_error(run_id, recorded.uri)
    assert f"run {run_id} in {recorded.uri} holds no provenance.json here: no file of the run is at" in message
    assert "or its store was moved or packed without the run's files" in message


@pytest.mark.parametrize(
    "damage, named",
    [
        ('{"flow": {"name": "baseline_eval", "entrypoint": "flows.bas', "not a JSON document"),
        ('["a", "list"]', "a JSON list, not an object"),
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply to read"),
        ("{}", "flow: Field required"),
        (lambda r: r.update(settings="out"), "settings: Input should be a valid dictionary"),
        (lambda r: r["inputs"].update(model={"path": 3}), "inputs.model.path: Input should be a valid string"),
    ],
)
def test_a_damaged_record_is_named(damage, named, recorded):
    run_id = recorded(damage)
    message = reproduce_error(run_id, recorded.uri)
    assert f"run {run_id}: its provenance.json is damaged (" in message and named in message, message


def test_a_record_cannot_send_the_outputs_outside_the_project(recorded, tmp_path):
    """The re-run's folder goes inside the run's recorded output folder: one outside the project (a system
    folder, another user's files) that a5 did not make is refused; --output-dir gives the folder instead."""
    elsewhere = tmp_path / "elsewhere"
    for folder in (str(elsewhere), "/etc", "../elsewhere"):
        run_id = recorded(lambda r, f=folder: r["settings"].update(output_dir=f))
        message = reproduce_error(run_id, recorded.uri, "--allow-differences")
        assert f"the run's record puts its outputs in {folder!r}, which is neither inside this project" in message
    assert not elsewhere.exists() and not list(Path("/etc").glob("reproduce-*"))
