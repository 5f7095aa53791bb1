"""Prefect flows and stage entry points: one module per user-facing job, called by DVC stages."""
