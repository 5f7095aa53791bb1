"""Fixed-seed tiny GRPO, SFT and EI runs on the CPU: every step's losses (as float.hex) and a digest of the
final weights, to check that a refactoring of the loops moves no number.

    PYTHONPATH=$PWD .venv/bin/python lab/fixed_seed_losses.py lab/records/fixed_seed_losses_after.json
    diff lab/records/fixed_seed_losses_before.json lab/records/fixed_seed_losses_after.json

Uses the test suite's tiny planted model and BPE tokenizer (tests/tiny_lm.py, built from the shared MATH data).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from tiny_lm import build_tiny_lm  # noqa: E402

from a5core.data.files import Problem, Trace  # noqa: E402
from a5core.data.prompts import load_prompt  # noqa: E402
from a5core.engines.hf import HFEngine  # noqa: E402
from a5core.loops.expert_iteration import EIConfig, expert_iteration  # noqa: E402
from a5core.loops.grpo import GRPOConfig, grpo  # noqa: E402
from a5core.loops.sft import SFTConfig, train_sft  # noqa: E402

TEMPLATE = load_prompt("r1_zero")
PROBLEMS = [Problem(f"p{i}", f"What is {i} + 1?", str(i + 1)) for i in range(8)]
KEYS = ("loss", "grad_norm", "clip_fraction", "ratio_mean", "ratio_max", "kl", "token_entropy", "reward_mean")

GRPO_RUNS = {
    "reinforce_with_baseline": {},
    "no_baseline": dict(loss_type="no_baseline", length_normalization="masked_normalize"),
    "grpo_clip_off_policy": dict(
        loss_type="grpo_clip", epochs_per_rollout_batch=2, train_batch_size=4, cliprange_high=0.28
    ),
    "grpo_no_clip": dict(loss_type="grpo_no_clip", epochs_per_rollout_batch=2),
    "gspo": dict(loss_type="gspo", epochs_per_rollout_batch=2, gspo_cliprange=0.02),
    "kl_tis_token_mean": dict(kl_coef=0.1, tis_cap=2.0, length_normalization="token_mean", kl_estimator="k2"),
    "mask_truncated_k3": dict(mask_truncated=True, kl_coef=0.05),
    "dapo_dynamic_overlong": dict(dynamic_sampling=True, overlong_buffer=4, max_extra_draws=2),
    "drop_uniform_token_budget": dict(drop_uniform_groups=True, max_tokens_per_microbatch=64),
    "one_step_off": dict(pipeline_depth=1, tis_cap=2.0, n_grpo_steps=3),
    "lora": dict(lora_rank=4, learning_rate=1e-2),
    "checkpointing_no_std": dict(gradient_checkpointing=True, use_std_normalization=False, grad_clip=0.0),
}


def parity_reward(response: str, ground_truth: str) -> dict[str, float]:
    reward = float(len(response) % 2 == 0)
    return {"reward": reward, "format_reward": reward, "answer_reward": reward}


def make_model(tokenizer):
    """The planted tiny LM (tests/tiny_lm.py): some rollouts reach </answer> within max_tokens, some are cut."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tokenizer.name_or_path).train()


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def hexed(metrics: dict[str, float], keys: tuple[str, ...]) -> dict[str, str]:
    return {k: float(metrics[k]).hex() for k in keys if k in metrics}


def grpo_run(tokenizer, options: dict) -> dict:
    model = make_model(tokenizer)
    settings = dict(
        n_grpo_steps=2,
        learning_rate=1e-3,
        rollout_batch_size=8,
        group_size=4,
        train_batch_size=8,
        gradient_accumulation_steps=2,
        min_tokens=2,
        max_tokens=16,
        eval_every=0,
        checkpoint_every=0,
    )
    config = GRPOConfig(**{**settings, **options})
    engine = HFEngine(copy.deepcopy(model), tokenizer)
    history = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, config)
    return {"steps": [hexed(h, KEYS) for h in history], "weights": digest(model)}


def sft_run(tokenizer, options: dict) -> dict:
    model = make_model(tokenizer)
    traces = [
        Trace(TEMPLATE.format(p.problem), f" {p.answer} </think> <answer> {p.answer} </answer>", p.answer)
        for p in PROBLEMS
    ]
    steps = []
    config = SFTConfig(
        **{"learning_rate": 1e-3, "batch_size": 4, "microbatch_size": 2, "epochs": 2, "warmup_steps": 1, **options}
    )
    train_sft(
        model, tokenizer, traces, config, log=lambda m, s: steps.append(hexed(m, ("loss", "token_nll", "grad_norm")))
    )
    return {"steps": steps, "weights": digest(model)}


def ei_run(tokenizer) -> dict:
    model = make_model(tokenizer)
    config = EIConfig(
        n_ei_steps=2,
        questions_per_step=4,
        rollouts_per_question=4,
        batch_size=4,
        microbatch_size=2,
        learning_rate=1e-3,
        min_tokens=2,
        max_tokens=16,
        entropy_sample=4,
    )
    engine = HFEngine(copy.deepcopy(model), tokenizer)
    history = expert_iteration(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, config)
    keys = ("kept", "sft_loss", "rollout_mean_token_entropy")
    return {"steps": [hexed(h, keys) for h in history], "weights": digest(model)}


def main(out: str) -> None:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    data = Path(os.environ.get("A5_SHARED_DATA", ROOT.parent / "shared" / "data"))
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_lm(Path(tmp), data / "math" / "train.jsonl"))
        results = run_all(tokenizer)
    for name, result in results.items():
        losses = [float.fromhex(s.get("loss", s.get("sft_loss", "nan"))) for s in result["steps"]]
        print(f"{name:38s} {result['weights']}  loss {' '.join(f'{v:.9g}' for v in losses)}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def run_all(tokenizer) -> dict[str, dict]:
    results = {f"grpo/{name}": grpo_run(tokenizer, options) for name, options in GRPO_RUNS.items()}
    results["sft/cosine"] = sft_run(tokenizer, {})
    results["sft/token_budget_constant"] = sft_run(
        tokenizer, {"max_tokens_per_microbatch": 96, "lr_schedule": "constant"}
    )
    results["sft/lora"] = sft_run(tokenizer, {"lora_rank": 4})
    results["ei"] = ei_run(tokenizer)
    return results


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fixed_seed_losses.json")
