"""Grading, on text alone: answers extracted and compared, the reward functions by name, a group's rewards and
advantages, per-sample statistics."""
