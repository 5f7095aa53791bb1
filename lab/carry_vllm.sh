#!/usr/bin/env bash
# vLLM for a GPU machine that cannot reach PyPI and already has torch 2.11 + transformers (our device image), in
# parts small enough for one device call each.
#
#   lab/carry_vllm.sh build [PART_MB]   # here (PyPI reachable): .devV1/ .devV2/ ... each holding vllm.tar.xz.partN
#   PART_BYTES="3100000 14900000" lab/carry_vllm.sh parts VLLM_TAR_XZ DEPS_TAR_XZ
#                                       # the parts cut again (build with KEEP=1 keeps the two archives): the first
#                                       #   of the sizes given (what the other carried files leave in calls 1 and 2
#                                       #   of a pool's session), the rest in the last, with deps.tar.xz (call 3)
#   KEEP=1 lab/carry_vllm.sh build && lab/carry_vllm.sh check
#                                       # here, before any device time: the build's vLLM and packages imported as
#                                       #   the device would (Python 3.12, its torch and transformers and the image's
#                                       #   packages vLLM imports, site.tar.xz first): `from vllm import LLM`, the
#                                       #   engine core, the GPU model runner, the Qwen2/Llama models (no GPU: vLLM's
#                                       #   CUDA kernels are not loaded, so what imports them is not checked)
#   lab/carry_vllm.sh install DIR       # there: join the parts found under .devV*/ and unpack them into DIR
#                                       #   (then PYTHONPATH=/tmp/site:DIR); imports what an engine's start imports,
#                                       #   as check does, and prints versions
#
# What goes in (build): vLLM 0.26.0, the last release that pins the image's torch 2.11.0 (0.27 and later pin 2.13),
# and the pure-python or small binary packages it imports for a dense model's generation, each --no-deps at the
# versions below (resolved by pip against vLLM 0.26.0's requirements, cp312 manylinux x86_64). Left out: what
# lab/device_carry.sh's site.tar.xz carries (/tmp/site, first on PYTHONPATH: pydantic, fastapi, jsonschema, gguf,
# opentelemetry, ...; its cachetools 7.3.3 is the one vLLM imports), what vLLM never imports (anthropic) or loads
# only when a request asks for the outlines backend (outlines-core: llguidance stays, since a class of the
# structured-output module every engine imports annotates with its types, evaluated at import), what the
# image has (numpy, torch, triton, transformers, tokenizers, safetensors, huggingface_hub, protobuf, pillow, requests,
# aiohttp, ...), and what a dense Qwen2/Llama model's generation on Hopper never imports: FlashAttention 2 (Hopper runs
# FA3), the MoE, FlashMLA and QuTLASS kernels (each imported in a try; a dense model calls none), FlashInfer (its
# attention backend and sampler are off: VLLM_USE_FLASHINFER_SAMPLER=0), numba/llvmlite (n-gram speculative decoding
# only), the SM100 FMHA and the DeepGEMM builds for other Pythons, the Rust frontend binary, tilelang, cutlass-dsl,
# torchcodec, video codecs, mistral-common's tokenizer files and pycountry's translations: 83.2 MB in all (vLLM 69.2,
# its packages 14.0), which the three calls of a pool's session carry beside the packages, data and GGUF. PART_MB
# (default 44) leaves room for the tree that travels with each call.
# On the device: VLLM_USE_FLASHINFER_SAMPLER=0 (its sampler compiles kernels at first use).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_CONFIG_FILE=/dev/null  # PyPI only
PY=${PY:-/root/.pyenv/versions/3.12.1/bin/python}
PLATFORM=(--only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64
  --platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_12_x86_64
  --python-version 3.12 --implementation cp)

