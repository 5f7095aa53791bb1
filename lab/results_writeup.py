"""Make ``docs/results.md`` from the record archives: unpack them, let the product's verdict flow answer the page's
expectations, and list the archives.

    python lab/results_writeup.py [--runs lab/records] [--out docs/results.md] [--figures docs/results] \\
        [--context lab/how_to_repeat.md] [--index RUNS/INDEX.md]

1. Every ``*.tar.gz`` under ``--runs`` is unpacked into ``outputs/records/<archive>/`` (made anew).
2. The GPU cost of the runs made side by side (each archive's ``pool.txt``, ``lab/device_run.sh pool``) is
   computed per GPU into a Markdown section: runs a GPU-minute, the GPU-minutes of a pair, how many ran at once.
3. ``python -m flows.verdicts --stores outputs/records --expectations-file docs/expectations.yaml`` writes the
   page, with the cost section and ``--context`` (hand-kept: how to repeat the runs) after it; below the cost
   table, what deciding each row not yet decided would cost (its pairs still needed × a pair's GPU-minutes); the
   page is copied to ``--out`` and its figures to ``--figures``.
4. ``--index`` (beside the archives): which archive holds each run, and what each archive holds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tarfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNPACKED = Path("outputs/records")
EXPECTATIONS = Path("docs/expectations.yaml")
GPU = re.compile(r"cuda: 1 × (?:NVIDIA )?(.+?)(?:[ -](?:\d+GB|HBM|PCIe|SXM|NVL).*)?")


def unpack(runs_dir: Path, into: Path) -> list[Path]:
    """Each archive into a folder of its own under ``into`` (emptied first); the folders, in name order."""
    shutil.rmtree(into, ignore_errors=True)
    folders = []
    for archive in sorted(runs_dir.glob("*.tar.gz")):
        folder = into / archive.name.removesuffix(".tar.gz")
        folder.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
        folders.append(folder)
    return folders


# ----------------------------------------------------------------------------------------------------- the cost


def read_pool(path: Path) -> list[tuple[str, int, int, str]]:
    """A pool's attempts (``pool.txt``: ``NAME start T`` and ``NAME end T rc=R`` lines): (name, start, end, exit
    status) of each that ended."""
    starts, ended = {}, []
    for words in (line.split() for line in path.read_text().splitlines()):
        if len(words) >= 3 and words[1] == "start":
            starts[words[0]] = int(words[2])
        elif len(words) >= 4 and words[1] == "end" and words[0] in starts:
            ended.append((words[0], starts[words[0]], int(words[2]), words[3].removeprefix("rc=")))
    return ended


def run_devices(folder: Path) -> list[tuple[float, str]]:
    """(start, GPU kind) of each run of an unpacked archive whose record names one GPU: its provenance record's
    ``device``, else its tag ``device`` (``cuda: 1 × NVIDIA H100 80GB HBM3`` → ``H100``)."""
    records = {p.parent.parent.name: p for p in folder.rglob("artifacts/provenance.json")}
    found = []
    for db in folder.rglob("mlflow.db"):
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            tags = dict(con.execute("select run_uuid, value from tags where key = 'device'").fetchall())
            for run_id, start in con.execute("select run_uuid, start_time from runs"):
                device = json.loads(records[run_id].read_text()).get("device") if run_id in records else None
                match = GPU.fullmatch(device or tags.get(run_id) or "")
                if match:
                    found.append(((start or 0) / 1000, match[1]))
        finally:
            con.close()
    return found


@dataclass
class Pool:
    """Runs made side by side on one GPU: its attempts, the GPU its runs' records name (None where they name none
    or several), and the walls of the SFT runs its archive started with."""

    gpu: str | None
    attempts: list[tuple[str, int, int, str]]
    sft_seconds: list[float]

    @property
    def minutes(self) -> float:
        """Its first start to its last end: the GPU's time, failed attempts and waits included."""
        return (max(e for _, _, e, _ in self.attempts) - min(s for _, s, _, _ in self.attempts)) / 60


def pools_of(folder: Path) -> list[Pool]:
    found = []
    walls = [line for p in folder.rglob("walls.txt") for line in p.read_text().splitlines()]
    sft = [float(m[1]) for w in walls if (m := re.match(r"sft\S* call=\S+ rc=0 wall_s=(\d+)", w))]
    devices = run_devices(folder)
    for path in sorted(folder.rglob("pool.txt")):
        attempts = read_pool(path)
        if attempts:
            first, last = min(s for _, s, _, _ in attempts), max(e for _, _, e, _ in attempts)
            kinds = {gpu for start, gpu in devices if first <= start <= last}
            found.append(Pool(kinds.pop() if len(kinds) == 1 else None, attempts, sft))
    return found


