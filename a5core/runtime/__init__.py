"""Runtime, the ground floor every room stands on: ranks and FSDP2, checkpoints, atomic writes, token budgets and
the out-of-memory retry, the divergence guard, progress, and how settings models are made."""
