"""Serve every flow as a Prefect deployment: start any of them from the Prefect UI with a validated form.

    prefect server start --host 127.0.0.1          # the API and UI on http://127.0.0.1:4200
    python -m flows.serve                          # from the repository root, in a second terminal
    python -m flows.serve --config params.yaml     # the forms' defaults from params.yaml (and its profile)

Each flow module's ``@flow`` objects become one deployment, titled by what it does (:func:`deployment_name`:
``baseline_eval/Zero-shot evaluation``, ``grpo_lr_sweep/GRPO ablation: learning rate``, ...; all tagged
``a5``). A flow takes one pydantic parameter model, so the UI's "Run"
form has a field per parameter with its description, and the server rejects values the model rejects
(deployments enforce their parameter schema). Runs execute in subprocesses of this process, in its
working directory: relative paths (``outputs/``, ``sqlite:///mlflow.db``, ``../shared/data``) mean
what they mean on the command line. ``--limit`` (default 1) runs at most that many flows at once, since
each wants the whole GPU. Ctrl-C stops serving.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import typing
from pathlib import Path
from typing import Any

TAG = "a5"
DEFAULT_API_URL = "http://127.0.0.1:4200/api"
NOT_FLOW_MODULES = {"cli", "serve"}
# What each flow does, as its deployment's title (Prefect shows a deployment by its name); the GRPO ablations
# are titled from their table (flows.ablations.ABLATIONS).
TITLES = {
    "prepare_data": "Data check: every data file, validated, into the manifest",
    "sft_data": "SFT trace sets: MATH solutions, teacher traces, distillation, filtering",
    "baseline_eval": "Zero-shot evaluation",
    "sft_experiment": "SFT sweep over training-set sizes",
    "expert_iteration": "Expert Iteration: one run or a G × E × D_b sweep",
    "difficulty": "Pass rates by question (the difficulty table)",
    "grpo": "GRPO: one run, or any ablation",
    "leaderboard": "Leaderboard run: best accuracy within a time budget",
    "compare": "Compare evaluation runs",
    "verdicts": "Verdicts: does one setting beat another, and how sure are we",
    "reproduce": "Reproduce a run from its MLflow record",
    "report": "Pipeline report",
}


def deployment_name(flow: Any) -> str:
    """The deployment's title: what the flow does (:data:`TITLES`, a GRPO ablation's title, else the first line
    of the flow's description)."""
    from flows.ablations import ABLATIONS

    if flow.name in TITLES:
        return TITLES[flow.name]
    if flow.name in ABLATIONS:
        return f"GRPO ablation: {ABLATIONS[flow.name][0]}"
    return (flow.description or flow.name).strip().splitlines()[0].rstrip(".")


def discover_flows() -> dict[str, Any]:
    """Every ``@flow`` object defined in a module of the ``flows`` package, by flow name."""
    from prefect import Flow

    import flows

    found: dict[str, Any] = {}
    for module_info in pkgutil.iter_modules(flows.__path__):
        if module_info.name in NOT_FLOW_MODULES:
            continue
        module = importlib.import_module(f"flows.{module_info.name}")
        for value in vars(module).values():
            if isinstance(value, Flow) and value.fn.__module__ == module.__name__:
                found[value.name] = value
    return dict(sorted(found.items()))


def params_model(flow: Any) -> tuple[str, type]:
    """The flow's single parameter and its pydantic model."""
    (name,) = flow.parameters.properties
    return name, typing.get_type_hints(flow.fn)[name]


def config_defaults(flow: Any, config: Path) -> dict[str, Any]:
    """Deployment parameters from ``config``'s section for this flow and its selected profile's overrides,
    as ``--config`` reads them on the command line (ablations read ``grpo``; no section: the model's defaults);
    ConfigError naming the file and place for a file or a section that is not valid settings."""
    from flows.config_file import read_config, settings_from_file

    name, model = params_model(flow)
    if "config" in model.model_fields:  # a flow that reads the settings file itself (prepare_data, sft_data)
        return {name: {"config": str(config)}}
    section = "grpo" if flow.name.startswith("grpo_") else flow.name
    if section not in read_config(config):
        return {}
    params = settings_from_file(model, section, config)
    if "ablation" in model.model_fields and flow.name != "grpo":
        params = params.replace(ablation=None)  # the flow itself is the ablation
    return {name: params.model_dump(mode="json")}


def deployments(config: Path | None = None) -> list[Any]:
    """One deployment per flow; entrypoints are module paths (``flows.grpo.grpo_lr_sweep``), valid from any
    directory."""
    from prefect.types.entrypoint import EntrypointType

    result = []
    for flow in discover_flows().values():
        parameters = config_defaults(flow, config) if config is not None else {}
        result.append(
            flow.to_deployment(
                name=deployment_name(flow),
                parameters=parameters,
                description=flow.description,
                tags=[TAG],
                entrypoint_type=EntrypointType.MODULE_PATH,
            )
        )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--api-url",
        default=os.environ.get("PREFECT_API_URL") or DEFAULT_API_URL,
        help=f"Prefect API (default: $PREFECT_API_URL, else {DEFAULT_API_URL})",
    )
    parser.add_argument("--config", type=Path, help="take each form's defaults from this params file's sections")
    parser.add_argument("--limit", type=int, default=1, help="flow runs at once (default: 1)")
    args = parser.parse_args(argv)
    if args.config is not None and not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    os.environ["PREFECT_API_URL"] = args.api_url  # before prefect is imported: the runs' subprocesses inherit it
    from flows.cli import cli_main

    cli_main("flows.serve")(lambda _: _serve(args.config, args.limit))(argv)


def _serve(config: Path | None, limit: int) -> None:
    """Serve the deployments, once the Prefect API answers and every form's defaults are valid settings (one line
    otherwise: :func:`flows.cli.cli_main`)."""
    from prefect import serve

    from tasks.prefect_server import check_prefect_api

    served = deployments(config)
    check_prefect_api(otherwise="pass --api-url the address of a running one")
    serve(*served, limit=limit)


if __name__ == "__main__":
    main(sys.argv[1:])
