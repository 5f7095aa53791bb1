"""A small SFT run for tests/a5core/loops/test_sft.py to SIGKILL:
``python tests/sft_kill_target.py TINY_LM_DIR CKPT_DIR MARKER MODE``.

``build_run`` defines the run (tiny model, examples, config); the test imports it for its uninterrupted
reference. The script trains with checkpoints every 2 steps and, once the first checkpoint exists,
writes MARKER and freezes so the test can kill it at a known point:

- ``MODE=between_steps``: in the ``log`` call of step 3 (checkpoint 2 complete, step 3 trained);
- ``MODE=lora_between_steps``: the same with LoRA adapters (:data:`LORA`);
- ``MODE=mid_write``: inside the step-4 checkpoint, after its weights and before its optimizer state
  (``.latest.partial`` half written, ``latest`` still step 2).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

CHECKPOINT_EVERY = 2
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules=["q_proj", "v_proj"])  # mode lora_between_steps


def build_run(tiny_lm_dir: str | Path):
    """(model, tokenizer, examples, config kwargs) of the run; the model is freshly initialised, seed 0."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from a5core.data.files import Trace

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    examples = [
        Trace(
            f"What is {a} + {b}?",
            f" {a} + {b} = {a + b}{' so' * (a % 4)} </think> <answer> {a + b} </answer>",
            str(a + b),
        )
        for a, b in [(i, (3 * i + 1) % 10) for i in range(10)]
    ]
    kwargs = dict(learning_rate=3e-3, warmup_steps=1, batch_size=4, microbatch_size=2, epochs=2, seed=7)
    return model, tokenizer, examples, kwargs  # 10 examples, batch 4: 3 steps per epoch, 6 steps


def _freeze(marker: Path) -> None:
    marker.write_text("frozen\n")
    while True:
        time.sleep(60)


def main(tiny_lm_dir: str, checkpoint_dir: str, marker: str, mode: str) -> None:
    import a5core.loops.sft as sft
    import a5core.runtime.checkpoint as checkpoint

    torch.set_num_threads(1)
    model, tokenizer, examples, kwargs = build_run(tiny_lm_dir)
    if mode == "lora_between_steps":
        kwargs |= LORA
    config = sft.SFTConfig(**kwargs, checkpoint_every=CHECKPOINT_EVERY)

    def log(metrics: dict, step: int) -> None:
        if mode in ("between_steps", "lora_between_steps") and step == 3:
            _freeze(Path(marker))

    if mode == "mid_write":
        real_save, saves = checkpoint._save_fsynced, []

        def save(obj, path: Path) -> None:
            saves.append(path.name)
            if path.name == "optimizer.pt" and saves.count("optimizer.pt") == 2:
                _freeze(Path(marker))
            real_save(obj, path)

        checkpoint._save_fsynced = save
    sft.train_sft(model, tokenizer, examples, config, checkpoint_dir=checkpoint_dir, log=log)
    raise SystemExit("finished without freezing")  # the test expects to kill it first


if __name__ == "__main__":
    main(*sys.argv[1:])
