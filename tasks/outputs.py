"""Where a flow may write: checked before any work, so an output setting cannot replace what is not an output.

A flow writes files into its ``output_dir`` and to single files it is given (``metrics_path``, the difficulty
table, the SFT sets). Each is refused, with a ValueError naming the setting and the path, when it would
replace something that is not this flow's output:

- a file path that is an existing folder (written at the end, it failed after all the work);
- an existing file that a5 did not write there, or that changed since it did (a file git tracks such as
  ``params.yaml`` or ``README.md``, a user's own ``results.json``): a5 notes each output file it writes
  (:func:`write_output_file`), and replaces only those holding what it wrote, and the files ``dvc.yaml``
  declares a stage's outputs (DVC keeps a copy of each in its cache);
- an output folder that is an existing file, holds files git tracks (a source folder such as ``.`` or
  ``docs``; the ``.gitignore`` and ``.dvc`` files DVC commits beside its outputs do not count), or holds
  another flow's outputs: the report's (marker ``.a5-report``) or another kind of run's (marker
  ``.a5-outputs``, naming it, which :func:`claim_output_dir` writes once the checks pass);
- an output folder that is not empty and that a5 did not make (no marker): files a5 did not write, which
  its outputs (``report.md``, ``summary.json``, ``run.json``, ...) could replace;
- an output folder, or file, in a system folder (``/etc``, ``/usr``, ...), or in a read-only one (no write
  permission for anyone: a folder of data others read, such as the shared data), even for a user, root, whom
  the permissions would not stop.

A folder a5 made (its marker) takes the same kind of run's outputs again: a run's own earlier folder. The
marker is made at once or not at all (two flows claiming a new folder together: one of them gets it), and a
flow holds its folder while it writes there (:func:`outputs_held`): a second flow on it is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from a5core.runtime.writing import write_text_atomic

OUTPUT_MARKER = ".a5-outputs"  # in an output folder: the kind of flow whose outputs it holds
OUTPUT_LOCK = ".a5-outputs.lock"  # in an output folder: held by the flow writing there
REPORT_MARKER = ".a5-report"  # in every report folder (flows.report): a folder it made, which it may replace


def git_tracked(path: Path, recursive: bool = False) -> list[str]:
    """The files git tracks at ``path`` (a file), or under it (a folder, ``recursive``); [] outside a
    repository or without git."""
    folder, spec = (path, ".") if recursive else (path.parent, path.name)
    try:
        listed = subprocess.run(
            ["git", "-C", str(folder), "ls-files", "-z", "--", spec], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [name for name in listed.stdout.split("\0") if name] if listed.returncode == 0 else []


def dvc_outputs(project: Path = Path(".")) -> set[Path]:
    """The resolved paths ``dvc.yaml`` (in ``project``) declares as stage outputs (outs, metrics, plots)."""
    try:
        stages = (yaml.safe_load((project / "dvc.yaml").read_text()) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return set()
    declared = set()
    for stage in stages.values():
        for kind in ("outs", "metrics", "plots"):
            for entry in (stage or {}).get(kind) or []:
                for name in entry if isinstance(entry, dict) else [entry]:
                    declared.add((project / str(name)).resolve())
    return declared


# Where a5 notes the output files it wrote: under a hash of each file's resolved path, the sha256 of the bytes it
# wrote there (:func:`write_output_file`). A file that still holds them is a5's to replace.
WRITTEN_MEMO = Path("~/.cache/a5/written")


def _memo(path: Path) -> Path:
    return WRITTEN_MEMO.expanduser() / hashlib.sha256(str(path.resolve()).encode()).hexdigest()


def note_written(path: str | os.PathLike) -> None:
    """Note ``path`` as an output file a5 wrote, with its bytes (a memo that cannot be written is skipped: the
    next run then refuses to replace the file, naming it)."""
    from tasks.fingerprints import file_digest

    path = Path(path)
    try:
        memo = _memo(path)
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(memo, file_digest(path))
    except OSError:
        pass


def a5_wrote(path: Path) -> bool:
    """Whether ``path`` holds the bytes a5 last wrote there (:func:`note_written`)."""
    from tasks.fingerprints import file_digest

    try:
        return _memo(path).read_text().strip() == file_digest(path)
    except OSError:
        return False


def write_output_file(path: str | os.PathLike, text: str) -> Path:
    """Write output file ``path`` atomically and note it as a5's, so that the next run may replace it."""
    written = write_text_atomic(path, text)
    note_written(written)
    return written


