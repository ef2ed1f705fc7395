# Quick start:  make demo   (creates .venv, installs, runs the demo pilot on CPU)
#               make test   (the whole suite)
# CUDA or ROCm users pick their torch build, e.g.
#   make demo TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.pilotrun-installed

.PHONY: venv demo test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: venv
	$(VENV)/bin/pilotrun run examples/tiny-sft/pilot.yaml

test: venv
	$(PY) -m pytest -q

# ruff and mypy are pinned in the dev extra; their caches stay out of the repository's file checks.
lint: venv
	$(VENV)/bin/ruff check --no-cache pilotrun tests bench examples
	$(VENV)/bin/mypy --cache-dir=/tmp/pilotrun-mypy-cache

bench: venv
	$(PY) bench/steady_step_overhead.py
	$(PY) bench/save_overhead.py
	$(PY) bench/estimate_accuracy.py
	$(PY) bench/distributed_estimate.py

clean:
	rm -rf runs .pytest_cache .ruff_cache .mypy_cache