def at_once(attempts: list[tuple[str, int, int, str]]) -> int:
    """The most attempts running at one time (those that failed too: they held memory)."""
    events = sorted([(s, 1) for _, s, _, _ in attempts] + [(e, -1) for _, _, e, _ in attempts])
    return max(itertools.accumulate(change for _, change in events))


def by_gpu(pools: list[Pool]) -> list[tuple[str, list[Pool], list[tuple[int, int]]]]:
    """(GPU, its pools, its runs that ended well as (start, end)) for each GPU with such runs (a pool whose GPU no
    record names stands alone as "a GPU")."""
    groups: dict[str | int, list[Pool]] = defaultdict(list)
    for i, pool in enumerate(pools):
        groups[pool.gpu or i].append(pool)
    found = []
    for group in groups.values():
        done = [(s, e) for pool in group for _, s, e, rc in pool.attempts if rc == "0"]
        if done:
            found.append((group[0].gpu or "a GPU", group, done))
    return found


def run_minutes(group: list[Pool], done: list[tuple[int, int]]) -> float:
    """A run's GPU-minutes on one GPU: its pools' minutes over the runs that ended well."""
    return sum(pool.minutes for pool in group) / len(done)


def pair_minutes(pools: list[Pool]) -> dict[str, tuple[float, float]]:
    """For each GPU the records name, a pair's GPU-minutes: two runs, and one (the reference's run serving several
    comparisons)."""
    return {
        gpu: (2 * run_minutes(group, done), run_minutes(group, done))
        for gpu, group, done in by_gpu(pools)
        if group[0].gpu
    }


