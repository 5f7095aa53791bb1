"""The models benchmarks run: Qwen2.5-Math-1.5B's exact architecture at random weights, or a tiny one.

Speed and memory do not depend on the weight values, so the 1.5B figures need only the config and
tokenizer (``../shared/data/qwen2.5-math-1.5b``, or a copy passed with ``--model-dir``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

DEFAULT_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "qwen2.5-math-1.5b"
PEAK_BF16_FLOPS = 790e12  # an H200's measured bf16 rate (8192³ products through PyTorch): the roofline's peak


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-dir", type=Path, default=DEFAULT_DIR, help="config.json + tokenizer of the architecture"
    )
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family, for a CPU check")


TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_window_layers=2,
)  # the same family, small enough for a CPU check; head_dim 32 (vLLM's CPU attention has no kernel for 16)


def random_model(config_path: Path, dtype: torch.dtype, device: str, overrides: dict | None = None):
    """The architecture of ``config_path`` (a config.json; fields replaced by ``overrides``) at seeded
    random weights, built on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(Path(config_path).read_text())
    config = AutoConfig.for_model(fields.pop("model_type"), **{**fields, **(overrides or {})})
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def build(model_dir: Path, tiny: bool, device: str):
    """(model in bf16 on ``device`` — fp32 on CPU —, tokenizer, description), random weights, seeded."""
    from transformers import AutoTokenizer

    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"{model_dir}: no config.json (pass --model-dir)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = random_model(model_dir / "config.json", dtype, device, TINY if tiny else None)
    name = f"{model.config.model_type} {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, {dtype}".replace(
        "torch.", ""
    )
    return model, tokenizer, name


def train_flops_per_token(model, context: int) -> float:
    """6·N (forward + backward of every parameter, the tied head counted once as the head) + attention's
    12·layers·hidden·context."""
    config = model.config
    n = sum(p.numel() for p in model.parameters())
    return 6 * n + 12 * config.num_hidden_layers * config.hidden_size * context


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
