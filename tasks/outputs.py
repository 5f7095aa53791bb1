"""Where a flow may write: checked before any work, so an output setting cannot replace what is not an output.

A flow writes files into its ``output_dir`` and to single files it is given (``metrics_path``, the difficulty
table, the SFT sets). Each is refused, with a ValueError naming the setting and the path, when it would
replace something that is not this flow's output:

- a file path that is an existing folder (written at the end, it failed after all the work);
- a file git tracks (``params.yaml``, ``dvc.yaml``, code, documents), unless ``dvc.yaml`` declares it a
  stage's output (a metrics file DVC keeps in git);
- a metrics file that exists and is not a JSON object or list (what flows write there), e.g. ``params.yaml``;
- an output folder that is an existing file, holds files git tracks (a source folder such as ``.`` or
  ``docs``; the ``.gitignore`` and ``.dvc`` files DVC commits beside its outputs do not count), or holds
  another flow's outputs: the report's (marker ``.a5-report``) or another kind of run's (marker
  ``.a5-outputs``, naming it, which :func:`claim_output_dir` writes once the checks pass);
- an output folder that is not empty and that a5 did not make (no marker): files a5 did not write, which
  its outputs (``report.md``, ``summary.json``, ``run.json``, ...) could replace;
- an output folder in a system folder (``/etc``, ``/usr``, ...), or in a read-only one (no write permission
  for anyone: a folder of data others read, such as the shared data), even for a user, root, whom the
  permissions would not stop.

A folder a5 made (its marker) takes the same kind of run's outputs again: a run's own earlier folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from a5core.runtime.writing import write_text_atomic

OUTPUT_MARKER = ".a5-outputs"  # in an output folder: the kind of flow whose outputs it holds
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


def check_output_file(path: str | os.PathLike, what: str, metrics: bool = False) -> None:
    """Refuse to write file ``path`` (setting ``what``) over a folder, a file git tracks that ``dvc.yaml``
    does not declare an output, or (``metrics``) a file that is not a JSON object or list."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{what} {path}: a folder; give the path of a file to write")
    if not path.exists():
        return
    if git_tracked(path) and path.resolve() not in dvc_outputs():
        raise ValueError(
            f"{what} {path}: a file git tracks, not an output of this flow; not replacing it: give another path"
        )
    if metrics:
        try:
            is_metrics = isinstance(json.loads(path.read_text(encoding="utf-8")), (dict, list))
        except (OSError, ValueError):
            is_metrics = False
        if not is_metrics:
            raise ValueError(
                f"{what} {path}: exists and is not a metrics file (JSON: an object or a list); not replacing it: "
                "give another path, or delete it if it is an old output"
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
        _check_place(folder, what)
        if folder.exists():
            _check_contents(folder, owner, what, ours)
    except OSError as error:  # a name too long, a folder that cannot be listed
        raise ValueError(f"{what} {folder}: cannot be used as a folder ({error.strerror or error})") from None


def _check_place(folder: Path, what: str) -> None:
    """A system folder, or a read-only one, or in one: refused."""
    resolved = folder.resolve()
    in_system = any(resolved == s or s in resolved.parents for s in SYSTEM_FOLDERS) or resolved == Path("/")
    if in_system and not any(resolved == s or s in resolved.parents for s in SCRATCH_FOLDERS):
        raise ValueError(f"{what} {folder}: a system folder; outputs go in a folder of your own (e.g. under outputs/)")
    existing = next(p for p in (resolved, *resolved.parents) if p.exists())
    if not existing.stat().st_mode & 0o222:
        raise ValueError(
            f"{what} {folder}: {existing} is read-only (no one may write there: data others read, such as the "
            "shared data); outputs go in a folder of your own (e.g. under outputs/)"
        )


def _check_contents(folder: Path, owner: str, what: str, ours: Callable[[str], bool]) -> None:
    if not folder.is_dir():
        raise ValueError(f"{what} {folder}: a file, not a folder")
    if (folder / REPORT_MARKER).is_file() and owner != "Report":
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
    if marker.is_file() or owner == "Report":  # a5 made it (the report flow checks its own folder's files)
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
    """Mark the run's ``output_dir`` as this kind of run's (:func:`claim_output_dir`): every flow that writes
    there does so first, whether a command line or a Prefect deployment started it, so that its next run
    finds the folder its own."""
    claim_output_dir(params.output_dir, output_kind(type(params)))


def claim_output_dir(folder: str | os.PathLike, owner: str) -> None:
    """Mark ``folder`` (made if missing) as holding the outputs of flows of kind ``owner``, once."""
    marker = Path(folder).expanduser() / OUTPUT_MARKER
    if not marker.is_file():
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(marker, owner + "\n")


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
