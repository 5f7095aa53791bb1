"""Whether a server a run depends on answers, in seconds rather than after minutes of a client's retries: a GET
with a deadline (:func:`http_get`, which the Prefect API's check uses too), and the MLflow tracking server's
``/health`` before a run starts (:func:`check_server`). Addresses in messages keep a password out
(:func:`shown_uri`)."""

from __future__ import annotations

SERVER_DEADLINE_S = 10  # a tracking server's /health must answer within it before a run starts


def shown_uri(tracking_uri: str) -> str:
    """A store's address as messages show it: a password in it masked."""
    scheme, sep, rest = tracking_uri.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return tracking_uri
    return f"{scheme}{sep}{credentials.partition(':')[0]}:***@{host}"


def http_get(url: str, deadline_s: float) -> tuple[int, bytes] | str:
    """What a server answers a GET of ``url`` with within ``deadline_s`` seconds: its status and the start of its
    body; or, a string, why it does not answer (refused, unreachable, timed out, no such host)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=deadline_s) as reply:
            return reply.status, reply.read(4096)
    except urllib.error.HTTPError as error:  # it answered
        return error.code, b""
    except (OSError, ValueError) as error:
        return str(getattr(error, "reason", None) or error)


# The statuses of a server that asks for credentials: it is left to the client, which sends them, to say more.
CREDENTIALS_WANTED = (401, 403)


def check_server(tracking_uri: str, what: str = "--tracking-uri") -> None:
    """For a tracking server (``http(s)://``): ValueError naming it unless it answers within
    :data:`SERVER_DEADLINE_S` seconds (MLflow's own client would retry for minutes), and answers as MLflow does:
    ``/health`` with ``OK`` and its REST API with JSON (a server that answers otherwise, a web page say, gave
    tracebacks). ``what``: the setting that names it, in the advice. Other stores: nothing."""
    if not tracking_uri.startswith(("http://", "https://")):
        return
    base = tracking_uri.rstrip("/")
    reply = http_get(base + "/health", SERVER_DEADLINE_S)
    if isinstance(reply, str):
        raise ValueError(
            f"MLflow tracking server {shown_uri(tracking_uri)}: no answer within {SERVER_DEADLINE_S} s ({reply}); "
            f"start it, or pass another {what}"
        )
    status, body = reply
    if status in CREDENTIALS_WANTED:
        return
    api = None
    if (status, body.strip()) == (200, b"OK"):
        api = http_get(base + "/api/2.0/mlflow/experiments/search?max_results=1", SERVER_DEADLINE_S)
        if isinstance(api, str):
            raise ValueError(
                f"MLflow tracking server {shown_uri(tracking_uri)}: /health answers, but its API gives no answer "
                f"within {SERVER_DEADLINE_S} s ({api}); check the server, or pass another {what}"
            )
        if api[0] in CREDENTIALS_WANTED or (api[0] == 200 and api[1].lstrip().startswith(b"{")):
            return
        status, body = api
    where = "/health" if api is None else "its API (/api/2.0/mlflow/experiments/search)"
    raise ValueError(
        f"MLflow tracking server {shown_uri(tracking_uri)}: a server answers there, but not as MLflow does (GET "
        f"{where}: status {status}, {body.strip()[:40]!r}); check the address, or pass another {what}"
    )
