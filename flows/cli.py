"""Command lines for flows: one flag per field of a flow's pydantic parameter model.

Values come, in increasing priority, from the model's defaults, one section of a YAML file
(``--config params.yaml``, the file DVC tracks), that file's ``profiles.<profile>.<section>``
overrides for its selected ``profile`` (or ``--profile NAME``), and the flags. A flag's value is read as YAML, so
``--limit 20``, ``--stop '["</answer>"]'`` and ``--seed null`` all work; pydantic validates the result
and a bad value exits with its message. ``--show-config`` prints the settings so resolved, each with where its
value came from, and exits without running anything.

Every flow's ``main`` is wrapped by :func:`cli_main`: logging at INFO for the project's own loggers (the
loops' one line per step), a Ctrl-C ends it with one line (exit status 130; a SIGTERM: 143) wherever it lands,
and bad input (a data file, a
prompt template, a model path, settings, a NaN loss, a checkpoint of another run, a micro-batch too large for
the GPU) ends the command with one message on stderr and exit status 1, not a traceback. ``A5_TRACEBACK=1``
shows the traceback instead.

Several GPUs: ``torchrun --nproc-per-node N -m flows.grpo ...`` (also sft_experiment, expert_iteration,
leaderboard). A flow's ``main`` runs it through :func:`run_flow`: every rank runs the same flow code
and trains in the same loop (FSDP2, :mod:`a5core.runtime.distributed`); rank 0 runs it as the Prefect flow
and alone tracks (MLflow, outputs, metrics files, printed results), the other ranks run the flow's
plain function, without Prefect, MLflow or outputs, and log warnings only.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from a5core.data.files import DataError
from a5core.data.prompts import PromptTemplateError
from a5core.policy.model_specs import ModelResolutionError
from a5core.runtime.checkpoint import CheckpointMismatchError, NonFiniteLossError
from a5core.runtime.guards import DivergenceError
from a5core.runtime.out_of_memory import MicrobatchOutOfMemoryError
from a5core.runtime.settings import Settings, describe, setting_location, unknown_setting
from tasks.engines import EngineStartError

Params = TypeVar("Params", bound=Settings)

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


def cli_main(prog: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a flow's ``main(argv)``: configure logging, turn a user's error (see :func:`user_error_message`)
    into ``SystemExit("PROG: error: MESSAGE")`` (message on stderr, exit status 1), and end the command with
    one line on a Ctrl-C or a SIGTERM wherever it lands (:class:`StopSignals`): exit status 130 (143 for
    SIGTERM), the shell's for a command a signal ended."""

    def decorate(main: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> Any:
            configure_logging()
            signals = StopSignals()
            try:
                with signals:
                    result = main(argv)
            except BaseException as error:
                stopped = signals.received[0] if signals.received else _stop_signal_in(error)
                if stopped is not None:
                    print(stopped_line(prog, stopped), file=sys.stderr)
                    raise SystemExit(128 + stopped) from None
                message = None if not isinstance(error, Exception) or _show_tracebacks() else user_error_message(error)
                if message is None:
                    raise
                raise SystemExit(f"{prog}: error: {message}") from None
            finally:
                if getattr(sys.modules.get("__main__"), "main", None) is run:  # this command is the process
                    exit_at_once_on_stop_signals(prog, announced=bool(signals.received))
            if signals.received:  # a library swallowed the interrupt and the work went on to its end
                print(stopped_line(prog, signals.received[0]), file=sys.stderr)
                raise SystemExit(128 + signals.received[0])
            return result

        return run

    return decorate


def stopped_line(prog: str, signum: int) -> str:
    """The one line a command a signal ended prints."""
    how = "interrupted" if signum == signal.SIGINT else f"stopped ({signal.Signals(signum).name})"
    return f"{prog}: {how}; what was written is intact (atomic writes, checkpoints): the same command resumes"


class StopSignals:
    """``with StopSignals() as signals:`` SIGINT and SIGTERM raise KeyboardInterrupt in the main thread, their
    numbers appended to ``signals.received``, so an error an interrupt turned into another on its way up (a
    serializer wraps it in its own error) is still known for what it is.

    An interrupt a library turns into its own error and then catches would be lost, and the command would run
    on (Prefect, serializing a flow's or a task's parameters, catches pydantic's error, which wraps the
    interrupt): so until the block ends, the interrupt is raised again every :attr:`AGAIN_S` seconds. A signal
    the process was started ignoring (a background job of a shell script) stays ignored. Outside the main
    thread, where handlers cannot be set: nothing."""

    AGAIN_S = 10.0

    def __init__(self) -> None:
        self.received: list[int] = []
        self.previous: dict[int, Any] = {}
        self.over = threading.Event()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {
                signum: signal.signal(signum, self.interrupt)
                for signum in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(signum) is not signal.SIG_IGN
            }
        return self

    def __exit__(self, *exc: Any) -> None:
        self.over.set()
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def interrupt(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if len(self.received) == 1:
            threading.Thread(target=self._again, args=(signum,), name="interrupt-again", daemon=True).start()
        raise KeyboardInterrupt

    def _again(self, signum: int) -> None:
        while not self.over.wait(self.AGAIN_S):
            if signal.getsignal(signum) not in (signal.SIG_DFL, signal.SIG_IGN):  # this handler, or one holding it
                signal.pthread_kill(threading.main_thread().ident, signum)  # a real signal: it ends a sleep too


def _stop_signal_in(error: BaseException) -> int | None:
    """The signal an error reports, where it is a Ctrl-C (KeyboardInterrupt) or Prefect's SIGTERM of a flow
    run (TerminationSignal), itself or in its chain; else None."""
    from prefect.exceptions import TerminationSignal

    from tasks.mlflow_store import exception_chain

    for cause in exception_chain(error):
        if isinstance(cause, KeyboardInterrupt):
            return signal.SIGINT
        if isinstance(cause, TerminationSignal):
            return cause.signal
    return None


def exit_at_once_on_stop_signals(prog: str, announced: bool) -> None:
    """From now on (the command's work is over; Prefect drains its logs and stops its temporary server) a
    SIGINT or SIGTERM ends the process at once: its one line (unless ``announced`` already), exit status 128 +
    the signal, no traceback out of an exit handler. A temporary Prefect server still running is stopped by
    its watcher (:mod:`tasks.prefect_server`)."""

    def exit_now(signum: int, frame: Any) -> None:
        if not announced:
            print(stopped_line(prog, signum), file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(128 + signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, exit_now)


def user_error_message(error: BaseException) -> str | None:
    """The one-line message for an error the user can act on, or None for a bug (keeps its traceback):
    a :data:`USER_ERRORS` exception; a full disk or a name too long anywhere in the error's chain
    (``torch.save`` reports a full disk as a RuntimeError caused by the OSError); an MLflow store that is
    read-only, full or cannot be opened (:func:`tasks.tracking.store_problem`)."""
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
    starts), run the flow (:func:`run_flow`: one process, or each of torchrun's ranks) and, on the rank
    that tracks, print what ``show(params, result)`` prints. A user's error ends it with one message
    (:func:`cli_main`, program ``flows.<section>``)."""

    @cli_main(f"flows.{section}")
    def main(argv: list[str] | None = None) -> None:
        params = parse_params(params_model, section, argv, doc or "")
        if check is not None:
            check(params)
        result = run_flow(flow, params)
        if result is not None and show is not None:  # None: a torchrun rank other than 0 (rank 0 reports)
            show(params, result)

    return main


def print_paths(paths: dict[str, str]) -> None:
    """``name  path`` lines, aligned: where a flow wrote its outputs."""
    width = max(map(len, paths), default=0) + 2
    for name, path in paths.items():
        print(f"{name:{width}}{path}")


def run_flow(flow: Any, params: BaseModel) -> Any:
    """Run a Prefect ``flow`` with ``params`` from a command line, one process or torchrun's N.

    Joins the process group torchrun describes (:func:`a5core.runtime.distributed.init_from_env`, before any
    model is loaded; left at the process's exit, so several flows can run in one launch); then rank 0
    calls the flow (a Prefect flow run, tracked as usual) and every other rank its plain function
    (``flow.fn``: the same training, untracked; see :func:`tasks.tracking.tracking_rank`). Returns the
    flow's result on rank 0 and None on the others. Prefect's temporary API server, when one starts, is
    stopped with this process even if it is killed; a server ``PREFECT_API_URL`` names must answer first
    (:mod:`tasks.prefect_server`).
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
    if rank == 0:
        check_prefect_api()  # a server named but not answering: one line now, not minutes of retries
        return flow(params)
    flow.fn(params)
    return None


class ConfigError(ValueError):
    """A ``--config`` file that cannot be read as settings: missing, not UTF-8, malformed YAML (a key given twice
    in one mapping, aliases that expand past :data:`MAX_YAML_VALUES` values), a section or profile that is not a
    mapping, a profile it does not define, a key no flow parameter has. The message names file and place."""


# The most values a settings document (or a flag's value) may expand to through its aliases: params.yaml holds a
# few hundred; an "alias bomb" of a few lines expands to billions, and reading it would never end.
MAX_YAML_VALUES = 100_000
# The largest settings file read (params.yaml: 23 kB): a bigger file is not settings, and parsing megabytes of YAML
# takes minutes.
MAX_CONFIG_BYTES = 1_000_000


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping (the safe loader keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str | int | float | bool) and key in first:
                problem = f"key {key!r} given twice in one mapping (first on line {first[key]})"
                raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
            first.setdefault(key, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, lambda loader, node: loader.construct_mapping(node)
)


def load_yaml(text: str) -> Any:
    """The YAML value of ``text``, read strictly: a key twice in one mapping, or aliases that expand past
    :data:`MAX_YAML_VALUES` values (or refer to themselves), raise ``yaml.YAMLError`` with the place."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node) -> None:
    """``yaml.YAMLError`` when the node graph, aliases expanded, holds more than :data:`MAX_YAML_VALUES` nodes
    or an alias inside its own anchor. Each node is sized once (an alias is the node it names)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_nodes: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        children = _children(node)
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[id(node)] > MAX_YAML_VALUES:
                what = (  # each node is sized once: as many sized as that, the text itself holds them
                    "holds more than {:,} values: not a settings file"
                    if len(sizes) > MAX_YAML_VALUES
                    else "its aliases expand to more than {:,} values; write the values out"
                )
                raise yaml.YAMLError(f"at line {node.start_mark.line + 1}: {what.format(MAX_YAML_VALUES)}")
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            raise yaml.YAMLError(f"at line {node.start_mark.line + 1}: an alias inside its own anchor")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    return []


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The YAML document of a settings file (``params.yaml``), a mapping of sections; an empty file is {}."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"--config {path}: {size / 1e6:.1f} MB, not a settings file (those hold at most "
            f"{MAX_CONFIG_BYTES / 1e6:.0f} MB; params.yaml holds a few kB): give the settings file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"--config {path}: not UTF-8 text (byte {error.start}: {error.object[error.start : error.start + 1]!r})"
        ) from None
    try:
        document = load_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise ConfigError(
            f"--config {path}{where}: malformed YAML ({getattr(error, 'problem', None) or error})"
        ) from None
    except RecursionError:
        raise ConfigError(f"--config {path}: malformed YAML (nested too deeply to read)") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(
            f"--config {path}: expected a mapping of sections (baseline_eval:, grpo:, ...), "
            f"got a {type(document).__name__}"
        )
    return document


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override``'s keys on top; a mapping under the same key is merged key by key."""
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# The profile of the settings as a file's sections give them, without a profile's overrides (params.yaml: the
# handout's); any other profile is one the file's ``profiles`` defines.
BASE_PROFILE = "a5"


def profile_name(
    document: dict[str, Any], chosen: str | None = None, path: str | os.PathLike = "params.yaml"
) -> str | None:
    """The profile whose overrides apply: ``chosen`` (``--profile``), else the document's ``profile``.
    ConfigError for either naming a profile the document does not define (nor :data:`BASE_PROFILE`)."""
    profiles = document.get("profiles") or {}
    if not isinstance(profiles, dict):
        raise ConfigError(
            f"--config {path}: `profiles` must be a mapping of profile names, got {type(profiles).__name__}"
        )
    known = [BASE_PROFILE, *(name for name in profiles if name != BASE_PROFILE)]
    defined = f"(it has: {', '.join(map(str, known))})"
    if chosen is not None and chosen not in known:
        raise ConfigError(f"--profile {chosen}: no such profile in {path} {defined}")
    selected = document.get("profile")
    if selected is not None and selected not in known:  # the file's own choice: never silently the base settings
        raise ConfigError(f"--config {path}: `profile: {selected}` names no profile of the file {defined}")
    return chosen or selected


def section_layers(
    document: dict[str, Any], section: str, profile: str | None, path: str | os.PathLike = "params.yaml"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Section ``section`` of a settings document, and ``profiles.<profile>.<section>``'s overrides of it ({}
    each where the document has none)."""

    def mapping(value: Any, where: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(
                f"--config {path}: `{where}` must be a mapping of settings, got {type(value).__name__} {value!r}"
            )
        return value

    base = mapping(document.get(section), section)
    overrides = mapping((document.get("profiles") or {}).get(profile), f"profiles.{profile}") if profile else {}
    return base, mapping(overrides.get(section), f"profiles.{profile}.{section}")


def section_settings(
    document: dict[str, Any], section: str, profile: str | None, path: str | os.PathLike = "params.yaml"
) -> dict[str, Any]:
    """Section ``section`` of a settings document with ``profiles.<profile>.<section>`` deep-merged on top
    (a profile may override one key of a nested mapping). {} when neither has the section."""
    return deep_merge(*section_layers(document, section, profile, path))


def _unknown_keys(model: type[Settings], values: dict[str, Any], where: str) -> str | None:
    """A message naming the keys of ``values`` that ``model`` has no field for (typos), or None."""
    settings = model.flat_fields()
    unknown = [unknown_setting(key, model) for key in values if key not in settings]
    return f"{where}: {'; '.join(unknown)}" if unknown else None


def _refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit status 2 with one line (no usage: the message names the file, the place or the flag)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def parse_params(model: type[Params], section: str, argv: list[str] | None = None, description: str = "") -> Params:
    """Build ``model`` from defaults < ``--config FILE`` section ``section`` < its profile's overrides <
    command-line flags. ``--show-config``: print the settings and where each came from
    (:func:`show_config`), then exit 0."""
    parser = _parser(model, section, description)
    args = vars(parser.parse_args(argv))
    config, profile, show = args.pop("config"), args.pop("_profile"), args.pop("_show_config")
    if profile is not None and config is None:
        _refuse(parser, f"--profile {profile}: a profile of a settings file; give the file with --config")
    sources: dict[str, str] = {}  # setting → where its value came from, for --show-config
    layers = [] if config is None else _config_layers(parser, model, section, config, profile, sources)
    layers.append(("", _flag_values(parser, args, sources)))
    values: dict[str, Any] = {}
    for _, layer in layers:
        values = deep_merge(values, layer)
    try:
        params = model(**values)
    except ValidationError as e:
        problems = "; ".join(map(_flag_problem, e.errors()))
        _refuse(parser, f"invalid parameters: {problems}")
    hidden = hidden_problems(model, values, layers)
    if hidden:
        _refuse(parser, f"invalid parameters: {hidden}")
    if show:
        print(show_config(params, section, sources))
        parser.exit(0)
    return params


def argument_parser(description: str | None) -> argparse.ArgumentParser:
    """Every command line's parser: a flag is taken only as it is spelt in full (argparse would take a prefix of
    one, and ``--epochs 3`` set ``epochs_per_rollout_batch``)."""
    return argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )


def _parser(model: type[Settings], section: str, description: str) -> argparse.ArgumentParser:
    """The command line of a flow of parameters ``model``: --config, --profile, --show-config, a flag a field."""
    parser = argument_parser(description)
    parser.add_argument("--config", type=Path, help=f"YAML file whose `{section}` section sets parameters")
    parser.add_argument(
        "--profile",
        dest="_profile",
        metavar="NAME",
        help="with --config: use this profile's overrides instead of the file's `profile`",
    )
    parser.add_argument(
        "--show-config",
        dest="_show_config",
        action="store_true",
        help="print the settings a run would take, each with where its value comes from, and exit without running",
    )
    for name, field in model.flat_fields().items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            metavar="VALUE",
            help=f"{field.description or name} (default: {field.default!r})",
        )
    return parser


def _config_layers(
    parser: argparse.ArgumentParser,
    model: type[Settings],
    section: str,
    config: Path,
    profile_flag: str | None,
    sources: dict[str, str],
) -> list[tuple[str, dict[str, Any]]]:
    """:func:`config_layers`, each key's source (the file's section, or the profile) recorded in ``sources``; a
    file that cannot be read, or a key ``model`` has no field for, exits (:func:`_refuse`)."""
    try:
        profile, layers = config_layers(model, section, config, profile_flag)
    except ConfigError as error:
        _refuse(parser, str(error))
    (_, base), (_, overrides) = layers
    sources.update({**dict.fromkeys(base, f"{config} {section}"), **dict.fromkeys(overrides, f"profile {profile}")})
    return layers


def config_layers(
    model: type[Settings], section: str, config: str | os.PathLike, profile_flag: str | None = None
) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
    """The profile that applies, and section ``section`` of settings file ``config`` and that profile's overrides
    of it, each with where it is (``--config FILE section `NAME```, ``--config FILE profile NAME``). ConfigError
    for a file that cannot be read, no such section, or a key ``model`` has no field for."""
    document = read_config(config)
    if section not in document:
        raise ConfigError(f"--config {config}: no `{section}` section")
    profile = profile_name(document, profile_flag, config)
    base, overrides = section_layers(document, section, profile, config)
    where = f"--config {config} section `{section}`" + (f" (with profile {profile})" if profile else "")
    unknown = _unknown_keys(model, deep_merge(base, overrides), where)
    if unknown:
        raise ConfigError(unknown)
    return profile, [
        (f"--config {config} section `{section}`", base),
        (f"--config {config} profile {profile}", overrides),
    ]


def settings_from_file(
    model: type[Params], section: str, config: str | os.PathLike, profile_flag: str | None = None
) -> Params:
    """``model`` from section ``section`` of settings file ``config`` with its profile's overrides
    (:func:`config_layers`), every value checked, those the profile replaces too (:func:`hidden_problems`);
    ConfigError naming file and place otherwise."""
    _, layers = config_layers(model, section, config, profile_flag)
    values = deep_merge(layers[0][1], layers[1][1])
    try:
        params = model(**values)
    except ValidationError as error:
        raise ConfigError(f"--config {config}: invalid `{section}`: {describe(error)}") from None
    hidden = hidden_problems(model, values, layers)
    if hidden:
        raise ConfigError(hidden)
    return params


def hidden_problems(model: type[Settings], values: dict[str, Any], layers: list[tuple[str, dict[str, Any]]]) -> str:
    """The invalid values a later layer hides (a section's value its profile or a flag replaces: ``dvc exp run -S
    baseline_eval.limit=abc`` under a profile that sets ``limit``), each named with its place; "" when none. A
    value is checked where it was written, whether or not it is the one that runs."""
    problems = []
    for index, (where, layer) in enumerate(layers[:-1]):
        later = {key for _, above in layers[index + 1 :] for key in above}
        hidden = {key: value for key, value in layer.items() if key in later and values.get(key) != value}
        if not hidden:
            continue
        try:
            model(**{**values, **hidden})
        except ValidationError as error:
            for problem in error.errors():
                loc = setting_location(problem["loc"])
                if loc and loc[0] in hidden:
                    name = "".join([str(loc[0]), *(f"[{i}]" for i in loc[1:] if isinstance(i, int))])
                    problems.append(
                        f"{where}: {name} {problem.get('input')!r}: {problem['msg']} (a later value replaces it, "
                        "but it is wrong: fix or remove it)"
                    )
    return "; ".join(problems)


def _flag_values(parser: argparse.ArgumentParser, args: dict[str, Any], sources: dict[str, str]) -> dict[str, Any]:
    """The flags given, each value read as YAML (a value that is not YAML exits), recorded in ``sources``."""
    values = {}
    for name, raw in args.items():
        if raw is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        try:
            values[name] = load_yaml(raw)
        except (yaml.YAMLError, RecursionError) as error:
            _refuse(parser, f"{flag} {raw!r}: not a YAML value ({getattr(error, 'problem', None) or error})")
        sources[name] = flag
    return values


def _flag_problem(error: Any) -> str:
    """One of pydantic's errors as the flag it names: ``--flag[index] 'value': message``."""
    loc = setting_location(error["loc"])
    if not loc:  # a check across fields: no single flag to name
        return error["msg"]
    index = "".join(f"[{i}]" for i in loc[1:] if isinstance(i, int))
    flag = f"--{str(loc[0]).replace('_', '-')}{index}"
    return f"{flag} {error.get('input')!r}: {error['msg']}"


def declared_in(model: type[Settings], name: str) -> str:
    """The class whose body gives setting ``name`` of ``model`` its default (module and name)."""
    cls = model.declaring_class(name)
    return f"{cls.__module__}.{cls.__qualname__}"


def _flow_yaml(value: Any) -> str:
    """``value`` (JSON-like) as one line of YAML flow style: ``1.0e-05``, ``[128, full]``, ``null``."""
    return yaml.safe_dump([value], default_flow_style=True, width=float("inf")).strip()[1:-1]


def show_config(params: Settings, section: str, sources: dict[str, str]) -> str:
    """``params`` as YAML, section ``section``, each setting commented with where its value came from: a
    ``default`` (the class that declares it), the file's section, a profile or a flag; then, for an ablation
    (``params.ablation``), what each of its children sets (:mod:`flows.ablations`)."""
    values = params.flat(mode="json")
    rows: list[tuple[str, str | None]] = [
        ("# The settings this command runs with, each followed by where its value comes from", None),
        (f"{section}:", None),
    ]
    rows += [
        (f"  {name}: {_flow_yaml(value)}", sources.get(name) or f"default ({declared_in(type(params), name)})")
        for name, value in values.items()
    ]
    ablation = getattr(params, "ablation", None)
    if ablation:  # the grpo flow's: its children run the settings above but what the ablation sets
        from flows.ablations import ablation_overrides, ablation_settings

        children = ablation_settings(ablation, params)
        rows.append((f"ablation {ablation}:", None))
        for setting, overrides in ablation_overrides(ablation, params).items():
            child = children[setting].flat(mode="json")
            rows.append((f"  {setting}:", None))
            rows += [(f"    {key}: {_flow_yaml(child[key])}", f"ablation {ablation}") for key in overrides]
    width = min(max(len(text) for text, source in rows if source), 48)  # a long list stands out on its own
    return "\n".join(text if source is None else f"{text:{width}}  # {source}" for text, source in rows)
