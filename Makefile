# The README's two commands. Each bootstraps .venv itself on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tunedjax-installed

.PHONY: test demo bench clean-venv

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

bench: $(STAMP)
	$(PY) benchmarks/rewrite_overhead.py --write

clean-venv:
	rm -rf $(VENV)
