"""Runtime: distributed ranks, checkpoints, token budgets, guards, progress, settings."""
