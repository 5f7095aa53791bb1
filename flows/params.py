"""The flows' parameter models, each composed of its loop's settings and the pipeline's shared groups.

A setting is declared once: the training loops' own in :mod:`a5core.loops.settings` and the loops' configs
(:class:`~a5core.loops.sft.SFTConfig`, :class:`~a5core.loops.expert_iteration.EIConfig`,
:class:`~a5core.loops.grpo.GRPOConfig`), the pipeline's here (the engine, the problems and their validation, the
prompt and grader, where outputs and MLflow runs go). A flow's model holds the groups it uses as fields
(``params.grpo``, ``params.engine``, ``params.eval``, ``params.outputs`` ...), so its command-line flags
(:func:`flows.arguments.parse_params`), its Prefect UI form and the validation of its ``params.yaml`` section all come
from those declarations; a flow that wants another default gives a group a subclass that redeclares the field
with :func:`a5core.runtime.settings.inherited` (``LeaderboardGRPO``); each flow's outputs group follows one rule
(:func:`flow_outputs`). A setting keeps its own name wherever its group sits (``learning_rate``, ``output_dir``). A
run builds and validates the model once and passes each part down: the loop gets its config (``params.grpo``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, PositiveFloat, StrictBool, field_validator, model_validator

from a5core.data.prompts import PromptTemplate, builtin_prompt_names
from a5core.engines import BACKENDS, DTYPES, SamplingSettings
from a5core.engines.engine import ENGINE_SAMPLING, RolloutSamplingFields, SamplingFields
from a5core.engines.teacher import TeacherSettings
from a5core.grading.rewards import GRADER_PROMPTS, RewardName
from a5core.loops.expert_iteration import EIConfig
from a5core.loops.grpo import GRPOConfig
from a5core.loops.grpo.config import GRPOOptimizer
from a5core.loops.sft import SFTConfig
from a5core.policy.losses import LengthNormalization
from a5core.runtime.settings import HOW_FAST_FIELDS, MAX_SEED, READS, Settings, group, inherited
from a5core.verdicts.decide import Rule
from a5core.verdicts.expectations import parse_expectation
from tasks.engines import parse_engine_devices
from tasks.evaluation import EVALUATION_FILES
from tasks.flow_summary import RUN_FILE
from tasks.mlflow_store import DEFAULT_TRACKING_URI, address_problem, foreign_database, sqlite_database
from tasks.outputs import (
    check_output_dir,
    check_output_file,
    check_place,
    git_tracked,
    output_kind,
    source_folders_refused,
)

Backend = Literal[BACKENDS]
EngineDtype = Literal[DTYPES]
DataFormat = Literal["math", "gsm8k"]


# ------------------------------------------------------------------------------------- the groups


class ModelChoice(Settings):
    """The model a run samples from (and, training, starts from), and the engine that samples."""

    model: Annotated[str, READS] = Field(
        "Qwen/Qwen2.5-Math-1.5B",
        description="the model: hub id, local folder (e.g. an SFT stage's best_model), or smollm2-135m-instruct",
    )
    backend: Backend = Field(
        "auto",
        description="rollout engine (auto: vllm where installed, else hf; beside a training policy on a GPU, hf)",
    )


class EngineSettings(ModelChoice):
    """The model a run starts from and the engine that samples from it."""

    engine_dtype: EngineDtype = Field("auto", description="engine dtype (auto: bf16 on GPU, fp32 on CPU)")
    engine_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM gpu_memory_utilization beside the policy (None: what the GPU has free less what the "
        "policy will hold; the engine sleeps while the policy trains)",
    )
    gpu_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="the share of the GPU's memory this run may allocate, policy and in-process engine together "
        "(None: all of it); for runs side by side on one GPU. A Ray child of ray_gpus_per_child < 1 takes that share",
    )
    policy_dtype: Literal["float32", "bfloat16"] = Field("float32", description="policy weights (bf16 autocast on GPU)")


class TrainData(Settings):
    """The training questions."""

    train_data: Annotated[str, READS] = Field(
        "../shared/data/math/train.jsonl",
        description="questions to sample from: a MATH/GSM8K "
        "file, a dataset id, or arithmetic:N:DIGITS (the generated task)",
    )
    train_format: DataFormat = Field("math", description="record format of train_data")


class TrainProblems(TrainData):
    """The questions a run samples from, and their difficulty."""

    difficulty_table: Annotated[str | None, READS] = Field(
        None, description="pass rates of the questions (python -m flows.difficulty), for question_sampling"
    )


class Validation(Settings):
    """Where and how much a run validates: a fixed random subset during training, more at the end."""

    validation_data: Annotated[str, READS] = Field(
        "../shared/data/math/validation.jsonl",
        description="validation problems: a MATH/GSM8K file, a dataset id, or arithmetic:N:DIGITS",
    )
    validation_format: DataFormat = Field("math", description="record format of validation_data")
    val_subset: int = Field(500, ge=1, description="problems evaluated every eval_every steps (a fixed random subset)")
    val_limit: int | None = Field(None, ge=1, description="problems in the final evaluation (None: all)")
    val_samples: int = Field(1, ge=1, description="samples per validation problem (> 1: pass@k and maj@k too)")


class Prompt(Settings):
    prompt: Annotated[str, READS] = Field(
        "r1_zero", description=f"prompt template: {' or '.join(builtin_prompt_names())}, or a file"
    )


class PromptSettings(Prompt):
    """The prompt template (it brings its stop strings) and the grader of the responses."""

    reward_fn: RewardName | None = Field(
        None,
        description="grader; None: the prompt's own (r1_zero, question_only); "
        "arithmetic (r1_zero prompt), arithmetic_question_only: for arithmetic:N:DIGITS data (the answer must be "
        "the number)",
    )

    @model_validator(mode="after")
    def _grader_known(self) -> "PromptSettings":
        if self.reward_fn is not None and self.prompt in builtin_prompt_names():
            reads = GRADER_PROMPTS[self.reward_fn]
            if reads != self.prompt:
                raise ValueError(
                    f"reward_fn {self.reward_fn!r} reads {reads} answers, but prompt {self.prompt!r} asks for "
                    f"its own format: use a grader of {self.prompt} answers "
                    f"({', '.join(g for g, p in GRADER_PROMPTS.items() if p == self.prompt)})"
                )
        if self.reward_fn is None and self.prompt not in builtin_prompt_names():
            if not Path(self.prompt).expanduser().is_file():
                raise ValueError(
                    f"no prompt template {self.prompt!r}: not a built-in ({', '.join(builtin_prompt_names())}) "
                    "and no such file"
                )
            raise ValueError(
                f"prompt {self.prompt!r} is a template file: name its grader with reward_fn "
                f"({', '.join(RewardName.__args__)})"
            )
        return self

    @property
    def grader(self) -> str:
        """The reward function's name: ``reward_fn``, else the built-in prompt's own."""
        return self.reward_fn or self.prompt


class Generation(Settings):
    """How an evaluation or a teacher samples: n samples a problem (the stop strings: the prompt's, unless
    ``stop`` says otherwise; the seed: 0, reproducible). What is passed to the engine as it is starts from the
    engine's own default (:data:`a5core.engines.engine.ENGINE_SAMPLING`)."""

    sampling: SamplingFields = group(SamplingFields, "temperature and response length")
    dtype: EngineDtype = Field("auto", description="engine dtype: auto (bf16 on GPU, fp32 on CPU), bfloat16, float32")
    limit: int | None = Field(None, ge=1, description="only the first N problems")
    n: int = Field(ENGINE_SAMPLING.n, ge=1, description="samples per problem")
    top_p: float = Field(ENGINE_SAMPLING.top_p, gt=0, le=1, description="nucleus sampling")
    stop: list[str] | None = Field(None, description="stop strings, kept in the response (None: the prompt's)")
    seed: int | None = Field(0, ge=0, le=MAX_SEED, description="sampling seed (None: unseeded)")

    def sampling_for(self, template: PromptTemplate) -> SamplingSettings:
        """The engine's sampling: these settings, ``n`` samples a prompt, the template's stop strings unless
        ``stop`` is set."""
        stop = template.stop if self.stop is None else self.stop
        return self.sampling.engine_settings(stop, n=self.n, top_p=self.top_p, seed=self.seed)


