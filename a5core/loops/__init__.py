"""The training loops: SFT, Expert Iteration, GRPO."""
