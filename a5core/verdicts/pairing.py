"""Which runs an expectation compares, and how they pair.

A run is a :class:`RunRecord`. An arm's labelled runs are those an expectation's arm names (:func:`labelled`); the
settings that define the arms are those in which every labelled run of the one differs from every labelled run
of the other (:func:`defining_keys`); every run whose defining settings are an arm's is a run of that arm,
wherever it was made (one run of today's GRPO serves every comparison against it).

Runs alike in start model, settings and seed form a :class:`Cell`: one run, made once or more; its value is the
mean of its runs, and their spread is shown, never a silent pick. A :class:`Pair` is a cell of each arm with the
same start model, the same seed and every other setting alike (so scored on the same problems).

A pair is fair only if its arms differ in the setting under test alone: a start model trained with one arm's prompt
and not the other's favours that arm, so such a pair is set apart (:func:`favours`), shown with why but not judged.
The prompts a model was trained with are those of its SFT traces where the run that made it recorded them
(``trace_prompts``: a model trained on traces of both prompts favours neither), else that run's ``prompt``. The
pairs of a start model whose every run scored 0 (or 1) are set apart too while another's can tell the arms apart
(:func:`apart_at_a_bound`): at a bound of the metric they carry no information about the difference. A
comparison is not judged at all (:func:`not_judged`) when no fair pair is left, when its arms are scored by graders
that are not each its own prompt's (they measure different things), or when every run of both arms scored alike (a
floor or ceiling of the metric: the runs cannot tell the arms apart).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from a5core.grading.rewards import GRADER_PROMPTS
from a5core.verdicts.expectations import START, Expectation

# Settings whose value shapes the form of a model's answers: a start model trained with one arm's value (and not the
# other's) favours that arm in a comparison of them. Each maps to the setting in which a training run records the
# values its training data was written with (comma-separated), which, where recorded, says what its model was
# trained with better than the run's own setting: an SFT run's trace_prompts, the templates of its traces.
FORM_SETTINGS = {"prompt": "trace_prompts"}


@dataclass(frozen=True)
class RunRecord:
    """One run as verdicts see it (:mod:`tasks.store_runs` reads them from MLflow stores).

    ``settings``: what it ran with, as MLflow keeps them (strings), less where and how fast it ran, its label,
    seed and start model, which are fields of their own; ``setting``: its label among an ablation's or sweep's
    children (``dapo``), else its run name; ``group``: the ablation or sweep it ran in (its parent's), else its
    flow's run name; ``origin``: the model it started from, by its weights' content hash (``folder:…``), or
    ``parent run ID`` where no record says; ``finals``: its final metrics (``final_val_accuracy``); ``starts``:
    the same metrics before training (``final_val_accuracy`` → its ``val_accuracy`` at step 0); ``made``: the
    content hash of the model folder it saved, where it registered one; ``flow_status``: how its parent run (the
    flow that ran it) ended, its own status where it has none.
    """

    id: str
    name: str
    group: str
    setting: str
    settings: Mapping[str, str]
    seed: str | None
    origin: str
    finals: Mapping[str, float]
    starts: Mapping[str, float] = field(default_factory=dict)
    status: str = "FINISHED"
    flow_status: str = "FINISHED"
    made: str | None = None
    experiment: str = ""
    start_time: int = 0


@dataclass(frozen=True)
class Cell:
    """Runs alike in start model, settings and seed (one run made once or again) and their values of the metric."""

    origin: str
    seed: str | None
    runs: tuple[RunRecord, ...]
    values: tuple[float, ...]

    @property
    def value(self) -> float:
        """The mean of its runs' values: re-runs count once."""
        return sum(self.values) / len(self.values)

    @property
    def spread(self) -> float:
        """max − min of its runs' values (0 for one run)."""
        return max(self.values) - min(self.values)


@dataclass(frozen=True)
class Pair:
    a: Cell
    b: Cell

    @property
    def difference(self) -> float:
        return self.a.value - self.b.value


@dataclass
class Arms:
    """What an expectation compares: the settings that define its arms (``keys``), the fair pairs, how many runs
    of each arm are in them, the pairs set apart with why (``set_apart``), and why the comparison cannot be judged
    (``not_judged``, "" when it can)."""

    keys: tuple[str, ...]
    pairs: list[Pair]
    not_judged: str = ""
    missing: str = ""  # why nothing was compared ("" when pairs or unpaired runs were found)
    set_apart: list[tuple[Pair, str]] = field(default_factory=list)

    @property
    def runs_in_pairs(self) -> tuple[int, int]:
        return sum(len(p.a.runs) for p in self.pairs), sum(len(p.b.runs) for p in self.pairs)


def labelled(runs: Iterable[RunRecord], arm: str, scope: str | None) -> list[RunRecord]:
    """The runs an arm names: by their label (``dapo``), or by settings (``backend=vllm,seed=1``); only those of
    group or MLflow experiment ``scope`` when given."""
    arm = arm.removesuffix(START)
    wanted = dict(item.split("=", 1) for item in arm.split(",")) if "=" in arm else None
    found = []
    for run in runs:
        if scope is not None and scope not in (run.group, run.experiment):
            continue
        if wanted is None:
            if run.setting == arm:
                found.append(run)
        elif all(_value_of(run, key) == value for key, value in wanted.items()):
            found.append(run)
    return found


def _value_of(run: RunRecord, key: str) -> str | None:
    return run.seed if key == "seed" else run.settings.get(key)


def defining_keys(a_runs: Sequence[RunRecord], b_runs: Sequence[RunRecord]) -> set[str]:
    """The settings in which every run of ``a_runs`` differs from every run of ``b_runs``."""
    differ = [
        {k for k in ra.settings.keys() | rb.settings.keys() if ra.settings.get(k) != rb.settings.get(k)}
        for ra in a_runs
        for rb in b_runs
    ]
    return set.intersection(*differ) if differ else set()


def _cells(runs: Iterable[RunRecord], keys: set[str], metric: str, start: bool = False) -> dict[tuple, Cell]:
    """The runs grouped by (start model, seed, settings other than ``keys``), each group a :class:`Cell` of their
    ``metric`` (their value before training when ``start``)."""
    grouped: dict[tuple, list[RunRecord]] = defaultdict(list)
    for run in sorted(runs, key=lambda r: (r.start_time, r.id)):
        other = tuple(sorted((k, v) for k, v in run.settings.items() if k not in keys))
        grouped[(run.origin, run.seed, other)].append(run)
    cells = {}
    for key, members in grouped.items():
        values = tuple((r.starts if start else r.finals)[metric] for r in members)
        cells[key] = Cell(key[0], key[1], tuple(members), values)
    return cells


def pair_arms(expectation: Expectation, runs: Sequence[RunRecord]) -> Arms:
    """The pairs behind ``expectation`` among ``runs`` (those with its metric; see the module docstring)."""
    metric = expectation.metric
    usable = [r for r in runs if metric in r.finals]
    a_label = labelled(usable, expectation.a, expectation.experiment)
    if expectation.against_start:
        with_start = [r for r in a_label if metric in r.starts]
        if not with_start:
            return Arms((), [], missing=f"no run of {expectation.a} holds {metric} before training")
        settings = {tuple(sorted(r.settings.items())) for r in with_start}
        units = [r for r in usable if metric in r.starts and tuple(sorted(r.settings.items())) in settings]
        pairs = [Pair(cell, starts) for cell, starts in _start_cells(units, metric)]
        return Arms((), pairs)
    b_label = labelled(usable, expectation.b, expectation.experiment)
    if not a_label or not b_label:
        absent = " and ".join(arm for arm, found in ((expectation.a, a_label), (expectation.b, b_label)) if not found)
        return Arms((), [], missing=f"no run of {absent} holds {metric}")
    keys = defining_keys(a_label, b_label)
    if not keys:
        return Arms((), [], missing=f"{expectation.a} and {expectation.b} differ in no setting their runs share")
    a_values = {tuple(r.settings.get(k) for k in sorted(keys)) for r in a_label}
    b_values = {tuple(r.settings.get(k) for k in sorted(keys)) for r in b_label}
    a_units = [r for r in usable if tuple(r.settings.get(k) for k in sorted(keys)) in a_values]
    b_units = [r for r in usable if tuple(r.settings.get(k) for k in sorted(keys)) in b_values]
    a_cells, b_cells = _cells(a_units, keys, metric), _cells(b_units, keys, metric)
    makers = {r.made: r for r in runs if r.made}
    fair, set_apart = [], []
    for pair in (Pair(a_cells[k], b_cells[k]) for k in a_cells if k in b_cells):
        why = favours(keys, pair, makers)
        (set_apart.append((pair, why)) if why else fair.append(pair))
    fair, at_bound = apart_at_a_bound(fair)
    set_apart += at_bound
    return Arms(tuple(sorted(keys)), fair, not_judged(keys, fair, set_apart), set_apart=set_apart)


def _start_cells(units: Sequence[RunRecord], metric: str) -> list[tuple[Cell, Cell]]:
    finals, starts = _cells(units, set(), metric), _cells(units, set(), metric, start=True)
    return [(finals[k], starts[k]) for k in finals]


def favours(keys: Iterable[str], pair: Pair, makers: Mapping[str, RunRecord]) -> str:
    """Why ``pair`` is not fair, "" when it is: its start model was trained (by a run among ``makers``, keyed by
    the model it saved) with one arm's value of a :data:`FORM_SETTINGS` setting that defines the arms and not the
    other's (:func:`trained_with`), or is known only as a parent run's, so that what it was trained with cannot be
    checked."""
    maker = makers.get(pair.a.origin)
    forms = sorted(set(keys) & set(FORM_SETTINGS))
    if forms and pair.a.origin.startswith("parent run"):
        return f"its start model ({short(pair.a.origin)}) has no recorded hash: whether it favours an arm is unknown"
    for form in forms:
        trained = trained_with(maker, form) if maker is not None else set()
        a_value, b_value = pair.a.runs[0].settings.get(form), pair.b.runs[0].settings.get(form)
        if trained and (a_value in trained) != (b_value in trained):
            return (
                f"the start model ({short(pair.a.origin)}, made by run {maker.id[:8]}) was trained with "
                f"{form}={','.join(sorted(trained))}, one arm's {form}: it favours that arm"
            )
    return ""


def trained_with(maker: RunRecord, form: str) -> set[str]:
    """The values of :data:`FORM_SETTINGS` setting ``form`` that the model ``maker`` made was trained with: those
    its training data was written with where it recorded them (``trace_prompts=question_only,r1_zero``), else its
    own value of ``form``; empty where it records neither."""
    recorded = maker.settings.get(FORM_SETTINGS[form])
    if recorded is not None:
        return set(recorded.split(","))
    return {maker.settings[form]} if form in maker.settings else set()


def apart_at_a_bound(pairs: Sequence[Pair]) -> tuple[list[Pair], list[tuple[Pair, str]]]:
    """``(kept, set apart with why)``: the pairs of a start model every run of whose (both arms, every seed) scored
    one value at the metric's floor or ceiling (0 or 1) are set apart while another start model's pairs can tell
    the arms apart: they carry no information about the difference, and counted as differences of 0 they would
    pull it toward 0. Where no start model can (every run alike), all stay, for :func:`not_judged` to say so."""
    scores: dict[str, set[float]] = defaultdict(set)
    for pair in pairs:
        scores[pair.a.origin].update(x for cell in (pair.a, pair.b) for x in cell.values)
    bound = {o: v.pop() for o, v in scores.items() if len(v) == 1 and next(iter(v)) in (0.0, 1.0)}
    if not bound or len(bound) == len(scores):
        return list(pairs), []
    why = "every run of both arms from this start model scored {:.3f} (a bound of the metric): its pairs cannot tell "
    why += "the arms apart"
    kept = [p for p in pairs if p.a.origin not in bound]
    return kept, [(p, why.format(bound[p.a.origin])) for p in pairs if p.a.origin in bound]


def not_judged(keys: Iterable[str], pairs: Sequence[Pair], set_apart: Sequence[tuple[Pair, str]]) -> str:
    """Why arms that differ in ``keys`` cannot be judged from their fair ``pairs``, "" when they can: every pair
    set apart, arms scored by graders that are not each its own prompt's, or every run of both arms alike."""
    keys = set(keys)
    if set_apart and not pairs:
        return set_apart[0][1]
    if "reward_fn" in keys and "prompt" not in keys:
        return "the arms are scored by different graders (reward_fn) of one prompt: they measure different things"
    if "reward_fn" in keys:
        for pair in pairs:
            for cell in (pair.a, pair.b):
                settings = cell.runs[0].settings
                grader, prompt = settings.get("reward_fn"), settings.get("prompt")
                if grader not in (None, "None") and GRADER_PROMPTS.get(grader) != prompt:
                    return f"an arm is scored by {grader}, which is not the grader of its prompt ({prompt})"
    values = {x for pair in pairs for cell in (pair.a, pair.b) for x in cell.values}
    if len(values) == 1:
        return f"every run of both arms scored {values.pop():.3f}: the runs cannot tell the arms apart"
    return ""


def short(origin: str) -> str:
    """A start model as tables name it: its hash's first hex digits, or ``parent <id>``."""
    if origin.startswith("parent run"):
        return f"parent {origin.split()[-1][:8]}"
    return origin.split(":")[-1][:8]
