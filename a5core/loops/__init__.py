"""The training loops: SFT, Expert Iteration, GRPO; the setup, settings and question sampling they share."""
