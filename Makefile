# Quick start:  make demo       (creates .venv, installs, runs the demo pilot on CPU)
#               make test       (the whole suite, a pytest-xdist worker per core: 10.5-18 minutes on the 2-core dev VM)
#               make test-fast  (the tests that start no process: pure logic, in-process; 47-89 s there)
# CUDA or ROCm users pick their torch build, e.g.
#   make demo TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.pilotrun-installed
# SkyPilot in a venv of its own: its click<8.2 would downgrade huggingface_hub and transformers in $(VENV). The tests
# load every task `pilotrun plan --skypilot` writes with its parser there (offline, HOME in a temp folder).
SKY_VENV   ?= .venv-skypilot
SKYPILOT_SPEC ?= skypilot==0.14.1
SKY_STAMP  := $(SKY_VENV)/.skypilot-installed
# pytest-xdist workers: one per core, at most 8 (each holds torch and starts pilots of its own).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 8 ] && n=8; echo $$n)

.PHONY: venv skypilot-venv demo test test-fast lint docs bench gpu-check clean

venv: $(STAMP)

skypilot-venv: $(SKY_STAMP)

$(SKY_STAMP):
	test -x $(SKY_VENV)/bin/python || $(PYTHON) -m venv $(SKY_VENV)
	@echo "pilotrun: installing $(SKYPILOT_SPEC) into $(SKY_VENV) for the task parser tests (about 40 s)"
	$(SKY_VENV)/bin/python -m pip install -q "$(SKYPILOT_SPEC)"
	touch $(SKY_STAMP)

# pip -q keeps the log short; the echo lines say what the minutes are spent on (a new user saw nothing for 2.5).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "pilotrun: installing $(TORCH_SPEC) into $(VENV) (a CPU wheel: seconds; a CUDA build: minutes)"
	$(PY) -m pip install -q $(TORCH_SPEC)
	@echo "pilotrun: installing pilotrun and its dependencies (transformers, datasets, ray, lightning, ...): 2-3 minutes"
	$(PY) -m pip install -q -e ".[dev]"
	@echo "pilotrun: installed into $(VENV)"
	touch $(STAMP)

demo: venv
	$(VENV)/bin/pilotrun run examples/tiny-sft/pilot.yaml

# The whole suite. --dist loadfile: each module on one worker (its module-scoped fixtures run once; not loadgroup,
# whose groups pytest 9.2 no longer passes to xdist 3.8's scheduler: node ids are computed now), the longest
# modules first (tests/conftest.py orders them; --no-loadscope-reorder keeps that order). Tests that start a process
# carry @pytest.mark.process. --durations: the 25 slowest tests at the end, to keep the suite's time in view.
test: venv skypilot-venv
	PILOTRUN_SKYPILOT_PYTHON=$(abspath $(SKY_VENV))/bin/python \
	  $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The edit loop: every test without @pytest.mark.process (pure logic in the test's own process).
test-fast: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not process"

# ruff and mypy are pinned in the dev extra; their caches stay out of the repository's file checks.
lint: venv
	$(VENV)/bin/ruff check --no-cache pilotrun tests bench examples
	$(VENV)/bin/mypy --cache-dir=/tmp/pilotrun-mypy-cache

# The documentation site (mkdocs.yml, docs/) into site/: --strict fails on a broken link or anchor, or a page left out
# of the nav. mkdocs and mkdocs-material are pinned in the dev extra (and the docs extra, for the site alone).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench: venv
	$(PY) bench/steady_step_overhead.py
	$(PY) bench/save_overhead.py
	$(PY) bench/estimate_accuracy.py
	$(PY) bench/distributed_estimate.py
	$(PY) bench/published_memory.py
	$(PY) bench/published_time.py

# On a lent GPU machine: gpu tests, demo + LoRA pilots per precision, estimate vs measured, catalog fit (< 8 min).
# Writes bench/results/gpu_check-<device>-<date>.{json,md}; commit them. `make gpu-check GPU_CHECK_ARGS=--dry` on a CPU.
GPU_CHECK_ARGS ?=
gpu-check: venv
	timeout 480 $(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf runs .pytest_cache .ruff_cache .mypy_cache
