"""Engine start as a Prefect task with retries: the step of a flow most likely to fail transiently
(vLLM's start-up while a previous process still holds GPU memory or a port, a model read from a slow
or busy filesystem). Each flow calls ``start_engine(make_engine, ...)`` with its own ``make_engine``,
so what starts, and with which arguments, is exactly what a direct ``make_engine(...)`` call starts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE


class EngineStartError(RuntimeError):
    """The rollout engine could not be started (after the retries)."""


@task(name="start_engine", retries=2, retry_delay_seconds=10, cache_policy=NO_CACHE, persist_result=False)
def start_engine(factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``factory(*args, **kwargs)``, retried twice (10 s apart) if it raises; the engine is never cached.
    A failure raises :class:`EngineStartError` naming the model, the settings and the cause."""
    try:
        return factory(*args, **kwargs)
    except Exception as error:
        settings = ", ".join([*map(str, args), *(f"{k}={v}" for k, v in kwargs.items())])
        raise EngineStartError(f"could not start the rollout engine ({settings}): {type(error).__name__}: {error}") from error
