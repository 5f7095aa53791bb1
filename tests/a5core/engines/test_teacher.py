"""The served teacher (a5core.engines.teacher): distillation through a real engine and a plain function, the
OpenAI-compatible client's requests, parsed replies, retries, deadlines and refusals."""

import json
import socket
import threading
import time

import pytest
from fake_teachers import FakeServer, RawServer, send

from a5core.data.files import Problem, load_math
from a5core.data.prompts import load_prompt
from a5core.engines import Completion, SamplingSettings, make_engine
from a5core.engines.teacher import OpenAICompletionsTeacher, TeacherError, distill
from a5core.grading.grader import r1_zero_reward_fn

R1 = load_prompt("r1_zero")


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def test_distill_through_a_real_engine(tiny_lm_dir, shared_data):
    engine = make_engine(str(tiny_lm_dir), "hf")
    problems = load_math(shared_data / "math" / "train.jsonl")[:3]
    sampling = SamplingSettings(n=5, temperature=1.0, max_tokens=24, seed=0)
    traces = distill(problems, R1, engine, n=2, sampling=sampling)
    assert len(traces) == 6
    assert [t.ground_truth for t in traces] == [p.answer for p in problems for _ in range(2)]
    assert [t.prompt for t in traces] == [R1.format(p.problem) for p in problems for _ in range(2)]
    direct = engine.generate([R1.format(p.problem) for p in problems], SamplingSettings(n=2, max_tokens=24, seed=0))
    assert [t.response for t in traces] == [c.text for group in direct for c in group]
    assert all(t.response for t in traces)
    # a plain function returning strings works too; a wrong number of samples is an error
    assert distill(problems[:1], R1, lambda prompts, s: [["x"] * s.n for _ in prompts], n=3)[2].response == "x"
    with pytest.raises(ValueError, match="expected 2 completions each"):
        distill(problems, R1, lambda prompts, s: [["x"]] * len(prompts), n=2)


def test_openai_teacher_request_and_parsed_traces(server):
    teacher = OpenAICompletionsTeacher(server.base_url, "teacher-7b", api_key="k3y", batch_size=2, backoff_s=0)
    problems = [Problem(f"p{i}", f"What is {i}+{i}?", str(2 * i)) for i in range(3)]
    sampling = SamplingSettings(temperature=0.7, top_p=0.9, max_tokens=321, stop=("</answer>",), seed=5)
    traces = distill(problems, R1, teacher, n=2, sampling=sampling)
    assert len(server.requests) == 2  # 3 prompts in batches of 2, sent concurrently
    first = next(r for r in server.requests if len(r["body"]["prompt"]) == 2)
    assert first["path"] == "/v1/completions" and first["headers"]["Authorization"] == "Bearer k3y"
    assert first["body"] == {
        "model": "teacher-7b",
        "prompt": [R1.format(p.problem) for p in problems[:2]],
        "n": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 321,
        "stop": ["</answer>"],
        "seed": 5,
    }
    # grouped by prompt in sample order despite the shuffled choices; the cut stop string is put back
    tail = [R1.format(p.problem)[-12:] for p in problems]
    assert [t.response for t in traces] == [
        f" {tail[i]} #{j} </think> <answer> 4 </answer>" for i in range(3) for j in range(2)
    ]
    assert [t.ground_truth for t in traces] == ["0", "0", "2", "2", "4", "4"]
    assert [
        r["reward"] for r in r1_zero_reward_fn.batch([t.response for t in traces], [t.ground_truth for t in traces])
    ] == [0, 0, 0, 0, 1, 1]


def test_openai_teacher_completion_fields(server):
    server.script = [
        (
            200,
            {
                "choices": [
                    {
                        "index": 0,
                        "text": " a </answer>",
                        "finish_reason": "stop",
                        "stop_reason": "</answer>",
                    },  # stop string kept by the server
                    {"index": 1, "text": " b", "finish_reason": "stop", "matched_stop": "</answer>"},  # sglang's field
                    {
                        "index": 2,
                        "text": " c",
                        "finish_reason": "stop",
                        "stop_reason": None,
                    },  # EOS: nothing to put back
                    {"index": 3, "text": " d", "finish_reason": "length"},
                ]
            },
        )
    ]
    groups = OpenAICompletionsTeacher(server.base_url, "m").generate(["p"], SamplingSettings(n=4))
    assert groups == [
        [
            Completion(" a </answer>", (), "stop"),
            Completion(" b</answer>", (), "stop"),
            Completion(" c", (), "stop"),
            Completion(" d", (), "length"),
        ]
    ]
    assert "Authorization" not in server.requests[0]["headers"] and "seed" not in server.requests[0]["body"]


