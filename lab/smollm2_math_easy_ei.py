"""SmolLM2-135M-Instruct: SFT on MATH-solution traces, then Expert Iteration on easy MATH problems; hf engine.

Issue 4's GPU learning figure, second try (docs/learning_runs.md). On random MATH problems the 135M model
solves too few for EI to have anything to learn from, so EI questions come from the easy levels of the
train split and the evaluation is every validation problem of the easiest level(s), each sampled
EVAL_N times. Accuracy (answer reward) is the mean over problems of the per-problem mean; its standard
error is over problems (sd of per-problem means / sqrt(problems)); each stage is also compared with
the stage before it and with the SFT stage, paired by problem (mean difference ± its s.e.).

EI rounds run (library ``expert_iteration``, one round per call, round k with seed k) while the
previous round's wall time (before round 0: 2.5 evaluations) still fits before DEADLINE_S. One json line per stage goes to $OUT/log.jsonl.
    OUT=outputs/experiments python lab/smollm2_math_easy_ei.py
Settings (env): MATH_TRAIN, MATH_VALIDATION, SFT_LEVELS ("1,2,3": traces of those levels; "all"),
EI_LEVELS ("1,2"), EVAL_LEVELS ("1"), EVAL_N (4), EVAL_MAX_TOKENS (512), EI_ROUNDS (max rounds, 8),
D_B (256), G (8), EI_MAX_TOKENS (512), EI_EPOCHS (2), EI_LR (2e-5), SFT_MICRO (32), DEADLINE_S (470),
ZERO_SHOT (1), LIMIT (0: all; >0 caps every problem list, for a smoke test).
"""

import json
import math
import os
import statistics
import time
from collections import defaultdict

t0 = time.time()
import torch

env = os.environ.get
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
from a5core.data.files import load_math
from a5core.data.prompts import load_prompt
from a5core.data.sft_data import math_solution_traces
from a5core.engines import SamplingSettings
from a5core.engines.hf import HFEngine
from a5core.evaluation.records import evaluate
from a5core.grading.grader import r1_zero_reward_fn
from a5core.loops.expert_iteration import EIConfig, expert_iteration
from a5core.loops.sft import SFTConfig, train_sft
from a5core.policy.causal_lm import load_policy
from a5core.policy.model_specs import resolve_model

OUT = env("OUT", "outputs/experiments")
os.makedirs(OUT, exist_ok=True)
log_lines = []


def note(**kw):
    kw["t"] = round(time.time() - t0, 1)
    print(json.dumps(kw), flush=True)
    log_lines.append(kw)
    open(f"{OUT}/log.jsonl", "w").write("".join(json.dumps(x) + "\n" for x in log_lines))


def levels(name, default):
    value = env(name, default)
    return None if value == "all" else {int(x) for x in value.split(",")}


def pick(problems, wanted):
    chosen = [p for p in problems if wanted is None or p.level in wanted]
    return chosen[: int(env("LIMIT", 0))] if int(env("LIMIT", 0)) else chosen


template = load_prompt("r1_zero")
train = load_math(env("MATH_TRAIN", "../shared/data/math/train.jsonl"))
val = pick(load_math(env("MATH_VALIDATION", "../shared/data/math/validation.jsonl")), levels("EVAL_LEVELS", "1"))
sft_problems, ei_problems = pick(train, levels("SFT_LEVELS", "1,2,3")), pick(train, levels("EI_LEVELS", "1,2"))
path = resolve_model("smollm2-135m-instruct")
policy, tok = load_policy(path, dtype=torch.float32, device=DEVICE)
D_B, G = int(env("D_B", 256)), int(env("G", 8))
eval_n = int(env("EVAL_N", 4))
engine = HFEngine.from_pretrained(path, dtype="bfloat16", device=DEVICE, batch_size=max(D_B * G, len(val) * eval_n))
evs = SamplingSettings(
    n=eval_n, temperature=1.0, top_p=1.0, max_tokens=int(env("EVAL_MAX_TOKENS", 512)), stop=("</answer>",), seed=0
)
note(
    stage="setup",
    device=torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
    val_problems=len(val),
    eval_n=eval_n,
    sft_problems=len(sft_problems),
    ei_problems=len(ei_problems),
)

