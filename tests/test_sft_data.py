"""SFT trace sets: MATH solutions, imported and distilled traces, dedup + filter, the CLI and the DVC stages."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from a5core.data.files import DataError, Problem, Trace, load_math, load_sft_traces
from a5core.data.prompts import load_prompt
from a5core.data.sft_data import dedup_traces, filter_correct, import_traces, math_solution_traces, r1_zero_response
from a5core.engines import Completion, SamplingSettings, make_engine
from a5core.engines.teacher import OpenAICompletionsTeacher, TeacherError, distill
from a5core.grading.grader import extract_r1_zero_answer, r1_zero_reward_fn
from flows import sft_data as flow

ROOT = Path(__file__).resolve().parents[1]
R1 = load_prompt("r1_zero")
EMPTY_BOX_IDS = ["train/number_theory/7115.json", "train/number_theory/7117.json"]


@pytest.fixture(scope="module")
def teacher_file(shared_data) -> Path:
    return shared_data / "sft" / "teacher_traces_sample.jsonl"


@pytest.fixture(scope="module")
def math_train(shared_data) -> list[Problem]:
    return load_math(shared_data / "math" / "train.jsonl")


# ------------------------------------------------------------------------------ MATH solutions


def test_every_math_train_solution_becomes_a_trace_that_grades_one(math_train):
    traces, skipped = math_solution_traces(math_train, R1)
    assert len(math_train) == 7500 and skipped == EMPTY_BOX_IDS and len(traces) == 7498
    kept = [p for p in math_train if p.unique_id not in skipped]
    for problem, trace in zip(kept, traces, strict=True):
        assert trace.prompt == R1.format(problem.problem) and trace.prompt.endswith("Assistant: <think>")
        assert trace.response.startswith(" " + problem.solution.strip() + " </think> <answer> ")
        assert (
            trace.response.endswith(f" <answer> {problem.answer.strip()} </answer>")
            and trace.ground_truth == problem.answer
        )
    rewards = r1_zero_reward_fn.batch([t.response for t in traces], [t.ground_truth for t in traces])
    assert all(r == {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0} for r in rewards)


def test_the_response_convention_matches_the_teacher_traces(teacher_file):
    teacher = load_sft_traces(teacher_file)
    accepted = [
        t
        for t, r in zip(
            teacher,
            r1_zero_reward_fn.batch([t.response for t in teacher], [t.ground_truth for t in teacher]),
            strict=True,
        )
        if r["format_reward"]
    ]
    # The teacher's graded responses continue "<think>" with a space and end with "</answer>", as ours do.
    assert sum(t.response.startswith(" ") for t in accepted) / len(accepted) > 0.95
    assert all(t.response.endswith("</answer>") for t in accepted)
    assert r1_zero_response("  x = 2.\n", " 2 ") == " x = 2. </think> <answer> 2 </answer>"


def test_solutions_without_a_usable_box_are_skipped_and_named():
    problems = [
        Problem(str(i), f"q{i}", "", solution)
        for i, solution in enumerate(
            [
                "no box at all",
                "empty \\boxed{}",
                "blank \\boxed{ }",
                "unclosed \\boxed{3",
                "so \\boxed 5.",
                "\\fbox{7}",
                "\\boxed{1} then \\boxed{\\frac{1}{2}}",
            ]
        )
    ]
    traces, skipped = math_solution_traces(problems, R1)
    assert skipped == ["0", "1", "2", "3"]
    assert [t.response.split("<answer> ")[1] for t in traces] == [
        "5. </answer>",
        "7 </answer>",
        "\\frac{1}{2} </answer>",
    ]


# ----------------------------------------------------------------------- imported traces, filter


def test_filter_keeps_exactly_the_teacher_traces_the_grader_accepts(teacher_file):
    traces = import_traces(teacher_file)
    kept, stats = filter_correct(traces)
    rewards = r1_zero_reward_fn.batch([t.response for t in traces], [t.ground_truth for t in traces])
    assert kept == [t for t, r in zip(traces, rewards, strict=True) if r["reward"] == 1.0]
    formatted = sum(r["format_reward"] for r in rewards)
    assert len(traces) == 1767 and formatted == 1439  # 328 write "\n</think>\n<answer>", which r1_zero rejects
    assert stats == {"raw": 1767, "filtered": len(kept), "kept_fraction": len(kept) / 1767, "format_rate": 1439 / 1767}
    assert 0.75 < stats["kept_fraction"] < 0.85
    # a wrong answer and a badly formatted right one are both dropped
    wrong = next(t for t in traces if t.ground_truth == "57" and extract_r1_zero_answer(t.response)[1] == "60")
    newline = next(t for t in traces if "\n</think>\n<answer>" in t.response)
    assert wrong not in kept and newline not in kept
    assert filter_correct([]) == ([], {"raw": 0, "filtered": 0, "kept_fraction": None, "format_rate": None})


def test_import_can_rerender_prompts_with_the_project_template(teacher_file, math_train, tmp_path):
    raw, traces = import_traces(teacher_file), import_traces(teacher_file, R1)
    assert "</answer>.\n\nUser: " in raw[0].prompt  # the sample's own prompt differs from r1_zero.prompt
    questions = {p.problem for p in math_train}
    for before, after in zip(raw, traces, strict=True):
        assert after.response == before.response and after.ground_truth == before.ground_truth
        question = after.prompt[len(R1.text.split("{question}")[0]) : -len("\nAssistant: <think>")]
        assert after.prompt == R1.format(question) and question in questions
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": raw[0].prompt, "response": " a", "ground_truth": "1"})
        + "\n"
        + json.dumps({"prompt": "Q: 1+1?", "response": " a", "ground_truth": "2"})
        + "\n"
    )
    with pytest.raises(DataError, match=r"bad\.jsonl: record 2: prompt is not r1_zero-style"):
        import_traces(bad, R1)
    bad.write_text(json.dumps({"prompt": "p", "response": " a"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: missing key\(s\) 'ground_truth'"):
        import_traces(bad)


def test_dedup_drops_exact_repeats_in_order():
    a, b, c = Trace("p", " r1", "1"), Trace("p", " r2", "1"), Trace("q", " r1", "1")
    assert dedup_traces([a, b, a, c, b, Trace("p", " r1", "1")]) == ([a, b, c], 3)
    assert dedup_traces([Trace("p", " r1", "1"), Trace("p", " r1", "2")])[1] == 0  # a different truth is another trace


# ------------------------------------------------------------------------------------ distill


def test_distill_through_a_real_engine(tiny_lm_dir, math_train):
    engine = make_engine(str(tiny_lm_dir), "hf")
    problems = math_train[:3]
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


class FakeServer:
    """A canned OpenAI-compatible completions server on 127.0.0.1 (one thread per request)."""

    def __init__(self):
        self.requests: list[dict] = []  # {"path", "headers", "body"}
        self.script: list[tuple[int, object]] = []  # (status, reply) served in order, then echo replies
        self.delay_s = 0.0
        self.answer = "4"  # what echo replies answer
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                time.sleep(server.delay_s)
                status, reply = server.script.pop(0) if server.script else (200, server.echo(body))
                data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def echo(self, body):
        """Choices in reverse index order; text names prompt and sample; vLLM's stop_reason set, stop string cut."""
        prompts, n = body["prompt"], body["n"]
        choices = [
            {
                "index": i * n + j,
                "text": f" {p[-12:]} #{j} </think> <answer> {self.answer} ",
                "finish_reason": "stop",
                "stop_reason": "</answer>",
            }
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        return {"object": "text_completion", "choices": choices[::-1]}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


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


def test_credentials_in_the_teacher_url_go_in_a_header_and_never_into_a_message(server, tmp_path, shared_data):
    """http://user:pw@host/v1: sent as Basic authentication, masked in every error, repr and CLI message."""
    import base64

    address = server.base_url.replace("http://", "http://alice:s3cr%3At@")
    server.script = [(400, {"error": "bad request"})]
    teacher = OpenAICompletionsTeacher(address, "m", backoff_s=0)
    with pytest.raises(TeacherError) as failed:
        teacher.generate(["p"], SamplingSettings())
    assert "s3cr" not in str(failed.value) and "alice:***@127.0.0.1" in str(failed.value)
    assert "s3cr" not in repr(teacher)
    assert server.requests[0]["headers"]["Authorization"] == "Basic " + base64.b64encode(b"alice:s3cr:t").decode()
    with pytest.raises(ValueError) as refused:
        OpenAICompletionsTeacher("ftp://alice:s3cret@host/v1", "m")
    assert "s3cret" not in str(refused.value)
    with socket.socket() as s:  # the command line, against a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://alice:s3cret@127.0.0.1:{s.getsockname()[1]}/v1"
    config = _config(
        tmp_path,
        shared_data,
        distill={
            "enabled": True,
            "base_url": dead,
            "model": "m",
            "max_retries": 0,
            "problems": str(shared_data / "math/train.jsonl"),
            "limit": 1,
        },
    )
    with pytest.raises(SystemExit) as stopped:
        flow.main(["distill", "--config", str(config), "--out", str(tmp_path / "d.jsonl")])
    assert "connection failed" in str(stopped.value.code) and "s3cret" not in str(stopped.value.code)


class RawServer:
    """A server on 127.0.0.1 whose ``reply(handler)`` writes each response by hand; records every request's
    method, path and headers (GETs too: a redirected POST may arrive as one)."""

    def __init__(self, reply):
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers)})
                try:
                    reply(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_GET = do_POST

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _redirect(status: int, location: str):
    def reply(handler):
        handler.send_response(status)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return reply


def _send(handler, data: bytes, length: bool = True):
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    if length:
        handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def test_credentials_never_follow_a_redirect_to_another_port(server, tmp_path, shared_data):
    """A 302 or 307 to another origin is refused, named, and the other server gets nothing: neither the
    API key through the command line nor a URL's user and password; a 307 on the same origin is followed."""
    elsewhere = RawServer(lambda handler: _send(handler, b"{}"))
    redirects = []
    try:
        for status in (302, 307):
            redirecting = RawServer(_redirect(status, f"{elsewhere.url}/v1/completions"))
            redirects.append(redirecting)
            config = _config(
                tmp_path,
                shared_data,
                distill={
                    "enabled": True,
                    "base_url": f"{redirecting.url}/v1",
                    "api_key_env": "A5_TEST_TEACHER_KEY",
                    "model": "m",
                    "problems": str(shared_data / "math/train.jsonl"),
                    "limit": 1,
                },
            )
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("A5_TEST_TEACHER_KEY", "sk-s3cret")
                with pytest.raises(SystemExit) as stopped:
                    flow.main(["distill", "--config", str(config), "--out", str(tmp_path / "d.jsonl")])
            assert f"redirected ({status}) to {elsewhere.url}/v1/completions; not followed" in stopped.value.code
            assert redirecting.requests[0]["headers"]["Authorization"] == "Bearer sk-s3cret"
        basic = OpenAICompletionsTeacher(redirects[1].url.replace("http://", "http://alice:pw@") + "/v1", "m")
        with pytest.raises(TeacherError, match="not followed"):
            basic.generate(["p"], SamplingSettings())
        assert elsewhere.requests == []

        def moved_on_the_same_origin(handler):
            if handler.path == "/v1/completions":
                _redirect(307, "/v2/completions")(handler)
            else:
                _send(handler, json.dumps({"choices": [{"index": 0, "text": " ok"}]}).encode())

        same_origin = RawServer(moved_on_the_same_origin)
        redirects.append(same_origin)
        teacher = OpenAICompletionsTeacher(f"{same_origin.url}/v1", "m", api_key="k")
        assert teacher.generate(["p"], SamplingSettings())[0][0].text == " ok"
        assert [(r["path"], r["headers"]["Authorization"]) for r in same_origin.requests] == [
            ("/v1/models", "Bearer k"),  # the teacher answers at all (within seconds)
            ("/v1/completions", "Bearer k"),
            ("/v2/completions", "Bearer k"),
        ]
    finally:
        for s in (elsewhere, *redirects):
            s.close()


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
    flood = RawServer(lambda handler: _send(handler, big, length=announced))
    try:
        teacher = OpenAICompletionsTeacher(f"{flood.url}/v1", "m", max_retries=0)
        with pytest.raises(TeacherError, match=r"/v1/completions: reply .*bytes.* of at most 16 tokens; refused"):
            teacher.generate(["p"], SamplingSettings(max_tokens=16))
    finally:
        flood.close()


# --------------------------------------------------------------------------------------- CLI


def _config(tmp_path, shared_data, **sft) -> Path:
    section = {
        "math": str(shared_data / "math/train.jsonl"),
        "traces": str(shared_data / "sft/teacher_traces_sample.jsonl"),
        **sft,
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"profile": "a5", "sft_data": section}))
    return path


