"""A flow's command line: its parameters read (:mod:`flows.arguments`), checked, and the flow run on this
process's rank.

Every flow's ``main`` is wrapped by :func:`cli_main`: logging at INFO for the project's own loggers (the
loops' one line per step), a Ctrl-C ends it with one line (exit status 130; a SIGTERM: 143) wherever it lands,
and bad input (a data file, a prompt template, a model path, settings, a NaN loss, a checkpoint of another run,
a micro-batch too large for the GPU) ends the command with one message on stderr and exit status 1, not a
traceback. ``A5_TRACEBACK=1`` shows the traceback instead.

Several GPUs: ``torchrun --nproc-per-node N -m flows.grpo ...`` (also sft_experiment, expert_iteration,
leaderboard). A flow's ``main`` runs it on its rank (:func:`launched_rank`): every rank runs the same flow code
and trains in the same loop (FSDP2, :mod:`a5core.runtime.distributed`); rank 0 runs it as the Prefect flow
and alone tracks (MLflow, outputs, metrics files, printed results), the other ranks run the flow's
plain function, without Prefect, MLflow or outputs, and log warnings only.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel, ValidationError

from a5core.data.files import DataError
from a5core.data.prompts import PromptTemplateError
from a5core.policy.model_specs import ModelResolutionError
from a5core.runtime.checkpoint import CheckpointMismatchError, NonFiniteLossError
from a5core.runtime.distributed import check_launch_variables
from a5core.runtime.guards import DivergenceError
from a5core.runtime.out_of_memory import MicrobatchOutOfMemoryError
from a5core.runtime.settings import describe
from flows.arguments import parse_params
from flows.config_file import Params
from flows.stop_signals import StopSignals, exit_at_once_on_stop_signals, stop_signal_in, stopped_line
from tasks.engines import EngineStartError

# What a user's input can cause, each raised with a message naming what and where: such an error ends a
# command with that message. (DataError, PromptTemplateError and CheckpointMismatchError are ValueErrors;
# listed for the reader.) Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    DataError,
    PromptTemplateError,
    CheckpointMismatchError,
    ModelResolutionError,
    NonFiniteLossError,
    DivergenceError,
    MicrobatchOutOfMemoryError,
    FileNotFoundError,
    ValueError,
    EngineStartError,
)
PROJECT_LOGGERS = ("a5core", "flows", "tasks")


class _NoUserErrorTracebacks(logging.Filter):
    """On the console handler: Prefect logs a failed flow or task run with its traceback; for a user
    error, keep its one-line message and drop the traceback (the Prefect API still gets it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and not _show_tracebacks() and user_error_message(record.exc_info[1]) is not None:
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
            isinstance(f, _NoUserErrorTracebacks) for f in handler.filters
        ):
            handler.addFilter(_NoUserErrorTracebacks())


@contextlib.contextmanager
def command_line(prog: str, is_the_process: Callable[[], bool]) -> Iterator[None]:
    """``with command_line(prog, ...):`` the body of a command's ``main``: logging configured, a user's error (see
    :func:`user_error_message`) turned into ``SystemExit("PROG: error: MESSAGE")`` (message on stderr, exit status
    1), and a Ctrl-C or a SIGTERM, wherever it lands, into one line (:class:`StopSignals`) and exit status 130 (143
    for SIGTERM), the shell's for a command a signal ended. ``is_the_process()``: whether this command is the
    process (its ``__main__``), which then ends at once on a second signal while it shuts down."""
    configure_logging()
    signals = StopSignals()
    try:
        with signals:
            yield
    except BaseException as error:
        stopped = signals.received[0] if signals.received else stop_signal_in(error)
        if stopped is not None:
            print(stopped_line(prog, stopped), file=sys.stderr)
            raise SystemExit(128 + stopped) from None
        message = None if not isinstance(error, Exception) or _show_tracebacks() else user_error_message(error)
        if message is None:
            raise
        raise SystemExit(f"{prog}: error: {message}") from None
    finally:
        if is_the_process():
            exit_at_once_on_stop_signals(prog, announced=bool(signals.received))
    if signals.received:  # a library swallowed the interrupt and the work went on to its end
        print(stopped_line(prog, signals.received[0]), file=sys.stderr)
        raise SystemExit(128 + signals.received[0])


