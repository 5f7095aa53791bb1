"""MLflow's model registry as the project uses it: a registered model a kind of trained policy, its versions the
runs that trained one, each version's weights left in the run's folder (loaded by :mod:`tasks.hf_folder_model`,
which checks them against the digests recorded here)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import mlflow

from tasks.fingerprints import file_digests
from tasks.resumable_runs import reopen_run

# The registered models' names: one a kind of trained policy, its versions the runs that trained one.
REGISTERED_MODELS = {
    "sft_experiment": "a5-sft",
    "expert_iteration": "a5-expert-iteration",
    "grpo": "a5-grpo",
    "leaderboard": "a5-leaderboard",
}
REGISTERED_TAG = "registered_model"  # on a run whose model is registered: "NAME/VERSION"


def register_model(
    model_dir: str | Path,
    name: str,
    run_id: str,
    setting: str,
    metrics: dict[str, float] | None = None,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Log the Hugging Face folder ``model_dir`` as the MLflow model ``model`` of run ``run_id`` and register it
    as a version of ``name`` (weights not copied: :mod:`tasks.hf_folder_model` loads them from the folder, and
    refuses it once its files differ from the digests recorded here), in the store ``tracking_uri`` (None: the
    process's).
    The version's description is the run's final metrics (``metrics``, else the run's ``final_*``), its tags
    the setting and the run. Done once a run: a run already registered returns its version (tag
    :data:`REGISTERED_TAG`). Returns ``name``, ``version``, ``setting``, ``run_id``, ``model_dir``."""
    if tracking_uri is not None:
        mlflow.set_tracking_uri(tracking_uri)
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    found = {"name": name, "setting": setting, "run_id": run_id, "model_dir": str(Path(model_dir).resolve())}
    if REGISTERED_TAG in run.data.tags:
        return {**found, "version": run.data.tags[REGISTERED_TAG].rpartition("/")[2]}
    if metrics is None:
        metrics = {k: v for k, v in sorted(run.data.metrics.items()) if k.startswith("final_")}
    description = (
        f"The policy of run `{run.info.run_name}` (setting `{setting}`, experiment run {run_id}), saved at "
        f"`{found['model_dir']}`.\n\n"
        + "\n".join(f"- {k}: {v:.4g}" for k, v in metrics.items())
        + '\n\nLoad it: `mlflow.pyfunc.load_model("models:/NAME/VERSION").predict([prompt])`.'
    )
    active = mlflow.active_run()
    nested = active is not None and active.info.run_id != run_id
    reopen = contextlib.nullcontext() if active is not None and not nested else None
    with reopen or reopen_run(run_id, run.info.experiment_id, nested=nested):
        logged = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(Path(__file__).with_name("hf_folder_model.py")),
            model_config={"model_dir": found["model_dir"], "file_sha256": file_digests(found["model_dir"])},
            pip_requirements=["mlflow", "torch", "transformers"],
            registered_model_name=name,
            tags={"setting": setting},
        )
        version = str(logged.registered_model_version)
        client.update_model_version(name, version, description=description.replace("NAME/VERSION", f"{name}/{version}"))
        client.set_model_version_tag(name, version, "setting", setting)
        client.set_model_version_tag(name, version, "mlflow_run_id", run_id)
        mlflow.set_tag(REGISTERED_TAG, f"{name}/{version}")
    client.update_registered_model(name, description=f"a5's {name.removeprefix('a5-')} policies, one version a run.")
    return {**found, "version": version}