def test_cli_writes_every_set_and_the_metrics(tmp_path, shared_data, server, capsys):
    config = _config(
        tmp_path,
        shared_data,
        distill={
            "enabled": True,
            "base_url": server.base_url,
            "model": "m",
            "problems": str(shared_data / "math/train.jsonl"),
            "limit": 3,
            "n": 2,
        },
    )
    server.answer = "36"  # the third problem's answer
    out = tmp_path / "sft"
    sets = {"math_solutions": out / "m.jsonl", "teacher": out / "t.jsonl", "distilled": out / "d.jsonl"}
    flow.main(["math", "--config", str(config), "--out", str(sets["math_solutions"])])
    assert "7498 traces" in capsys.readouterr().out
    flow.main(["traces", "--config", str(config), "--out", str(sets["teacher"])])
    flow.main(["distill", "--config", str(config), "--out", str(sets["distilled"])])
    assert server.requests[0]["body"]["n"] == 2 and len(server.requests[0]["body"]["prompt"]) == 3
    metrics_path = tmp_path / "metrics" / "sft_data.json"
    flow.main(
        [
            "filter",
            "--config",
            str(config),
            "--out-dir",
            str(out),
            "--metrics",
            str(metrics_path),
            *[f"--set={k}={v}" for k, v in sets.items()],
        ]
    )
    metrics = json.loads((out / "sizes.json").read_text())
    assert json.loads(metrics_path.read_text()) == {"traces": sum(m["filtered"] for m in metrics.values())}
    assert metrics["math_solutions"] == {
        "raw": 7498,
        "duplicates": 0,
        "filtered": 7498,
        "kept_fraction": 1.0,
        "format_rate": 1.0,
    }
    teacher = metrics["teacher"]
    assert teacher["raw"] == 1767 and teacher["duplicates"] == 57 and teacher["format_rate"] > 0.8
    assert (
        teacher["filtered"] == len(load_sft_traces(out / "teacher_filtered.jsonl"))
        and 0.7 < teacher["kept_fraction"] < 0.85
    )
    # right for the third problem's two samples only
    assert metrics["distilled"] == {
        "raw": 6,
        "duplicates": 0,
        "filtered": 2,
        "kept_fraction": 2 / 6,
        "format_rate": 1.0,
    }
    assert {p.name for p in out.iterdir()} == {
        "m.jsonl",
        "t.jsonl",
        "d.jsonl",
        "math_solutions_filtered.jsonl",
        "teacher_filtered.jsonl",
        "distilled_filtered.jsonl",
        "sizes.json",
    }  # no temporaries left
    teacher_raw = load_sft_traces(sets["teacher"])
    assert teacher_raw[0].prompt == R1.format(
        teacher_raw[0].prompt.split("\nUser: ", 1)[1][: -len("\nAssistant: <think>")]
    )


