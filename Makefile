# The README's two commands. Each bootstraps .venv itself on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tunedjax-installed

.PHONY: test demo bench bench-smoke clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	@echo "make demo arrives with tunedjax.Trainer (see the README's status table)."
	@echo "Today: $(VENV)/bin/tunedjax info"
	$(VENV)/bin/tunedjax info

# Every benchmark, one after another (about 30 minutes on 2 quiet cores); each
# rewrites its own section of BENCHMARKS.md. Run one alone with
# `$(PY) benchmarks/<name>.py --write`, or `--quick` for a smoke run.
bench: $(STAMP)
	$(PY) benchmarks/rewrite_overhead.py --write
	$(PY) benchmarks/kernels.py --write
	$(PY) benchmarks/layout.py --image 112 --rounds 9 --write
	$(PY) benchmarks/mixed_precision.py --write
	$(PY) benchmarks/input_pipeline.py --write
	$(PY) benchmarks/jit_overhead.py --write
	$(PY) benchmarks/trainer.py --write

# Every benchmark's --quick run (about 8 minutes), nothing written.
bench-smoke: $(STAMP)
	$(PY) -m pytest tests/test_docs.py -m "bench_smoke or not bench_smoke" -k benchmark

clean-venv:
	rm -rf $(VENV)
