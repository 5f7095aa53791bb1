"""Command lines for flows: one flag per field of a flow's pydantic parameter model.

Values come, in increasing priority, from the model's defaults, one section of a YAML file
(``--config params.yaml``, the file DVC tracks), that file's ``profiles.<profile>.<section>``
overrides for its selected ``profile`` (or ``--profile NAME``), and the flags. A flag's value is read as YAML, so
``--limit 20``, ``--stop '["</answer>"]'`` and ``--seed null`` all work; pydantic validates the result
and a bad value exits with its message.

Every flow's ``main`` is wrapped by :func:`cli_main`: logging at INFO for the project's own loggers (the
loops' one line per step), and bad input (a data file, a prompt template, a model path, settings, a
NaN loss, a checkpoint of another run) ends the command with one message on stderr and exit status 1,
not a traceback. ``A5_TRACEBACK=1`` shows the traceback instead.

Several GPUs: ``torchrun --nproc-per-node N -m flows.grpo ...`` (also sft_experiment, expert_iteration,
leaderboard). A flow's ``main`` runs it through :func:`run_flow`: every rank runs the same flow code
and trains in the same loop (FSDP2, :mod:`a5core.distributed`); rank 0 runs it as the Prefect flow
and alone tracks (MLflow, outputs, metrics files, printed results), the other ranks run the flow's
plain function, without Prefect, MLflow or outputs, and log warnings only.
"""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from a5core.checkpoint import CheckpointMismatchError, NonFiniteLossError
from a5core.data import DataError
from a5core.models import ModelResolutionError
from a5core.prompts import PromptTemplateError
from tasks.engines import EngineStartError

Params = TypeVar("Params", bound=BaseModel)

# What a user's input can cause, each raised with a message naming what and where: such an error ends a
# command with that message. (DataError, PromptTemplateError and CheckpointMismatchError are ValueErrors;
# listed for the reader.) Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    DataError, PromptTemplateError, CheckpointMismatchError, ModelResolutionError, NonFiniteLossError,
    FileNotFoundError, ValueError, EngineStartError,
)
PROJECT_LOGGERS = ("a5core", "flows", "tasks")


class _NoUserErrorTracebacks(logging.Filter):
    """On the console handler: Prefect logs a failed flow or task run with its traceback; for a user
    error, keep its one-line message and drop the traceback (the Prefect API still gets it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], USER_ERRORS) and not _show_tracebacks():
            record.exc_info, record.exc_text = None, None
        return True


def _show_tracebacks() -> bool:
    return os.environ.get("A5_TRACEBACK", "").strip().lower() not in ("", "0", "false", "no", "off")


def configure_logging(level: int = logging.INFO) -> None:
    """Show the project's INFO records (the training loops' one line per step) through the root logger's
    handlers: Prefect's console handler once prefect is imported, else a plain stderr handler."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(asctime)s | %(levelname)-7s | %(name)s - %(message)s", datefmt="%H:%M:%S")
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(level)
    for handler in root.handlers:
        if isinstance(handler, logging.StreamHandler) and not any(
                isinstance(f, _NoUserErrorTracebacks) for f in handler.filters):
            handler.addFilter(_NoUserErrorTracebacks())


def cli_main(prog: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a flow's ``main(argv)``: configure logging, and turn a :data:`USER_ERRORS` exception into
    ``SystemExit("PROG: error: MESSAGE")`` (message on stderr, exit status 1)."""

    def decorate(main: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> Any:
            configure_logging()
            try:
                return main(argv)
            except USER_ERRORS as error:
                if _show_tracebacks():
                    raise
                raise SystemExit(f"{prog}: error: {error}") from None
            except OSError as error:  # a full disk: say so; atomic writes left every earlier output whole
                if error.errno not in (errno.ENOSPC, errno.EDQUOT) or _show_tracebacks():
                    raise
                raise SystemExit(f"{prog}: error: no space left on the device writing {error.filename or 'an output'}; "
                                 "outputs written before are intact (written atomically): free space and run again "
                                 "to resume") from None

        return run

    return decorate


def run_flow(flow: Any, params: BaseModel) -> Any:
    """Run a Prefect ``flow`` with ``params`` from a command line, one process or torchrun's N.

    Joins the process group torchrun describes (:func:`a5core.distributed.init_from_env`, before any
    model is loaded; left at the process's exit, so several flows can run in one launch); then rank 0
    calls the flow (a Prefect flow run, tracked as usual) and every other rank its plain function
    (``flow.fn``: the same training, untracked; see :func:`tasks.training.tracking_rank`). Returns the
    flow's result on rank 0 and None on the others.
    """
    import atexit

    import torch.distributed as dist

    from a5core import distributed

    joined = dist.is_initialized()
    rank, world = distributed.init_from_env()
    if world > 1 and not joined:
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    if rank != 0:
        configure_logging(logging.WARNING)  # one rank's INFO lines are enough
    if rank == 0:
        return flow(params)
    flow.fn(params)
    return None


def parse_params(model: type[Params], section: str, argv: list[str] | None = None, description: str = "") -> Params:
    """Build ``model`` from defaults < ``--config FILE`` section ``section`` < command-line flags."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help=f"YAML file whose `{section}` section sets parameters")
    parser.add_argument("--profile", dest="_profile", metavar="NAME",
                        help="with --config: use this profile's overrides instead of the file's `profile`")
    for name, field in model.model_fields.items():
        parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, metavar="VALUE",
            help=f"{field.description or name} (default: {field.default!r})",
        )
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    config, profile_flag = args.pop("config"), args.pop("_profile")
    if config is not None:
        if not config.is_file():
            parser.error(f"--config {config}: no such file")
        document = yaml.safe_load(config.read_text()) or {}
        if section not in document:
            parser.error(f"--config {config}: no `{section}` section")
        values.update(document[section])
        profile = profile_flag or document.get("profile")
        if profile_flag and profile_flag not in (document.get("profiles") or {}) and profile_flag != document.get("profile"):
            parser.error(f"--profile {profile_flag}: no such profile in {config}")
        values.update(((document.get("profiles") or {}).get(profile) or {}).get(section) or {})
    values.update({name: yaml.safe_load(raw) for name, raw in args.items() if raw is not None})
    try:
        return model(**values)
    except ValidationError as e:
        def describe(error: dict[str, Any]) -> str:
            if not error["loc"]:  # a check across fields: no single flag to name
                return error["msg"]
            flag = f"--{str(error['loc'][0]).replace('_', '-')}{''.join(f'[{i}]' for i in error['loc'][1:] if isinstance(i, int))}"
            return f"{flag} {error.get('input')!r}: {error['msg']}"

        problems = "; ".join(describe(error) for error in e.errors())
        parser.exit(2, f"{parser.prog}: error: invalid parameters: {problems}\n")  # no usage: the flag is named
