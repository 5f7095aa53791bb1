"""One training run, as every training flow runs it: GRPO, Expert Iteration, a setting of the SFT sweep,
the leaderboard run.

:func:`training_run` is the skeleton they share: a flow trains inside ``with training_run(...) as run:`` (a
sweep's children inside one ``with parent_run(...)``: :func:`tasks.parent_run.parent_run`). Around the block:

- the run's folder, ``output_dir/runs-<key>/<name>`` (the key a hash of the settings, so changed settings
  never pick up another run's checkpoint or MLflow run), locked while the run works there
  (:func:`tasks.run_lock.run_lock`: a second process with the same settings is refused), and its
  ``done.json``: a finished run returns its row without training again;
- a resumable MLflow run (a child of ``parent_run_id`` in a sweep), its parameters and the starting
  model's real folder (tag ``model_path``) logged on the tracking rank;
- the policy loaded on the GPU if there is one, in ``policy_dtype``;
- the validation set, prompt template, grader and evaluation sampling (``val_samples`` a problem,
  ``temperature``, ``max_tokens``, the prompt's stop strings, ``seed``), and :meth:`Run.validation`, the
  loops' ``evaluate`` hook;
- after the block: the final evaluation on ``val_limit`` problems, unless the block made its own
  (:attr:`Trained.final`); its metrics logged as ``final_*`` at the last step;
  and the row: ``setting``, accuracy and format rate before (``initial_*``: the starting model's
  evaluation, logged at step 0 by the loops) and after (``final_*``), the MLflow run id, and what the
  block added; written to ``done.json`` on the tracking rank, which then deletes the run's checkpoint
  tensors (:func:`drop_resume_state`): a finished run keeps its model as a Hugging Face folder
  (``model/``, saved by the GRPO and EI flows, and by the SFT sweep's with ``save_models``).

Under torchrun every rank runs all of it (the loops are collective); only rank 0 tracks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from a5core.data.files import Problem
from a5core.data.problem_sets import load_validation_set
from a5core.data.prompts import PromptTemplate, load_prompt
from a5core.engines import Engine, SamplingSettings
from a5core.grading.rewards import REWARD_FNS
from a5core.loops.question_sampling import load_pass_rates
from a5core.policy.causal_lm import load_policy
from a5core.policy.lora import has_adapters, merged_state_dict
from a5core.runtime import distributed
from a5core.runtime.checkpoint import read_state
from a5core.runtime.settings import HOW_FAST_FIELDS
from a5core.runtime.writing import write_text_atomic
from tasks.evaluation import validation_hook
from tasks.fingerprints import file_digest, model_fingerprint
from tasks.mlflow_runs import log_params_flat
from tasks.provenance import log_provenance
from tasks.resumable_runs import mlflow_logger, start_resumable_run
from tasks.run_lock import run_lock
from tasks.run_reading import artifact_paths
from tasks.tracking_rank import tracking_rank

logger = logging.getLogger(__name__)
ARTIFACTS = "artifacts.json"  # in a finished run's folder: its MLflow run's artifacts when it finished

# Where results go and how fast they come, not what runs: changing these keeps a run's folder (and resumes it).
RUN_KEY_IGNORED = ("output_dir", "metrics_path", "experiment", "tracking_uri", *HOW_FAST_FIELDS)


def params_key(params: Any, ignore: tuple[str, ...] = RUN_KEY_IGNORED) -> str:
    """A short hash of a flow's parameters: runs with other settings get other folders (and MLflow runs),
    so a resumed run never picks up a checkpoint or a 'done' marker written under different settings.
    What a setting names counts by its contents (:mod:`tasks.fingerprints`): a ``model`` that is a local
    folder by its files (a stage that starts from another stage's saved model runs again when that model
    was trained again), and every setting naming a file (data, prompt template, difficulty table) by its
    bytes (an edited or newly pulled data file is another run, not a finished one)."""
    values = {k: v for k, v in params.flat().items() if k not in ignore}
    if isinstance(values.get("model"), str) and Path(values["model"]).expanduser().is_dir():
        values["model_files"] = model_fingerprint(values["model"])
    files = {k: v for k, v in values.items() if isinstance(v, str) and v and Path(v).expanduser().is_file()}
    if files:
        values["file_contents"] = {k: file_digest(v) for k, v in sorted(files.items())}
    dump = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(dump.encode()).hexdigest()[:10]


def model_path(model: str | None) -> str:
    """A starting model as a run records it (tag ``model_path``): a local folder by its real path (a link
    such as the SFT stage's ``best_model`` resolved to the setting it points at), a hub id as it is."""
    path = Path(str(model)).expanduser()
    return str(path.resolve()) if path.is_dir() else str(model)


# What does not make a run another run: where its results go, how fast it runs, where its engine runs, what
# share of the GPU it may use, how a sweep's children are scheduled and what is asked of them once they finish.
RUN_KEY_EXTRA_IGNORED = (
    "engine_device",
    "gpu_memory_fraction",
    "runner",
    "ray_address",
    "ray_gpus_per_child",
    "ray_cpus_per_child",
    "at_once",
    "decide",
)
# The seeds a sweep runs each setting with: part of a sweep's key where set (its parent run is another run than the
# single seed's), left out where unset, so a run's key is the one it had before these settings existed.
SEEDS_FIELDS = ("seeds", "until_decided")


def run_key(params: Any) -> str:
    """The folder key of a run: a hash of its settings, less :data:`RUN_KEY_IGNORED` and the scheduling ones."""
    unset = tuple(name for name in SEEDS_FIELDS if getattr(params, name, None) is None)
    return params_key(params, ignore=(*RUN_KEY_IGNORED, *RUN_KEY_EXTRA_IGNORED, *unset))


DONE = "done.json"  # in a finished run's folder: its row


def run_folder(params: Any, name: str) -> Path:
    """Where run ``name`` of ``params`` works: ``output_dir/runs-<key>/<name>`` (:func:`run_key`)."""
    return Path(params.output_dir) / f"runs-{run_key(params)}" / name


def finished_row(folder: Path) -> dict[str, Any] | None:
    """The row of the run that finished in ``folder`` (its ``done.json``), None while it has not finished;
    CorruptStateError naming the file and what to do where it cannot be read."""
    done = folder / DONE
    if not done.is_file():
        return None
    recovery = f"the run finished (its checkpoint tensors are gone): delete {folder} to train it again"
    return read_state(done, ("setting", "mlflow_run_id"), recovery)


@dataclass
class Run:
    """A training run as the block of ``with training_run(...) as run:`` sees it (see the module docstring).

    A run that finished before (a flow started again) holds its ``row`` from the start (``run.finished``): the block
    returns it without training. Otherwise the policy, the validation problems, prompt template, grader and
    evaluation sampling are loaded, and the block ends with ``run.trained(...)``; the row is set on leaving."""

    name: str
    folder: Path
    run_id: str | None  # the MLflow run's (None off the tracking rank)
    params: Any
    engine: Engine
    row: dict[str, Any] | None = None  # a run that finished before: from the start; else set on leaving
    model: torch.nn.Module | None = None
    tokenizer: Any = None
    validation_problems: list[Problem] = field(default_factory=list)
    template: PromptTemplate | None = None
    reward_fn: Callable[[str, Any], dict[str, float]] | None = None
    sampling: SamplingSettings | None = None  # the evaluations'
    log: Callable[[dict[str, float], int], None] = lambda metrics, step: None
    pass_rates: dict[str, float] | None = None  # the questions' difficulty table (``difficulty_table``), if any
    result: Trained | None = None  # what the block trained (:meth:`trained`)

    @property
    def finished(self) -> bool:
        """Whether the run finished before: its row is there, nothing to train."""
        return self.row is not None

    def trained(self, step: int, row: dict[str, Any], final: dict[str, float] | None = None) -> None:
        """The block's last word: the step the final evaluation is logged at, the row's own fields, and the final
        evaluation's metrics where the block made its own (None: the run's final evaluation on ``val_limit``
        problems follows)."""
        self.result = Trained(step, row, final)

    def validation(self, subset: int | None) -> Callable[[torch.nn.Module, int], dict[str, float]]:
        """``evaluate(model, step)`` on the first ``subset`` validation problems (all if None)."""
        return validation_hook(
            self.engine, self.tokenizer, self.validation_problems, self.template, self.reward_fn, self.sampling, subset
        )

    def final_from(self, last: dict[str, Any]) -> dict[str, float] | None:
        """The loop's last evaluation (the metrics of its last step) as the run's final one, when it scored the
        problems the final evaluation would (the first ``val_subset`` are the first ``val_limit``): the curve
        then ends at the final score, evaluated once. None otherwise (the final evaluation follows)."""
        n = len(self.validation_problems)
        subset, limit = self.params.val_subset, self.params.val_limit
        if "val_accuracy" not in last or min(subset or n, n) != min(limit or n, n):
            return None
        return {key: value for key, value in last.items() if key.startswith("val_")}


@dataclass
class Trained:
    """What a block trained: the step its final evaluation is logged at, and the row's own fields.
    ``final``: the final evaluation's metrics (``val_accuracy``, ``val_format_rate``) when the block made
    its own (the leaderboard scores its best checkpoint under the rules' sampling); None: the run evaluates
    the trained model on ``val_limit`` validation problems."""

    step: int
    row: dict[str, Any]
    final: dict[str, float] | None = None


def training_task(train: Callable[..., dict]) -> Any:
    """``@training_task``: a flow's function that trains one run (inside :func:`training_run`) as a Prefect task run,
    one in the flow run's view for each setting of a sweep. Never cached: the run's folder (its ``done.json``, its
    checkpoint) decides whether it trains again, resumes or returns its row."""
    return task(cache_policy=NO_CACHE)(train)


@contextmanager
def training_run(
    name: str,
    run_name: str,
    params: Any,
    engine: Engine,
    parent_run_id: str | None,
    logged: dict[str, Any] | None = None,
) -> Iterator[Run]:
    """``with training_run(name, run_name, params, engine, parent_run_id) as run:`` run ``name`` of ``params``
    (see the module docstring): its block trains ``run.model`` and ends with ``run.trained(...)``, or, where the
    run finished before, returns ``run.row``; on leaving, ``run.row`` holds the row. ``logged``: more parameters
    for the MLflow run (a sweep setting's size, say)."""
    folder = run_folder(params, name)
    done = folder / DONE
    with run_lock(folder):  # one process at a time trains here
        row = finished_row(folder)
        if row is not None:
            if tracking_rank():
                warn_of_lost_artifacts(folder, row["mlflow_run_id"], params.tracking_uri)
            yield Run(name, folder, row["mlflow_run_id"], params, engine, row=row)
            return
        validation = load_validation_set(params.validation_data, params.validation_format)
        template, reward_fn = load_prompt(params.prompt), REWARD_FNS[params.grader]
        sampling = SamplingSettings(
            n=params.val_samples,
            temperature=params.temperature,
            max_tokens=params.max_tokens,
            stop=template.stop,
            seed=params.seed,
        )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with start_resumable_run(
            folder / "mlflow_run_id", params.experiment, run_name, params.tracking_uri, parent_run_id
        ) as mlflow_run:
            log_run_params(params, {"setting": name, **(logged or {})})
            model, tokenizer = load_policy(params.model, dtype=getattr(torch, params.policy_dtype), device=device)
            run = Run(
                name,
                folder,
                mlflow_run.info.run_id,
                params,
                engine,
                model=model,
                tokenizer=tokenizer,
                validation_problems=validation,
                template=template,
                reward_fn=reward_fn,
                sampling=sampling,
                log=mlflow_logger(),
                pass_rates=load_pass_rates(params.difficulty_table)
                if getattr(params, "difficulty_table", None)
                else None,
            )
            yield run
            if run.result is None:  # a bug in the flow: the run would be marked done untrained
                raise RuntimeError(f"training run {name}: its block ended without run.trained(...)")
            run.row = _finish(run, run.result, mlflow_run.info.run_id)
        if tracking_rank():
            write_text_atomic(
                folder / ARTIFACTS, json.dumps(artifact_paths(params.tracking_uri, run.row["mlflow_run_id"]))
            )
            write_text_atomic(done, json.dumps(run.row))
            drop_resume_state(folder)


def _finish(run: Run, trained: Trained, mlflow_run_id: str | None) -> dict[str, Any]:
    """The final evaluation (unless the block made its own), logged as ``final_*`` at the last step, and the row."""
    final = trained.final
    if final is None:
        run.model.eval()
        final = run.validation(run.params.val_limit)(run.model, trained.step)
    run.log({f"final_{k}": v for k, v in final.items()}, trained.step)
    start = _starting_evaluation(mlflow_run_id)
    return {
        "setting": run.name,
        "initial_accuracy": start.get("val_accuracy"),
        "initial_accuracy_se": start.get("val_accuracy_se"),
        "initial_format_rate": start.get("val_format_rate"),
        "final_accuracy": final["val_accuracy"],
        "final_accuracy_se": final.get("val_accuracy_se"),
        "final_format_rate": final["val_format_rate"],
        **accuracy_change(mlflow_run_id),
        **trained.row,
        "mlflow_run_id": mlflow_run_id,
    }


# The columns of a setting's row that score it (training_run writes them; each flow's summary lists them, with
# its own columns around them): where it started, where it ended, and the change between, paired problem by problem.
STARTING_SCORE = ("initial_accuracy", "initial_accuracy_se", "initial_format_rate")
FINAL_SCORE = (
    "final_accuracy",
    "final_accuracy_se",
    "final_format_rate",
    "accuracy_change",
    "accuracy_change_se",
    "paired_problems",
)


def warn_of_lost_artifacts(folder: Path, run_id: str, tracking_uri: str) -> None:
    """Say which artifacts a finished run's MLflow run has lost since it finished (``ARTIFACTS`` lists what
    it held then): deleted from ``mlruns/``, they are not made again, since the run is not trained again."""
    from mlflow.exceptions import MlflowException

    listed = folder / ARTIFACTS
    if not listed.is_file():
        return
    again = f"they are not made again (the run is not trained again): delete {folder} to train it again"
    try:
        missing = sorted(set(json.loads(listed.read_text())) - set(artifact_paths(tracking_uri, run_id)))
    except (ValueError, MlflowException, OSError) as error:
        logger.warning("%s finished before; its MLflow run %s cannot be read (%s): %s", folder, run_id, error, again)
        return
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        logger.warning(
            "%s finished before; its MLflow run %s has lost %d of the artifacts it logged while training (%s): %s",
            folder,
            run_id,
            len(missing),
            shown,
            again,
        )


def drop_resume_state(folder: Path) -> None:
    """Delete a finished run's checkpoint tensors (every ``*.pt`` under ``folder``: weights, optimizer
    moments, RNG states). ``done.json`` ends the run, so nothing resumes from them, and at 1.5B parameters
    with fp32 weights they are 18 GB a run. The checkpoints' records (``state.json``, EI's kept traces and
    rollouts) and the saved model folder stay."""
    for path in folder.rglob("*.pt"):
        path.unlink()


def log_run_params(params: Any, extra: dict[str, Any] | None = None) -> None:
    """A run's parameters into the active MLflow run (tracking rank only), with ``extra``, every setting a
    parameter (an attempt that resumes the run and changes one of the fields :func:`run_key` ignores, where
    results go or how fast it runs, records the new value as a tag: :func:`tasks.mlflow_runs.log_settings`); the
    starting model's real folder as the tag ``model_path``; the run's provenance record, ``provenance.json``
    (:func:`tasks.provenance.log_provenance`)."""
    import mlflow

    if not tracking_rank():
        return
    log_params_flat({**params.flat(), **(extra or {})})
    mlflow.set_tags({"model_path": model_path(params.model)})
    log_provenance(params)


def _starting_evaluation(run_id: str | None) -> dict[str, float]:
    """The starting model's validation metrics (step 0), as the loops logged them: {} off the tracking
    rank, or when the run did not evaluate at its start."""
    import mlflow

    if run_id is None:
        return {}
    client = mlflow.MlflowClient()
    return {
        key: m.value
        for key in ("val_accuracy", "val_accuracy_se", "val_format_rate")
        for m in client.get_metric_history(run_id, key)
        if m.step == 0
    }


def accuracy_change(run_id: str | None) -> dict[str, float]:
    """The final evaluation's accuracy less the starting model's, problem by problem on the problems both
    scored (``accuracy_change``, its standard error ``accuracy_change_se`` over ``paired_problems``): a gain
    is measured against the noise of those problems, not against two separate standard errors. From the
    ``per_problem/`` tables of step 0 and of the final evaluation; {} off the tracking rank, without a
    step-0 table, or when the two evaluations share no problem (the SFT sweep's selection and score splits)."""
    import mlflow

    from a5core.grading.sample_metrics import paired_difference, problem_scores
    from tasks.run_reading import final_per_problem, run_records

    if run_id is None:
        return {}
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    starts = [a.path for a in client.list_artifacts(run_id, "per_problem") if a.path.endswith("_step_000000.json")]
    final = final_per_problem(client, run)
    if not starts or not final:
        return {}
    largest = max(starts, key=lambda path: float("inf") if "/full_" in path else int(re.findall(r"\d+", path)[0]))
    start = run_records(client, run, largest, folder="per_problem")
    try:
        change = paired_difference(problem_scores(final), problem_scores(start))
    except ValueError:  # no problem in common
        return {}
    return {
        "accuracy_change": change["difference"],
        "accuracy_change_se": change["difference_se"],
        "paired_problems": int(change["n_problems"]),
    }


def curve(run_id: str | None, *keys: str) -> list[dict[str, float]]:
    """Points (step, and each of ``keys`` where logged) of a run's ``val_accuracy`` history, by step."""
    import mlflow

    if run_id is None:
        return []
    client = mlflow.MlflowClient()
    series = {key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in ("val_accuracy", *keys)}
    return [
        {"step": step, **{key: series[key][step] for key in series if step in series[key]}}
        for step in sorted(series["val_accuracy"])
    ]


def accuracy_by_wall_clock(run_id: str) -> Callable[[float, int, float], None]:
    """``log(val_accuracy, step, wall_seconds)`` for run ``run_id``: the metric ``val_accuracy_by_wall_seconds``
    at MLflow step int(wall-clock seconds), one point per validated GRPO step, resumes included.

    A resumed run replays the steps after its checkpoint and validates them again, later in wall-clock
    time: logged as is, a replayed validation would be a second point at a new x. A step's point belongs
    at the second the run first recorded for that step (its ``wall_seconds``, which the resume-safe
    logger keeps from the first time): among the validated steps whose first second is that one, this
    step is the k-th, and the point is written only if the run holds fewer than k points there (so a
    kill between the step's metrics and its point still gets the point written, once).
    Off the tracking rank (torchrun rank > 0) it logs nothing.
    """
    import mlflow

    if not tracking_rank():
        return lambda accuracy, step, wall_seconds: None
    client = mlflow.MlflowClient()
    second_of = {m.step: int(m.value) for m in client.get_metric_history(run_id, "wall_seconds")}
    validated = {m.step for m in client.get_metric_history(run_id, "val_accuracy")}
    held = Counter(m.step for m in client.get_metric_history(run_id, "val_accuracy_by_wall_seconds"))

    def log(accuracy: float, step: int, wall_seconds: float) -> None:
        second = second_of.setdefault(step, int(wall_seconds))
        validated.add(step)
        if sum(second_of.get(s) == second for s in validated if s <= step) > held[second]:
            mlflow.log_metrics({"val_accuracy_by_wall_seconds": accuracy}, step=second)
            held[second] += 1

    return log


def save_model_folder(
    model: torch.nn.Module, tokenizer: Any, directory: Path, extra_files: dict[str, str] | None = None
) -> None:
    """Replace ``directory`` with a Hugging Face folder of ``model`` and ``tokenizer`` (written beside it,
    then renamed: never half a folder), and ``extra_files`` (name → text) in it, replaced with the weights.
    Every rank calls it (:func:`a5core.runtime.distributed.write_whole`: the weights are gathered whole, rank 0
    writes, the others wait)."""

    def write(state: dict[str, torch.Tensor]) -> None:
        if has_adapters(model):  # the trained model, adapters merged: any HF loader reads it
            state = merged_state_dict(model)
        if getattr(model.config, "tie_word_embeddings", False):
            # Gathered from FSDP2 shards, a tied head is a tensor of its own, which save_pretrained would
            # write; one process leaves it out (it shares the embedding's storage). Same folder either way.
            head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
            state = {k: v for k, v in state.items() if k != f"{head}.weight"}
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, state_dict=state)
        tokenizer.save_pretrained(partial)
        for name, text in (extra_files or {}).items():
            (partial / name).write_text(text)
        old = directory.with_name(directory.name + ".old")
        if directory.exists():
            directory.rename(old)
        partial.rename(directory)
        shutil.rmtree(old, ignore_errors=True)

    distributed.write_whole(model, write)
