"""The tags every MLflow run of the project carries: the Prefect flow run it belongs to (id, name, UI address),
the git commit it ran and whether the tree had uncommitted changes, the versions of the packages that decide a
result, and the device."""

from __future__ import annotations

from collections import Counter

from tasks.git_checkout import NOT_DVC_RECORDS, git
from tasks.prefect_run import prefect_flow_run

# The packages whose versions a run records.
VERSIONED_PACKAGES = ("torch", "transformers", "vllm", "peft", "mlflow", "prefect", "dvc")


def run_tags() -> dict[str, str]:
    """The tags every MLflow run of the project carries (the "Any run, again" provenance, and the way back to
    the Prefect run that started it):

    - ``prefect.flow_run_id``, ``prefect.flow_run_name``, ``prefect.flow``, ``prefect.flow_run_url`` (the
      Prefect UI's page of the flow run), when it runs inside one; then also the run's description
      (``mlflow.note.content``) links that page, and its source (``mlflow.source.name``) is the flow's module;
    - ``mlflow.source.git.commit`` (shown by MLflow as the run's commit; MLflow records none for a run that
      Prefect's engine starts), ``git.dirty`` (``true``: the tree had uncommitted changes to tracked files,
      other than ``dvc.lock``: DVC's record of what the pipeline's stages made, which it rewrites as they run);
    - ``versions.python``, ``versions.a5`` and ``versions.<package>`` of :data:`VERSIONED_PACKAGES` installed;
    - ``device``: ``cuda`` with the GPUs' names and count, or ``cpu``.

    The run's full record, to run it again (settings, inputs' hashes, seeds), is :mod:`tasks.provenance`'s.
    """
    tags: dict[str, str] = {}
    flow_run = prefect_flow_run()
    for key in ("id", "name", "flow", "url"):
        if flow_run.get(key):
            tags[f"prefect.flow_run_{key}" if key != "flow" else "prefect.flow"] = flow_run[key]
    if flow_run.get("module", "").startswith("flows."):  # not Prefect's engine, which MLflow would name
        tags["mlflow.source.name"] = flow_run["module"].replace(".", "/") + ".py"
        tags["mlflow.source.type"] = "LOCAL"
    commit = git("rev-parse", "HEAD")
    if commit:
        tags["mlflow.source.git.commit"] = commit
        tags["git.dirty"] = str(bool(git("status", "--porcelain", "--untracked-files=no", *NOT_DVC_RECORDS))).lower()
    if flow_run.get("url"):  # the run's description: a link back to the Prefect flow run
        tags["mlflow.note.content"] = (
            f"Started by Prefect flow run [{flow_run['name']}]({flow_run['url']}) of flow `{flow_run['flow']}`"
            + (f" at commit `{commit[:12]}`" + (" (uncommitted changes)" if tags["git.dirty"] == "true" else ""))
            * bool(commit)
            + "."
        )
    tags.update({f"versions.{name}": version for name, version in versions().items()})
    tags["device"] = device_name()
    return tags


def versions() -> dict[str, str]:
    """The versions of Python, the project (``a5``) and each of :data:`VERSIONED_PACKAGES` installed."""
    import importlib.metadata
    import platform

    found = {"python": platform.python_version()}
    for package in ("a5", *VERSIONED_PACKAGES):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def device_name() -> str:
    """The GPUs this process sees, by kind (``cuda: 2 × NVIDIA H200``), or ``cpu``."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    names = Counter(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return "cuda: " + ", ".join(f"{count} × {name}" for name, count in names.items())
