"""A teacher's traces for SFT distillation (:func:`distill`): ``n`` samples per problem from a local
:class:`~a5core.engines.Engine`, or from a served model through :class:`OpenAICompletionsTeacher` (an
OpenAI-compatible legacy ``/completions`` endpoint, as vLLM and sglang serve), whose transport is
:mod:`a5core.engines.http_post`. The traces are filtered and deduplicated by :mod:`a5core.data.sft_data`.
"""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from http.client import HTTPException
from typing import Any

from pydantic import Field

from a5core.data.files import Problem, Trace
from a5core.data.prompts import PromptTemplate
from a5core.engines import http_post
from a5core.engines.engine import Completion, SamplingSettings, check_prompts
from a5core.runtime.settings import Settings


def distill(
    problems: Sequence[Problem],
    template: PromptTemplate,
    teacher: Any,
    n: int = 1,
    sampling: SamplingSettings | None = None,
) -> list[Trace]:
    """``n`` teacher samples per problem as traces: ``len(problems) * n`` of them, problem-major order.

    ``teacher``: anything with ``generate(prompts, sampling) -> list[list[Completion]]`` (an
    :class:`~a5core.engines.Engine`, an :class:`OpenAICompletionsTeacher`), or such a function
    itself; items may be Completions or plain strings. ``sampling`` (default: ``SamplingSettings()``,
    i.e. temperature 1, 1024 tokens, stop ``</answer>``) is used with its ``n`` replaced by ``n``.
    Every sample is kept, correct or not (filter with :func:`a5core.data.sft_data.filter_correct`); each carries its
    problem's answer as ground truth.
    """
    sampling = replace(sampling or SamplingSettings(), n=n)
    generate = teacher.generate if hasattr(teacher, "generate") else teacher
    if not callable(generate):
        raise TypeError(
            f"teacher must have a generate(prompts, sampling) method or be such a function, got {teacher!r}"
        )
    prompts = [template.format(p.problem) for p in problems]
    groups = generate(prompts, sampling) if prompts else []
    if len(groups) != len(prompts) or any(len(g) != n for g in groups):
        sizes = sorted({len(g) for g in groups})
        raise ValueError(
            f"teacher returned {len(groups)} groups (sizes {sizes}) for {len(prompts)} prompts; "
            f"expected {n} completions each"
        )
    return [
        Trace(prompt, getattr(c, "text", c), problem.answer)
        for problem, prompt, group in zip(problems, prompts, groups, strict=True)
        for c in group
    ]


# The most bytes a teacher's reply may take: a JSON object of ``answers`` completions of at most ``max_tokens``
# tokens each. 64 bytes a token is generous (a token is a few characters; JSON escapes one in at most 6
# bytes); a larger reply is not an answer to the request, and is refused before it fills memory.
REPLY_BYTES_BASE, REPLY_BYTES_PER_ANSWER, REPLY_BYTES_PER_TOKEN = 64 << 10, 4 << 10, 64
# A served teacher must answer (anything) within it before a prompt is sent: one that takes connections and never
# answers is named in seconds, not after a whole request's deadline (timeout_s) at every attempt.
ANSWER_DEADLINE_S = 10.0


class TeacherError(RuntimeError):
    """A teacher server could not be reached, kept failing, or answered something unusable."""


class TeacherSettings(Settings):
    """How to reach a served teacher (:class:`OpenAICompletionsTeacher`): its address, patience and batching."""

    base_url: str = Field("http://127.0.0.1:8000/v1", description="teacher: openai; POSTs {base_url}/completions")
    timeout_s: float = Field(600.0, gt=0, description="teacher: openai; deadline of a whole request, in seconds")
    max_retries: int = Field(4, ge=0, description="teacher: openai; retries of a failed request")
    batch_size: int = Field(16, gt=0, description="prompts per request (openai)")
    concurrency: int = Field(4, gt=0, description="requests in flight (openai)")


_SERVED = TeacherSettings()  # the client's defaults are these settings'


