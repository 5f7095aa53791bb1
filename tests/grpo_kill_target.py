"""A one-step-off GRPO run (``pipeline_depth`` 1) for tests/a5core/loops/grpo/test_loop_options.py to SIGKILL:
``python tests/grpo_kill_target.py TINY_LM_DIR CKPT_DIR MARKER``.

Four steps, a checkpoint after every one. In the ``log`` call of step 2 (checkpoint 1 complete, step 2
trained, step 3's rollouts started in the background from step 2's starting weights) it writes MARKER and
freezes, for the test to kill it there.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tiny_loops import PROBLEMS, TEMPLATE, RecordingEngine, make_model, parity_reward, small_config

ASYNC_SETTINGS = dict(n_grpo_steps=4, pipeline_depth=1, tis_cap=2.0, checkpoint_every=1)


def main(tiny_lm_dir: str, checkpoint_dir: str, marker: str) -> None:
    from transformers import AutoTokenizer

    from a5core.loops.grpo import grpo

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = make_model(tokenizer)

    def log(metrics: dict, step: int) -> None:
        if step == 2:
            Path(marker).write_text("frozen\n")
            while True:
                time.sleep(60)

    config = small_config(**ASYNC_SETTINGS)
    engine = RecordingEngine(model, tokenizer)
    grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, config, checkpoint_dir=checkpoint_dir, log=log)
    raise SystemExit("finished without freezing")  # the test expects to kill it first


if __name__ == "__main__":
    main(*sys.argv[1:])