def check_output_file(path: str | os.PathLike, what: str) -> None:
    """Refuse to write file ``path`` (setting ``what``) over a folder, in a system or read-only folder, or over a
    file a5 did not write there (or that changed since) unless ``dvc.yaml`` declares it a stage's output."""
    path = Path(path).expanduser()
    try:
        if path.is_dir():
            raise ValueError(f"{what} {path}: a folder; give the path of a file to write")
        check_place(path.parent, what, shown=path)
        if not path.exists() or path.resolve() in dvc_outputs() or a5_wrote(path):
            return
    except OSError as error:  # a name too long
        raise ValueError(f"{what} {path}: cannot be used as a file ({error.strerror or error})") from None
    whose = "a file git tracks" if git_tracked(path) else "a file a5 did not write there (or one changed since)"
    raise ValueError(
        f"{what} {path}: {whose}, not an output of this flow; not replacing it: give another path, or move the file "
        "away"
    )


def source_folders_refused(schema: dict[str, Any]) -> None:
    """The JSON schema of an output folder setting (what the Prefect UI's form validates against): a pattern
    that refuses the project itself and each of its top-level folders that holds files git tracks (``flows``,
    ``docs``, ...), as :func:`check_output_dir` does, so the form refuses them before a run starts. Outside a
    repository, no pattern (nothing is tracked)."""
    folders = sorted({name.split("/")[0] for name in git_tracked(Path("."), recursive=True) if "/" in name})
    if folders:
        names = "|".join(re.escape(folder) for folder in folders)
        schema["pattern"] = rf"^(?!(\./)*({names})?/*$)"
        schema["description"] = (
            f"{schema.get('description', '')} (a folder of its own: not the project's, nor {', '.join(folders)})"
        ).strip()


# Folders of the operating system: never an output folder, nor anything in them (but their scratch space).
SYSTEM_FOLDERS = tuple(Path("/", name) for name in "bin boot dev etc lib lib32 lib64 proc run sbin sys usr var".split())
SCRATCH_FOLDERS = (Path("/var/tmp"),)
DVC_FILES = (".gitignore", ".dvc")  # what DVC commits beside the outputs it keeps out of git


def check_output_dir(
    folder: str | os.PathLike, owner: str, what: str = "output_dir", ours: Callable[[str], bool] = lambda name: False
) -> None:
    """Refuse output folder ``folder`` for a flow of kind ``owner`` when it is a file, a system or read-only
    folder (or in one), holds files git tracks, another flow's outputs, or (a folder a5 did not make) files
    other than those ``ours(name)`` says the flow itself writes or reads there (see the module docstring)."""
    folder = Path(folder).expanduser()
    try:
        check_place(folder, what)
        if folder.exists():
            _check_contents(folder, owner, what, ours)
    except OSError as error:  # a name too long, a folder that cannot be listed
        raise ValueError(f"{what} {folder}: cannot be used as a folder ({error.strerror or error})") from None


def check_place(folder: Path, what: str, shown: Path | None = None) -> None:
    """ValueError naming setting ``what`` and ``shown`` (else ``folder``) when ``folder`` is a system folder or a
    read-only one, or in one: nothing a5 writes goes there."""
    resolved, shown = folder.resolve(), shown or folder
    in_system = any(resolved == s or s in resolved.parents for s in SYSTEM_FOLDERS) or resolved == Path("/")
    if in_system and not any(resolved == s or s in resolved.parents for s in SCRATCH_FOLDERS):
        where = "a system folder" if shown == folder else "in a system folder"
        raise ValueError(f"{what} {shown}: {where}; outputs go in a folder of your own (e.g. under outputs/)")
    existing = next(p for p in (resolved, *resolved.parents) if p.exists())
    if not existing.is_dir():  # the folder, or one above it (FILE/sub), is a file: nothing can be made there
        where = "a file, not a folder" if existing == resolved and shown == folder else f"{existing} is a file"
        raise ValueError(f"{what} {shown}: {where}; give a path under a folder")
    if not existing.stat().st_mode & 0o222:
        raise ValueError(
            f"{what} {shown}: {existing} is read-only (no one may write there: data others read, such as the "
            "shared data); outputs go in a folder of your own (e.g. under outputs/)"
        )


