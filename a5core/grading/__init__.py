"""Grading and metrics: the answer grader, evaluation records, per-sample statistics."""
