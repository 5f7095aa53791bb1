import json

import pytest

from a5core.data.files import DataError, gsm8k_final_answer, load_gsm8k, load_math, load_sft_traces


def test_real_math_files(shared_data):
    train = load_math(shared_data / "math/train.jsonl")
    validation = load_math(shared_data / "math/validation.jsonl")
    math500 = load_math(shared_data / "math/math500.jsonl")  # no `type` key, integer levels
    assert (len(train), len(validation), len(math500)) == (7500, 5000, 500)
    first = validation[0]
    assert (first.unique_id, first.answer, first.level, first.subject) == ("test/algebra/1.json", "2", 3, "algebra")
    assert {p.level for p in train} == {1, 2, 3, 4, 5, None}  # two train items say "Level ?"
    assert len({p.unique_id for p in validation}) == 5000


def test_real_gsm8k_files(shared_data):
    test = load_gsm8k(shared_data / "gsm8k/test.jsonl")
    assert len(test) == 1319 and len(load_gsm8k(shared_data / "gsm8k/train.jsonl")) == 7473
    assert test[0].answer == "18" and test[0].unique_id == "gsm8k/test/0"
    assert "####" not in test[0].solution and test[0].problem.startswith("Janet")
    assert all(p.answer.lstrip("-").replace(".", "", 1).isdigit() for p in test)


def test_gsm8k_final_answer_strips_thousands_separators():
    assert gsm8k_final_answer("so 1,000 + 5\n#### 1,005") == "1005"
    with pytest.raises(ValueError, match="####"):
        gsm8k_final_answer("no marker 5")


def test_real_sft_traces(shared_data):
    traces = load_sft_traces(shared_data / "sft/teacher_traces_sample.jsonl")
    assert len(traces) == 1767
    assert traces[0].prompt.endswith("Assistant: <think>") and "</answer>" in traces[0].response


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps(
    {
        "unique_id": "a",
        "problem": "1+1?",
        "solution": "$\\boxed{2}$",
        "answer": "2",
        "level": "Level 1",
        "type": "Algebra",
    }
)


@pytest.mark.parametrize(
    "lines, message",
    [
        ([GOOD, '{"unique_id": "b", "problem": '], r"bad\.jsonl:2: malformed JSON"),
        (
            [GOOD, json.dumps({"unique_id": "b", "problem": "p", "solution": "s", "level": 1, "type": "t"})],
            r"bad\.jsonl:2: missing key\(s\) 'answer'",
        ),
        ([GOOD, "[1, 2]"], r"bad\.jsonl:2: expected a JSON object, got list"),
        ([], r"bad\.jsonl: empty data file"),
        (["", "   "], r"bad\.jsonl: empty data file"),
        (
            [json.dumps({"unique_id": "a", "problem": "p", "solution": "s", "answer": "2", "level": 1})],
            r"bad\.jsonl:1: missing key 'type' \(or 'subject'\)",
        ),
        (
            [json.dumps({"unique_id": "a", "problem": 5, "solution": "s", "answer": "2", "level": 1, "type": "t"})],
            r"bad\.jsonl:1: key 'problem' must be a string, got int",
        ),
    ],
)
def test_bad_math_files_name_file_and_line(tmp_path, lines, message):
    with pytest.raises(DataError, match=message):
        load_math(write_lines(tmp_path / "bad.jsonl", lines))


def test_bad_gsm8k_and_traces(tmp_path):
    with pytest.raises(DataError, match=r"g\.jsonl:1: GSM8K answer does not end with"):
        load_gsm8k(write_lines(tmp_path / "g.jsonl", [json.dumps({"question": "q", "answer": "5"})]))
    with pytest.raises(DataError, match=r"t\.jsonl:1: missing key\(s\) 'response', 'ground_truth'"):
        load_sft_traces(write_lines(tmp_path / "t.jsonl", [json.dumps({"prompt": "p"})]))


def test_missing_local_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such data file"):
        load_math(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no such data file"):
        load_math("./data/math/validation.jsonl")


def test_a_data_path_that_is_not_a_regular_file_is_refused_unread(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")  # opened, it would wait for a writer for ever
    for path, why in (
        ("/dev/zero", r"a file of the operating system \(/dev\), not an input; not read"),  # endless
        ("/proc/self/pagemap", r"a file of the operating system \(/proc\), not an input; not read"),  # 'regular'
        (tmp_path / "fifo", r"a FIFO \(a named pipe: reading it waits for a writer\), not a regular file; not read"),
        (tmp_path, r"a folder, not a regular file; not read"),
    ):
        with pytest.raises(DataError, match=rf"^{path}: {why}$"):
            load_math(path)


def test_a_data_file_without_line_breaks_is_not_read_whole(tmp_path, monkeypatch):
    """A binary file of gigabytes and no line break is refused at the longest line a record may have, not read
    into memory as one line."""
    import a5core.data.files

    monkeypatch.setattr(a5core.data.files, "MAX_LINE_BYTES", 1000)
    (tmp_path / "blob.jsonl").write_bytes(b"x" * 5000)
    with pytest.raises(DataError, match=r"blob.jsonl:1: a line of more than 1,000 bytes \(not a data record\)$"):
        load_math(tmp_path / "blob.jsonl")


def test_hub_source_error_is_clear():
    # HF_HUB_OFFLINE=1 (conftest): the real datasets code path runs and fails fast.
    with pytest.raises(
        DataError, match=r"EleutherAI/hendrycks_math: could not load Hugging Face dataset .*local \.jsonl"
    ):
        load_math("EleutherAI/hendrycks_math", split="test")
