"""What a run started from a deployment (``python -m flows.serve``: the Prefect UI's form, the API) may read.

Whoever reaches the Prefect server can fill a deployment's form, and its run reads files as the process serving
the deployments: a form's path (``append: [/proc/self/environ]``, a store, a data file) is read only inside the
project (the working directory the deployments are served from) or a data folder its settings name (the folder
of each data file, model or prompt that params.yaml or a flow's defaults name: ``../shared/data/math``). A run
started from the command line reads what its user names.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from a5core.runtime.settings import Settings, read_settings
from tasks.mlflow_store import sqlite_database

SETTINGS_FILE = Path("params.yaml")


def started_from_a_deployment() -> bool:
    """Whether this flow run was started from a deployment (not from a command line): its flow run names one
    (``PREFECT__RUNTIME__DEPLOYMENT__ID``, Prefect's own way to say so, too)."""
    from prefect.context import FlowRunContext

    if os.environ.get("PREFECT__RUNTIME__DEPLOYMENT__ID"):
        return True
    context = FlowRunContext.get()
    return bool(context and context.flow_run and context.flow_run.deployment_id)


def _read_names() -> set[str]:
    """The settings of every flow that name what it reads (:data:`a5core.runtime.settings.READS`), and the data
    section's ``source``."""
    from flows import params

    models = [
        params.BaselineEvalParams,
        params.DifficultyParams,
        params.DistillParams,
        params.SFTExperimentParams,
        params.EIParams,
        params.GRPOParams,
        params.LeaderboardParams,
    ]
    return {"source", *(name for model in models for name in read_settings(model))}


def _named_values(node: Any, names: set[str]) -> list[str]:
    """The string values of keys in ``names`` at any depth of a settings document."""
    if isinstance(node, Mapping):
        return [
            found
            for key, value in node.items()
            for found in ([value] if key in names and isinstance(value, str) else _named_values(value, names))
        ]
    return [found for value in node for found in _named_values(value, names)] if isinstance(node, list) else []


def data_folders(settings_file: Path = SETTINGS_FILE) -> list[Path]:
    """The folders of the data the settings name: of each file or folder a read setting names in the settings
    file (every section and profile) or as a flow's default, where it exists."""
    from flows import params
    from flows.config_file import ConfigError, read_config

    names = _read_names()
    try:
        document = read_config(settings_file) if settings_file.is_file() else {}
    except ConfigError:
        document = {}
    defaults = [model().flat() for model in (params.BaselineEvalParams, params.SFTExperimentParams, params.GRPOParams)]
    found = []
    for value in _named_values([document, *defaults], names):
        path = Path(value).expanduser()
        if path.is_file():
            found.append(path.resolve().parent)
        elif path.is_dir():
            found.append(path.resolve())
    return list(dict.fromkeys(found))


def check_served_reads(paths: Mapping[str, Iterable[str | None]]) -> None:
    """In a run started from a deployment: ValueError naming the setting and the path of the first of ``paths``
    (setting → the paths it names) outside the project and the data folders (:func:`data_folders`). Elsewhere,
    nothing."""
    if not started_from_a_deployment():
        return
    roots = [Path.cwd().resolve(), *data_folders()]
    for what, values in paths.items():
        for value in values:
            if not value:
                continue
            resolved = Path(value).expanduser().resolve()
            if not any(resolved == root or root in resolved.parents for root in roots):
                raise ValueError(
                    f"{what} {value}: outside this project and the data folders its settings name; a run started "
                    "from a deployment reads nothing else (run it from the command line to read it)"
                )


def check_served_inputs(params: Settings, stores: Iterable[str] = ()) -> None:
    """:func:`check_served_reads` of every setting of ``params`` that names what the run reads, and of the
    database files of ``stores`` (tracking URIs it reads)."""
    reads: dict[str, list[str | None]] = {name: [getattr(params, name)] for name in read_settings(type(params))}
    for name, value in getattr(params, "extra_sets", {}).items():
        reads[f"extra_sets.{name}"] = [value]
    reads["tracking_uri"] = served_databases(stores)
    check_served_reads({k: [v for v in values if isinstance(v, str)] for k, values in reads.items()})


def served_databases(stores: Iterable[str]) -> list[str]:
    """The database files of the SQLite stores among ``stores`` (tracking URIs)."""
    return [str(database) for store in stores if (database := sqlite_database(store)) is not None]
