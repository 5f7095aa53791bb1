"""Verdicts on expectations asked of runs: runs paired by start model and seed, Student's t over the pairs, one
correction for the expectations asked together, and the words a reader acts on."""
