"""Files written whole or not at all (a5core.runtime.writing)."""

import json

import pytest

from a5core.runtime.writing import check_writable_folder, write_jsonl_atomic


def test_write_jsonl_atomic_keeps_old_file_on_failure(tmp_path):
    path = write_jsonl_atomic(tmp_path / "out" / "r.jsonl", [{"a": 1}, {"a": 2}])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"a": 1}, {"a": 2}]

    def exploding():
        yield {"a": 3}
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_jsonl_atomic(path, exploding())
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"a": 1}, {"a": 2}]
    assert [p.name for p in path.parent.iterdir()] == ["r.jsonl"]  # no temporary left behind
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    import os

    current = os.umask(0)
    os.umask(current)
    return current


def test_a_folder_that_cannot_hold_files_is_named_and_a_new_one_is_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"output_dir .*/file/out: cannot write there"):
        check_writable_folder(blocker / "out", "output_dir")
    check_writable_folder(tmp_path / "new" / "folder", "output_dir")
    assert (tmp_path / "new" / "folder").is_dir() and not list((tmp_path / "new" / "folder").iterdir())
