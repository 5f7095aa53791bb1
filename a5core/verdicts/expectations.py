"""Expectations asked of runs, written as a user would say them.

``A >= B``: runs of A end at or above runs of B; ``A <= B``: at or below; ``A ~ B``: within the margin of each
other (parity). An arm is a setting's label among an ablation's or sweep's children (``dapo``, ``kl_0``, ``1024``)
or settings (``backend=vllm``, ``loss_type=gspo,cliprange=0.3``); ``A >= A@start`` asks whether runs of A end above
where they started (the same runs' metric before training). An optional ``on METRIC`` names the metric (default
``final_val_accuracy``; ``final_val_format_rate`` for the format rate); an optional ``at equal rollouts`` compares
each pair where both runs had generated as many rollouts (the evaluation of the run that generated more, at the
last step within the other's total: dynamic sampling draws several batches a step).

Each expectation's endpoint, declared before its runs: ``final`` (the final evaluation, the default) or
``mean_last_K`` (the mean of the last K points of the metric's validation curve, steadier where a curve is noisy).

In a YAML file (``flows.verdicts --expectations-file``)::

    metric: final_val_accuracy            # the default metric of every entry
    endpoint: final                       # the default endpoint of every entry (final, or mean_last_K)
    expectations:
      - expect: dapo >= grpo
        experiment: grpo_dapo_ablation    # where A's and B's labels are learnt (optional)
        why: DAPO reports its techniques together beat GRPO
      - kl_0 ~ kl_0.001 on final_val_accuracy
      - expect: dynamic_sampling >= grpo at equal rollouts
        endpoint: mean_last_3                   # final (the default) or mean_last_K
    exclude:                              # runs left out, by id or id prefix, with the reason shown
      60cb54e8: made by code with a bug fixed since
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Relation = Literal[">=", "<=", "~"]
DEFAULT_METRIC = "final_val_accuracy"
START = "@start"
FINAL = "final"
EQUAL_ROLLOUTS = "at equal rollouts"
_FORM = re.compile(
    r"\s*(?P<a>\S+)\s*(?P<relation>>=|<=|~)\s*(?P<b>\S+)(?:\s+on\s+(?P<metric>\S+))?"
    r"(?P<equal>\s+at\s+equal\s+rollouts)?\s*"
)
_ENDPOINT = re.compile(r"final|mean_last_(?P<k>[1-9][0-9]*)")
_ARM = re.compile(r"[\w.\-+/:]+(?:=[^,\s]*)?(?:,[\w.\-+/:]+=[^,\s]*)*(?:@start)?")


class Expectation(BaseModel):
    """One expectation: ``a relation b`` on ``metric``; ``experiment`` scopes where the arms' labels are learnt;
    ``why`` says where it comes from (the handout, a paper); ``endpoint``: ``final`` or ``mean_last_K``;
    ``equal_rollouts``: compared at equal rollouts generated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    a: str
    relation: Relation
    b: str
    metric: str = DEFAULT_METRIC
    experiment: str | None = None
    why: str = ""
    endpoint: str = FINAL
    equal_rollouts: bool = False

    @model_validator(mode="after")
    def _arms(self) -> Expectation:
        for arm in (self.a, self.b):
            if not _ARM.fullmatch(arm):
                raise ValueError(f"{arm!r} is not an arm: a setting's label (dapo) or settings (backend=vllm)")
        if self.a.endswith(START):
            raise ValueError(f"{self.a!r}: @start goes on the right (A >= A@start)")
        if self.b.endswith(START) and self.b != self.a + START:
            raise ValueError(f"{self.b!r}: compare runs with their own start, {self.a} {self.relation} {self.a}{START}")
        if self.a == self.b:
            raise ValueError(f"{self.a} compared with itself")
        if not _ENDPOINT.fullmatch(self.endpoint):
            raise ValueError(f"endpoint {self.endpoint!r}: final or mean_last_K (K evaluations, K ≥ 1)")
        if self.equal_rollouts and (self.endpoint != FINAL or self.against_start):
            raise ValueError("at equal rollouts compares one evaluation of each run, against another arm's runs")
        return self

    @property
    def text(self) -> str:
        """As written: ``dapo >= grpo`` (with `` on METRIC`` when not the default, `` at equal rollouts``)."""
        on = "" if self.metric == DEFAULT_METRIC else f" on {self.metric}"
        return f"{self.a} {self.relation} {self.b}{on}" + (f" {EQUAL_ROLLOUTS}" if self.equal_rollouts else "")

    @property
    def last(self) -> int | None:
        """K of a ``mean_last_K`` endpoint; None for the final evaluation."""
        return None if self.endpoint == FINAL else int(_ENDPOINT.fullmatch(self.endpoint)["k"])

    @property
    def parity(self) -> bool:
        return self.relation == "~"

    @property
    def against_start(self) -> bool:
        return self.b.endswith(START)

    @property
    def sign(self) -> int:
        """+1 when a difference a − b > 0 agrees, −1 when a difference < 0 does, 0 for parity."""
        return {">=": 1, "<=": -1, "~": 0}[self.relation]


