"""Evaluation: completions an engine generates for problems, graded, recorded and summarised; case reports."""
