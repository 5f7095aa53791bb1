"""Checkpoints of the training loops (SFT, GRPO): atomic to write, exact to resume, refused if foreign.

``directory/latest/`` holds model.pt (state_dict), optimizer.pt (optimizer and, if any, scheduler
state), rng.pt (python, numpy, torch CPU and CUDA generator states) and state.json (the loop's own
position and metrics, plus the run's fingerprint). A checkpoint is written whole into
``.latest.partial/``, then swapped in by two renames (latest → .latest.previous, .latest.partial →
latest) before .latest.previous is deleted: at every instant either latest/ or .latest.previous/ is
a complete checkpoint, and :func:`load_checkpoint` puts .latest.previous back if a crash fell between
the renames. A Ctrl-C or SIGTERM that arrives while a checkpoint is written waits for the write to finish
(:func:`signals_held`), then acts as it would have. Under several ranks (FSDP2) every rank calls
:func:`save_checkpoint` and :func:`load_checkpoint`: the shards are gathered and rank 0 writes them whole, and each
rank loads the whole tensors and keeps its shards, so a checkpoint resumes on any number of ranks.

The fingerprint says what must match for a checkpoint to be resumed: the run's settings (less those
that only say where and how often side effects happen) and a sha256 of its data, in order.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from a5core.runtime import distributed
from a5core.runtime.writing import write_text_atomic

logger = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """A training step produced a NaN/inf loss or gradient norm; the step's update was not applied."""


class CheckpointMismatchError(ValueError):
    """The checkpoint directory holds a run with another configuration or other training data."""


class CorruptStateError(ValueError):
    """A file a run resumes from cannot be read (truncated, overwritten, missing): the message names the
    file, says what is wrong with it and how to recover."""


def read_state(path: Path, required: Sequence[str], recovery: str) -> dict[str, Any]:
    """The JSON object in ``path``, which must hold the keys ``required``; CorruptStateError naming the
    file, what is wrong and ``recovery`` (what to do: "delete … to …") otherwise."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as error:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise CorruptStateError(f"{path}: unreadable ({error}); {recovery}") from None
    except RecursionError:
        raise CorruptStateError(f"{path}: unreadable (JSON nested too deeply); {recovery}") from None
    if not isinstance(state, dict):
        raise CorruptStateError(f"{path}: a JSON {type(state).__name__}, not the state's object; {recovery}")
    missing = [key for key in required if key not in state]
    if missing:
        raise CorruptStateError(f"{path}: not a run's state (no {', '.join(map(repr, missing))}); {recovery}")
    return state


def load_tensors(path: Path, recovery: str, map_location: Any = None) -> Any:
    """``torch.load(path)`` of tensors only (``weights_only``: a tampered file cannot run code); a missing
    or unreadable file (truncated: "failed finding central directory") raises CorruptStateError naming it,
    what is wrong and ``recovery``."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except torch.OutOfMemoryError:
        raise
    except FileNotFoundError:
        raise CorruptStateError(f"{path}: missing; {recovery}") from None
    except (RuntimeError, EOFError, ValueError, OSError, pickle.UnpicklingError) as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CorruptStateError(f"{path}: unreadable ({detail}); {recovery}") from None


def fingerprint(settings: dict[str, Any], records: Iterable[Sequence[str]], what: str) -> dict[str, Any]:
    """``{"settings", "what", "n", "sha256"}``: the settings (JSON-able) and a digest of the data.

    records: the data, each record a sequence of strings (e.g. prompt and response), in training order;
    what: its name in messages ("examples", "problems").
    """
    digest = hashlib.sha256()
    n = 0
    for record in records:
        n += 1
        for text in record:
            data = text.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
    settings = json.loads(json.dumps(settings, default=list))  # tuples → lists, as they come back from disk
    return {"settings": settings, "what": what, "n": n, "sha256": digest.hexdigest()}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_fsynced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block: one that arrives is noted, and once the block is over the
    handlers in place before are back and the signal is raised again, so it acts as it would have, after the
    block (a checkpoint being written is finished first). A signal ignored stays ignored. Outside the main
    thread, where handlers cannot be set: nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {
        signum: signal.signal(signum, lambda received, frame: held.append(received))
        for signum in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(signum) not in (signal.SIG_IGN, None)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


def save_checkpoint(
    directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any]
) -> None:
    """Write ``directory/latest`` atomically (see the module docstring), a Ctrl-C or SIGTERM meanwhile held
    until it is written (:func:`signals_held`). Every rank calls it: with several, the model's and optimizer's
    shards are gathered (collectives) and rank 0 writes them whole, in the one-process layout, so the checkpoint
    resumes on any number of ranks.

    state: JSON-able, must hold ``step`` and ``fingerprint``; scheduler may be None.
    """
    rank, world = distributed.rank_and_world()
    if world > 1:
        model, optimizer = distributed.gathered(model, keep=rank == 0), distributed.gathered(optimizer, keep=rank == 0)
    if rank == 0:
        with signals_held():
            _save_checkpoint(directory, model, optimizer, scheduler, state)
    if world > 1:
        dist.barrier()