def parse_expectation(text: str, **fields: Any) -> Expectation:
    """``A >= B``, ``A <= B`` or ``A ~ B``, optionally `` on METRIC`` and `` at equal rollouts``; ``fields`` fill the
    rest (``experiment``, ``why``, ``endpoint``, a default ``metric`` that the text's own ``on`` overrides).
    ValueError naming the text otherwise."""
    match = _FORM.fullmatch(text)
    if not match:
        raise ValueError(
            f"expectation {text!r}: write A >= B, A <= B or A ~ B (optionally: on METRIC, at equal rollouts)"
        )
    parts = {k: v for k, v in match.groupdict().items() if v is not None and k != "equal"}
    if match["equal"]:
        parts["equal_rollouts"] = True
    try:
        return Expectation(**{**fields, **parts})
    except ValidationError as error:
        raise ValueError(f"expectation {text!r}: {_first_message(error)}") from None


class ExpectationsFile(BaseModel):
    """A YAML file of expectations (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    metric: str = DEFAULT_METRIC
    endpoint: str = FINAL
    expectations: list[str | dict[str, Any]] = Field(min_length=1)
    exclude: dict[str, str] = {}


def expectations_from(document: Any, where: str) -> tuple[list[Expectation], dict[str, str]]:
    """The expectations and the runs excluded (id or id prefix → why) of a parsed YAML ``document``; ValueError
    naming ``where`` and the entry otherwise."""
    try:
        parsed = ExpectationsFile.model_validate(document)
    except ValidationError as error:
        raise ValueError(f"{where}: {_first_message(error)}") from None
    found = []
    for i, entry in enumerate(parsed.expectations, 1):
        try:
            if isinstance(entry, str):
                found.append(parse_expectation(entry, metric=parsed.metric, endpoint=parsed.endpoint))
                continue
            entry = dict(entry)
            text = entry.pop("expect", None)
            if not isinstance(text, str):
                raise ValueError("give the expectation as expect: A >= B")
            unknown = set(entry) - {"experiment", "why", "metric", "endpoint"}
            if unknown:
                raise ValueError(
                    f"unknown keys {', '.join(sorted(unknown))} (expect, experiment, why, metric, endpoint)"
                )
            found.append(parse_expectation(text, **{"metric": parsed.metric, "endpoint": parsed.endpoint, **entry}))
        except ValueError as error:
            raise ValueError(f"{where}: expectations[{i}]: {error}") from None
    return found, parsed.exclude


def _first_message(error: ValidationError) -> str:
    first = error.errors()[0]
    place = ".".join(str(p) for p in first["loc"])
    return f"{place}: {first['msg']}" if place else first["msg"]