class RolloutGeneration(Generation):
    """Generation that may not stop before ``min_tokens``."""

    sampling: RolloutSamplingFields = group(RolloutSamplingFields, "temperature and response length")


def _a_metrics_file(value: str | None) -> str | None:
    if value:
        check_output_file(value, "metrics_path")
    return value


def _a_store(value: str) -> str:
    problem = address_problem(value)
    if problem is not None:
        raise ValueError(f"tracking_uri {value}: {problem}")
    database = sqlite_database(value)
    foreign = foreign_database(database) if database is not None else None
    if foreign is not None:
        raise ValueError(f"tracking_uri {value}: {foreign}")
    if database is not None and database.is_file() and git_tracked(database):
        raise ValueError(f"tracking_uri {value}: {database} is a file git tracks, not an MLflow store")
    if database is not None and not database.exists():  # a new store: made where outputs may go
        check_place(database.parent, "tracking_uri", shown=database)
    return value


MAX_EXPERIMENT_NAME_BYTES = 200  # a folder's name (mlruns/<name>): file systems take 255 bytes


def _a_name(value: str) -> str:
    """An experiment's name is a name: MLflow keeps the experiment's files in ``mlruns/<name>``, and a name that is
    a path (``/usr``, ``../../elsewhere``) put them there."""
    if not value.strip() or value in (".", "..") or any(c in value for c in "/\\") or not value.isprintable():
        raise ValueError(
            "an experiment's name, not a path: no '/', '\\' or control characters, and not '.' or '..' "
            "(its runs' files go in mlruns/<name>)"
        )
    if len(value.encode()) > MAX_EXPERIMENT_NAME_BYTES:
        raise ValueError(
            f"an experiment's name of at most {MAX_EXPERIMENT_NAME_BYTES} bytes ({len(value.encode())} given): its "
            "runs' files go in the folder mlruns/<name>, and a file system takes no longer name"
        )
    return value


