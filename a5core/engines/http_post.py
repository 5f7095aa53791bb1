"""One HTTP POST that cannot hang, flood memory or carry credentials elsewhere: the served teacher's transport.

:func:`post` sends a body and reads the whole reply within one deadline (connecting, sending, waiting and
reading together: a server that trickles a byte at a time is cut off when the deadline passes, not kept
alive by each byte), reads at most ``max_bytes`` of reply, and follows a redirect only to the same origin
(scheme, host and port) and only one that keeps the method (307, 308): the request's credentials
(an ``Authorization`` header) never go to another address. Proxies from the environment are not used.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPConnection, HTTPException, HTTPSConnection

MAX_REDIRECTS = 3


class ReplyTooLarge(ValueError):
    """The reply would exceed the bytes allowed for it."""


class RedirectRefused(ValueError):
    """The server redirected elsewhere (another origin, or a redirect that would drop the body)."""


@dataclass(frozen=True)
class Reply:
    status: int
    reason: str
    body: bytes


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL, the port made explicit."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


def post(url: str, data: bytes, headers: dict[str, str], deadline_s: float, max_bytes: int) -> Reply:
    """POST ``data`` to ``url`` and return the reply, whatever its status.

    TimeoutError once ``deadline_s`` seconds have passed since the call (redirects included);
    :class:`ReplyTooLarge` for a reply over ``max_bytes`` (announced or read); :class:`RedirectRefused`
    for a redirect to another origin or one that is not 307/308 (the message names where it pointed,
    without its user info); OSError or HTTPException for a connection that fails.
    """
    deadline = time.monotonic() + deadline_s
    for _ in range(MAX_REDIRECTS + 1):
        reply, location = _post_once(url, data, headers, deadline, deadline_s, max_bytes)
        if location is None:
            return reply
        target = urllib.parse.urljoin(url, location)
        if origin(target) != origin(url) or reply.status not in (307, 308):
            shown = urllib.parse.urlsplit(target)
            shown = shown._replace(netloc=shown.netloc.rpartition("@")[2]).geturl()
            raise RedirectRefused(
                f"redirected ({reply.status}) to {shown}; not followed (the credentials stay with the "
                "address given): point the address at the server itself"
            )
        url = target
    raise RedirectRefused(f"more than {MAX_REDIRECTS} redirects")


def answers(url: str, headers: dict[str, str], deadline_s: float) -> int:
    """The status a GET of ``url`` gets within ``deadline_s`` seconds (the status line and headers read, the
    body not; a redirect not followed): TimeoutError past the deadline, however the server trickles; OSError
    or HTTPException for a connection that fails."""
    parts = urllib.parse.urlsplit(url)
    connection_type = HTTPSConnection if parts.scheme == "https" else HTTPConnection
    connection = connection_type(parts.hostname, parts.port, timeout=deadline_s)
    deadline = time.monotonic() + deadline_s
    try:
        connection.connect()
        with _deadline(connection, deadline, deadline_s):
            path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
            connection.request("GET", path, headers=headers)
            return connection.getresponse().status
    finally:
        connection.close()


@contextlib.contextmanager
def _deadline(connection: HTTPConnection, deadline: float, deadline_s: float) -> Iterator[threading.Event]:
    """Around a request on the connected ``connection``: at ``deadline`` (``time.monotonic``) its socket is shut,
    which unblocks whatever read or write waits on it, and a connection error after that is a TimeoutError
    naming ``deadline_s``. Yields the event set once the deadline has passed."""
    sock, expired = connection.sock, threading.Event()  # the response reads it after the connection lets go

    def expire() -> None:
        expired.set()
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    timer = threading.Timer(max(deadline - time.monotonic(), 0), expire)
    timer.daemon = True
    timer.start()
    try:
        yield expired
    except (OSError, HTTPException):
        if expired.is_set():
            raise TimeoutError(f"timed out after {deadline_s:g} s") from None
        raise
    finally:
        timer.cancel()


def _post_once(
    url: str, data: bytes, headers: dict[str, str], deadline: float, deadline_s: float, max_bytes: int
) -> tuple[Reply, str | None]:
    """One request: the reply, and where a 3xx reply points (None otherwise)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"timed out after {deadline_s:g} s")
    parts = urllib.parse.urlsplit(url)
    connection_type = HTTPSConnection if parts.scheme == "https" else HTTPConnection
    connection = connection_type(parts.hostname, parts.port, timeout=remaining)
    connection.connect()  # within the remaining time (the socket's timeout)
    try:
        with _deadline(connection, deadline, deadline_s) as expired:
            path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
            connection.request("POST", path, body=data, headers=headers)
            response = connection.getresponse()
            announced = response.getheader("Content-Length")
            if announced is not None and announced.isdigit() and int(announced) > max_bytes:
                raise ReplyTooLarge(f"reply of {int(announced):,} bytes, over the {max_bytes:,} allowed")
            chunks, size = [], 0
            while chunk := response.read1(1 << 16):
                size += len(chunk)
                if size > max_bytes:
                    raise ReplyTooLarge(f"reply over the {max_bytes:,} bytes allowed")
                chunks.append(chunk)
            if expired.is_set():  # the socket shut at the deadline reads as the end of the reply
                raise TimeoutError(f"timed out after {deadline_s:g} s")
            location = response.getheader("Location") if 300 <= response.status < 400 else None
            return Reply(response.status, response.reason, b"".join(chunks)), location
    finally:
        connection.close()