def _save_checkpoint(
    directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any]
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    latest, partial, previous = directory / "latest", directory / ".latest.partial", directory / ".latest.previous"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    _save_fsynced(model.state_dict(), partial / "model.pt")
    _save_fsynced(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict() if scheduler else None},
        partial / "optimizer.pt",
    )
    numpy_state = np.random.get_state()
    _save_fsynced(
        {
            "python": random.getstate(),
            "numpy": (numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
        partial / "rng.pt",
    )
    write_text_atomic(partial / "state.json", json.dumps(state, indent=1, default=float) + "\n")  # float: numpy scalars
    _fsync_dir(partial)
    if latest.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(latest, previous)
    os.rename(partial, latest)
    _fsync_dir(directory)
    shutil.rmtree(previous, ignore_errors=True)
    logger.info("checkpoint at step %d written to %s", state["step"], latest)


def check_counts(path: Path, state: dict[str, Any], counts: dict[str, int | None], recovery: str) -> None:
    """CorruptStateError naming ``path``, the key and ``recovery`` unless each key of ``counts`` holds a whole
    number from 0 to its bound (None: no bound) and ``finished`` a boolean: the position a run resumes at."""
    for key, high in counts.items():
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (high is not None and value > high):
            bound = f"from 0 to {high}" if high is not None else "of 0 or more"
            raise CorruptStateError(f"{path}: {key} {value!r} is not a whole number {bound} (damaged?); {recovery}")
    finished = state.get("finished")
    if not isinstance(finished, bool):
        raise CorruptStateError(f"{path}: finished {finished!r} is not true or false (damaged?); {recovery}")
    last = counts.get("step")
    if finished and last is not None and state["step"] != last:  # a run finishes at its last step
        raise CorruptStateError(
            f"{path}: finished at step {state['step']}, but the run's last step is {last} (damaged?); {recovery}"
        )


def load_checkpoint(
    directory: Path,
    expected: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    counts: dict[str, int | None] | None = None,
) -> dict[str, Any] | None:
    """Restore ``directory/latest`` into model, optimizer, scheduler and the RNGs; return its state.json.

    None when there is no checkpoint. A finished run (state ``finished`` true) only restores the model.
    Raises CheckpointMismatchError, naming what differs, when its fingerprint is not ``expected``, and
    CorruptStateError, naming the file and the folder to delete, for a file of it that cannot be read or a
    position that is not one of the run's (``step``, and each key of ``counts``, a whole number within its
    bound: :func:`check_counts`). Every rank calls it: with several, each reads the whole checkpoint and keeps
    its shards, rank 0 first (it repairs a save a crash interrupted), then the others.
    """
    if distributed.rank_and_world()[1] == 1:
        return _load_checkpoint(directory, expected, model, optimizer, scheduler, counts)
    with distributed.rank0_first():
        sharded_model, sharded_optimizer = distributed.Sharding(model), distributed.Sharding(optimizer)
        return _load_checkpoint(directory, expected, sharded_model, sharded_optimizer, scheduler, counts)


def _load_checkpoint(
    directory: Path,
    expected: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    counts: dict[str, int | None] | None,
) -> dict[str, Any] | None:
    latest, previous = directory / "latest", directory / ".latest.previous"
    if not latest.exists() and previous.exists():  # a crash between the two renames of a save
        os.rename(previous, latest)
    shutil.rmtree(directory / ".latest.partial", ignore_errors=True)  # a save the crash interrupted
    if not (latest / "state.json").is_file():
        return None
    recovery = f"delete {directory} to train this run again from its start (its MLflow run and outputs stay)"
    state = read_state(latest / "state.json", ("step", "finished", "fingerprint"), recovery)
    if state["fingerprint"] != expected:
        raise CheckpointMismatchError(_describe_mismatch(latest, state["fingerprint"], expected))
    check_counts(latest / "state.json", state, {"step": None, **(counts or {})}, recovery)
    device = next(model.parameters()).device
    weights = load_tensors(latest / "model.pt", recovery, device)
    with _restoring(latest / "model.pt", "this model's weights", recovery):
        model.load_state_dict(weights)
    if state.get("finished"):
        return state
    saved = load_tensors(latest / "optimizer.pt", recovery, device)
    with _restoring(latest / "optimizer.pt", "this run's optimizer state", recovery):
        optimizer.load_state_dict(saved["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(saved["scheduler"])
    rng = load_tensors(latest / "rng.pt", recovery)
    with _restoring(latest / "rng.pt", "random generators' states", recovery):
        random.setstate(rng["python"])
        name, keys, *rest = rng["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state


@contextlib.contextmanager
def _restoring(path: Path, what: str, recovery: str) -> Iterator[None]:
    """CorruptStateError naming ``path`` for a file that reads as tensors but does not hold ``what`` (another
    model's weights, a file put in its place): its contents do not fit what they are restored into."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise CorruptStateError(f"{path}: does not hold {what} ({detail}); {recovery}") from None


def _describe_mismatch(latest: Path, saved: dict[str, Any], current: dict[str, Any]) -> str:
    saved_settings, current_settings = saved.get("settings", {}), current["settings"]
    differences = [
        f"{key}: {saved_settings.get(key)!r} in the checkpoint, {current_settings.get(key)!r} now"
        for key in sorted(set(saved_settings) | set(current_settings))
        if saved_settings.get(key) != current_settings.get(key)
    ]
    what = current["what"]
    if saved.get("n") != current["n"]:
        differences.append(f"{what}: {saved.get('n')} in the checkpoint, {current['n']} now")
    elif saved.get("sha256") != current["sha256"]:
        differences.append(f"{what}: same number ({current['n']}) but different contents or order")
    return (
        f"checkpoint {latest} belongs to a different run ({'; '.join(differences)}); "
        f"resume with the same settings and {what}, or use a new checkpoint directory"
    )
