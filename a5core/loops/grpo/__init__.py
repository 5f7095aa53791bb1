"""GRPO with verified rewards (CS336 A5 §7): :func:`grpo` trains a policy in place under a :class:`GRPOConfig`.

Read :mod:`a5core.loops.grpo.loop` (one step, top to bottom) and :mod:`a5core.loops.grpo.objective` (the loss of a
micro-batch, each option one branch); the rest of the package is what they lean on. How a run works: docs/grpo.md.
"""

from a5core.loops.grpo.config import GRPOConfig, run_fingerprint
from a5core.loops.grpo.loop import grpo, grpo_step

__all__ = ["GRPOConfig", "grpo", "grpo_step", "run_fingerprint"]