def cli_main(prog: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command's ``main(argv)`` to run inside :func:`command_line`."""

    def decorate(main: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> Any:
            with command_line(prog, lambda: getattr(sys.modules.get("__main__"), "main", None) is run):
                return main(argv)

        return run

    return decorate


def user_error_message(error: BaseException) -> str | None:
    """The one-line message for an error the user can act on, or None for a bug (keeps its traceback):
    a :data:`USER_ERRORS` exception; a full disk or a name too long anywhere in the error's chain
    (``torch.save`` reports a full disk as a RuntimeError caused by the OSError); an MLflow store that is
    read-only, full or cannot be opened (:func:`tasks.mlflow_store.store_problem`)."""
    from tasks.mlflow_store import exception_chain, store_problem

    if isinstance(error, ValidationError):  # settings a flow refused as it started: one line, not pydantic's table
        return describe(error)
    if isinstance(error, USER_ERRORS):
        return str(error)
    chain = exception_chain(error)
    full = next((e for e in chain if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)), None)
    if full is not None:  # atomic writes left every earlier output whole
        return (
            f"no space left on the device writing {full.filename or 'an output'}; outputs written before are "
            "intact (written atomically): free space and run again to resume"
        )
    long = next((e for e in chain if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG), None)
    if long is not None:
        name = str(long.filename or "a path")
        shown = name if len(name) <= 80 else f"{name[:60]}...({len(name)} characters)"
        return f"{shown}: a file or folder name too long for the file system; give a shorter one"
    return store_problem(error)


def flow_main(
    flow: Any,
    params_model: type[Params],
    section: str,
    doc: str | None,
    check: Callable[[Any], None] | None = None,
    show: Callable[[Any, Any], None] | None = None,
) -> Callable[[list[str] | None], None]:
    """A flow's command line, ``main(argv)``: read its parameters (:func:`parse_params`: defaults <
    ``--config`` section ``section`` < flags), ``check`` them (what can be checked before an engine
    starts), run the flow on this process's rank (:func:`launched_rank`: one process, or each of torchrun's) and,
    on the rank that tracks, print what ``show(params, result)`` prints. A user's error ends it with one message
    (:func:`command_line`, program ``flows.<section>``)."""

    def main(argv: list[str] | None = None) -> None:
        with command_line(f"flows.{section}", lambda: getattr(sys.modules.get("__main__"), "main", None) is main):
            params = parse_params(params_model, section, argv, doc or "")
            check_launch_variables()  # torchrun's variables left from another launch: refused before any check writes
            if check is not None:
                check(params)
            with launched_rank() as rank:
                # Rank 0 runs the flow (a Prefect flow run, tracked); the others its plain function (the same
                # training, untracked: tasks.tracking_rank.tracking_rank).
                result = flow(params) if rank == 0 else flow.fn(params)
            if rank == 0 and show is not None:
                show(params, result)

    return main


def print_paths(paths: dict[str, str]) -> None:
    """``name  path`` lines, aligned: where a flow wrote its outputs."""
    width = max(map(len, paths), default=0) + 2
    for name, path in paths.items():
        print(f"{name:{width}}{path}")


@contextlib.contextmanager
def launched_rank() -> Iterator[int]:
    """``with launched_rank() as rank:`` this process's rank in the launch: 0 alone, or one of torchrun's N.

    Joins the process group torchrun describes (:func:`a5core.runtime.distributed.init_from_env`, before any
    model is loaded; left at the process's exit, so several flows can run in one launch). Prefect's temporary API
    server, when one starts, is stopped with this process even if it is killed; on rank 0 a server
    ``PREFECT_API_URL`` names must answer first (:mod:`tasks.prefect_server`). The other ranks log warnings only.
    """
    import atexit

    import torch.distributed as dist

    from a5core.runtime import distributed
    from tasks.prefect_server import check_prefect_api, stop_temporary_server_with_this_process

    stop_temporary_server_with_this_process()  # a killed flow leaves no Prefect server behind
    joined = dist.is_initialized()
    rank, world = distributed.init_from_env()
    if world > 1 and not joined:
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    if rank != 0:
        configure_logging(logging.WARNING)  # one rank's INFO lines are enough
    else:
        check_prefect_api()  # a server named but not answering: one line now, not minutes of retries
    yield rank


def run_flow(flow: Any, params: BaseModel) -> Any:
    """Run a Prefect ``flow`` with ``params`` from a command line (:func:`launched_rank`): on rank 0 as a flow
    run, whose result it returns; on torchrun's other ranks its plain function (``flow.fn``), returning None."""
    with launched_rank() as rank:
        if rank == 0:
            return flow(params)
        flow.fn(params)
        return None