VLLM=vllm==0.26.0
# vLLM 0.26.0's imports for LLM.generate on CUDA, and theirs (pip's resolution, pinned). xgrammar 0.2.6: the last
# that accepts the apache-tvm-ffi 0.1.10 vLLM pins.
PACKAGES=(annotated-doc==0.0.7 anyio==4.16.0 apache-tvm-ffi==0.1.10 astor==0.8.1 blake3==1.0.11 cbor2==6.3.0
  compressed-tensors==0.17.0 depyf==0.20.0 dill==0.4.1 diskcache==5.6.3 distro==1.9.0 docstring-parser==0.18.0
  einops==0.8.2 h11==0.16.0 httpcore==1.0.9 httpx==0.28.1 ijson==3.6.0 interegular==0.3.3 httpx2==2.16.2
  httpcore2==2.16.2 jiter==0.19.0 lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3 loguru==0.7.3
  mistral-common==1.13.1 msgspec==0.23.0 ninja==1.13.2 nvidia-ml-py==13.615.71 nvtx==0.2.15 openai==3.57.0
  openai-harmony==0.0.8 opentelemetry-semantic-conventions-ai==0.5.1 partial-json-parser==0.2.1.1.post7
  prometheus-fastapi-instrumentator==8.1.0 py-cpuinfo==9.0.0 pybase64==1.5.1 pycountry==26.2.16
  python-json-logger==4.2.0 pyzmq==27.3.0 setproctitle==1.3.8 tabulate==0.10.0 uvloop==0.23.0 watchfiles==1.3.0
  xgrammar==0.2.6 zipp==3.23.0)
# vLLM files a dense model on Hopper does not load (each checked: imported in a try, or only by other hardware/models)
PRUNE=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/fmha_sm100
  vllm/_moe_C_stable_libtorch.abi3.so vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so vllm/_qutlass_C.abi3.so
  vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so
  vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so
  vllm/third_party/deep_gemm/include vllm/entrypoints/serve/instrumentator/static mistral_common/data pycountry/locales)

build() {  # build [PART_MB]: .devV1/ .devV2/ ... with vllm.tar.xz.partN (vLLM alone), the last also deps.tar.xz
  local part_mb=${1:-44} build=/tmp/carrybuild-vllm
  rm -rf "$build" && mkdir -p "$build/wheels" "$build/vllm" "$build/deps"
  [ -n "${KEEP:-}" ] || trap 'rm -rf /tmp/carrybuild-vllm' EXIT
  "$PY" -m venv "$build/venv" && "$build/venv/bin/python" -m pip install -q --upgrade pip
  local pip=("$build/venv/bin/python" -m pip)
  "${pip[@]}" download -q --no-deps "${PLATFORM[@]}" -d "$build/wheels" "$VLLM" "${PACKAGES[@]}"
  "${pip[@]}" install -q --no-deps --no-compile --target "$build/vllm" "$build"/wheels/vllm-*.whl
  rm "$build"/wheels/vllm-*.whl
  "${pip[@]}" install -q --no-deps --no-compile --target "$build/deps" "$build"/wheels/*.whl
  for dir in "$build/vllm" "$build/deps"; do
    (cd "$dir" && rm -rf "${PRUNE[@]}" bin include && find . -name __pycache__ -type d -prune -exec rm -rf {} +)
  done
  (cd "$build/deps" && du -sm -- * | sort -rn | head -8) || true
  XZ_OPT="-9 -T2" tar -C "$build/vllm" -cJf "$build/vllm.tar.xz" .
  XZ_OPT="-9 -T2" tar -C "$build/deps" -cJf "$build/deps.tar.xz" .
  parts "$build/vllm.tar.xz" "$build/deps.tar.xz" "$part_mb"
}

parts() {  # parts VLLM_TAR_XZ DEPS_TAR_XZ PART_MB: .devV1/ .devV2/ ..., vllm.tar.xz cut in parts of PART_MB, or of the
  # sizes in PART_BYTES (a list: the first parts, so as to fill what other carried files leave of each call; the rest
  # goes in one last part), the packages' deps.tar.xz with the last part (its arrival starts the install: pool_call.sh)
  local tar=$1 deps=$2 part_mb=$3 size offset=0 n=0 total
  total=$(stat -c %s "$tar")
  rm -rf .devV[0-9]*
  set -- ${PART_BYTES:-}  # the sizes given, one a part; then the rest in one part, or in parts of PART_MB
  while [ "$offset" -lt "$total" ]; do
    if [ $# -gt 0 ]; then size=$1 && shift
    elif [ -n "${PART_BYTES:-}" ]; then size=$((total - offset))
    else size=$((part_mb * 1024 * 1024)); fi
    n=$((n + 1)) && mkdir -p ".devV$n"
    dd if="$tar" of=".devV$n/vllm.tar.xz.part$n" bs=1M iflag=skip_bytes,count_bytes skip="$offset" count="$size" status=none
    offset=$((offset + size))
  done
  cp "$deps" ".devV$n/"
  ls -l .devV*/
}

