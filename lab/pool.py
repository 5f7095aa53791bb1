"""One device call of the lab's comparisons, each run as a user runs it: the product's command over seeds.

Run by ``lab/pool_call.sh`` on the device (the image's python3; stdlib only), after the packages, the data and the
GGUF are in place. A queue entry is one comparison, a command of the product over seeds (``flows.grpo ... --ablation
grpo_dapo_ablation --ablation-only [grpo,token_mean] --seeds [22,23,24] --decide "token_mean >= grpo"``), which
runs its children side by side sized to the card (how many at once, each child's ``--gpu-memory-fraction``, under
CUDA MPS: ``flows.seeds``), resumes what an earlier call on this machine cut, and prints its verdict. What is left
here is what a borrowed machine needs, within one call and nothing outliving it:

1. the SFT start model (``PRE``), made unless the folder an earlier call on this warm machine made is there with the
   content hash recorded when it was made (``outputs/.devrun/start_model.json``); the difficulty table first where
   an entry needs it;
2. the queue's entries, one after another in its order, each with its own output folder and MLflow store under
   ``outputs/.devrun/NAME`` (its records, packed apart): an entry not yet complete (the ``--done`` file, kept in the
   repository, is the queue's state across calls and machines) runs with its seeds less those an earlier call
   finished on another machine (those finished here are read back, not run again), after
   the references it names (``ref=A,B``) that have not ended with rc 0 from this call's start model; one starts only
   with ``MIN_START_S`` of the call left;
3. the call's deadline: the running command is stopped (SIGTERM: it stops its children, which keep their checkpoints
   and resume in the next call on this warm machine; rc 124);
4. packing: the records of the entries that finished a child in this call (their stores, artifacts, outputs and
   metrics; no weights, checkpoints or plots) into ``$OUT/records_<TAG>.tar.gz`` (in parts under ``PART_BYTES``),
   with ``pool.txt`` (a start and an end line per child run in this call) and ``walls.txt`` of this call under
   ``outputs/.devrun/<TAG>/``; ``$OUT/done.txt`` (a line per entry tried: rc, start model, call, archive, the seeds
   whose children all finished) and ``$OUT/pool.log``.

Queue lines (``lab/queues/verdicts_7.txt``): ``NAME [ref=A,B] [from=S] MODULE ARGS...;`` ('#' lines left out; words
as a shell splits them, a ``--seeds`` list without spaces; no ';' inside an argument). ``from=S``: the run starts from the model entry S saved (``--model
outputs/.devrun/S/out/best_model``), made on this machine by S first where it is not here yet (its content hash in
``outputs/.devrun/S/made.json``). A done line: ``NAME rc=R origin=HASH call=TAG archive=FILE wall_s=S gpu=CARD
seeds=A,B`` (origin ``base`` for runs from the base model, S's model's hash for runs from it).

    python3 lab/pool.py --queue lab/queues/verdicts_7.txt --done lab/queues/verdicts_7.done --tag session25_call2 \
        --seconds 560 [--plan]            # --plan: print what it would start, and exit
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

PACK_SECONDS = 25  # kept at the end of the call for packing
STOP_SECONDS = 40  # a stopped command's time to stop its children (the product waits 30 s for them) before SIGKILL
MIN_START_S = 90  # an entry starts only with this much of the call left: its children's start and first steps
PART_BYTES = 15 * 1024**2  # an archive part's limit (16 MiB a file comes back)
PRE = os.environ.get("POOL_PRE") or (  # POOL_PRE, POOL_DIFFICULTY: other commands (a dry run of the pool)
    "sft flows.sft_experiment --config params.yaml --profile gpu-small --sizes [1024] --filtered-data null "
    "--val-limit 128 --eval-every 64"
)
START_MODEL = Path("outputs/sft_experiment/best_model")
DIFFICULTY = os.environ.get("POOL_DIFFICULTY") or "difficulty flows.difficulty --config params.yaml --profile gpu-small"
TABLE = Path("outputs/difficulty/pass_rates.csv")
DEVRUN = Path("outputs/.devrun")
BASE_MODEL = "smollm2-135m-instruct"  # an entry that names it starts from the base model, not the SFT start model


@dataclass
class Entry:
    name: str
    words: list[str]  # MODULE ARGS...
    refs: list[str]
    needs: str  # base | start | table | entry (the model of entry ``source``)
    source: str | None = None  # from=S: the entry whose saved model it starts from

    @property
    def module(self) -> str:
        return self.words[0]

    @property
    def seeds(self) -> list[int]:
        """The seeds its command names (``--seeds [9,10]``); [] for one run of ``--seed``."""
        if "--seeds" not in self.words:
            return []
        return [int(s) for s in self.words[self.words.index("--seeds") + 1].strip("[]").split(",") if s.strip()]


def parse_queue(path: Path) -> list[Entry]:
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    entries = []
    for chunk in text.replace("\n", " ").split(";"):
        words = shlex.split(chunk)  # a quoted argument (--decide "A >= B") is one word
        if not words:
            continue
        name, rest, refs, source = words[0], words[1:], [], None
        while rest and rest[0].startswith(("ref=", "from=")):
            key, _, value = rest.pop(0).partition("=")
            if key == "ref":
                refs = [r for r in value.split(",") if r]
            else:
                source = value
        from_base = BASE_MODEL in rest or rest[0] == "flows.sft_experiment"  # SFT trains the base model; GRPO from it
        needs = "entry" if source else "base" if from_base else "table" if "--difficulty-table" in rest else "start"
        entries.append(Entry(name, rest, refs, needs, source))
    return entries


@functools.cache
def vllm_installed() -> bool:  # once a pool: pool_call.sh installs vLLM before the pool starts, never during it
    return importlib.util.find_spec("vllm") is not None


def engine_here(entry: Entry) -> bool:
    """Whether the engine ``entry`` asks for is on this machine: a ``--backend vllm`` entry waits for vLLM (carried in
    parts over calls by lab/carry_vllm.sh)."""
    return "vllm" not in entry.words or vllm_installed()


def read_done(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        words = line.split()
        if words and not line.startswith("#"):
            rows.append({"name": words[0], **dict(w.split("=", 1) for w in words[1:] if "=" in w)})
    return rows


def seeds_done(entry: Entry, done: list[dict]) -> set[int]:
    """The seeds whose children all finished in an earlier call (any start model: a seed's arms run together)."""
    return {int(s) for r in done if r["name"] == entry.name for s in r.get("seeds", "").split(",") if s}


def complete(entry: Entry, done: list[dict]) -> bool:
    """Every seed it names finished; or it ended with rc 0, with each of its references, from one start model."""
    if entry.seeds and set(entry.seeds) <= seeds_done(entry, done):
        return True
    origins = {r["origin"] for r in done if r["name"] == entry.name and r.get("rc") == "0"}
    for ref in entry.refs:
        origins &= {r["origin"] for r in done if r["name"] == ref and r.get("rc") == "0"}
    return bool(origins)


def saved_model(name: str) -> Path:
    """Where entry ``name``'s flow saves its model (its ``--output-dir``'s best_model)."""
    return DEVRUN / name / "out" / "best_model"


def card() -> str:
    """The card as nvidia-smi names it, with its memory (for the records); "no GPU" without one (a dry run)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,memory.used", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "no GPU"
    return out.splitlines()[0] if out else "no GPU"


def folder_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    root = folder.resolve()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def children_of(entry_name: str) -> list[tuple[str, int, float, float | None]]:
    """The children the product's command of an entry made (its ``child.json`` files): label, seed, when its last
    attempt started, and when it finished (its ``done.json``; None: not finished)."""
    found = []
    for spec in sorted((DEVRUN / entry_name / "out").glob("runs-*/*/child.json")):
        try:
            child = json.loads(spec.read_text())
            label, seed = child["name"], int(child["params"].get("seed", 0))
        except (OSError, ValueError, KeyError):
            continue
        done = spec.with_name("done.json")
        found.append((label, seed, spec.stat().st_mtime, done.stat().st_mtime if done.exists() else None))
    return found


def finished_seeds(entry_name: str) -> list[int]:
    """The seeds all of whose children finished: as many finished as the seed with the most children has."""
    children = children_of(entry_name)
    per_seed: dict[int, list[bool]] = {}
    for _, seed, _, end in children:
        per_seed.setdefault(seed, []).append(end is not None)
    arms = max((len(v) for v in per_seed.values()), default=0)
    return sorted(seed for seed, ends in per_seed.items() if len(ends) == arms and all(ends))


class Pool:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.time()
        self.deadline = self.t0 + args.seconds - PACK_SECONDS - STOP_SECONDS
        self.tag = args.tag
        self.calldir = DEVRUN / self.tag
        self.calldir.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.calldir / "pool.log", "a")
        self.ended: dict[str, int] = {}
        self.walls: dict[str, int] = {}
        self.seeds: dict[str, list[int]] = {}  # entry → the seeds whose children all finished (here, so far)
        self.origin: str | None = None
        self.made: dict[str, str | None] = {}  # entry → the hash of its saved model here (from=ENTRY runs)
        self.gpu = card()
        self.log(f"card {self.gpu}; deadline in {self.deadline - self.t0:.0f} s (the commands size themselves)")

    def log(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:6.0f} s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def left(self) -> float:
        return self.deadline - time.time()

    def command(self, entry: Entry, done: list[dict], own: bool) -> list[str]:
        """The entry's command: its seeds less those finished on another machine (those finished here are read back:
        one parent run over them all), its start model, its own outputs."""
        words = list(entry.words)
        if entry.seeds:
            elsewhere = seeds_done(entry, done) - set(finished_seeds(entry.name))
            left = [s for s in entry.seeds if s not in elsewhere]
            words[words.index("--seeds") + 1] = "[" + ",".join(map(str, left)) + "]"
        if entry.source:
            words += ["--model", str(saved_model(entry.source))]
        if own:
            folder = DEVRUN / entry.name
            words += ["--tracking-uri", f"sqlite:///{folder}/mlflow.db", "--output-dir", f"{folder}/out"]
            words += ["--metrics-path", f"{folder}/metrics.json"]
        return [sys.executable, "-m", *words]

    def run_entry(self, entry: Entry, done: list[dict], own: bool = True) -> int:
        """Run the entry's command to its end or the call's deadline (then SIGTERM: rc 124 unless it had published
        its result); its pool.txt and walls.txt lines."""
        folder = DEVRUN / entry.name
        folder.mkdir(parents=True, exist_ok=True)
        cmd = self.command(entry, done, own)
        log = open(folder / f"{entry.name}.log", "a")
        log.write(f"== {entry.name} ({self.tag}): {shlex.join(cmd)}\n")
        log.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        began = time.time()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        self.log(f"start {entry.name}: {shlex.join(cmd[2:])}")
        try:
            while proc.poll() is None and time.time() < self.deadline:
                time.sleep(3)
        finally:  # the deadline, or the pool stopped: the command stops its children, which keep their checkpoints
            rc = proc.poll()
            if rc is None:
                self.log(f"stop {entry.name}: its children keep their checkpoints and resume in the next call")
                rc = self.stop(proc)
                if self.published(entry.name, began):
                    rc = 0
            self.finish(entry, rc, began)
        return rc

    def stop(self, proc: subprocess.Popen) -> int:
        """SIGTERM to the command's process group (it stops its children), SIGKILL after STOP_SECONDS; rc 124."""
        for sig, wait in ((signal.SIGTERM, STOP_SECONDS), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            end = time.time() + wait
            while time.time() < end and proc.poll() is None:
                time.sleep(0.5)
        return 124

    def published(self, name: str, began: float) -> bool:
        """Whether a command stopped at the deadline had already published its result (its ``run.json``, written
        after its MLflow runs ended): stopped while its temporary Prefect server stopped, its records are whole."""
        published = DEVRUN / name / "out" / "run.json"
        if published.exists() and published.stat().st_mtime >= began:
            self.log(f"{name}: its result was published before the stop; its records are whole (rc 0)")
            return True
        return False

    def finish(self, entry: Entry, rc: int, began: float) -> None:
        now = time.time()
        self.ended[entry.name], self.walls[entry.name] = rc, int(now - began)
        self.seeds[entry.name] = finished_seeds(entry.name)
        children = [c for c in children_of(entry.name) if c[2] >= began]  # the children started in this call
        with open(self.calldir / "pool.txt", "a") as f:
            if not children:  # a command of one run without children (the start model, the difficulty table)
                f.write(f"{entry.name} start {int(began)}\n{entry.name} end {int(now)} rc={rc}\n")
            for label, _, start, end in children:
                ok = end is not None and end >= start
                f.write(f"{entry.name}:{label} start {int(start)}\n")
                f.write(f"{entry.name}:{label} end {int(end if ok else now)} rc={0 if ok else (rc or 124)}\n")
        with open(self.calldir / "walls.txt", "a") as f:
            f.write(f"{entry.name} call={self.tag} rc={rc} wall_s={int(now - began)}\n")
        finished = sum(end is not None for *_, end in children)
        self.log(f"end {entry.name} rc={rc} in {int(now - began)} s: {finished} of {len(children)} children finished")
        if rc not in (0, 124):
            tail = (DEVRUN / entry.name / f"{entry.name}.log").read_text(errors="replace").splitlines()[-12:]
            self.log("  " + "\n  ".join(line[:400] for line in tail))

    # ---- the start model -------------------------------------------------------------------------------------
    def start_model_ok(self) -> bool:
        record = DEVRUN / "start_model.json"
        if not (START_MODEL.exists() and record.exists()):
            return False
        made = json.loads(record.read_text())
        found = folder_hash(START_MODEL)
        if found != made["sha256"]:
            self.log(
                f"start model changed since {made['call']}: {found[:12]} against {made['sha256'][:12]}: made again"
            )
            return False
        self.origin = found[:12]
        self.log(f"start model of {made['call']} found, sha256 {found[:12]} (unchanged)")
        return True

    def record_start_model(self) -> None:
        digest = folder_hash(START_MODEL)
        (DEVRUN / "start_model.json").write_text(json.dumps({"sha256": digest, "call": self.tag}))
        self.origin = digest[:12]
        self.log(f"start model made, sha256 {digest[:12]}")

    def model_of(self, name: str) -> str | None:
        """The hash (12 digits) of the model entry ``name`` saved on this machine, None while there is none: made
        in an earlier call on this warm machine (its record and the folder's hash agree; checked once a call) or in
        this one (recorded once it ended with rc 0)."""
        if name not in self.made:
            self.made[name] = self.found_model(name)
        if self.made[name] is None and self.ended.get(name) == 0 and saved_model(name).is_dir():
            digest = folder_hash(saved_model(name))
            (DEVRUN / name / "made.json").write_text(json.dumps({"sha256": digest, "call": self.tag}))
            self.log(f"{name}'s model made, sha256 {digest[:12]}")
            self.made[name] = digest[:12]
        return self.made[name]

    def found_model(self, name: str) -> str | None:
        """The hash of the model an earlier call on this machine recorded for entry ``name``, if it is unchanged."""
        folder, record = saved_model(name), DEVRUN / name / "made.json"
        if not (folder.is_dir() and record.exists()):
            return None
        made = json.loads(record.read_text())
        digest = made["sha256"]
        if folder_hash(folder) != digest:
            self.log(f"{name}'s model changed since {made['call']}: made again")
            return None
        self.log(f"{name}'s model found, sha256 {digest[:12]} (unchanged)")
        return digest[:12]

    def origin_of(self, entry: Entry) -> str | None:
        """The model ``entry`` starts from, as done lines name it: base, a from=ENTRY model's hash, or the start
        model's."""
        if entry.needs == "base":
            return "base"
        return self.model_of(entry.source) if entry.source else self.origin

    # ---- the loop --------------------------------------------------------------------------------------------
    def plan(self, entries: list[Entry], done: list[dict]) -> list[Entry]:
        """The entries to run, in order: each incomplete one, after the models it starts from and its references not
        yet ended from this start model (or, before it is known, not ended with rc 0 from any)."""
        by_name = {e.name: e for e in entries}
        picked: list[str] = []

        def here(name: str) -> bool:  # ended with rc 0 from the model it starts from here (the base model: any)
            ok = {r["origin"] for r in done if r["name"] == name and r.get("rc") == "0"}
            return bool(ok) if by_name[name].needs == "base" else self.origin_of(by_name[name]) in ok

        for entry in entries:
            if complete(entry, done):
                continue
            failed = [r for r in done if r["name"] == entry.name and r.get("rc") not in ("0", "124")]
            if len(failed) >= 2:  # twice failed (not stopped at a deadline): left for a person to look at
                self.log(f"skip {entry.name}: failed {len(failed)} times ({', '.join(r['call'] for r in failed)})")
                continue
            for source in [by_name[n].source for n in [*entry.refs, entry.name] if by_name[n].source]:
                if self.model_of(source) is None and source not in picked:  # made on this machine first
                    picked.append(source)
            for name in [*entry.refs, entry.name]:
                if not here(name) and name not in picked:
                    picked.append(name)
        return [by_name[n] for n in picked]

    def run(self, entries: list[Entry], done: list[dict]) -> None:
        reuse = self.start_model_ok()
        todo = self.plan(entries, done)
        self.log(f"plan ({len(todo)}): {' '.join(e.name for e in todo)}")
        if waits := [e.name for e in todo if not engine_here(e)]:
            self.log(f"vLLM is not installed here: {' '.join(waits)} wait for it (lab/carry_vllm.sh)")
        if self.args.plan:
            return
        needs_start = any(e.needs != "base" for e in todo)
        if needs_start and not reuse:
            if self.run_entry(Entry("sft", PRE.split()[1:], [], "base"), done, own=False) != 0:
                self.log("start model failed: only the base-model runs go on")
                todo = [e for e in todo if e.needs == "base"]
            else:
                self.record_start_model()
        if any(e.needs == "table" for e in todo) and (not reuse or not TABLE.exists()):
            TABLE.unlink(missing_ok=True)  # from another start model
            self.run_entry(Entry("difficulty", DIFFICULTY.split()[1:], [], "start"), done, own=False)
        for entry in todo:
            if self.left() < MIN_START_S:
                break
            ready = engine_here(entry) and (
                entry.needs == "base"
                or (entry.needs == "entry" and self.model_of(entry.source) is not None)
                or (self.origin is not None and (entry.needs == "start" or TABLE.exists()))
            )
            if ready:
                self.run_entry(entry, done)
        self.log(f"not run: {' '.join(e.name for e in todo if e.name not in self.ended) or 'none'}")


# ---- packing ---------------------------------------------------------------------------------------------------
SKIP = re.compile(r"(^|/)(checkpoint(\.[^/]*)?|model|best_model)(/|$)|\.(safetensors|pt|bin|png|gguf)$")
# A run's git_diff.patch over this size is left out: the tree travels sparse (no docs, tests, lab/records), so
# the patch lists those folders as deleted; the record's diff_sha256 still names it.
LARGEST_PATCH = 100_000


def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if SKIP.search(info.name) or (info.name.endswith("git_diff.patch") and info.size > LARGEST_PATCH):
        return None
    return info


def store_folders(db: Path) -> list[Path]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        uris = [u for (u,) in con.execute("select artifact_uri from runs") if u]
    finally:
        con.close()
    found = []
    for uri in uris:
        folder = Path(uri.removeprefix("file://").removesuffix("/artifacts"))
        if folder.is_dir():
            found.append(Path(os.path.relpath(folder.resolve(), Path.cwd())))
    return found


def pack(pool: Pool, out: Path) -> list[tuple[str, str]]:
    """The records of the entries that ended with rc 0 or finished a seed, in parts under PART_BYTES; (name,
    archive) of each."""
    ok = [n for n, rc in pool.ended.items() if rc == 0 or pool.seeds.get(n)]
    groups: dict[str, list[Path]] = {}
    for name in ok:
        if name in ("sft", "difficulty"):
            paths = [
                Path("mlflow.db"),
                Path("metrics"),
                Path("outputs") / ("sft_experiment" if name == "sft" else "difficulty"),
            ]
            paths += store_folders(Path("mlflow.db")) if Path("mlflow.db").exists() else []
        else:
            db = DEVRUN / name / "mlflow.db"
            paths = [DEVRUN / name] + (store_folders(db) if db.exists() else [])
        seen = {p for n in groups for p in groups[n]}
        groups[name] = list(dict.fromkeys(p for p in paths if p.exists() and p not in seen))
    common = [pool.calldir]  # pool.txt and walls.txt: in the first part only (the page counts a pool once)
    archives: list[tuple[str, str]] = []
    names = list(groups)
    part, start = 1, 0
    while start < len(names) or (not names and part == 1):
        file = out / (f"records_{pool.tag}.tar.gz" if part == 1 else f"records_{pool.tag}_part{part}.tar.gz")
        end = len(names)
        while True:
            with tarfile.open(file, "w:gz") as tar:
                for path in (common if part == 1 else []) + [p for n in names[start:end] for p in groups[n]]:
                    tar.add(str(path), filter=keep)
            if file.stat().st_size <= PART_BYTES or end - start <= 1:
                break
            end = start + max(1, (end - start) // 2)
        archives += [(n, file.name) for n in names[start:end]]
        pool.log(f"packed {file.name}: {file.stat().st_size / 1e6:.1f} MB, {end - start} entries")
        start, part = end, part + 1
        if not names:
            break
    return archives


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queue", type=Path, required=True)
    ap.add_argument("--done", type=Path, required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--seconds", type=float, default=560)
    ap.add_argument("--plan", action="store_true")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/pool_out"))
    out.mkdir(parents=True, exist_ok=True)
    pool = Pool(args)

    def interrupted(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    entries = parse_queue(args.queue)
    try:
        pool.run(entries, read_done(args.done))
    except KeyboardInterrupt:
        pool.log("interrupted")
    if args.plan:
        return
    archive = dict(pack(pool, out))
    lines, by_name = [], {e.name: e for e in entries}
    for name, rc in pool.ended.items():
        origin = (pool.origin_of(by_name[name]) if name in by_name else pool.origin) or "none"
        seeds = ",".join(map(str, pool.seeds.get(name, [])))
        lines.append(
            f"{name} rc={rc} origin={origin} call={pool.tag} archive={archive.get(name, '-')} "
            f"wall_s={pool.walls[name]} gpu={pool.gpu.split(',')[0].replace(' ', '_')}"
            + (f" seeds={seeds}" * bool(seeds))
        )
    (out / "done.txt").write_text("\n".join(lines) + "\n")
    (pool.calldir / "done.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    (out / "pool.log").write_text((pool.calldir / "pool.log").read_text())


if __name__ == "__main__":
    main()
