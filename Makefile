# The README's two commands. Each bootstraps .venv itself on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tunedjax-installed

.PHONY: test demo notebooks bench bench-smoke clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,demo]'
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

# The same training twice, default and with set_config(None), side by side
# (under 3 minutes on 2 cores). Run it again: the second run tunes nothing.
demo: $(STAMP)
	$(VENV)/bin/tunedjax demo

# Re-run every notebook at full size and save its outputs in the file.
notebooks: $(STAMP)
	$(PY) notebooks/execute.py

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
