"""Seeds as a dimension of a sweep: each setting run once per seed, side by side, then the verdict over them.

With ``seeds`` (or ``until_decided``) a flow's settings (an ablation's, a sweep's, or the one run's) each run once per
seed, every such child labelled ``SETTING/seedS`` (:func:`flows.fanout.label`) in the flow's parent run. A child is the
run a single-seed command makes (``--seed S``, the one setting): the same folder (its settings' key), the same records,
so a finished child is never run again whichever command made it, and a child cut by a deadline, a crash or a kill
resumes from its checkpoint when the command is run again. The children run at once, as far as the machine allows:
``runner: local``, each a process here (:func:`flows.fanout.children_in_processes`), as many at once as the GPU's free
memory, this machine's memory and the cores allow (:mod:`tasks.side_by_side`), each with its ``gpu_memory_fraction``;
``runner: ray``, on Ray's workers (:func:`flows.fanout.children_on_ray`), on one node or a cluster.

``decide`` asks expectations of the children (``dapo >= grpo``): once they finish, the verdicts flow decides them over
the parent's children alone (:func:`judge`) and the command prints each verdict with its confidence sequence.
``until_decided N`` runs the seeds in waves, the first of the pairs a verdict needs at least, each next one of as many
seeds as run at once (one on Ray), and after each looks at the verdicts: it stops once every expectation is decided
or N pairs were made. Looking after every wave and stopping when decided is valid because the verdicts' default rule
is anytime-valid (confidence sequences: :mod:`a5core.verdicts.anytime`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from a5core.runtime import distributed
from a5core.verdicts.decide import DECIDED, Rule
from a5core.verdicts.expectations import START, parse_expectation
from flows.fanout import LOG, children_in_processes, children_on_ray, ended_how, label, setting_of
from tasks.parent_run import Parent
from tasks.runs import finished_row, run_folder
from tasks.side_by_side import Sizing, child_need, size_children, this_machine

logger = logging.getLogger(__name__)
# The settings of a command over seeds, which its children, each one seed's run, do not carry.
SEED_SETTINGS = ("seeds", "decide", "until_decided", "at_once")
VERDICTS_FOLDER = "verdicts"  # in the flow's output_dir: the verdicts' page, JSON and CSV


class ChildrenFailedError(ValueError):
    """Children of a command over seeds that ended without finishing; the message names each and its log."""


def seeded(params: Any) -> bool:
    """Whether ``params`` run each setting once per seed (``seeds`` or ``until_decided`` set)."""
    return params.seeds is not None or params.until_decided is not None


def seed_list(params: Any) -> list[int]:
    """The seeds a command may run, in order: ``seeds`` (the first ``until_decided`` of them), else ``seed``,
    ``seed`` + 1, ... (``until_decided`` of them)."""
    if params.seeds is not None:
        return list(params.seeds[: params.until_decided])
    return list(range(params.seed, params.seed + params.until_decided))


def with_seed(child: Any, seed: int) -> Any:
    """``child`` as the single-seed command makes it: seed ``seed``, none of :data:`SEED_SETTINGS`."""
    values = {k: v for k, v in child.explicit_values().items() if k not in SEED_SETTINGS}
    return type(child)(**{**values, "seed": seed})


def check_seeds(params: Any, settings: Iterable[str]) -> None:
    """ValueError naming the expectation when ``decide`` asks of a label that is none of the command's ``settings``
    (an arm by its settings, ``backend=vllm``, and a label's start, ``dapo@start``, are asked as they are), and when
    a command over seeds is launched on several ranks (its children are processes of their own)."""
    settings = list(settings)
    for text in params.decide:
        expectation = parse_expectation(text)
        arms = (expectation.a, expectation.b)
        unknown = [arm for arm in arms if "=" not in arm and arm.removesuffix(START) not in settings]  # a label
        if unknown:
            raise ValueError(
                f"decide {text!r}: {' and '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a setting "
                "this command runs "
                f"({', '.join(settings)}); ask of its settings, or run flows.verdicts over the store"
            )
    if seeded(params) and distributed.rank_and_world()[1] > 1:
        raise ValueError("seeds: the children run side by side, a process each: start the command once, not torchrun")


def run_seeded(children: dict[str, Any], run_child: Any, params: Any, parent: Parent, scope: str) -> None:
    """Every setting of ``children`` (name → settings) once per seed, side by side, their rows (labelled
    ``SETTING/seedS``) into ``parent.rows``; with ``until_decided``, in waves until decided (the module docstring).
    ``run_child``: the flow's Prefect task for one child; ``scope``: the parent's name, which the verdicts' labels
    are read in."""
    check_seeds(params, children)
    seeds = seed_list(params)
    sizing = None
    if params.runner == "local":
        machine = this_machine()
        need = child_need(next(iter(children.values())), machine)
        sizing = size_children(len(children) * len(seeds), machine, need, params.at_once)
        logger.info("side by side: %s", sizing.why)
    for wave in waves(params, seeds, len(children), sizing):
        batch = {label(setting, seed): with_seed(child, seed) for seed in wave for setting, child in children.items()}
        parent.rows += side_by_side(batch, run_child, params, parent.run_id, sizing)
        if params.until_decided is None:
            continue
        pairs = len(parent.rows) // len(children)
        found = judge(params, scope, parent.rows, log_to_mlflow=False)
        undecided = [v["expectation"] for v in found["verdicts"] if v["verdict"] not in DECIDED]
        if not undecided:
            logger.info("every expectation decided after %d pairs: no more seeds", pairs)
            return
        logger.info("after %d pairs, not decided yet: %s", pairs, "; ".join(undecided))
    if params.until_decided is not None:
        logger.info("%d pairs made (until_decided), still undecided: stopping", len(seeds))


def waves(params: Any, seeds: list[int], settings: int, sizing: Sizing | None) -> list[list[int]]:
    """The seeds in the order they run: all at once, or (``until_decided``) the pairs a verdict needs first, then as
    many seeds as run at once (one on Ray) a wave."""
    if params.until_decided is None:
        return [seeds]
    size = 1 if sizing is None else max(1, sizing.at_once // settings)
    first = max(Rule.min_pairs, size)
    return [seeds[:first]] + [seeds[i : i + size] for i in range(first, len(seeds), size)]


def side_by_side(
    batch: dict[str, Any], run_child: Any, params: Any, parent_run_id: str | None, sizing: Sizing | None
) -> list[dict]:
    """Each child's row, in ``batch``'s order, labelled with its name: a child finished before is read, not run
    again; the others run at once (``sizing``: the local runner's; None: on Ray). ChildrenFailedError naming those
    that did not finish."""
    rows = {name: finished_row(run_folder(child, setting_of(name))) for name, child in batch.items()}
    todo = {name: child for name, child in batch.items() if rows[name] is None}
    if len(todo) < len(batch):
        done = [name for name in batch if name not in todo]
        logger.info("finished before, not run again: %s", ", ".join(done))
    if todo and sizing is None:
        rows |= dict(zip(todo, children_on_ray(todo, run_child, params, parent_run_id), strict=True))
    elif todo:
        share = sizing.gpu_memory_fraction
        if share is not None:  # each its share of the GPU, unless its settings give one
            todo = {n: c if c.gpu_memory_fraction else c.replace(gpu_memory_fraction=share) for n, c in todo.items()}
        ended = children_in_processes(todo, run_child, parent_run_id, sizing)
        rows |= {name: finished_row(run_folder(child, setting_of(name))) for name, child in todo.items()}
        failed = [name for name in todo if rows[name] is None]
        if failed:
            logs = ", ".join(
                f"{n} ({ended_how(ended.get(n))}, {run_folder(todo[n], setting_of(n)) / LOG})" for n in failed
            )
            raise ChildrenFailedError(
                f"children that did not finish: {logs}; what the others finished is kept: run the command again to "
                "resume them from their checkpoints"
            )
    return [{**rows[name], "setting": name} for name in batch]


def judge(params: Any, scope: str, rows: list[dict], log_to_mlflow: bool = True) -> dict:
    """The verdicts flow over the children of ``rows`` alone (``decide``'s expectations, labels read in ``scope``):
    its page, JSON and CSV into ``output_dir/verdicts``; its result (``verdicts``: one record an expectation)."""
    from flows.verdicts import VerdictParams, verdicts

    return verdicts(
        VerdictParams(
            expect=params.decide,
            scope=scope,
            stores=[params.tracking_uri],
            runs=[row["mlflow_run_id"] for row in rows],
            output_dir=str(Path(params.output_dir) / VERDICTS_FOLDER),
            tracking_uri=params.tracking_uri,
            log_to_mlflow=log_to_mlflow,
        )
    )


def with_verdicts(params: Any, parent: Parent, scope: str) -> dict:
    """The flow's result, with (``decide``) the verdicts over its children, logged to MLflow (experiment
    ``verdicts``): asked once the parent run has ended."""
    if not params.decide or parent.run_id is None:
        return parent.result
    return {**parent.result, "verdicts": judge(params, scope, parent.rows)}


def show_verdicts(result: dict) -> None:
    """Each verdict, one line: its words, the difference with its confidence sequence, the pairs; then its page."""
    found = result.get("verdicts")
    if not found:
        return
    for v in found["verdicts"]:
        print(f"{v['expectation']}: {verdict_line(v)}")
    print(f"verdicts  {found['paths']['page']}")


def verdict_line(v: dict) -> str:
    """``agrees (for this start model): dapo − grpo = +0.120 ± 0.041 over 4 pairs (95% confidence sequence)``, and
    for a verdict not decided yet the pairs that would likely decide it."""
    from flows.verdicts import VerdictParams

    words = v["verdict"] + (f" ({v['scope']})" if v["scope"] not in (None, "general") else "")
    if v["verdict"] == "not judged":
        return f"{words}: {v['not_judged']}"
    if v["verdict"] == "not measured":
        return f"{words}: {v['not_measured']}"
    if v["mean"] is None:
        return f"{words} ({v['pairs']} pairs)"
    pairs = v["tests"].get("pairs") or {}
    half = pairs.get("half_width")
    interval = "" if not pairs else f" ± {'∞' if half is None else f'{half:.3f}'}"
    level = f"{VerdictParams.model_fields['confidence'].default:.0%} confidence sequence"
    line = f"{words}: {v['a']} − {v['b']} = {v['mean']:+.3f}{interval} over {v['pairs']} pairs ({level})"
    if v["verdict"] not in DECIDED and v.get("more_pairs"):
        line += f"; about {v['more_pairs']} more pairs would likely decide it"
    return line
