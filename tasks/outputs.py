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
  ``.a5-outputs``, naming it, which :func:`claim_output_dir` writes once the checks pass).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from a5core.data import write_text_atomic

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


def check_output_dir(folder: str | os.PathLike, owner: str, what: str = "output_dir") -> None:
    """Refuse output folder ``folder`` for a flow of kind ``owner`` when it is a file, holds files git
    tracks, or holds another flow's outputs (see the module docstring)."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        return
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
    tracked = [name for name in git_tracked(folder, recursive=True) if not name.endswith((".gitignore", ".dvc"))]
    if tracked:
        listed = ", ".join(tracked[:3]) + (f" and {len(tracked) - 3} more" if len(tracked) > 3 else "")
        raise ValueError(
            f"{what} {folder}: holds files git tracks ({listed}); outputs go in a folder of their own "
            "(e.g. under outputs/)"
        )


def output_kind(params_model: type) -> str:
    """The kind of run a parameter model describes, as a marker names it: ``GRPOParams`` → ``GRPO`` (the
    GRPO run and its ablations share it)."""
    return params_model.__name__.removesuffix("Params")


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
