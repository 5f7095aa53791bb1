"""The sft_data flow (flows/sft_data.py): its command line writes every set and the metrics, refuses bad input
keeping the previous output, merges profiles into the distill settings, and names a teacher that fails."""

import json
import socket
from pathlib import Path

import pytest
import yaml
from fake_teachers import FakeServer, RawServer, redirect, send

from a5core.data.files import load_math, load_sft_traces
from a5core.data.prompts import load_prompt
from a5core.engines import SamplingSettings
from a5core.engines.teacher import OpenAICompletionsTeacher, TeacherError
from flows import sft_data as flow
from tasks.outputs import write_output_file

ROOT = Path(__file__).resolve().parents[2]
R1 = load_prompt("r1_zero")


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


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


def test_credentials_never_follow_a_redirect_to_another_port(server, tmp_path, shared_data):
    """A 302 or 307 to another origin is refused, named, and the other server gets nothing: neither the
    API key through the command line nor a URL's user and password; a 307 on the same origin is followed."""
    elsewhere = RawServer(lambda handler: send(handler, b"{}"))
    redirects = []
    try:
        for status in (302, 307):
            redirecting = RawServer(redirect(status, f"{elsewhere.url}/v1/completions"))
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
                redirect(307, "/v2/completions")(handler)
            else:
                send(handler, json.dumps({"choices": [{"index": 0, "text": " ok"}]}).encode())

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


def test_cli_math_writes_with_the_math_prompts_in_turn(tmp_path, shared_data, capsys):
    config = _config(tmp_path, shared_data, math_prompts=["question_only"])
    out = tmp_path / "m.jsonl"
    problems = load_math(shared_data / "math/train.jsonl")[:4]
    flow.main(["math", "--config", str(config), "--math-prompts", "[r1_zero,question_only]", "--out", str(out)])
    assert "7498 traces (r1_zero, question_only)" in capsys.readouterr().out  # the flag replaces the file's
    traces = load_sft_traces(out)
    assert [t.prompt for t in traces[:4]] == [
        R1.format(problems[0].problem),
        problems[1].problem,
        R1.format(problems[2].problem),
        problems[3].problem,
    ]
    assert traces[0].response.endswith(" </answer>") and traces[1].response == " " + problems[1].solution.strip()
    flow.main(["math", "--config", str(config), "--out", str(out)])  # the file's
    assert "7498 traces (question_only)" in capsys.readouterr().out
    flow.main(["math", "--config", str(config), "--math-prompts", "null", "--out", str(out)])  # null: `prompt`
    assert "7498 traces (r1_zero)" in capsys.readouterr().out
    assert load_sft_traces(out)[1].prompt == R1.format(problems[1].problem)
    for value, message in (
        ("[r2_zero]", "sft_data math: no prompt template 'r2_zero'"),
        ("[]", "math_prompts"),
        ("[a", "argument --math-prompts: not a YAML value"),
    ):
        with pytest.raises(SystemExit) as refused:
            flow.main(["math", "--config", str(config), "--math-prompts", value, "--out", str(out)])
        assert message in f"{refused.value.code} {capsys.readouterr().err}"  # sys.exit's message, or argparse's


def test_cli_filter_keeps_the_correct_traces_of_both_prompts(tmp_path, shared_data):
    """A set written with both prompts: each trace graded by its own prompt's grader, so both halves stay."""
    config = _config(tmp_path, shared_data, math_prompts=["r1_zero", "question_only"])
    raw, out = tmp_path / "m.jsonl", tmp_path / "out"
    flow.main(["math", "--config", str(config), "--out", str(raw)])
    raw.write_text("".join(raw.read_text().splitlines(keepends=True)[:40]))
    metrics = tmp_path / "sft_data.json"
    flow.main(
        ["filter", "--config", str(config), "--out-dir", str(out), "--metrics", str(metrics)]
        + ["--set", f"math_solutions={raw}"]
    )
    kept = load_sft_traces(out / "math_solutions_filtered.jsonl")
    assert len(kept) == 40 and sum(t.prompt.startswith(R1.format("")[:40]) for t in kept) == 20


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
    write_output_file(out, "previous\n")  # an earlier run's
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
