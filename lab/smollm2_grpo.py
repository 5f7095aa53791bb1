"""SmolLM2-135M-Instruct: SFT for the r1 format, then GRPO (a5core.loops.grpo) on a task it can partly solve; hf engine.

The GPU learning run of issue 5 (see docs/learning_runs.md). TASK=arithmetic: format SFT on 64 one-digit sums,
GRPO on 2-digit +/- (a5core.data.arithmetic, MATH's record format). TASK=math: SFT on all MATH-solution traces, GRPO on
MATH train problems of level <= MAX_LEVEL, validated on validation problems of those levels.
Writes one json line per step/evaluation to $OUT/log_grpo.jsonl.
    OUT=outputs/experiments TASK=arithmetic STEPS=60 python lab/smollm2_grpo.py
"""

import json
import os
import random
import time

t0 = time.time()
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
from a5core.data.arithmetic import arithmetic_problems
from a5core.data.files import Trace, load_math
from a5core.data.prompts import load_prompt
from a5core.data.sft_data import math_solution_traces
from a5core.engines import SamplingSettings
from a5core.engines.hf import HFEngine
from a5core.evaluation.records import evaluate
from a5core.grading.grader import r1_zero_reward_fn
from a5core.grading.rewards import arithmetic_reward_fn
from a5core.loops.grpo import GRPOConfig, grpo
from a5core.loops.sft import SFTConfig, train_sft
from a5core.policy.causal_lm import load_policy
from a5core.policy.model_specs import resolve_model

env = lambda k, d: type(d)(os.environ.get(k, d))  # noqa: E731
TASK, STEPS, LR, MAX_TOKENS = env("TASK", "arithmetic"), env("STEPS", 60), env("LR", 3e-5), env("MAX_TOKENS", 64)
OUT = env("OUT", "outputs/experiments")
os.makedirs(OUT, exist_ok=True)
lines = []


def note(**kw):
    kw["t"] = round(time.time() - t0, 1)
    print(json.dumps(kw), flush=True)
    lines.append(kw)
    open(f"{OUT}/log_grpo.jsonl", "w").write("".join(json.dumps(x) + "\n" for x in lines))


template = load_prompt("r1_zero")
path = resolve_model("smollm2-135m-instruct")
policy, tok = load_policy(path, dtype=torch.float32, device=DEVICE)
engine = HFEngine.from_pretrained(path, dtype="bfloat16", device=DEVICE, batch_size=512)
if TASK == "arithmetic":
    sft_set = [
        Trace(template.format(p.problem), f" {p.solution} </think> <answer> {p.answer} </answer>", p.answer)
        for p in arithmetic_problems(64, digits=1, operations="+-", split="train", seed=1)
    ]
    sft = SFTConfig(learning_rate=3e-5, batch_size=16, microbatch_size=16, epochs=2, seed=0)
    train = arithmetic_problems(4000, digits=2, operations="+-", split="train", seed=0)
    val = arithmetic_problems(300, digits=2, operations="+-", split="validation", seed=0)
else:
    level = env("MAX_LEVEL", 1)
    math_train = load_math(env("MATH_TRAIN", "../shared/data/math/train.jsonl"))
    sft_set, _ = math_solution_traces(math_train, template)
    sft = SFTConfig(
        learning_rate=5e-5, warmup_steps=10, batch_size=32, microbatch_size=16, epochs=1, max_seq_len=1024, seed=0
    )
    train = [p for p in math_train if p.level is not None and p.level <= level]
    val = [
        p
        for p in load_math(env("MATH_VALIDATION", "../shared/data/math/validation.jsonl"))
        if p.level is not None and p.level <= level
    ]
    val = random.Random(0).sample(val, min(len(val), env("VAL_N", 500)))
# REWARD=arithmetic (default for TASK=arithmetic): the answer must be the number; r1_zero: the MATH grader,
# which also accepts the question's own expression (see a5core.data.arithmetic).
reward_fn = (
    arithmetic_reward_fn
    if env("REWARD", "arithmetic" if TASK == "arithmetic" else "r1_zero") == "arithmetic"
    else r1_zero_reward_fn
)
evs = SamplingSettings(temperature=1.0, max_tokens=MAX_TOKENS, stop=("</answer>",), seed=0)


def ev(model, step):
    engine.load_weights(model)
    records, s = evaluate(engine, val, template, reward_fn, evs)
    lenient = [r1_zero_reward_fn(r["response"], r["ground_truth"])["reward"] for r in records]
    note(
        stage="eval",
        step=step,
        accuracy=s["accuracy"],
        format_rate=s["format_rate"],
        mean_tokens=s["mean_response_tokens"],
        n=len(val),
        math_grader_accuracy=sum(lenient) / len(lenient),
    )
    if step == 0 or step == STEPS:
        with open(f"{OUT}/samples_step{step}.jsonl", "w") as f:
            f.writelines(
                json.dumps({k: r[k] for k in ("unique_id", "response", "ground_truth", "reward")}) + "\n"
                for r in records[:40]
            )
    return {"val_accuracy": s["accuracy"]}


train_sft(policy, tok, sft_set, sft)
note(stage="sft_done", examples=len(sft_set), train_questions=len(train))
config = GRPOConfig(
    n_grpo_steps=STEPS,
    learning_rate=LR,
    rollout_batch_size=256,
    group_size=8,
    train_batch_size=256,
    gradient_accumulation_steps=env("GRAD_ACCUM", 8),
    eval_every=env("EVAL_EVERY", 10),
    seed=0,
    loss_type=env("LOSS", "reinforce_with_baseline"),
    length_normalization=env("LENGTH_NORM", "masked_mean"),
    temperature=1.0,
    min_tokens=4,
    max_tokens=MAX_TOKENS,
)
keys = (
    "reward_mean",
    "format_reward_mean",
    "token_entropy",
    "response_tokens_mean",
    "grad_norm",
    "time_generate",
    "time_grade",
    "time_train",
    "time_weight_sync",
    "generate_tokens_per_s",
    "train_tokens_per_s",
)
grpo(
    policy,
    tok,
    engine,
    train,
    template,
    reward_fn,
    config,
    evaluate=ev,
    log=lambda m, s: (
        note(stage="step", step=s, **{k: round(m[k], 4) for k in keys if k in m}) if "reward_mean" in m else None
    ),
)
note(stage="done")
