"""One device call's pool of side-by-side flow runs that sizes itself to the card and finishes what it starts.

Run by ``lab/pool_call.sh`` on the device (the image's python3; stdlib only), after the packages, the data and the
GGUF are in place. Within one call, and nothing outliving it:

1. reads the card (``nvidia-smi``: name, total and used memory) and the cores, and from them the memory each kind of
   run gets (``--gpu-memory-fraction`` = its GiB / the card's total; GiB per kind in ``KINDS``) and how many run at
   once (the memory left after a reserve, and ``MAX_AT_ONCE``, at most the cores less two);
2. makes the SFT start model (``PRE``) unless the folder an earlier call on this warm machine made is there with the
   content hash recorded when it was made (``outputs/.devrun/start_model.json``); the runs that start from the base
   model (``needs base``) start beside it;
3. starts the queue's entries in its order: an entry not yet complete (the ``--done`` file: the queue's state, kept in
   the repository) is taken with the references it names (``ref=A,B``) that have not ended with rc 0 from this call's
   start model; an entry starts only while the memory and the slots allow and its estimated wall (``KINDS``, scaled
   by how many run at once) ends before the call's deadline; ``flows.difficulty`` runs first where an entry needs
   its table;
4. kills, at the deadline, whatever still runs (each run in a process group of its own); then packs the records of
   the runs that ended with rc 0 (their stores, artifacts, outputs and metrics; no weights, checkpoints or plots) into
   ``$OUT/records_<TAG>.tar.gz`` (in parts under ``PART_BYTES``), with ``pool.txt`` and ``walls.txt`` of this call
   under ``outputs/.devrun/<TAG>/``, and writes ``$OUT/done.txt`` (a line per entry tried: rc, start model, call,
   archive) and ``$OUT/pool.log``.

Queue lines (``lab/queues/verdicts_4.txt``): ``NAME [ref=A,B] [from=S] MODULE ARGS...;`` ('#' lines left out).
``from=S``: the run starts from the model entry S saved (``--model outputs/.devrun/S/out/best_model``: a second start
model, such as one trained for both prompts), made on this machine by S first where it is not here yet (its content
hash in ``outputs/.devrun/S/made.json``). A done line: ``NAME rc=R origin=HASH call=TAG archive=FILE wall_s=S``
(origin ``base`` for runs from the base model, S's model's hash for runs from it).

    python3 lab/pool.py --queue lab/queues/verdicts_4.txt --done lab/queues/verdicts_4.done --tag session15_call2 \
        --seconds 560 [--plan] [--fill-tail]
                                   # --plan: print what it would start, and exit; --fill-tail: in the call's last
                                   # minutes, start GRPO runs that cannot end in time; they checkpoint, are killed
                                   # at the deadline (rc 124) and resume in the next call on this warm machine
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

GIB = 1024**3
RESERVE_GIB = 4.0  # left free on the card: the MPS server, contexts that outgrow their share
OVERHEAD_GIB = 1.0  # a process's CUDA context and non-PyTorch memory, beyond its --gpu-memory-fraction
MAX_AT_ONCE = 14  # 12 at once gave 2.2 runs a GPU-minute on an H200 (CPU-bound: 16 cores)
BASE_BESIDE_PRE = 2  # base-model runs (SFT, GPU-heavy) started beside the start model's SFT: more slow it down
PACK_SECONDS = 25  # kept at the end of the call for packing
# --fill-tail starts a run with this share of its wall left: gpu-small's GRPO checkpoints every 15 of 40 steps
TAIL_SHARE = 0.5
SCALE = float(os.environ.get("POOL_SCALE", "1"))  # estimates × SCALE (a dry run with short fake flows)
PART_BYTES = 15 * 1024**2  # an archive part's limit (16 MiB a file comes back)
PRE = os.environ.get("POOL_PRE") or (  # POOL_PRE, POOL_DIFFICULTY: other commands (a dry run of the pool)
    "sft flows.sft_experiment --config params.yaml --profile gpu-small --sizes [1024] --filtered-data null "
    "--val-limit 128 --eval-every 64"
)
START_MODEL = Path("outputs/sft_experiment/best_model")
DIFFICULTY = os.environ.get("POOL_DIFFICULTY") or "difficulty flows.difficulty --config params.yaml --profile gpu-small"
TABLE = Path("outputs/difficulty/pass_rates.csv")
DEVRUN = Path("outputs/.devrun")


@dataclass(frozen=True)
class Kind:
    gib: float  # --gpu-memory-fraction × total (None: the flow takes no share, GiB only counted)
    wall: float  # seconds at 12 at once (records_session13/14 pool.txt; session 15's H100 walls at 6-8 at once)
    procs: int = 1  # processes that hold a CUDA context (one-step-off: trainer and engine)
    share: bool = True  # pass --gpu-memory-fraction
    resumes: bool = False  # a flows.grpo run that checkpoints and, started again in its folder, resumes


# GiB from the records: a GRPO run held 6.3 GiB at 0.07 of an H100 (5.5 GiB allowed) and ran out of it; 0.1 (7.9 GiB)
# held; E4_tb128 failed at 5.5 GiB with 3.4 GiB reserved unallocated (fragments), Expert Iteration at 5.5 GiB with 5.0
# allocated asking 0.4 more (an SFT micro-batch of 8,192 tokens). SFT (16,384 tokens a micro-batch, 49k vocabulary)
# holds its fp32 logits and their gradient: ~3 GiB each.
# E4's wall: session 18's H100 ran E4_tb64 in 336-405 s at 7 at once (400 estimated 297: one run killed at the end).
KINDS = {
    "grpo": Kind(8.0, 250, resumes=True),
    "clip": Kind(9.0, 290, resumes=True),
    "e4": Kind(10.0, 520, resumes=True),
    "dapo": Kind(8.0, 370, resumes=True),
    "recipe": Kind(8.0, 740, resumes=True),  # the RL recipe's candidates (lab/queues/rl_recipe.txt): 80 steps
    "async": Kind(9.0, 370, procs=2),
    # --backend vllm: the policy (~4 GiB with its reserve) and a colocated vLLM engine that sleeps while it trains;
    # session 8's H200 ran two in 194-269 s, few at once. It waits for vLLM to be carried (lab/carry_vllm.sh).
    "vllm": Kind(14.0, 300),
    "ei": Kind(11.0, 330),
    "sizes_a": Kind(18.0, 480),
    "sizes_b": Kind(18.0, 420),
    "pre": Kind(20.0, 230, share=False),
    "difficulty": Kind(8.0, 150, share=False),
}


BASE_MODEL = "smollm2-135m-instruct"  # an entry that names it starts from the base model, not the SFT start model


# An entry's kind: by its name (NAME_KINDS, then rl_*: the RL recipe's), else the first rule whose pattern its command
# matches, else "grpo"
NAME_KINDS = {"sft": "pre", "difficulty": "difficulty"}
KIND_RULES = [
    (r"flows\.sft_experiment .*\bfull\b", "sizes_a"),
    (r"flows\.sft_experiment", "sizes_b"),
    (r"flows\.expert_iteration", "ei"),
    (r"--backend vllm", "vllm"),
    (r"E4_tb", "e4"),
    (r"grpo_async_ablation", "async"),
    (r"\[(dapo|dynamic_sampling)\]", "dapo"),
    (r"\[(grpo_clip|grpo_no_clip|gspo|E2_tb\d+)\]", "clip"),
]


def kind_of(name: str, words: list[str]) -> str:
    if name in NAME_KINDS:
        return NAME_KINDS[name]
    if name.startswith("rl_"):
        return "recipe"
    text = " ".join(words)
    return next((kind for pattern, kind in KIND_RULES if re.search(pattern, text)), "grpo")


@dataclass
class Entry:
    name: str
    words: list[str]  # MODULE ARGS...
    refs: list[str]
    kind: str
    needs: str  # base | start | table | entry (the model of entry ``source``)
    source: str | None = None  # from=S: the entry whose saved model it starts from

    @property
    def module(self) -> str:
        return self.words[0]


def parse_queue(path: Path) -> list[Entry]:
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    entries = []
    for chunk in text.replace("\n", " ").split(";"):
        words = chunk.split()
        if not words:
            continue
        name, rest, refs, source = words[0], words[1:], [], None
        while rest and rest[0].startswith(("ref=", "from=")):
            key, _, value = rest.pop(0).partition("=")
            if key == "ref":
                refs = [r for r in value.split(",") if r]
            else:
                source = value
        kind = kind_of(name, rest)
        from_base = kind.startswith("sizes") or BASE_MODEL in rest  # SFT sizes; GRPO from the base model (prompts)
        needs = "entry" if source else "base" if from_base else "table" if "--difficulty-table" in rest else "start"
        entries.append(Entry(name, rest, refs, kind, needs, source))
    return entries


@functools.cache
def vllm_installed() -> bool:  # once a pool: pool_call.sh installs vLLM before the pool starts, never during it
    return importlib.util.find_spec("vllm") is not None


def engine_here(entry: Entry) -> bool:
    """Whether the engine ``entry`` asks for is on this machine: a ``--backend vllm`` run waits for vLLM (carried in
    parts over calls by lab/carry_vllm.sh), while its hf references run without it."""
    return entry.kind != "vllm" or vllm_installed()


def read_done(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        words = line.split()
        if words and not line.startswith("#"):
            rows.append({"name": words[0], **dict(w.split("=", 1) for w in words[1:] if "=" in w)})
    return rows


def complete(entry: Entry, done: list[dict]) -> bool:
    """Ended with rc 0, with each of its references, from one start model."""
    origins = {r["origin"] for r in done if r["name"] == entry.name and r.get("rc") == "0"}
    for ref in entry.refs:
        origins &= {r["origin"] for r in done if r["name"] == ref and r.get("rc") == "0"}
    return bool(origins)


def saved_model(name: str) -> Path:
    """Where entry ``name``'s flow saves its model (its ``--output-dir``'s best_model)."""
    return DEVRUN / name / "out" / "best_model"


def card() -> tuple[str, float, float]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[0]
    name, total, used = (x.strip() for x in out.split(","))
    return name, float(total) / 1024, float(used) / 1024


def folder_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    root = folder.resolve()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


class Pool:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.time()
        self.deadline = self.t0 + args.seconds - PACK_SECONDS
        self.tag = args.tag
        self.calldir = DEVRUN / self.tag
        self.calldir.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.calldir / "pool.log", "a")
        self.running: dict[str, tuple[subprocess.Popen, float, Entry, float]] = {}
        self.ended: dict[str, int] = {}
        self.walls: dict[str, int] = {}
        self.origin: str | None = None
        self.made: dict[str, str | None] = {}  # entry → the hash of its saved model here (from=ENTRY runs)
        self.gpu, self.total, used = card()
        self.cores = int(os.environ.get("POOL_CORES") or os.cpu_count() or 16)
        self.at_once = max(1, min(MAX_AT_ONCE, self.cores - 2))
        self.budget = self.total - RESERVE_GIB - used
        self.log(
            f"card {self.gpu}: {self.total:.1f} GiB, {used:.1f} in use; {self.cores} cores; at most "
            f"{self.at_once} at once in {self.budget:.1f} GiB; deadline in {self.deadline - self.t0:.0f} s"
        )
        for k, v in KINDS.items():
            self.log(
                f"  {k}: {v.gib:g} GiB"
                + (f" (--gpu-memory-fraction {self.fraction(k)})" if v.share else "")
                + f", about {v.wall:.0f} s at 12 at once"
            )

    def log(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:6.0f} s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def fraction(self, kind: str) -> str:
        return f"{min(0.9, KINDS[kind].gib / self.total):.3f}"

    def need(self, kind: str) -> float:
        k = KINDS[kind]
        return k.procs * (k.gib + OVERHEAD_GIB)

    def held(self) -> float:
        return sum(self.need(e.kind) for _, _, e, _ in self.running.values())

    def estimate(self, kind: str, at_once: int) -> float:
        """A run's wall with ``at_once`` running: in proportion to them (CPU-bound), from 8 up. Session 15's H100
        pools, memory-bound at 6-8 at once, ran GRPO in 150-200 s, E4_tb128 in 290, Expert Iteration in 160 and
        SFT [128,full] in 280-340, where the old floor (12) estimated 280, 430, 360 and 480: each pool stopped
        starting runs with 200 s of its call left."""
        return (KINDS[kind].wall * max(8, at_once) / 12 + 30) * SCALE

    def left(self) -> float:
        return self.deadline - time.time()

    def fits(self, entry: Entry) -> bool:
        n = len(self.running) + 1
        return n <= self.at_once and self.held() + self.need(entry.kind) <= self.budget and self.in_time(entry, n)

    def in_time(self, entry: Entry, n: int) -> bool:
        """Whether ``entry``, started now with ``n`` running, ends before the deadline or (``--fill-tail``) is a run
        that resumes and has time to pass its first checkpoints: killed at the deadline, it resumes in the next call
        on this warm machine, in a slot that would otherwise have stood idle (lost if the machine goes)."""
        wall = self.estimate(entry.kind, n)
        if wall <= self.left():
            return True
        return self.args.fill_tail and KINDS[entry.kind].resumes and self.left() >= TAIL_SHARE * wall

    def start(self, entry: Entry, own: bool = True) -> None:
        folder = DEVRUN / entry.name
        folder.mkdir(parents=True, exist_ok=True)
        words = list(entry.words)
        words = [
            w
            for i, w in enumerate(words)
            if not (w == "--gpu-memory-fraction" or (i and words[i - 1] == "--gpu-memory-fraction"))
        ]
        if entry.source:
            words += ["--model", str(saved_model(entry.source))]
        if KINDS[entry.kind].share:
            words += ["--gpu-memory-fraction", self.fraction(entry.kind)]
        if own:
            words += [
                "--tracking-uri",
                f"sqlite:///{folder}/mlflow.db",
                "--output-dir",
                f"{folder}/out",
                "--metrics-path",
                f"{folder}/metrics.json",
            ]
        env = {**os.environ, "OMP_NUM_THREADS": "4" if entry.kind == "pre" else "2"}
        cmd = [sys.executable, "-m", *words]
        log = open(folder / f"{entry.name}.log", "w")
        log.write(f"== {entry.name}: {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        now, wall = time.time(), self.estimate(entry.kind, len(self.running) + 1)
        self.running[entry.name] = (proc, now, entry, wall)
        with open(self.calldir / "pool.txt", "a") as f:
            f.write(f"{entry.name} start {int(now)}\n")
        tail = "; ends after the deadline: resumes in the next call" if wall > self.left() else ""
        self.log(
            f"start {entry.name} ({entry.kind}, {self.need(entry.kind):.0f} GiB, about {wall:.0f} s; "
            f"{len(self.running)} running, {self.held():.0f} GiB{tail})"
        )

    def reap(self) -> None:
        for name, (proc, began, _entry, _) in list(self.running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            self.finish(name, rc, began)

    def finish(self, name: str, rc: int, began: float) -> None:
        del self.running[name]
        now = time.time()
        self.ended[name], self.walls[name] = rc, int(now - began)
        with open(self.calldir / "pool.txt", "a") as f:
            f.write(f"{name} end {int(now)} rc={rc}\n")
        with open(self.calldir / "walls.txt", "a") as f:
            f.write(f"{name} call={self.tag} rc={rc} wall_s={int(now - began)}\n")
        self.log(f"end {name} rc={rc} in {int(now - began)} s")
        if rc != 0:
            tail = (DEVRUN / name / f"{name}.log").read_text(errors="replace").splitlines()[-12:]
            self.log("  " + "\n  ".join(line[:400] for line in tail))

    def kill_all(self, why: str) -> None:
        """Every running flow's process group: SIGTERM, 8 s, then SIGKILL (all at once); rc 124, or 0 for a run
        that had published its result (:meth:`finished_its_work`)."""
        if not self.running:
            return
        self.log(f"kill {' '.join(self.running)} ({why})")
        for sig, wait in ((signal.SIGTERM, 8), (signal.SIGKILL, 5)):
            for proc, *_ in self.running.values():
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            end = time.time() + wait
            while time.time() < end and any(p.poll() is None for p, *_ in self.running.values()):
                time.sleep(0.5)
        for name, (_proc, began, _, _) in list(self.running.items()):
            self.finish(name, 0 if self.finished_its_work(name, began) else 124, began)

    def finished_its_work(self, name: str, began: float) -> bool:
        """Whether a run killed at the deadline had already published its result (its ``run.json``, written after
        its MLflow runs ended): killed while the flow's temporary Prefect server stopped, its records are whole."""
        published = DEVRUN / name / "out" / "run.json"
        if published.exists() and published.stat().st_mtime >= began:
            self.log(f"{name}: its result was published before the kill; its records are whole (rc 0)")
            return True
        return False

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
        """The entries to try, in order: each incomplete one, after its references not yet ended from this start
        model (or, before it is known, not ended with rc 0 from any: the start model may be new)."""
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
            sources = [by_name[n].source for n in [*entry.refs, entry.name] if by_name[n].source]
            for source in sources:  # a model another call made is not on this machine: made again first
                if self.model_of(source) is None and source not in picked:
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
        self.pre = self.diff = None
        if not reuse:
            self.pre = Entry("sft", PRE.split()[1:], [], "pre", "base")
            self.start(self.pre, own=False)
        self.need_table = any(e.needs == "table" for e in todo)
        if self.need_table and not reuse:
            TABLE.unlink(missing_ok=True)  # from another start model
        while time.time() < self.deadline:
            self.reap()
            todo = self.after_start_model(todo)
            self.difficulty_when_ready()
            waiting = self.start_ready(todo)
            if not self.running and not waiting:
                break
            time.sleep(3)
        self.kill_all("the call's deadline")
        self.log(f"not started: {' '.join(e.name for e in todo) or 'none'}")

    def after_start_model(self, todo: list[Entry]) -> list[Entry]:
        """Once the start model's SFT ends: its record, or (it failed) only the runs from the base model."""
        if self.pre and "sft" in self.ended:
            if self.ended["sft"] != 0:
                self.log("start model failed: only the base-model runs go on")
                todo = [e for e in todo if e.needs == "base"]
            else:
                self.record_start_model()
            self.pre = None
        return todo

    def difficulty_when_ready(self) -> None:
        """The difficulty table, from the start model, once there is one and a run needs the table."""
        have_start = self.origin is not None
        if (
            have_start
            and self.need_table
            and not TABLE.exists()
            and self.diff is None
            and "difficulty" not in self.ended
        ):
            self.diff = Entry("difficulty", DIFFICULTY.split()[1:], [], "difficulty", "start")
            if self.estimate("difficulty", len(self.running) + 1) < self.left():
                self.start(self.diff, own=False)
        if self.diff and "difficulty" in self.ended:
            self.diff = None

    def start_ready(self, todo: list[Entry]) -> bool:
        """Start the entries whose inputs are there and that fit; whether any may still start (its inputs to come,
        or room and time for it)."""
        have_start = self.origin is not None
        waiting = False
        for entry in list(todo):
            ready = engine_here(entry) and (
                entry.needs == "base"
                or (entry.needs == "entry" and self.model_of(entry.source) is not None)
                or (have_start and (entry.needs == "start" or (entry.needs == "table" and TABLE.exists())))
            )
            if entry.needs == "base" and self.pre is not None:
                beside = sum(e.needs == "base" and e.kind != "pre" for _, _, e, _ in self.running.values())
                ready = ready and beside < BASE_BESIDE_PRE
            coming = engine_here(entry) and (
                self.pre is not None
                or (entry.needs == "table" and self.diff is not None)
                or (entry.needs == "entry" and entry.source in self.running)
            )
            if self.estimate(entry.kind, 1) <= self.left() and (ready or coming):
                waiting = True
            if entry.name in self.running or entry.name in self.ended or not ready:
                continue
            if self.fits(entry):
                self.start(entry)
                todo.remove(entry)
            elif len(self.running) >= self.at_once:
                break
        return waiting


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
    """The records of the runs that ended with rc 0, in parts under PART_BYTES; (name, archive) of each."""
    ok = [n for n, rc in pool.ended.items() if rc == 0]
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
            paths = [DEVRUN / name] + store_folders(DEVRUN / name / "mlflow.db")
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
        pool.log(f"packed {file.name}: {file.stat().st_size / 1e6:.1f} MB, {end - start} runs")
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
    ap.add_argument("--fill-tail", action="store_true", help="start resumable runs that end after the deadline")
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
    finally:
        pool.kill_all("the pool ended")
    if args.plan:
        return
    archive = dict(pack(pool, out))
    lines, by_name = [], {e.name: e for e in entries}
    for name, rc in pool.ended.items():
        origin = (pool.origin_of(by_name[name]) if name in by_name else pool.origin) or "none"

        lines.append(
            f"{name} rc={rc} origin={origin} call={pool.tag} archive={archive.get(name, '-')} "
            f"wall_s={pool.walls[name]} gpu={pool.gpu.replace(' ', '_')}"
        )
    (out / "done.txt").write_text("\n".join(lines) + "\n")
    (pool.calldir / "done.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    (out / "pool.log").write_text((pool.calldir / "pool.log").read_text())


if __name__ == "__main__":
    main()
