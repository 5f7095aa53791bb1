"""The product's text speaks to users: README, docs, code, settings and build files outside lab/ name none of
the maintainers' own GPU-run plumbing (record archives, device calls, their budgets and setups, sessions, issue
numbers), code does not retell where a number was measured, the README stays short and its links resolve."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What a user gets; lab/ (and tests/) are the maintainers' own.
PRODUCT = ("README.md", "docs", "benchmarks", "params.yaml", "a5core", "flows", "tasks", "dvc.yaml", "Makefile")
PRODUCT += ("pyproject.toml",)
LAB_WORDS = {
    "a record archive's name": r"records_\w*\.tar\.gz|\brecords_(?:call|session)\d",
    "the records' folder": r"lab/records",
    "the device-call script": r"device_run\.sh",
    "a device call's budget": r"\bBUDGET=",
    "the device setup step": r"\bsetup-a\b",
    "a session's number": r"\bsession ?\d",
    "an issue's number": r"(?i)\bissues? ?#? ?\d+|\bissue #",
}
# Code (the library, the flows and their tasks) says what and why; where and when a number was measured is in docs/
# and benchmarks/RESULTS.md.
CODE = ("a5core", "flows", "tasks")
MEASURED_ON = r"\b(?:on|in) (?:the|an|one) H200|\bH200 runs\b"
README_LINES = 300


def _product_files(*roots: str) -> list[Path]:
    """The text files git tracks under ``roots`` (binary files, such as the plots, are skipped)."""
    listed = subprocess.run(["git", "ls-files", *roots], cwd=ROOT, capture_output=True, text=True, check=True)
    files = []
    for name in listed.stdout.split():
        path = ROOT / name
        try:
            path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        files.append(path)
    return files


def _hits(paths: list[Path], pattern: str) -> dict[str, list[str]]:
    """File (relative to the repository) → its lines matching ``pattern``, as ``line: text``."""
    found = {}
    for path in paths:
        lines = [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)]
        if matching := [line for line in lines if re.search(pattern, line.split(": ", 1)[1])]:
            found[path.relative_to(ROOT).as_posix()] = matching
    return found


def test_the_product_files_are_found():
    """The scans below read what they should: the README, the docs pages and the code are among the files."""
    names = {p.relative_to(ROOT).as_posix() for p in _product_files(*PRODUCT)}
    assert {"README.md", "docs/results.md", "benchmarks/RESULTS.md", "params.yaml", "a5core/__init__.py"} <= names
    assert not any(name.startswith(("lab/", "tests/")) for name in names)


@pytest.mark.parametrize("what", sorted(LAB_WORDS))
def test_product_text_names_no_lab_plumbing(what):
    found = _hits(_product_files(*PRODUCT), LAB_WORDS[what])
    assert not found, f"{what} in product files (it belongs under lab/): {found}"


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("the archive records_session4_call3_par.tar.gz", "a record archive's name"),
        ("(records_call2_sft_experiment.tar.gz)", "a record archive's name"),
        ("Log: `lab/records/session8_call1.txt`.", "the records' folder"),
        ("`lab/device_run.sh bench`", "the device-call script"),
        ("`BUDGET=300`, after `setup-a`", "a device call's budget"),
        ("after `setup-a` on a fresh machine", "the device setup step"),
        ("measured in session12", "a session's number"),
        ("The 0.8 recipe (issue 18)", "an issue's number"),
        ("see issue #45", "an issue's number"),
    ],
)
def test_each_pattern_catches_its_kind(line, what):
    """The patterns catch what they name (so a clean scan means clean text)."""
    assert re.search(LAB_WORDS[what], line)


@pytest.mark.parametrize(
    "line",
    [
        'paths["records_json"] = write_text_atomic(output_dir / "records.json", ...)',
        "the temporary server runs in a session of its own",
        "Runs started 2026-12-01 – 2026-12-04; re-run: `python -m flows.grpo --profile gpu-small`",
    ],
)
def test_ordinary_words_are_no_lab_plumbing(line):
    assert not any(re.search(pattern, line) for pattern in LAB_WORDS.values())


def test_code_does_not_retell_where_it_was_measured():
    found = _hits(_product_files(*CODE), MEASURED_ON)
    assert re.search(MEASURED_ON, "measured on the H200: half of a 9 ms step")  # the rule catches its kind
    assert not found, found


def test_readme_is_short_and_names_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; details belong in docs/"
    # CI (.ci/run) runs exactly the README's test command
    assert any(re.match(r"make test\s+#", line) for line in lines)
    assert any(re.match(r"make pipeline\s+#", line) for line in lines)


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(page):
    """Every relative link of the README and the docs pages names a file that exists (anchors aside)."""
    path = ROOT / page if page == "README.md" else ROOT / "docs" / page
    targets = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    local = [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    missing = [t for t in local if t and not (path.parent / t).exists()]
    assert not missing, f"{page} links to missing files: {missing}"