def test_cli_distill_disabled_writes_an_empty_set(tmp_path, shared_data):
    config = _config(tmp_path, shared_data)  # distill.enabled defaults to false
    raw, out = tmp_path / "d.jsonl", tmp_path / "out"
    flow.main(["distill", "--config", str(config), "--out", str(raw)])
    assert raw.read_text() == ""
    metrics = flow.write_filtered({"distilled": raw}, out, None)
    assert metrics == {
        "distilled": {"raw": 0, "duplicates": 0, "filtered": 0, "kept_fraction": None, "format_rate": None}
    }
    assert (out / "distilled_filtered.jsonl").read_text() == ""


def test_cli_distill_with_a_local_engine(tmp_path, shared_data, tiny_lm_dir):
    config = _config(
        tmp_path,
        shared_data,
        distill={
            "enabled": True,
            "teacher": "engine",
            "model": str(tiny_lm_dir),
            "backend": "hf",
            "problems": str(shared_data / "math/train.jsonl"),
            "limit": 2,
            "n": 2,
            "max_tokens": 8,
        },
    )
    flow.main(["distill", "--config", str(config), "--out", str(tmp_path / "d.jsonl")])
    traces = load_sft_traces(tmp_path / "d.jsonl")
    assert len(traces) == 4 and [t.ground_truth for t in traces] == [
        p.answer for p in load_math(shared_data / "math/train.jsonl")[:2] for _ in range(2)
    ]


