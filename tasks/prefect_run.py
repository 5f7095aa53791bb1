"""The Prefect flow run this code runs in (its id, name, flow, UI page and entrypoint), and the name a flow's
module is imported by, which a record names so that the run can be made again (``flows.grpo``, not
``__main__``)."""

from __future__ import annotations

import sys
from pathlib import Path

from tasks.git_checkout import PROJECT_ROOT


def importable_module(module: str) -> str:
    """The name ``module`` is imported by elsewhere: ``module`` itself, except for ``__main__``, the module of a
    flow started as a command. ``python -m flows.grpo`` (and torchrun's ``-m``) names the module it ran in
    ``__main__.__spec__``; a script run by its path inside the project (``python flows/grpo.py``) is named by
    that path (``flows.grpo``). ``__main__`` when neither says (a script outside the project, a notebook)."""
    if module != "__main__":
        return module
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return spec.name
    script = getattr(main, "__file__", None)
    if script:
        path = Path(script).resolve()
        try:
            parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
        except ValueError:
            return module
        if path.suffix == ".py" and parts and all(part.isidentifier() for part in parts):
            return ".".join(parts)
    return module


def prefect_flow_run() -> dict[str, str]:
    """The Prefect flow run this code runs in: ``id``, ``name``, ``flow`` and the UI's ``url`` of its page
    (where the server has a UI); {} outside a flow run."""
    try:
        from prefect.runtime import flow_run
    except ImportError:  # pragma: no cover - prefect is a dependency
        return {}
    if not flow_run.id:
        return {}
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_UI_URL

    found = {"id": str(flow_run.id), "name": flow_run.name or "", "flow": flow_run.flow_name or ""}
    context = FlowRunContext.get()
    if context is not None and context.flow is not None:  # the module that defines the flow, and the function
        found["module"] = importable_module(context.flow.fn.__module__)  # flows.grpo under python -m flows.grpo
        found["entrypoint"] = f"{found['module']}:{context.flow.fn.__name__}"
    if PREFECT_UI_URL.value():  # the UI's page of a flow run (runtime's ui_url is an older route)
        found["url"] = f"{PREFECT_UI_URL.value().rstrip('/')}/runs/flow-run/{found['id']}"
    return found