@dataclass
class OpenAICompletionsTeacher:
    """A served model behind an OpenAI-compatible legacy completions API, with an Engine's ``generate``.

    ``generate(prompts, sampling)`` POSTs ``{base_url}/completions`` (``base_url`` like
    ``http://host:8000/v1``) with ``model``, ``prompt`` (a list of ``batch_size`` prompts), ``n``,
    ``temperature``, ``top_p``, ``max_tokens``, ``stop``, ``seed`` and, when > 0, ``min_tokens``
    (a vLLM extension), plus ``extra_body``; ``concurrency`` requests are in flight at once. It
    returns ``len(prompts)`` lists of ``n`` Completions (``token_ids`` empty: the API gives none).

    Sampling settings come from ``sampling``, as for an Engine, so one SamplingSettings drives a local
    or a served teacher alike. ``sampling.logprobs`` is not supported (ValueError).

    Stop strings: servers cut them off the text. Where the server says which one matched (vLLM
    ``stop_reason``, sglang ``matched_stop``) it is put back, so ``text`` ends with it as an Engine's
    does; other servers need ``extra_body={"include_stop_str_in_output": True}`` or an equivalent, or
    their responses lack ``</answer>`` and fail the format check.

    The chat API is not used on purpose: r1_zero is a continuation prompt ending in ``<think>``; a chat
    endpoint would wrap it in a chat template and the reply would not continue the reasoning.

    Failures: HTTP 5xx and 429, refused/reset connections and timeouts (``timeout_s``: the deadline of a
    whole request, connecting and reading included, so a server that trickles its reply is cut off) are
    retried ``max_retries`` times, waiting ``backoff_s``, 2·``backoff_s``, 4·``backoff_s``…; then, or at once
    for any other HTTP error, a malformed reply, a reply larger than its request can need
    (:data:`REPLY_BYTES_PER_TOKEN` bytes a token of ``max_tokens``, and a little more) or a redirect, a
    :class:`TeacherError` naming the URL. A redirect is followed only to the same origin, keeping the
    method (307, 308; :mod:`a5core.engines.http_post`): the credentials never go to another address.

    Credentials: ``api_key`` goes in a Bearer header; a user and password in ``base_url``
    (``http://user:pw@host/v1``) are sent as HTTP Basic authentication instead of in the address.
    Every message and ``repr`` shows the address with the password masked (``http://user:***@host/v1``).
    """

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = _SERVED.timeout_s
    max_retries: int = _SERVED.max_retries
    backoff_s: float = 1.0
    batch_size: int = _SERVED.batch_size
    concurrency: int = _SERVED.concurrency
    extra_body: dict[str, Any] = field(default_factory=dict)
    answered: bool = field(default=False, init=False, repr=False)  # the server has answered once

    @classmethod
    def served(cls, settings: TeacherSettings, model: str, api_key: str | None = None) -> OpenAICompletionsTeacher:
        """The client of the teacher ``settings`` describe, serving ``model``."""
        return cls(model=model, api_key=api_key, **settings.values_of(TeacherSettings))

    def __post_init__(self) -> None:
        if not re.match(r"\Ahttps?://[^/\s]+", self.base_url or ""):
            raise ValueError(
                "teacher base_url must be an http(s) URL like http://127.0.0.1:8000/v1, got "
                f"{masked_url(self.base_url or '')!r}"
            )
        if not self.model:
            raise ValueError("teacher model must name the served model")
        for name in ("batch_size", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError("max_retries and backoff_s must be >= 0 and timeout_s > 0")

    @property
    def url(self) -> str:
        """The completions endpoint, without credentials (they go in a header)."""
        parts = urllib.parse.urlsplit(self.base_url.rstrip("/") + "/completions")
        return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))

    @property
    def shown_url(self) -> str:
        """The endpoint as messages show it: a password in ``base_url`` masked."""
        return masked_url(self.base_url.rstrip("/") + "/completions")

    def __repr__(self) -> str:
        return f"OpenAICompletionsTeacher(base_url={masked_url(self.base_url)!r}, model={self.model!r})"

    def generate(self, prompts: Sequence[str], sampling: SamplingSettings) -> list[list[Completion]]:
        """``len(prompts)`` lists of ``sampling.n`` completions each, in prompt order."""
        prompts = check_prompts(prompts)
        if sampling.logprobs:
            raise ValueError("OpenAICompletionsTeacher does not return token log-probs; use a local Engine for that")
        batches = [prompts[i : i + self.batch_size] for i in range(0, len(prompts), self.batch_size)]
        self._check_answers()
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(batches)))) as pool:
            results = list(pool.map(lambda batch: self._generate_batch(batch, sampling), batches))
        return [group for result in results for group in result]

    def _generate_batch(self, prompts: list[str], sampling: SamplingSettings) -> list[list[Completion]]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompts,
            "n": sampling.n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.min_tokens:
            body["min_tokens"] = sampling.min_tokens
        body.update(self.extra_body)
        reply = self._post(body)
        choices = reply.get("choices") if isinstance(reply, dict) else None
        expected = len(prompts) * sampling.n
        if not isinstance(choices, list) or len(choices) != expected:
            got = len(choices) if isinstance(choices, list) else "no"
            raise TeacherError(
                f"POST {self.shown_url}: expected {expected} choices "
                f"({len(prompts)} prompts × n={sampling.n}), got {got}"
            )
        try:
            choices = sorted(choices, key=lambda c: c["index"])
            if [c["index"] for c in choices] != list(range(expected)) or not all(
                isinstance(c["text"], str) for c in choices
            ):
                raise ValueError("indices or texts")
        except (KeyError, TypeError, ValueError):
            raise TeacherError(
                f"POST {self.shown_url}: choices must carry text and indices 0..{expected - 1}"
            ) from None
        completions = [self._completion(c, sampling.stop) for c in choices]
        return [completions[i : i + sampling.n] for i in range(0, expected, sampling.n)]

    @staticmethod
    def _completion(choice: dict[str, Any], stops: Sequence[str]) -> Completion:
        text, reason = choice["text"], choice.get("finish_reason") or "stop"
        matched = next((m for m in (choice.get("stop_reason"), choice.get("matched_stop")) if isinstance(m, str)), None)
        if reason == "stop" and matched in stops and not text.endswith(matched):
            text += matched
        return Completion(text=text, token_ids=(), finish_reason=reason)

    def _json(self, body: bytes) -> Any:
        """A reply's JSON; TeacherError for one that is not JSON or nests too deeply to read ([[[[...)."""
        try:
            return json.loads(body)
        except ValueError:
            raise TeacherError(f"POST {self.shown_url}: reply is not JSON: {body[:200]!r}") from None
        except RecursionError:
            raise TeacherError(f"POST {self.shown_url}: reply is JSON nested too deeply to read") from None

    def _headers(self) -> dict[str, str]:
        """The requests' headers: JSON, and the credentials (the API key, else the URL's user and password)."""
        headers = {"Content-Type": "application/json"}
        user_info = urllib.parse.urlsplit(self.base_url).netloc.rpartition("@")[0]
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        elif user_info:
            credentials = urllib.parse.unquote(user_info).encode()
            headers["Authorization"] = "Basic " + base64.b64encode(credentials).decode()
        return headers

    def _check_answers(self) -> None:
        """Once: a GET of ``{base_url}/models`` must get an answer, whatever its status, within
        :data:`ANSWER_DEADLINE_S` seconds, else TeacherError naming it (a hung server). A connection that fails
        is the requests' to retry and name."""
        if self.answered:
            return
        models = self.url.removesuffix("/completions") + "/models"
        try:
            http_post.answers(models, self._headers(), ANSWER_DEADLINE_S)
        except TimeoutError:
            raise TeacherError(
                f"GET {self.shown_url.removesuffix('/completions')}/models: no answer within {ANSWER_DEADLINE_S:g} s; "
                "the teacher server takes connections but does not answer: restart it, or fix base_url"
            ) from None
        except (OSError, HTTPException):
            return
        self.answered = True

    def _post(self, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        answers = len(body["prompt"]) * body["n"]
        max_bytes = REPLY_BYTES_BASE + answers * (REPLY_BYTES_PER_ANSWER + REPLY_BYTES_PER_TOKEN * body["max_tokens"])
        headers = self._headers()
        failure = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                reply = http_post.post(self.url, data, headers, self.timeout_s, max_bytes)
            except http_post.ReplyTooLarge as e:
                raise TeacherError(
                    f"POST {self.shown_url}: {e} for {answers} completion(s) of at most {body['max_tokens']} tokens; "
                    "refused (is base_url an OpenAI-compatible completions server?)"
                ) from None
            except http_post.RedirectRefused as e:
                raise TeacherError(f"POST {self.shown_url}: {e}") from None
            except TimeoutError:
                failure = f"timed out after {self.timeout_s:g} s (the deadline of a whole request)"
                continue
            except (HTTPException, OSError) as e:
                failure = f"connection failed ({type(e).__name__}: {e})"
                continue
            if reply.status >= 400:
                detail = reply.body[:500].decode("utf-8", "replace").strip()
                failure = f"HTTP {reply.status} {reply.reason}: {detail}"
                if reply.status < 500 and reply.status != 429:
                    raise TeacherError(f"POST {self.shown_url}: {failure}")
                continue
            return self._json(reply.body)
        raise TeacherError(f"POST {self.shown_url} failed after {self.max_retries + 1} attempt(s): {failure}")


def masked_url(url: str) -> str:
    """``url`` with the password of its user info replaced by ``***`` (``http://u:***@host/v1``)."""
    parts = urllib.parse.urlsplit(url)
    user, at, host = parts.netloc.rpartition("@")
    if not at or ":" not in user:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}"))