stash() {  # stash: copy what this call carried (.devV*/) to /tmp/vllm_parts, which outlives the call on a warm machine
  mkdir -p /tmp/vllm_parts && cp .devV*/* /tmp/vllm_parts/ 2>/dev/null; ls -l /tmp/vllm_parts
}

install() {  # install DIR: join the stashed parts and unpack them, with the packages, into DIR; check the import
  local dir=$1 parts
  parts=$(ls /tmp/vllm_parts/vllm.tar.xz.part* 2>/dev/null | sort -V)
  [ -n "$parts" ] && [ -f /tmp/vllm_parts/deps.tar.xz ] || { echo "install: parts missing in /tmp/vllm_parts"; return 1; }
  mkdir -p "$dir" && cat $parts | tar -C "$dir" -xJf - && tar -C "$dir" -xJf /tmp/vllm_parts/deps.tar.xz
  imports python3 "/tmp/site:$dir${PYTHONPATH:+:$PYTHONPATH}"
}

imports() {  # imports PYTHON PYTHONPATH: what an engine's start imports (vLLM's LLM, engine core, GPU model runner,
  # the Qwen2/Llama models), then the versions
  PYTHONPATH="$2" VLLM_USE_FLASHINFER_SAMPLER=0 "$1" -c "
from vllm import LLM
import vllm, vllm.v1.engine.core, vllm.v1.worker.gpu_model_runner, torch, transformers
import vllm.model_executor.models.qwen2, vllm.model_executor.models.llama
print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, ': an engine start imports')"
}

check() {  # check: import the kept build (/tmp/carrybuild-vllm) as the device image would, in a Python 3.12 venv
  local build=/tmp/carrybuild-vllm venv=/tmp/carrycheck-venv site=/tmp/carrycheck-site
  [ -d "$build/vllm" ] && [ -d "$build/deps" ] \
    || { echo "check: no kept build (KEEP=1 lab/carry_vllm.sh build)"; return 1; }
  [ -x "$venv/bin/python" ] || { "$PY" -m venv "$venv" && "$venv/bin/python" -m pip install -q torch==2.11.0 \
    transformers==5.17.0 cloudpickle psutil urllib3 aiohttp requests pillow prometheus-client tiktoken; } || return 1
  rm -rf "$site" && mkdir -p "$site" && tar -C "$site" -xJf .devA/site.tar.xz
  imports "$venv/bin/python" "$site:$build/vllm:$build/deps"
}

case "${1:-}" in
  build) bash lab/ignore_carry.sh && build "${2:-44}" ;;  # the parts' folders out of every call first
  parts) bash lab/ignore_carry.sh && parts "${2:?parts VLLM_TAR_XZ DEPS_TAR_XZ [PART_MB]}" "${3:?deps.tar.xz}" "${4:-44}" ;;
  stash) stash ;;
  install) stash && install "${2:?install DIR}" ;;
  check) check ;;
  *) echo "usage: $0 build [PART_MB] | parts VLLM_TAR_XZ DEPS_TAR_XZ [PART_MB] | stash | install DIR | check"; exit 2 ;;
esac