def test_openai_teacher_retries_a_500_then_succeeds(server):
    server.script = [(500, {"error": "overloaded"}), (503, "busy")]
    teacher = OpenAICompletionsTeacher(server.base_url, "m", backoff_s=0.01)
    groups = teacher.generate(["p1", "p2"], SamplingSettings(n=1))
    assert len(server.requests) == 3 and [g[0].text for g in groups] == [
        " p1 #0 </think> <answer> 4 </answer>",
        " p2 #0 </think> <answer> 4 </answer>",
    ]
    server.script = [(500, "down")] * 3
    with pytest.raises(
        TeacherError, match=r"POST http://127\.0\.0\.1:\d+/v1/completions failed after 3 attempt\(s\): HTTP 500 .*down"
    ):
        OpenAICompletionsTeacher(server.base_url, "m", max_retries=2, backoff_s=0).generate(["p"], SamplingSettings())


def test_openai_teacher_client_errors_fail_at_once_with_the_url(server):
    server.script = [(400, {"error": {"message": "max_tokens is too large"}})]
    with pytest.raises(TeacherError, match=r"/v1/completions: HTTP 400 .*max_tokens is too large"):
        OpenAICompletionsTeacher(server.base_url, "m", backoff_s=0).generate(["p"], SamplingSettings())
    assert len(server.requests) == 1
    server.script = [(200, "<html>not json</html>"), (200, {"choices": [{"index": 0, "text": "x"}]})]
    teacher = OpenAICompletionsTeacher(server.base_url, "m", backoff_s=0)
    with pytest.raises(TeacherError, match="reply is not JSON"):
        teacher.generate(["p"], SamplingSettings())
    with pytest.raises(TeacherError, match=r"expected 2 choices \(1 prompts × n=2\), got 1"):
        teacher.generate(["p"], SamplingSettings(n=2))
    with pytest.raises(ValueError, match="log-probs"):
        teacher.generate(["p"], SamplingSettings(logprobs=True))


def test_openai_teacher_unreachable_or_slow_server(server):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = OpenAICompletionsTeacher(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff_s=0.01)
    with pytest.raises(
        TeacherError,
        match=rf"POST http://127\.0\.0\.1:{port}/v1/completions failed after 2 attempt\(s\): connection failed",
    ):
        dead.generate(["p"], SamplingSettings())
    server.delay_s = 1.0
    slow = OpenAICompletionsTeacher(server.base_url, "m", timeout_s=0.2, max_retries=0)
    with pytest.raises(TeacherError, match=r"/v1/completions failed after 1 attempt\(s\): timed out after 0\.2 s"):
        slow.generate(["p"], SamplingSettings())
    for url in ("not-a-url", "ftp://host/v1", ""):
        with pytest.raises(ValueError, match="base_url must be an http"):
            OpenAICompletionsTeacher(url, "m")


def test_a_trickling_teacher_is_cut_off_at_the_requests_deadline():
    """A reply announced as 600 bytes and sent a byte every 0.2 s (two minutes in all) against a 1 s deadline:
    the request is cut off at its deadline, though every byte came well within it."""

    def trickle(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", "600")
        handler.end_headers()
        for _ in range(600):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.2)

    slow = RawServer(trickle)
    failures = []
    teacher = OpenAICompletionsTeacher(f"{slow.url}/v1", "m", timeout_s=1.0, max_retries=0)

    def request():
        try:
            teacher.generate(["p"], SamplingSettings())
        except TeacherError as error:
            failures.append(str(error))

    try:
        asking = threading.Thread(target=request, daemon=True)
        asking.start()
        asking.join(timeout=60)  # a guard against the two minutes, not a timing assertion
        assert not asking.is_alive(), "the request outlived its deadline"
        (failure,) = failures
        assert failure.endswith("failed after 1 attempt(s): timed out after 1 s (the deadline of a whole request)")
    finally:
        slow.close()


@pytest.mark.parametrize("announced", [True, False])
def test_a_reply_far_larger_than_max_tokens_allows_is_refused(announced):
    """2 MB for one completion of at most 16 tokens, with or without a Content-Length: refused, named."""
    big = json.dumps({"choices": [{"index": 0, "text": "y" * 2_000_000}]}).encode()
    flood = RawServer(lambda handler: send(handler, big, length=announced))
    try:
        teacher = OpenAICompletionsTeacher(f"{flood.url}/v1", "m", max_retries=0)
        with pytest.raises(TeacherError, match=r"/v1/completions: reply .*bytes.* of at most 16 tokens; refused"):
            teacher.generate(["p"], SamplingSettings(max_tokens=16))
    finally:
        flood.close()