# Where a run's results go, as every flow that writes them declares it (each flow its own default). A flow with
# an output folder also checks it is one of its own kind's: `_output_folder = field_validator("output_dir")(
# output_folder_of_its_flow)`.
OutputFolder = Annotated[str, Field(description="where the run's files go", json_schema_extra=source_folders_refused)]
MetricsPath = Annotated[
    str | None, Field(description="the DVC metrics file (None: none)"), AfterValidator(_a_metrics_file)
]
ExperimentName = Annotated[
    str, Field(description="MLflow experiment of the run (a name, not a path)"), AfterValidator(_a_name)
]
TrackingUri = Annotated[str, Field(description="MLflow tracking store"), AfterValidator(_a_store)]
LogToMLflow = Annotated[StrictBool, Field(description="log the result as a run in MLflow")]


def output_folder_of_its_flow(cls: type, value: str) -> str:
    """``output_dir``: a folder for this kind of flow's outputs (:func:`tasks.outputs.check_output_dir`)."""
    check_output_dir(value, output_kind(cls))
    return value


class ChildRunner(Settings):
    """Where a sweep's or an ablation's children run (:mod:`flows.fanout`)."""

    runner: Literal["local", "ray"] = Field(
        "local",
        description="a sweep's or ablation's children: one after another here "
        "(one shared engine), or in parallel on Ray (an engine each)",
    )
    ray_address: str | None = Field(None, description="runner ray: None starts a local Ray; or ray://host:10001")
    ray_gpus_per_child: float = Field(1.0, ge=0, description="runner ray: GPUs each child reserves (0.25: a quarter)")
    ray_cpus_per_child: float = Field(1.0, ge=0, description="runner ray: CPUs each child reserves")
    seeds: list[Annotated[int, Field(ge=0, le=MAX_SEED)]] | None = Field(
        None,
        min_length=1,
        description="run each setting once per seed, the children side by side (runner local: a process each, "
        "as many at once as the GPU's free memory, this machine's memory and the cores allow); None: once, with seed",
    )
    decide: list[str] = Field(
        [],
        description='expectations decided over the children once they finish, e.g. "dapo >= grpo" (several: '
        'separated by ";"; see flows.verdicts): the verdict is printed with its confidence sequence',
    )
    until_decided: int | None = Field(
        None,
        ge=1,
        description="with decide: run the seeds in waves (the first the pairs a verdict needs, then as many seeds "
        "as run at once) and stop once every expectation is decided or this many pairs were made: valid because "
        "the verdicts are anytime-valid (looking after every wave does not raise their error rate)",
    )
    at_once: int | None = Field(
        None, ge=1, description="side by side: at most this many children at once (None: as many as fit)"
    )

    @field_validator("decide", mode="before")
    @classmethod
    def _split_expectations(cls, value: Any) -> Any:
        return [v.strip() for v in value.split(";") if v.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _seeds_and_verdicts(self) -> ChildRunner:
        for text in self.decide:
            parse_expectation(text)
        if self.seeds is not None and len(set(self.seeds)) < len(self.seeds):
            twice = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
            raise ValueError(f"seeds: {', '.join(map(str, twice))} given more than once")
        if self.until_decided is not None:
            if not self.decide:
                raise ValueError('until_decided: give the expectations it decides (decide: "dapo >= grpo")')
            if self.until_decided < Rule.min_pairs:
                raise ValueError(f"until_decided {self.until_decided}: a verdict needs {Rule.min_pairs} pairs at least")
            if self.seeds is not None and len(self.seeds) < self.until_decided:
                raise ValueError(
                    f"until_decided {self.until_decided}: seeds names {len(self.seeds)} seeds; name as many as the "
                    "pairs it may make, or leave seeds unset (seed, seed + 1, ...)"
                )
        elif self.decide and self.seeds is None:
            raise ValueError("decide: a verdict pairs runs of several seeds: give seeds ([0, 1, 2]) or until_decided")
        return self


class Outputs(Settings):
    """Where a run's files, metrics file and MLflow run go."""

    output_dir: OutputFolder = "outputs"
    metrics_path: MetricsPath = None
    experiment: ExperimentName = "a5"
    tracking_uri: TrackingUri = DEFAULT_TRACKING_URI

    _output_folder = field_validator("output_dir")(output_folder_of_its_flow)


def flow_outputs(flow: str, kind: str) -> type[Outputs]:
    """The outputs group of flow ``flow``, the class ``{kind}Outputs`` (``kind``: what the marker in its output
    folder names, :func:`tasks.outputs.output_kind`): its files under ``outputs/FLOW``, its metrics in
    ``metrics/FLOW.json``, its MLflow experiment ``FLOW``. Made once per flow, at module level (children on Ray
    unpickle it by name)."""
    defaults = {"output_dir": f"outputs/{flow}", "metrics_path": f"metrics/{flow}.json", "experiment": flow}
    namespace = {
        "__module__": __name__,
        "__qualname__": f"{kind}Outputs",
        "__annotations__": {name: Outputs.model_fields[name].annotation for name in defaults},
        **{name: inherited(value) for name, value in defaults.items()},
    }
    return type(f"{kind}Outputs", (Outputs,), namespace)


# Where a run's files and MLflow records go, where its engine and children run and how fast a step runs: not
# what a run computes. params.yaml leaves these to the flows' defaults (dvc.yaml names the outputs); a profile
# for a machine may set them. Every other field of a flow is listed in its params.yaml section.
PLACEMENT_FIELDS = frozenset(
    {
        *Outputs.model_fields,
        "log_to_mlflow",
        *ChildRunner.model_fields,
        *HOW_FAST_FIELDS,
        "engine_memory_fraction",
        "gpu_memory_fraction",
        "engine_device",
    }
)


# --------------------------------------------------------------------------------------- the flows


BaselineEvalOutputs = flow_outputs("baseline_eval", "BaselineEval")


class BaselineSampling(RolloutSamplingFields):
    min_tokens: int = inherited(0)


class BaselineGeneration(RolloutGeneration):
    sampling: BaselineSampling = group(BaselineSampling, "temperature and response length")


class BaselineEvalParams(Settings):
    """Zero-shot evaluation (flow ``baseline_eval``)."""

    engine: ModelChoice = group(ModelChoice, "the model evaluated and the engine that samples from it")
    generation: BaselineGeneration = group(BaselineGeneration, "how the model samples")
    grading: PromptSettings = group(PromptSettings, "the prompt template and the grader")
    outputs: BaselineEvalOutputs = group(BaselineEvalOutputs, "where the run's files, metrics and MLflow runs go")

    data: Annotated[str, READS] = Field(
        "../shared/data/math/validation.jsonl", description="jsonl path or hub dataset id"
    )
    data_format: DataFormat = Field("math", description="record format of the data")
    extra_sets: dict[str, str] = Field(
        {},
        description="more problem sets in the same run, name → source (e.g. math500: "
        "../shared/data/math/math500.jsonl): outputs under `output_dir/NAME/`, metrics `NAME/…`",
    )

    @field_validator("extra_sets")
    @classmethod
    def _set_names(cls, sets: dict[str, str]) -> dict[str, str]:
        taken = (*EVALUATION_FILES, RUN_FILE)
        for name in sets:
            if not name or not all(c.isalnum() or c in "_-." for c in name) or name.startswith("."):
                raise ValueError(f"extra set name {name!r}: use letters, digits, '_', '-' or '.' (a folder name)")
            if name in taken:
                raise ValueError(
                    f"extra set name {name!r}: the name of a file the evaluation writes beside the sets' folders "
                    f"({', '.join(taken)}); give the set another name"
                )
        return sets


DifficultyOutputs = flow_outputs("difficulty", "Difficulty")


class DifficultyGeneration(RolloutGeneration):
    n: int = inherited(8)


class DifficultyParams(Settings):
    """Each training question's pass rate under a model, from ``n`` samples (flow ``difficulty``)."""

    engine: ModelChoice = group(ModelChoice, "the model measured and the engine that samples from it")
    generation: DifficultyGeneration = group(DifficultyGeneration, "how the model samples")
    grading: PromptSettings = group(PromptSettings, "the prompt template and the grader")
    train: TrainData = group(TrainData, "the questions measured")
    outputs: DifficultyOutputs = group(DifficultyOutputs, "where the run's files, metrics and MLflow runs go")

    table: str = Field("data/difficulty/pass_rates.csv", description="the pass-rate table written (a csv)")

    @field_validator("table")
    @classmethod
    def _a_table_file(cls, value: str) -> str:
        check_output_file(value, "table")
        return value


class TeacherModel(ModelChoice):
    model: str = inherited("Qwen/Qwen2.5-Math-7B")


class DistillGeneration(Generation):
    n: int = inherited(4)


class DistillParams(Settings):
    """Distillation from a teacher (``flows.sft_data distill``): a served model (how to reach it:
    :class:`a5core.engines.teacher.TeacherSettings`) or a local engine."""

    model_config = ConfigDict(extra="forbid")

    engine: TeacherModel = group(TeacherModel, "the teacher model and, teacher engine, the engine that samples")
    generation: DistillGeneration = group(DistillGeneration, "how the teacher samples")
    server: TeacherSettings = group(TeacherSettings, "teacher openai: how to reach the served teacher")

    enabled: bool = Field(False, description="opt-in: needs a served or local teacher model")
    teacher: Literal["openai", "engine"] = Field(
        "openai", description="openai: a /v1/completions server; engine: make_engine"
    )
    api_key_env: str | None = Field(None, description="name of the environment variable holding the API key")
    problems: Annotated[str, READS] = Field("../shared/data/math/train.jsonl", description="MATH problems to distill")


SFTExperimentOutputs = flow_outputs("sft_experiment", "SFTExperiment")


class SFTExperimentParams(Settings):
    """The SFT sweep over training-set sizes (flow ``sft_experiment``); evaluation samples with
    ``temperature`` and ``max_tokens``."""

    sft: SFTConfig = group(SFTConfig, "the SFT loop's settings")
    sampling: SamplingFields = group(SamplingFields, "how validation samples")
    engine: EngineSettings = group(EngineSettings, "the starting model and the engine that samples from it")
    eval: Validation = group(Validation, "the validation problems and how many")
    grading: PromptSettings = group(PromptSettings, "the prompt template and the grader")
    outputs: SFTExperimentOutputs = group(SFTExperimentOutputs, "where the run's files, metrics and MLflow runs go")
    children: ChildRunner = group(ChildRunner, "where the sweep's settings run, and with which seeds")

    train_data: Annotated[str, READS] = Field(
        "data/sft/math_solutions.jsonl",
        description="SFT traces (prompt, response, ground_truth), or arithmetic:N:DIGITS (generated r1_zero traces)",
    )
    filtered_data: Annotated[str | None, READS] = Field(
        "data/sft/teacher_filtered.jsonl", description="filtered traces, trained as one more setting"
    )
    sizes: list[Annotated[int, Field(gt=0)] | Literal["full"]] = Field(
        [128, 256, 512, 1024, "full"], min_length=1, description="training-set sizes"
    )
    save_models: bool = Field(
        False,
        description="save each setting's final weights (Hugging Face folder) and link "
        "the best as output_dir/best_model",
    )


EIOutputs = flow_outputs("expert_iteration", "EI")


class EIParams(Settings):
    """Expert Iteration, one run or (``sweep``) the G × E × D_b grid (flow ``expert_iteration``)."""

    ei: EIConfig = group(EIConfig, "the Expert Iteration loop's settings")
    engine: EngineSettings = group(EngineSettings, "the starting model and the engine that samples from it")
    train: TrainProblems = group(TrainProblems, "the questions a round samples from")
    eval: Validation = group(Validation, "the validation problems and how many")
    grading: PromptSettings = group(PromptSettings, "the prompt template and the grader")
    children: ChildRunner = group(ChildRunner, "where a sweep's children run")
    outputs: EIOutputs = group(EIOutputs, "where the run's files, metrics and MLflow runs go")

    sweep: bool = Field(False, description="run the grid below as children of one parent run")
    sweep_rollouts_per_question: list[int] = Field([4, 8], min_length=1, description="G values of the sweep")
    sweep_epochs: list[int] = Field([1, 2], min_length=1, description="E values of the sweep")
    sweep_questions_per_step: list[int] = Field([512, 1024, 2048], min_length=1, description="D_b values of the sweep")


class GRPORunParams(Settings):
    """One GRPO run: the loop's settings (:class:`a5core.loops.grpo.GRPOConfig`) and the pipeline's (the engine, the
    problems, validation, the prompt, where outputs go). The grpo flow adds its ablations; the leaderboard its
    budget and rules."""

    grpo: GRPOConfig = group(GRPOConfig, "the GRPO loop's settings")
    engine: EngineSettings = group(EngineSettings, "the starting model and the engine that samples from it")
    train: TrainProblems = group(TrainProblems, "the questions a step samples from")
    eval: Validation = group(Validation, "the validation problems and how many")
    grading: PromptSettings = group(PromptSettings, "the prompt template and the grader")
    outputs: Outputs = group(Outputs, "where the run's files, metrics and MLflow runs go")

    engine_device: str | None = Field(
        None,
        description="None: the engine runs in the trainer's process; a device "
        "(cuda:1, cpu): in a process of its own there, weights pushed over NCCL/gloo; "
        "under torchrun one device per rank, comma-separated (cuda:4,cuda:5)",
    )

    @field_validator("engine_device")
    @classmethod
    def _devices(cls, value: str | None) -> str | None:
        if value is not None:
            parse_engine_devices(value)
        return value


# The GRPO ablations, the choices of ``grpo.ablation``: what each compares, and its children, in flows/ablations.py
# (tests/flows/test_ablations.py keeps the two lists one).
AblationName = Literal[
    "grpo_lr_sweep",
    "grpo_baseline_ablation",
    "grpo_length_norm_ablation",
    "grpo_std_norm_ablation",
    "grpo_off_policy_sweep",
    "grpo_clip_ablation",
    "grpo_prompt_ablation",
    "grpo_dapo_ablation",
    "grpo_gspo_ablation",
    "grpo_kl_ablation",
    "grpo_question_sampling_ablation",
    "grpo_async_ablation",
]


GRPOOutputs = flow_outputs("grpo", "GRPO")


class GRPOValidation(Validation):
    val_subset: int = inherited(1024)


class GRPOParams(GRPORunParams):
    """One GRPO run or (``ablation``) an A5 ablation (flow ``grpo`` and the ablation flows)."""

    eval: GRPOValidation = group(GRPOValidation, "the validation problems and how many")
    outputs: GRPOOutputs = group(GRPOOutputs, "where the run's files, metrics and MLflow runs go")
    children: ChildRunner = group(ChildRunner, "where an ablation's children run")

    ablation: AblationName | None = Field(None, description="run this ablation instead of one run")
    ablation_only: list[str] | None = Field(
        None,
        min_length=1,
        description="None: every setting of the ablation; a list: only these (e.g. [grpo, dapo], to repeat one "
        "comparison with another seed)",
    )
    sweep_learning_rates: list[float] = Field([3e-6, 1e-5, 3e-5, 1e-4], min_length=1, description="grpo_lr_sweep")
    sweep_epochs_per_rollout_batch: list[int] = Field([2, 4], min_length=1, description="grpo_off_policy_sweep")
    sweep_train_batch_sizes: list[int] = Field([128, 64], min_length=1, description="grpo_off_policy_sweep")
    clip_epochs_per_rollout_batch: int = Field(2, ge=1, description="grpo_clip_ablation's off-policy setting")
    clip_train_batch_size: int = Field(128, ge=1, description="grpo_clip_ablation's off-policy setting")
    sweep_kl_coefs: list[PositiveFloat] = Field([0.001, 0.01], description="grpo_kl_ablation's KL coefficients")


_SFT = SFTConfig()  # the leaderboard's SFT phase starts from the SFT loop's defaults


class LeaderboardOptimizer(GRPOOptimizer):
    learning_rate: float = inherited(3e-5)


class LeaderboardGRPO(GRPOConfig):
    """The GRPO loop's settings with the leaderboard's own defaults, which follow the public leaderboard's best
    entries."""

    length_normalization: LengthNormalization = inherited("masked_normalize")
    n_grpo_steps: int = inherited(100_000)
    optimizer: LeaderboardOptimizer = group(LeaderboardOptimizer, "AdamW and gradient clipping")


class LeaderboardValidation(Validation):
    val_subset: int = inherited(512)


LeaderboardOutputs = flow_outputs("leaderboard", "Leaderboard")


class LeaderboardParams(GRPORunParams):
    """The leaderboard run (flow ``leaderboard``): GRPO within a wall-clock budget, an optional SFT phase
    first, scored by the A5 rules. Its GRPO defaults that differ from the loop's follow the public
    leaderboard's best entries."""

    grpo: LeaderboardGRPO = group(LeaderboardGRPO, "the GRPO loop's settings")
    eval: LeaderboardValidation = group(LeaderboardValidation, "the validation problems and how many")
    outputs: LeaderboardOutputs = group(LeaderboardOutputs, "where the run's files, metrics and MLflow runs go")

    budget_hours: float = Field(4.0, gt=0, description="wall-clock budget of the whole flow, evaluation included")
    final_eval_limit: int | None = Field(
        None,
        gt=0,
        description="None: all validation problems (the rule); "
        "a number only for smoke runs, which are then not official",
    )
    final_eval_reserve_s: float = Field(900.0, ge=0, description="minimum seconds kept for the final evaluation")
    sft_data: Annotated[str | None, READS] = Field(
        None,
        description="traces for an SFT phase first: a prompt/response/ground_truth file, "
        "or arithmetic:N:DIGITS[:columns] (generated r1_zero traces)",
    )
    sft_max_steps: int = Field(0, ge=0, description="SFT optimizer steps (0: no SFT phase)")
    sft_learning_rate: float = Field(_SFT.learning_rate, gt=0, description="the SFT phase's learning rate")
    sft_batch_size: int = Field(_SFT.batch_size, gt=0, description="the SFT phase's sequences per optimizer step")
    sft_microbatch_size: int = Field(
        _SFT.microbatch_size, gt=0, description="the SFT phase's sequences per forward/backward"
    )

    @model_validator(mode="after")
    def _the_rules(self) -> "LeaderboardParams":
        if self.prompt != "r1_zero":
            raise ValueError(f"prompt {self.prompt!r}: the leaderboard's rules fix the prompt at r1_zero")
        if self.reward_fn not in (None, "r1_zero", "arithmetic"):
            raise ValueError(
                f"reward_fn {self.reward_fn!r}: the rules grade with r1_zero (arithmetic: only for "
                "smoke runs on the generated arithmetic task)"
            )
        on_arithmetic = all(d.startswith("arithmetic:") for d in (self.train_data, self.validation_data))
        if self.reward_fn == "arithmetic" and not on_arithmetic:
            raise ValueError(
                "reward_fn arithmetic grades only the generated arithmetic task: set train_data and "
                "validation_data to arithmetic:N:DIGITS, or leave reward_fn at r1_zero (the rule)"
            )
        return self
