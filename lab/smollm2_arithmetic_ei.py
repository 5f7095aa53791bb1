"""SmolLM2-135M-Instruct on a task in its reach: format SFT on 64 one-digit sums, then 4 EI rounds on 2-digit +/-.

The GPU learning run of issue 4 (see docs/learning_runs.md). Writes one json line per stage to $OUT/log_arith.jsonl.
    OUT=outputs/experiments python lab/smollm2_arithmetic_ei.py
"""

import json
import os
import time

t0 = time.time()
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
from a5core.data.arithmetic import arithmetic_problems
from a5core.data.files import Trace
from a5core.data.prompts import load_prompt
from a5core.engines import SamplingSettings
from a5core.engines.hf import HFEngine
from a5core.evaluation.records import evaluate
from a5core.grading.grader import r1_zero_reward_fn
from a5core.grading.rewards import arithmetic_reward_fn
from a5core.loops.expert_iteration import EIConfig, expert_iteration
from a5core.loops.sft import SFTConfig, train_sft
from a5core.policy.causal_lm import load_policy
from a5core.policy.model_specs import resolve_model

OUT = os.environ.get("OUT", "outputs/experiments")
os.makedirs(OUT, exist_ok=True)
lines = []


def note(**kw):
    kw["t"] = round(time.time() - t0, 1)
    print(json.dumps(kw), flush=True)
    lines.append(kw)
    open(f"{OUT}/log_arith.jsonl", "w").write("".join(json.dumps(x) + "\n" for x in lines))


template = load_prompt("r1_zero")
# REWARD=arithmetic (default): the answer must be the number; r1_zero: the MATH grader (accepts "$23 + 45$").
reward_fn = arithmetic_reward_fn if os.environ.get("REWARD", "arithmetic") == "arithmetic" else r1_zero_reward_fn
path = resolve_model("smollm2-135m-instruct")
policy, tok = load_policy(path, dtype=torch.float32, device=DEVICE)
engine = HFEngine.from_pretrained(path, dtype="bfloat16", device=DEVICE, batch_size=512)
val = arithmetic_problems(300, digits=2, operations="+-", split="validation", seed=0)
evs = SamplingSettings(temperature=1.0, max_tokens=64, stop=("</answer>",), seed=0)


def ev(tag):
    engine.load_weights(policy)
    _, s = evaluate(engine, val, template, reward_fn, evs)
    note(stage=tag, accuracy=s["accuracy"], format_rate=s["format_rate"], mean_tokens=s["mean_response_tokens"])
    return {"val_accuracy": s["accuracy"]}


ev("zero_shot")
fmt = [
    Trace(template.format(p.problem), f" {p.solution} </think> <answer> {p.answer} </answer>", p.answer)
    for p in arithmetic_problems(64, digits=1, operations="+-", split="train", seed=1)
]
train_sft(policy, tok, fmt, SFTConfig(learning_rate=3e-5, batch_size=16, microbatch_size=16, epochs=2, seed=0))
ev("after_format_sft_on_64_one_digit_sums")
train = arithmetic_problems(4000, digits=2, operations="+-", split="train", seed=0)
ei = EIConfig(
    n_ei_steps=4,
    questions_per_step=512,
    rollouts_per_question=8,
    seed=0,
    entropy_sample=64,
    temperature=1.0,
    min_tokens=4,
    max_tokens=64,
    learning_rate=2e-5,
    batch_size=32,
    microbatch_size=32,
    epochs=1,
    max_seq_len=1024,
)  # each round's SFT
expert_iteration(
    policy,
    tok,
    engine,
    train,
    template,
    reward_fn,
    ei,
    evaluate=lambda m, s: ev(f"after_{s}_ei_rounds"),
    log=lambda m, s: (
        note(
            stage=f"ei_round_{s - 1}",
            **{
                k: m[k]
                for k in ("kept", "kept_fraction", "rollout_format_rate", "rollout_mean_token_entropy", "val_accuracy")
            },
        )
        if "kept" in m
        else None
    ),
)
note(stage="done")
