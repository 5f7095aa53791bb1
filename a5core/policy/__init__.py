"""The policy and its losses: loading models, log-probs, LoRA, the handout's loss formulas."""