def test_cli_bad_input_keeps_the_previous_output_and_names_the_problem(tmp_path, shared_data):
    out = tmp_path / "t.jsonl"
    out.write_text("previous\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"prompt": "p", "response": "r", "ground_truth": "1"}) + "\n{oops\n")
    config = _config(tmp_path, shared_data, traces=str(broken), reprompt_traces=False)
    with pytest.raises(SystemExit, match=r"sft_data traces: .*broken\.jsonl:2: malformed JSON"):
        flow.main(["traces", "--config", str(config), "--out", str(out)])
    assert out.read_text() == "previous\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "broken.jsonl",
        "params.yaml",
        "t.jsonl",
    ]
    config.write_text(yaml.safe_dump({"sft_data": {"distill": {"enabeld": True}}}))
    with pytest.raises(SystemExit, match=r"(?s)invalid `sft_data`.*distill.enabeld"):
        flow.main(["distill", "--config", str(config), "--out", str(out)])
    config.write_text(
        yaml.safe_dump(
            {
                "sft_data": {
                    "distill": {
                        "enabled": True,
                        "api_key_env": "A5_TEST_UNSET_KEY",
                        "problems": str(shared_data / "math/train.jsonl"),
                    }
                }
            }
        )
    )
    with pytest.raises(SystemExit, match="environment variable A5_TEST_UNSET_KEY is not set"):
        flow.main(["distill", "--config", str(config), "--out", str(out)])


def test_profile_overrides_merge_into_nested_distill_settings(tmp_path):
    config = tmp_path / "params.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "profile": "cpu",
                "sft_data": {"dedup": False, "distill": {"n": 8, "max_tokens": 500}},
                "profiles": {"cpu": {"sft_data": {"distill": {"enabled": True, "max_tokens": 64}}}},
            }
        )
    )
    params = flow.load_params(config)
    assert (params.dedup, params.distill.enabled, params.distill.n, params.distill.max_tokens) == (False, True, 8, 64)
    real = flow.load_params(ROOT / "params.yaml")  # the project's own params validate
    assert real.distill.enabled is (yaml.safe_load((ROOT / "params.yaml").read_text())["profile"] == "cpu")


