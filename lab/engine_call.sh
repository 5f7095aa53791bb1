#!/usr/bin/env bash
# The hf engine's decode loop before and after its token step (one call a token, one read-back a stop check), side
# by side in one device call: benchmarks/roofline.py at batch 256, then 64, then benchmarks/rollout.py (shrinking
# decode, Gumbel-max, fixed then varied lengths), each for the old code (commit 608655a) and the new (this branch),
# each under its own timeout, the most important first (batch 256, old then new), within BUDGET seconds in all; last,
# if time is left, the host syncs of one warm generate, old and new (torch.cuda's sync debug mode). PIECES (names
# from old_/new_ r256 r64 rollout syncs, in order) runs others.
#
#   lab/engine_call.sh build [ROOT]   # on the CPU machine: ROOT/.devE (default /work/main), carried by the call:
#                                     #   base/ and new/ (a5core + benchmarks of 608655a and of this checkout's HEAD,
#                                     #   by git archive), site.tar.xz (pydantic, pydantic-core, annotated-types,
#                                     #   typing-inspection: cp312 manylinux x86_64 wheels, unpacked; what a5core.engines
#                                     #   imports that the device image lacks), qwen.tar.xz (Qwen2.5-Math-1.5B's config
#                                     #   and tokenizer: the benchmarks' architecture at random weights), and a copy of
#                                     #   this script; /.devE/ is added to ROOT's .git/info/exclude first
#   bash .devE/engine_call.sh run     # on the device, from the tree's root: everything under $OUT (per piece NAME:
#                                     #   NAME.log, NAME.results.md, the table it appended to RESULTS.md), and
#                                     #   summary.txt: old beside new, column by column
#   OUT=/tmp/o BUDGET=3000 PYTHON=/work/main/.venv/bin/python ROOFLINE_EXTRA='--tiny --batches 16 --prompt 16 --new 32' \
#     ROLLOUT_EXTRA='--tiny --batch 8 --prompt 16 --new 40' E=/work/main/.devE bash lab/engine_call.sh run
#                                     # the same on the CPU, at --tiny sizes (a check that it runs: no timings)
#
# BUDGET (default 470 s): no piece starts with less than MIN_START (default 45) seconds left, and each piece's timeout
# is cut to what is left. Both codes run in the same process environment and share torch.compile's on-disk caches:
# graphs alike (the roofline's bare decode step in both; each engine's step at the roofline's and the rollouts' shapes)
# compile faster the second time; the timings exclude compiling (the rollouts' "first call" rows include it). The
# rollouts generate ROLLOUT_NEW (default 256) tokens a row, not rollout.py's 512: a cache of 200 + 256 columns, the
# roofline's, so that their compiled steps come from the cache and both codes' rollouts fit the budget. Each script runs
# through a wrapper that prints torch.compile's counters at its end (graphs compiled, CUDA graph skips, graph breaks),
# with TORCH_LOGS=recompiles: each recompilation's reason in the log.
set -uo pipefail
BASE_COMMIT=608655a  # the code before the token loop (its engine is main's until 3887490)
ENGINE_SITE=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)
PLATFORM=(--only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux_2_28_x86_64 --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
QWEN_FILES=(config.json generation_config.json tokenizer_config.json vocab.json merges.txt tokenizer.json)

build() {
  local here root=${1:-/work/main} stage
  here=$(cd "$(dirname "$0")/.." && pwd)
  local exclude
  exclude="$(git -C "$root" rev-parse --git-common-dir)/info/exclude"
  [[ $exclude = /* ]] || exclude="$root/$exclude"
  mkdir -p "$(dirname "$exclude")" && touch "$exclude"
  grep -qxF '/.devE/' "$exclude" || echo '/.devE/' >> "$exclude"
  rm -rf "$root/.devE" && mkdir -p "$root/.devE/base" "$root/.devE/new"
  git -C "$here" archive "$BASE_COMMIT" a5core benchmarks | tar -x -C "$root/.devE/base"
  git -C "$here" archive HEAD a5core benchmarks | tar -x -C "$root/.devE/new"
  git -C "$here" rev-parse HEAD > "$root/.devE/new/COMMIT"
  echo "$BASE_COMMIT" > "$root/.devE/base/COMMIT"
  stage=$(mktemp -d)
  local py=${PY:-/root/.pyenv/versions/3.12.1/bin/python}
  PIP_CONFIG_FILE=/dev/null "$py" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$stage/wheels" "${ENGINE_SITE[@]}" \
    || { echo "build: pip download failed"; rm -rf "$stage"; return 1; }
  mkdir -p "$stage/site"
  for wheel in "$stage"/wheels/*.whl; do "$py" -m zipfile -e "$wheel" "$stage/site"; done
  XZ_OPT=-9 tar -C "$stage/site" -cJf "$root/.devE/site.tar.xz" .
  mkdir -p "$stage/q/qwen2.5-math-1.5b"
  for f in "${QWEN_FILES[@]}"; do cp "$here/../shared/data/qwen2.5-math-1.5b/$f" "$stage/q/qwen2.5-math-1.5b/"; done
  XZ_OPT=-9 tar -C "$stage/q" -cJf "$root/.devE/qwen.tar.xz" qwen2.5-math-1.5b
  cp "$here/lab/engine_call.sh" "$root/.devE/engine_call.sh"
  rm -rf "$stage"
  du -sh "$root/.devE" && ls -l "$root/.devE"
  git -C "$root" status --short --ignored .devE
}

piece() {  # piece NAME CODE LIMIT SCRIPT ARGS...: CODE's SCRIPT under timeout, its log and new results under $OUT
  local name=$1 code=$2 limit=$3
  shift 3
  local left=$((BUDGET - (SECONDS - T0)))
  if ((left < MIN_START)); then
    echo "$name: not started ($left s left)" | tee -a "$OUT/times.txt"
    return
  fi
  ((limit > left)) && limit=$left
  local results=$WORK/$code/benchmarks/RESULTS.md lines start=$SECONDS rc
  lines=$(wc -l < "$results")
  echo "== $name ($code, $(cat "$WORK/$code/COMMIT")): $* --model-dir $MODEL, at most $limit s" | tee "$OUT/$name.log"
  (cd "$WORK/$code" && timeout -k 10 "$limit" "$PYTHON" "$WORK/counted.py" "$@" --model-dir "$MODEL") \
    >> "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: rc $rc, $((SECONDS - start)) s (at $((SECONDS - T0)) s)" | tee -a "$OUT/times.txt"
  tail -n +$((lines + 1)) "$results" > "$OUT/$name.results.md"
  grep -E "^\[|greedy rows equal|ms a step, |outside the step|torch.compile counters|Recompiling" "$OUT/$name.log" \
    | tail -n 14
  summary > "$OUT/summary.txt" 2>&1  # after every piece: a later piece cut off leaves the earlier ones summed up
}

summary() {  # the tables of each pair (old_X, new_X) side by side, column by column; the rollouts' rows from the logs
  "$PYTHON" - "$OUT" <<'EOF'
import ast, pathlib, sys

out = pathlib.Path(sys.argv[1])


def table(path):
    """(settings line, header, rows) of the markdown table in a results file (else the one its log printed last:
    --tiny records none), or None."""
    text = path.read_text() if path.is_file() else ""
    log = path.with_name(path.name.replace(".results.md", ".log"))
    if not text.strip() and log.is_file():
        text = log.read_text()
        text = text[text.rfind("\n## ") :] if "\n## " in text else ""
    lines = [line for line in text.splitlines() if line.strip()]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")]
    settings = next((line for line in lines if line.startswith("device:")), "")
    return (settings, rows[0], rows[2:]) if len(rows) > 2 else None


def logged_rows(path):
    """The rows a benchmark printed as Python lists while it ran (rollout.py: one per timed call)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("['"):
            try:
                rows.append(ast.literal_eval(line))
            except (ValueError, SyntaxError):
                pass
    return rows


for name in ("syncs",):
    for label in ("old", "new"):
        log = out / f"{label}_{name}.log"
        for line in log.read_text().splitlines() if log.is_file() else []:
            if "host syncs" in line:
                print(f"  {label}: {line}")
for name in ("r256", "r64", "rollout"):
    old, new = table(out / f"old_{name}.results.md"), table(out / f"new_{name}.results.md")
    print(f"==== {name}: old (608655a) | new (engine-loop)")
    for label, t in (("old", old), ("new", new)):
        if t:
            print(f"{label}: {t[0]}")
    if old and new and old[1] == new[1] and name != "rollout":
        for i, column in enumerate(old[1]):
            print(f"  {column[:60]:60} | {old[2][0][i]:>24} | {new[2][0][i]}")
        continue
    for label in ("old", "new"):
        t = old if label == "old" else new
        if t and name != "rollout":
            for i, column in enumerate(t[1]):
                print(f"  {label} {column[:60]:60} | {t[2][0][i]}")
        for row in logged_rows(out / f"{label}_{name}.log") if name == "rollout" else []:
            print(f"  {label}: {row[0][:90]:90} {row[1]:>6} s {row[2]:>8} tok/s")
        log = out / f"{label}_{name}.log"
        for line in log.read_text().splitlines() if log.is_file() else []:
            if line.startswith(("greedy rows equal", "torch.compile counters")):
                print(f"  {label}: {line}")
        if log.is_file():
            print(f"  {label}: recompilations logged: {log.read_text().count('Recompiling function')}")
EOF
}

run() {
  OUT=${OUT:?set OUT, the folder that comes back}
  BUDGET=${BUDGET:-470}
  MIN_START=${MIN_START:-45}
  PYTHON=${PYTHON:-$(command -v python || command -v python3)}
  T0=$SECONDS
  local e=${E:-.devE}
  WORK=/tmp/engine_call
  rm -rf "$WORK" && mkdir -p "$WORK/site" "$WORK/q" "$OUT"
  cp -r "$e/base" "$e/new" "$WORK/"
  tar -C "$WORK/site" -xJf "$e/site.tar.xz" && tar -C "$WORK/q" -xJf "$e/qwen.tar.xz" || { echo "unpack failed"; exit 1; }
  MODEL=$WORK/q/qwen2.5-math-1.5b
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
  cat > "$WORK/counted.py" << 'PY'
"""Run a benchmark script (argv[1], its arguments after) as __main__; at its end print torch.compile's counters."""
import atexit
import runpy
import sys


def report():
    from torch._dynamo.utils import counters

    picked = {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    print("torch.compile counters (since the script's last torch._dynamo.reset):", picked, flush=True)


atexit.register(report)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
PY
  cat > "$WORK/syncs.py" << 'PY'
"""The hf engine's host syncs in one warm generate (rows of 200-token prompts, 256 new tokens, temperature 1, stop
'</answer>', min_tokens = max_tokens as the benchmarks), counted by torch.cuda's sync debug mode, which warns at each;
run from the code's root (its a5core and benchmarks). Arguments: the roofline's (--model-dir, --tiny, --batches N)."""
import collections
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
import argparse  # noqa: E402

import torch  # noqa: E402

from a5core.engines import SamplingSettings  # noqa: E402
from a5core.engines.hf import HFEngine  # noqa: E402
from benchmarks import _model  # noqa: E402
from benchmarks.rollout import prompts_of  # noqa: E402

parser = argparse.ArgumentParser()
_model.add_arguments(parser)
parser.add_argument("--batches", type=int, nargs="+", default=[256])
parser.add_argument("--prompt", type=int, default=200)
parser.add_argument("--new", type=int, default=256)
args = parser.parse_args()
cuda = torch.cuda.is_available()
model, tokenizer, description = _model.build(args.model_dir, args.tiny, "cuda" if cuda else "cpu")
model.eval()
batch = args.batches[0]
prompts = prompts_of(tokenizer, batch, args.prompt, model.config.vocab_size)
engine = HFEngine(model, tokenizer, batch_size=batch)
s = SamplingSettings(temperature=1.0, max_tokens=args.new, min_tokens=args.new, seed=0)
for _ in range(2):
    engine.generate(prompts, s)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    start = time.perf_counter()
    engine.generate(prompts, s)
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
syncs = [w for w in caught if "synchroniz" in str(w.message)]
print(f"{description}, batch {batch}: {len(syncs)} host syncs in one warm generate of {args.new} tokens ({seconds:.2f} s)")
where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
print("host syncs by line:", where.most_common(12), flush=True)
PY
  # the carried packages (cp312) only where pydantic is missing: the device image; a venv keeps its own
  if "$PYTHON" -c "import pydantic" 2> /dev/null; then export PYTHONPATH=; else export PYTHONPATH=$WORK/site; fi
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PYTHON" -c "import torch, transformers, pydantic; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'pydantic', pydantic.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0))"
    for code in base new; do
      (cd "$WORK/$code" && "$PYTHON" -c "import a5core.engines.hf; print('$code imports', '$(cat "$WORK/$code/COMMIT")')")
    done
  } 2>&1 | tee "$OUT/setup.txt"
  echo "setup: $((SECONDS - T0)) s" | tee -a "$OUT/times.txt"
  local rollout=(benchmarks/rollout.py --skip-baseline --decodes shrinking --samplers gumbel-max --new "${ROLLOUT_NEW:-256}")
  local extra_roofline extra_rollout name code
  read -ra extra_roofline <<< "${ROOFLINE_EXTRA:-}"
  read -ra extra_rollout <<< "${ROLLOUT_EXTRA:-}"
  for name in ${PIECES:-old_r256 new_r256 old_r64 new_r64 old_rollout new_rollout old_syncs new_syncs}; do
    code=$([[ $name = old_* ]] && echo base || echo new)
    case ${name#*_} in
      r256) piece "$name" "$code" 150 benchmarks/roofline.py --batches 256 "${extra_roofline[@]}" ;;
      r64) piece "$name" "$code" 110 benchmarks/roofline.py --batches 64 "${extra_roofline[@]}" ;;
      rollout) piece "$name" "$code" 130 "${rollout[@]}" "${extra_rollout[@]}" ;;
      syncs) piece "$name" "$code" 90 "$WORK/syncs.py" "${extra_roofline[@]}" ;;
      *) echo "unknown piece $name" ;;
    esac
  done
  cat "$OUT/summary.txt"
  echo "total: $((SECONDS - T0)) s"
}

case "${1:-run}" in
  build) build "${2:-}" ;;
  run) run ;;
  *) echo "usage: $0 build [ROOT] | run"; exit 2 ;;
esac