def cost_section(pools: list[Pool]) -> str:
    """The runs' cost, GPU by GPU."""
    rows = []
    for gpu, group, done in by_gpu(pools):
        minutes = sum(pool.minutes for pool in group)
        failed = sum(rc != "0" for pool in group for *_, rc in pool.attempts)
        walls = sorted((e - s) / 60 for s, e in done)
        sft = [s for pool in group for s in pool.sft_seconds]
        cells = [gpu, len(done), failed, max(at_once(p.attempts) for p in group)]
        cells += [
            f"{minutes:.1f}",
            f"{walls[len(walls) // 2]:.1f}",
            f"{len(done) / minutes:.2f}",
            f"{2 * run_minutes(group, done):.1f}",
            f"{run_minutes(group, done):.1f}",
        ]
        rows.append("| " + " | ".join(map(str, [*cells, f"{max(sft) / 60:.1f}" if sft else ""])) + " |")
    if not rows:
        return ""
    return "\n".join(
        [
            "## Cost",
            "",
            "The runs made side by side on one GPU (each setting and seed a process, sharing the card): runs that "
            "ended well and attempts that did not, the most at once (failed attempts included: they held memory), the "
            "GPU-minutes from the first start to the last end (failed attempts and waits included), a run's median "
            "wall clock, runs a GPU-minute, and what a pair costs: two runs, or one where the reference setting's run "
            "serves several comparisons. Multiply by a finding's pairs. The start model's SFT comes once per batch.",
            "",
            "| GPU | runs | failed attempts | at once | GPU-minutes | median run (min) | runs a GPU-minute | "
            "GPU-minutes a pair | with a shared reference | start model's SFT (min) |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )


def deciding_cost(verdicts: list[dict], pairs: dict[str, tuple[float, float]]) -> str:
    """What the rows not yet decided would cost to decide: the pairs that would likely decide each (the verdict
    flow's estimate) times a pair's GPU-minutes on each GPU, one run a pair where the row's reference runs serve
    other comparisons too."""
    rows, totals = [], dict.fromkeys(pairs, 0.0)
    for v in verdicts:
        if not v.get("more_pairs"):
            continue
        shared = bool(v.get("shares_runs_with"))
        cells = []
        for gpu, (two, one) in pairs.items():
            minutes = v["more_pairs"] * (one if shared else two)
            totals[gpu] += minutes
            cells.append(f"{minutes:.0f}")
        rows.append(f"| `{v['expectation']}` | {v['more_pairs']} | {'yes' if shared else 'no'} | {' | '.join(cells)} |")
    if not rows or not pairs:
        return ""
    gpus = list(pairs)
    return "\n".join(
        [
            "",
            "What deciding the rest would cost, at these rates: for each row not yet decided, the pairs that would "
            "likely decide it (Findings) times a pair's GPU-minutes on each GPU, one run a pair where its reference "
            "runs serve other comparisons too; the start models' SFT aside.",
            "",
            f"| expectation | pairs | reference shared | {' | '.join(f'GPU-minutes on the {g}' for g in gpus)} |",
            "|---|---|---|" + "---|" * len(gpus),
            *rows,
            f"| all of them | | | {' | '.join(f'{totals[g]:.0f}' for g in gpus)} |",
            "",
        ]
    )


# ---------------------------------------------------------------------------------------------------- the index


def index_text(runs_dir: Path, out: Path, folders: list[Path]) -> str:
    """Which archive holds each run (by the experiment that made it), and each archive's size, runs and logs."""
    sys.path.insert(0, str(ROOT))
    from flows.verdicts import NOT_WHAT_RAN
    from tasks.store_runs import read_runs

    holds, rows = [], []
    for folder in folders:
        archive = f"{folder.name}.tar.gz"
        records = read_runs([str(folder)], NOT_WHAT_RAN).records if any(folder.rglob("mlflow.db")) else []
        for run in records:
            holds.append(f"| `{run.group}` | {run.setting} | {run.seed or ''} | `{run.id}` | `{archive}` |")
        walls = [line for p in sorted(folder.rglob("walls.txt")) for line in p.read_text().splitlines()]
        size = (runs_dir / archive).stat().st_size // 1024
        rows.append(f"| `{archive}` | {size} | {len(records)} | {'; '.join(walls)} |")
    logs = sorted(p.name for p in runs_dir.glob("*.log"))
    return "\n".join(
        [
            f"# The record archives behind `{out.as_posix()}`",
            "",
            "> Generated by `python lab/results_writeup.py` beside the page: do not edit by hand.",
            "",
            "## Which archive holds which run",
            "",
            "| experiment | setting | seed | run | archive |",
            "|---|---|---|---|---|",
            *holds,
            "",
            "## The archives",
            "",
            f"The archives under `{runs_dir.as_posix()}/`, their size, the MLflow runs their stores hold and their "
            "flows' process walls (`walls.txt`):",
            "",
            "| archive | kB | MLflow runs | process walls |",
            "|---|---|---|---|",
            *rows,
            "",
            *([f"Logs beside them: {', '.join(f'`{name}`' for name in logs)}.", ""] if logs else []),
        ]
    )


# ----------------------------------------------------------------------------------------------------- the page


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--runs", type=Path, default=Path("lab/records"), help="folder of record archives")
    parser.add_argument("--out", type=Path, default=Path("docs/results.md"), help="the page to write")
    parser.add_argument("--figures", type=Path, default=Path("docs/results"), help="folder for its figures")
    parser.add_argument("--context", type=Path, default=Path("lab/how_to_repeat.md"), help="hand-kept, appended")
    parser.add_argument("--index", type=Path, help="the archives' index (default: INDEX.md in --runs)")
    parser.add_argument("--unpacked", type=Path, default=UNPACKED, help="where the archives are unpacked")
    args = parser.parse_args(argv)
    if not any(args.runs.glob("*.tar.gz")):
        parser.error(f"no *.tar.gz record archives under {args.runs}")
    folders = unpack(args.runs, args.unpacked)
    made = args.unpacked.parent / f"{args.unpacked.name}_page"
    shutil.rmtree(made, ignore_errors=True)
    appended = []
    pools = [pool for folder in folders for pool in pools_of(folder)]
    if cost := cost_section(pools):
        write_atomic(cost_file := args.unpacked / "cost.md", cost)
        appended.append(str(cost_file))
    if args.context.is_file():
        appended.append(str(args.context))
    command = [sys.executable, "-m", "flows.verdicts", "--stores", str(args.unpacked)]
    command += ["--expectations-file", str(EXPECTATIONS), "--title", "Results", "--output-dir", str(made)]
    command += ["--log-to-mlflow", "false"] + (["--append", ",".join(appended)] if appended else [])
    subprocess.run(command, check=True, cwd=ROOT)
    page = (made / "verdicts.md").read_text()
    if cost:
        verdicts = json.loads((made / "verdicts.json").read_text())["verdicts"]
        if cost not in page:
            raise RuntimeError(f"the cost section ({cost_file}) is not in {made / 'verdicts.md'} as it was appended")
        page = page.replace(cost, cost + deciding_cost(verdicts, pair_minutes(pools)), 1)
    link = os.path.relpath(args.figures.resolve(), args.out.resolve().parent)
    write_atomic(args.out, page.replace("](figures/", f"]({link}/"))
    shutil.rmtree(args.figures, ignore_errors=True)
    shutil.copytree(made / "figures", args.figures)
    write_atomic(index := args.index or args.runs / "INDEX.md", index_text(args.runs, args.out, folders))
    print(f"wrote {args.out}, {args.figures}/ and {index}")
    return args.out


if __name__ == "__main__":
    main()