def _check_contents(folder: Path, owner: str, what: str, ours: Callable[[str], bool]) -> None:
    if not folder.is_dir():
        raise ValueError(f"{what} {folder}: a file, not a folder")
    report = (folder / REPORT_MARKER).is_file()
    if report and owner != "Report":
        raise ValueError(
            f"{what} {folder}: holds the report flow's outputs ({REPORT_MARKER}); not writing there: "
            "choose another folder"
        )
    marker = folder / OUTPUT_MARKER
    other = marker.read_text(encoding="utf-8", errors="replace").strip() if marker.is_file() else owner
    if other != owner:
        raise ValueError(
            f"{what} {folder}: holds the outputs of another kind of run ({other}, see {marker}); not writing "
            "there: choose another folder"
        )
    # DVC keeps its outputs out of git with a .gitignore beside them (and .dvc files): those mark an output folder
    tracked = [name for name in git_tracked(folder, recursive=True) if not name.endswith(DVC_FILES)]
    if tracked:
        raise ValueError(
            f"{what} {folder}: holds files git tracks ({_listed(tracked)}); outputs go in a folder of their own "
            "(e.g. under outputs/)"
        )
    if marker.is_file() or report:  # a5 made it
        return
    foreign = sorted(e.name for e in folder.iterdir() if not e.name.endswith(DVC_FILES) and not ours(e.name))
    if foreign:
        raise ValueError(
            f"{what} {folder}: holds files a5 did not write ({_listed(foreign)}), which its outputs could replace; "
            "give an empty or new folder (or one a5 made), or move those files away"
        )


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def output_kind(params_model: type) -> str:
    """The kind of run a parameter model (or its outputs group) describes, as a marker names it: ``GRPOParams``
    and ``GRPOOutputs`` → ``GRPO`` (the GRPO run and its ablations share it)."""
    return params_model.__name__.removesuffix("Params").removesuffix("Outputs")


def claim_outputs(params: Any) -> None:
    """Mark the run's ``output_dir`` as this kind of run's (:func:`claim_output_dir`)."""
    claim_output_dir(params.output_dir, output_kind(type(params)))


def claim_output_dir(folder: str | os.PathLike, owner: str) -> None:
    """Mark ``folder`` (made if missing) as holding the outputs of flows of kind ``owner``, once: the marker is
    made whole or not at all, so of two flows claiming a new folder together one gets it, and the other is refused
    naming it (ValueError)."""
    folder = Path(folder).expanduser()
    marker = folder / OUTPUT_MARKER
    if not marker.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = write_text_atomic(folder / f".{OUTPUT_MARKER}.{os.getpid()}", owner + "\n")
        try:
            os.link(partial, marker)  # fails if the marker exists: a rename would replace another flow's
        except FileExistsError:
            pass
        finally:
            partial.unlink()
    other = marker.read_text(encoding="utf-8", errors="replace").strip()
    if other != owner:
        raise ValueError(
            f"output_dir {folder}: holds the outputs of another kind of run ({other}, see {marker}); not writing "
            "there: choose another folder"
        )


@contextlib.contextmanager
def outputs_held(params: Any) -> Iterator[None]:
    """The run's ``output_dir`` claimed (:func:`claim_outputs`: every flow that writes there does so first,
    whether a command line or a Prefect deployment started it, so that its next run finds the folder its own) and
    held for the ``with`` block: another flow that tries to write there meanwhile is refused (RunInUseError),
    naming the process that holds it."""
    from tasks.run_lock import lock_file

    claim_outputs(params)
    folder = Path(params.output_dir).expanduser()

    def in_use(holder: str) -> str:
        return (
            f"output_dir {folder} is in use by {holder}: another run writes its outputs there; give this run "
            "another output_dir, or wait for that one to end"
        )

    with lock_file(folder / OUTPUT_LOCK, in_use):
        yield


def own_subfolder(folder: str | os.PathLike, name: str, what: str = "output_dir") -> Path:
    """``folder/name``, a folder of a flow's own inside its output folder (a page's ``figures/``): ValueError when it
    is a link (what the flow writes there would land wherever the link points) or a file. Nothing is removed: the
    user moves it."""
    sub = Path(folder).expanduser() / name
    if sub.is_symlink():
        raise ValueError(
            f"{what} {folder}: {name} is a link (to {os.readlink(sub)}), where this flow writes a folder of its own; "
            "it writes nothing through a link: remove the link (what it points at stays as it is), or give another "
            f"{what}"
        )
    if sub.exists() and not sub.is_dir():
        raise ValueError(f"{what} {folder}: {name} is a file, where this flow writes a folder of its own; move it away")
    return sub


def link_model(model: Path, link: Path) -> None:
    """Point ``link`` (a symlink, replaced atomically) at the saved ``model`` folder (the best one a flow chose;
    it stays in the run's own folder, so a later run with other settings does not write over it). The link is
    relative: the output folder can be moved, copied or archived with it."""
    partial = link.with_name(link.name + ".partial")
    partial.unlink(missing_ok=True)
    partial.symlink_to(os.path.relpath(model.resolve(), link.parent.resolve()), target_is_directory=True)
    if link.is_dir() and not link.is_symlink():  # a folder put there by hand: not ours to keep
        raise ValueError(f"{link} is a folder, not the link to the model this flow writes; move it away")
    os.replace(partial, link)
