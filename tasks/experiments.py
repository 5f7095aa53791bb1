"""MLflow experiments as the project makes them, the check that a run's store takes them before the run spends its
time (:func:`check_store`), and the MLflow UI's addresses of them.

Experiments are created as model-training experiments (tag ``mlflow.experimentKind``). MLflow 3.17's UI ignores
that tag, though: it opens an experiment in the view its "GenAI | Model training" switch last chose in the
browser (GenAI at first) unless the address says ``workflowType=machine_learning``, so the addresses the flows
print (:func:`ui_address`) say so, and land on the runs. For a user who starts at the UI's home page, each
experiment's description (shown there beside it) says which switch to pick. The runs table opens sorted by the
stage's headline metric, shown as a column with its standard error: a shared view (MLflow's
``mlflow.sharedViewState.<key>`` experiment tag, which the address names).
"""

from __future__ import annotations

from pathlib import Path

import mlflow

from tasks.mlflow_store import DEFAULT_ARTIFACT_ROOT, DEFAULT_TRACKING_URI, store_lock, store_problem
from tasks.servers import check_server

# What an experiment says it is: a model-training experiment (MLflow's kinds), not a GenAI application's.
EXPERIMENT_KIND_TAG, TRAINING_EXPERIMENT = "mlflow.experimentKind", "custom_model_development"
# Each experiment's runs table as the printed addresses open it: MLflow's shared view ``VIEW_KEY`` (an experiment
# tag), sorted by the stage's headline metric (HEADLINE_METRICS; the training stages': final_val_accuracy) and
# showing it and its standard error (columns off the screen's width are not drawn: these come first).
VIEW_KEY, VIEW_TAG = "a5", "mlflow.sharedViewState.a5"
HEADLINE_METRICS = {"baseline_eval": "accuracy", "difficulty": "mean_pass_rate", "report": "grpo_best_accuracy"}
TRAINING_HEADLINE = "final_val_accuracy"
DESCRIPTION_TAG = "mlflow.note.content"
DESCRIPTION = (
    "Runs of the {name} stage. From MLflow's home page, pick Model training (top left, once in a browser) before "
    "opening it: MLflow shows an experiment's GenAI view until then, and its runs after."
)
# The MLflow UI as a user starts it, and the address it serves (port 5000).
UI_COMMAND = "mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1"
UI_ROOT = "http://127.0.0.1:5000"


def experiment_tags(name: str) -> dict[str, str]:
    """What every experiment of the project carries: its kind (model training), a description that tells a
    user at the UI's home page how to reach its runs, and the runs table's shared view (:data:`VIEW_KEY`)."""
    import json

    metric = HEADLINE_METRICS.get(name, TRAINING_HEADLINE)
    columns = [f"metrics.`{metric}`", f"metrics.`{metric}_se`"]
    view = {"orderByKey": columns[0], "orderByAsc": False, "selectedColumns": columns, "columnOrder": columns}
    return {
        EXPERIMENT_KIND_TAG: TRAINING_EXPERIMENT,
        DESCRIPTION_TAG: DESCRIPTION.format(name=name),
        VIEW_TAG: json.dumps(view),
    }


def ensure_experiment(
    name: str, tracking_uri: str = DEFAULT_TRACKING_URI, artifact_root: str = DEFAULT_ARTIFACT_ROOT
) -> str:
    """Point MLflow at the store and return the experiment's id, creating it (artifacts under mlruns/,
    tagged as a training experiment) if needed. The store's creation and the lookup-or-create hold
    :func:`store_lock`, so concurrent first runs on a new store all succeed."""
    check_server(tracking_uri)  # a server that does not answer: one line in seconds, not minutes of MLflow's retries
    mlflow.set_tracking_uri(tracking_uri)
    with store_lock(tracking_uri):
        client = mlflow.MlflowClient(tracking_uri)
        experiment = client.get_experiment_by_name(name)
        tags = experiment_tags(name)
        if experiment is None:
            location = (Path(artifact_root).resolve() / name).as_uri()
            return client.create_experiment(name, artifact_location=location, tags=tags)
        for key, value in tags.items():  # an experiment made before a tag was set gets it (a user's own kept)
            if key not in experiment.tags:
                client.set_experiment_tag(experiment.experiment_id, key, value)
        return experiment.experiment_id


def check_store(tracking_uri: str, experiment: str) -> None:
    """Before a run spends its time: a tracking server answers (:func:`check_server`) and the store takes
    writes (the experiment is looked up or created now). ValueError with :func:`store_problem`'s message
    otherwise."""
    check_server(tracking_uri)
    try:
        ensure_experiment(experiment, tracking_uri)
    except Exception as error:
        problem = store_problem(error)
        if problem is None:
            raise
        raise ValueError(problem) from None


def ui_address(
    experiment: str, tracking_uri: str = DEFAULT_TRACKING_URI, run_id: str | None = None, root: str = UI_ROOT
) -> str:
    """The MLflow UI's page of ``experiment`` (its runs, in the shared view :data:`VIEW_KEY` where the experiment
    holds it: the headline metric as a column) or of one of its runs, in the model-training view
    (``workflowType=machine_learning``; without it MLflow 3.17 opens its GenAI view). The experiment list
    if the store has no such experiment."""
    found = mlflow.MlflowClient(tracking_uri).get_experiment_by_name(experiment)
    page = f"{root}/#/experiments" + (f"/{found.experiment_id}" if found else "")
    if found and run_id:
        return f"{page}/runs/{run_id}?workflowType=machine_learning"
    if found:
        view = f"viewStateShareKey={VIEW_KEY}&" if VIEW_TAG in found.tags else ""
        return f"{page}/runs?{view}workflowType=machine_learning"
    return page + "?workflowType=machine_learning"


def landing(tracking_uri: str = DEFAULT_TRACKING_URI, root: str = UI_ROOT) -> str:
    """Where a user finds the runs in the MLflow UI: the home page (and the switch to pick there), then each
    experiment's runs table, as addresses to open."""
    experiments = mlflow.MlflowClient(tracking_uri).search_experiments(order_by=["creation_time ASC"])
    lines = [f"MLflow UI: {root} (pick Model training at the top left; its experiments then open on their runs)"]
    lines += [
        f"  {e.name:<17} {ui_address(e.name, tracking_uri, root=root)}" for e in experiments if e.name != "Default"
    ]
    return "\n".join(lines)
