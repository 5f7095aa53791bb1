"""SmolLM2-135M-Instruct: SFT on all MATH-solution traces, then Expert Iteration on MATH; hf engine.

The GPU learning run of issue 4 (see docs/learning_runs.md). Writes one json line per stage to $OUT/log.jsonl.
    OUT=outputs/experiments EI_STEPS=2 python lab/smollm2_math_sft_ei.py
"""

import json
import os
import random
import time

t0 = time.time()
import torch

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

OUT = os.environ.get("OUT", "outputs/experiments")
os.makedirs(OUT, exist_ok=True)
log_lines = []


def note(**kw):
    kw["t"] = round(time.time() - t0, 1)
    print(json.dumps(kw), flush=True)
    log_lines.append(kw)
    open(f"{OUT}/log.jsonl", "w").write("".join(json.dumps(x) + "\n" for x in log_lines))


template = load_prompt("r1_zero")
train = load_math(os.environ.get("MATH_TRAIN", "../shared/data/math/train.jsonl"))
val = random.Random(0).sample(load_math(os.environ.get("MATH_VALIDATION", "../shared/data/math/validation.jsonl")), 300)
path = resolve_model("smollm2-135m-instruct")
policy, tok = load_policy(path, dtype=torch.float32, device=DEVICE)
engine = HFEngine.from_pretrained(path, dtype="bfloat16", device=DEVICE, batch_size=320)
evs = SamplingSettings(temperature=1.0, top_p=1.0, max_tokens=1024, stop=("</answer>",), seed=0)


def ev(tag):
    engine.load_weights(policy)
    _, s = evaluate(engine, val, template, r1_zero_reward_fn, evs)
    note(
        stage=tag,
        accuracy=s["accuracy"],
        format_rate=s["format_rate"],
        mean_tokens=s["mean_response_tokens"],
        F1A1=s["count_format1_answer1"],
        F1A0=s["count_format1_answer0"],
        F0A0=s["count_format0_answer0"],
    )


traces, skipped = math_solution_traces(train, template)
cfg = SFTConfig(
    learning_rate=5e-5, warmup_steps=10, batch_size=32, microbatch_size=16, epochs=1, max_seq_len=1024, seed=0
)
losses = []
train_sft(policy, tok, traces, cfg, log=lambda m, s: losses.append(m["loss"]))
note(stage="sft", examples=len(traces), steps=len(losses), first_loss=losses[0], last_loss=sum(losses[-10:]) / 10)
ev("after_sft")
ei = EIConfig(
    n_ei_steps=int(os.environ.get("EI_STEPS", 2)),
    questions_per_step=256,
    rollouts_per_question=4,
    seed=0,
    entropy_sample=64,
    temperature=1.0,
    min_tokens=4,
    max_tokens=512,
    learning_rate=2e-5,
    batch_size=16,
    microbatch_size=16,
    epochs=1,
    max_seq_len=1024,
)  # each round's SFT
expert_iteration(
    policy,
    tok,
    engine,
    train,
    template,
    r1_zero_reward_fn,
    ei,
    evaluate=lambda m, s: ev(f"after_{s}_ei_rounds") or {},
    log=lambda m, s: (
        note(stage=f"ei_round_{s - 1}", **{k: v for k, v in m.items() if not k.startswith("sft/")})
        if "kept" in m
        else None
    ),
)
note(stage="done")