per_problem, eval_seconds = {}, []  # stage -> {unique_id: mean answer reward}; wall time of each evaluation


def paired(a, b):
    diffs = [per_problem[a][u] - per_problem[b][u] for u in per_problem[a]]
    return round(statistics.mean(diffs), 4), round(statistics.stdev(diffs) / math.sqrt(len(diffs)), 4)


def ev(tag, previous=None):
    start = time.time()
    engine.load_weights(policy)
    records, s = evaluate(engine, val, template, r1_zero_reward_fn, evs)
    by = defaultdict(list)
    for r in records:
        by[r["unique_id"]].append(r["answer_reward"])
    per_problem[tag] = {u: sum(v) / len(v) for u, v in by.items()}
    means = list(per_problem[tag].values())
    extra = {}
    for other in dict.fromkeys(x for x in (previous, "after_sft") if x and x != tag and x in per_problem):
        extra[f"diff_vs_{other}"] = paired(tag, other)
    eval_seconds.append(time.time() - start)
    note(
        stage=tag,
        accuracy=round(s["accuracy"], 4),
        se=round(statistics.stdev(means) / math.sqrt(len(means)), 4),
        problems_solved_once=sum(m > 0 for m in means),
        format_rate=round(s["format_rate"], 4),
        mean_tokens=round(s["mean_response_tokens"], 1),
        finish_length=s.get("finish_length", 0),
        F1A1=s["count_format1_answer1"],
        F1A0=s["count_format1_answer0"],
        F0A0=s["count_format0_answer0"],
        eval_s=round(time.time() - start, 1),
        **extra,
    )
    with open(f"{OUT}/samples_{tag}.jsonl", "w") as f:
        for r in records[:: max(1, len(records) // 40)]:
            f.write(
                json.dumps({k: r[k] for k in ("unique_id", "response", "ground_truth", "reward", "format_reward")})
                + "\n"
            )


if env("ZERO_SHOT", "1") == "1":
    ev("zero_shot")
traces, skipped = math_solution_traces(sft_problems, template)
sft_start = time.time()
losses = []
cfg = SFTConfig(
    learning_rate=5e-5,
    warmup_steps=10,
    batch_size=32,
    microbatch_size=int(env("SFT_MICRO", 32)),
    epochs=1,
    max_seq_len=1024,
    seed=0,
)
train_sft(policy, tok, traces, cfg, log=lambda m, s: losses.append(m["loss"]))
note(
    stage="sft",
    examples=len(traces),
    steps=len(losses),
    first_loss=losses[0],
    last_loss=sum(losses[-10:]) / min(10, len(losses)),
    sft_s=round(time.time() - sft_start, 1),
)
ev("after_sft", "zero_shot")

ei = EIConfig(
    n_ei_steps=1,
    questions_per_step=D_B,
    rollouts_per_question=G,
    entropy_sample=64,
    temperature=1.0,
    min_tokens=4,
    max_tokens=int(env("EI_MAX_TOKENS", 512)),
    learning_rate=float(env("EI_LR", 2e-5)),
    batch_size=16,
    microbatch_size=16,
    epochs=int(env("EI_EPOCHS", 2)),
    max_seq_len=1024,
)  # each round's SFT
deadline, last_round_s, previous = float(env("DEADLINE_S", 470)), None, "after_sft"
for k in range(int(env("EI_ROUNDS", 8))):
    left = deadline - (time.time() - t0)
    need = last_round_s * 1.05 if last_round_s is not None else 2.5 * eval_seconds[-1]  # round 0: ~2 evaluations + SFT
    if need > left:
        note(stage="stop", reason=f"round {k} would need ~{need:.0f} s, {left:.0f} s left before DEADLINE_S")
        break
    start, tag = time.time(), f"after_ei_round_{k}"
    expert_iteration(
        policy,
        tok,
        engine,
        ei_problems,
        template,
        r1_zero_reward_fn,
        ei.replace(seed=k),
        evaluate=lambda m, s: {},
        log=lambda m, s, k=k: (
            note(
                stage=f"ei_round_{k}",
                **{x: (round(v, 4) if isinstance(v, float) else v) for x, v in m.items() if not x.startswith("sft/")},
            )
            if "kept" in m
            else None
        ),
    )
    ev(tag, previous)
    previous, last_round_s = tag, time.time() - start
note(stage="done")