def test_a_teacher_reply_nested_too_deeply_ends_in_one_line(tmp_path, shared_data, server):
    """A reply of JSON nested thousands deep (Python's reader recurses into it): one line naming the teacher,
    not a RecursionError's traceback."""
    server.script = [(200, "[" * 20_000 + "]" * 20_000)]
    config = _config(
        tmp_path,
        shared_data,
        distill={
            "enabled": True,
            "base_url": server.base_url,
            "model": "m",
            "max_retries": 0,
            "problems": str(shared_data / "math/train.jsonl"),
            "limit": 1,
        },
    )
    with pytest.raises(SystemExit) as stopped:
        flow.main(["distill", "--config", str(config), "--out", str(tmp_path / "d.jsonl")])
    assert str(stopped.value.code) == (
        f"sft_data distill: POST {server.base_url}/completions: reply is JSON nested too deeply to read"
    )


def test_a_teacher_that_takes_connections_and_never_answers_is_named_in_seconds(tmp_path, shared_data):
    """A hung teacher (connections taken, nothing answered) with a whole request's deadline of minutes: named
    within seconds (10 s), in one line, instead of waiting out the deadline at every attempt."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        base_url = f"http://127.0.0.1:{hung.getsockname()[1]}/v1"
        config = _config(
            tmp_path,
            shared_data,
            distill={
                "enabled": True,
                "base_url": base_url,
                "model": "m",
                "timeout_s": 120,
                "max_retries": 0,
                "problems": str(shared_data / "math/train.jsonl"),
                "limit": 1,
            },
        )
        with pytest.raises(SystemExit) as stopped:
            flow.main(["distill", "--config", str(config), "--out", str(tmp_path / "d.jsonl")])
    assert str(stopped.value.code) == (
        f"sft_data distill: GET {base_url}/models: no answer within 10 s; the teacher server takes connections but "
        "does not answer: restart it, or fix base_url"
    )
