"""A sweep's curves and plots: learning-curve csv files (DVC plots read them), PNG plots with axes that
read the same from plot to plot, a histogram, and :func:`log_comparison`, the files a sweep's parent run
holds."""

from __future__ import annotations

import hashlib
import io
import json
import numbers
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow

from a5core.runtime.writing import write_bytes_atomic, write_text_atomic
from tasks.tables import csv_text, is_finite, markdown_table


def write_curves(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """A csv of learning-curve points (DVC plots read it), written atomically."""
    return write_text_atomic(path, csv_text(rows))


def plot_curves(path: Path, rows: Sequence[dict[str, Any]], x: str, y: str, series: str, title: str) -> Path:
    """One line per ``series`` value of ``y`` against ``x``, saved as a PNG.

    Axes that read the same from plot to plot:

    - y is a 0–1 metric when a word of its name (split at ``_``, ``/``, ...) is ``accuracy``, ``rate``,
      ``reward`` or ``fraction`` (``val_accuracy``, ``format_rate``, ``reward_mean``, ``clip_fraction``;
      not ``learning_rate``, not ``generated_tokens``) and every value lies in [0, 1] (rewards here do):
      its axis is fixed to -0.02..1.02, so points at 0 and 1 show and an all-zero curve sits at the
      bottom instead of mid-plot. Any other y (or one with a value outside [0, 1]) is autoscaled.
    - x gets integer ticks when it is ``step`` or ``round`` or every value is an integer (steps, rounds):
      no tick at step 0.25.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in rows if is_finite(r.get(x)) and is_finite(r.get(y))]  # a NaN or ±inf point cannot be drawn
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(str(r[series]) for r in rows):
        points = sorted((r[x], r[y]) for r in rows if str(r[series]) == name)
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=_plain(name))
    axes.set(xlabel=_plain(x), ylabel=_plain(y), title=_plain(title))
    ys = [r[y] for r in rows if isinstance(r[y], numbers.Real)]
    words = re.split(r"[^a-z0-9]+", y.lower())
    unit_metric = bool({"accuracy", "rate", "reward", "fraction"} & set(words)) and "learning_rate" not in y.lower()
    if unit_metric and all(0 <= v <= 1 for v in ys):
        axes.set_ylim(-0.02, 1.02)
    integer_x = all(isinstance(r[x], numbers.Integral) and not isinstance(r[x], bool) for r in rows)
    if x in ("step", "round") or integer_x:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    if rows:
        axes.legend(title=series)
    figure.tight_layout()
    return _save(figure, path)


def _plain(text: str) -> str:
    """A label shown as written: matplotlib reads text between ``$`` as TeX (and fails on a malformed one)."""
    return str(text).replace("$", r"\$")


def _save(figure: Any, path: Path) -> Path:
    """The figure as a PNG at ``path``, written atomically: a link there is replaced, never written through."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    plt.close(figure)
    return write_bytes_atomic(path, buffer.getvalue())


def file_stem(name: str, most: int = 100) -> str:
    """``name`` as a file name's stem of its own: letters, digits and ``_.-`` kept, anything else ``_``, at most
    ``most`` characters; where that changed the name, a short hash of it after, so that names that differ (``g/1``,
    ``g_1``) never share a file."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).lstrip(".") or "_"
    if safe == name and len(name) <= most:
        return name
    return f"{safe[:most]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def plot_histogram(path: Path, values: Sequence[float], edges: Sequence[float], x: str, title: str) -> Path:
    """A bar chart of ``values`` in [0, 1]: exactly ``edges[0]``, each interval (edges[i], edges[i+1]],
    with exactly ``edges[-1]`` apart (0 and 1 are the pass rates that teach nothing); saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{edges[0]:g}"] + [
        f"({a:g}, {b:g}{')' if b == edges[-1] else ']'}" for a, b in zip(edges, edges[1:], strict=False)
    ]
    labels.append(f"{edges[-1]:g}")
    counts = [sum(v == edges[0] for v in values)]
    counts += [sum(a < v <= b and v != edges[-1] for v in values) for a, b in zip(edges, edges[1:], strict=False)]
    counts.append(sum(v == edges[-1] for v in values))
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.bar(labels, counts)
    axes.set_xlabel(x)
    axes.set_ylabel("questions")
    axes.set_title(title)
    figure.tight_layout()
    return _save(figure, path)


def log_comparison(
    output_dir: Path,
    curves: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    series: str,
    title: str,
    *,
    trends: list[dict[str, Any]] | None = None,
) -> dict[str, str]:
    """Write curves.csv, summary.md/json and the comparison plot; log them to the active (parent) run, and
    each child's curves as the parent's metrics ``val_accuracy/<setting>`` (and ``<trend>/<setting>``).

    curves: validation points (``series``, step, val_accuracy[, wall_seconds]); with wall_seconds a
    second plot shows accuracy against wall-clock time. trends: per-step training points (``series``,
    step, then any metrics), written as train_curves.csv with one plot per metric against step.
    """
    paths = {
        "curves": write_curves(output_dir / "curves.csv", curves),
        "summary_md": write_text_atomic(output_dir / "summary.md", markdown_table(summary)),
        "summary_json": write_text_atomic(output_dir / "summary.json", json.dumps(summary, indent=2) + "\n"),
        "plot": plot_curves(output_dir / "accuracy_vs_step.png", curves, "step", "val_accuracy", series, title),
    }
    if "wall_seconds" in curves[0]:
        paths["plot_wall_clock"] = plot_curves(
            output_dir / "accuracy_vs_wall_clock.png",
            curves,
            "wall_seconds",
            "val_accuracy",
            series,
            f"{title} (wall-clock)",
        )
    if trends:
        paths["trends"] = write_curves(output_dir / "train_curves.csv", trends)
        for metric in [k for k in trends[0] if k not in (series, "step", "wall_seconds")]:
            paths[f"plot_{metric}"] = plot_curves(
                output_dir / f"{metric}_vs_step.png", trends, "step", metric, series, f"{metric} by step"
            )
    for path in paths.values():
        mlflow.log_artifact(str(path))
    log_child_curves(curves, series, ("val_accuracy",))
    if trends:
        log_child_curves(trends, series, [k for k in trends[0] if k not in (series, "step", "wall_seconds")])
    return {k: str(v) for k, v in paths.items()}


def log_child_curves(rows: Sequence[dict[str, Any]], series: str, metrics: Sequence[str]) -> None:
    """Each child's curve into the active (parent) run as ``<metric>/<setting>`` by step, so the parent's
    chart view shows every setting's curve (MLflow draws a run's own metrics only). Resume-safe: a parent
    continued by a later attempt does not get the points twice (:func:`tasks.resumable_runs.mlflow_logger`)."""
    import re

    from tasks.resumable_runs import mlflow_logger

    log = mlflow_logger()
    for row in rows:
        name = re.sub(r"[^\w./ -]", "_", str(row[series]))
        log({f"{metric}/{name}": row[metric] for metric in metrics if row.get(metric) is not None}, int(row["step"]))
