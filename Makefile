# The README's two commands. Each bootstraps .venv itself on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tunedjax-installed

.PHONY: test test-py312 test-native-sanitize demo notebooks bench bench-smoke device-wheels \
  clean-venv

# The install builds the native CPU kernels for this machine too (once; into
# ~/.cache/tunedjax/native), as a package with C extensions would: the first
# `make demo` then does not pay for the C++ build. Without a compiler it says so
# and goes on (tunedjax runs without them).
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,demo]'
	$(VENV)/bin/tunedjax native build || echo "native kernels not built; tunedjax works without them"
	@touch $(STAMP)

# The suite in two phases, both always run, failing if either fails: the tests
# that can share the cores in $(WORKERS) worker processes (pytest-xdist; a test
# module stays on one worker, so its module-scoped compiled fixtures compile
# once), then alone the tests marked `serial` (they time something, count page
# faults or wait on a time limit) and `default_compile` (below). ARGS go to
# both phases (`make test ARGS=tests/test_jit.py`); a phase that ARGS leave
# empty (pytest's exit status 5) is not a failure.
#
# The parallel phase compiles fast: its tests check what programs compute, not
# how fast, and most of the suite's time is XLA compiles. tests/fast_compile.py
# picks the flags this jaxlib knows: LLVM's optimisations off (XLA's backend
# optimisation level 0; the HLO passes all run), and on jaxlib 0.10 the loop
# emitters instead of the fusion emitters; a small program then compiles 2-5x
# faster. The serial phase, which times, keeps XLA's default, and so runs the
# few programs the loop emitters cannot (`default_compile`). Results may differ
# from the default build's in the last bits; a test comparing two programs
# bitwise compiles both in one phase, and child processes inherit the flags
# (tests/processes.py). `make test FAST_COMPILE=` runs both at the default;
# FAST_COMPILE="FLAGS" compiles the parallel phase with FLAGS.
WORKERS ?= 2
FAST_COMPILE ?= auto
SKIPPED := not bench_smoke and not native_checks
ALONE := (serial or default_compile)
SUITE = status=0; \
  fast=$$($(1) tests/fast_compile.py $(FAST_COMPILE)) || exit 1; \
  XLA_FLAGS="$$fast $$XLA_FLAGS" \
    $(1) -m pytest -n $(WORKERS) --dist loadfile -m "not $(ALONE) and $(SKIPPED)" $(ARGS) \
    || [ $$? -eq 5 ] || status=1; \
  $(1) -m pytest -m "$(ALONE) and $(SKIPPED)" $(ARGS) || [ $$? -eq 5 ] || status=1; \
  exit $$status

test: $(STAMP)
	$(call SUITE,$(PY))

# CI's second environment: the suite on Python 3.12 with the newest JAX the pin
# allows, in its own venv. .ci/find-python312 finds the interpreter (PATH, pyenv)
# and says so when there is none; PYTHON312=/path/to/python3.12 overrides it.
VENV312 ?= .venv312
PY312 := $(VENV312)/bin/python
STAMP312 := $(VENV312)/.tunedjax-installed

$(STAMP312): pyproject.toml
	@test -x $(PY312) || { python312=$$(.ci/find-python312) && $$python312 -m venv $(VENV312); }
	$(PY312) -m pip install --quiet --upgrade pip
	$(PY312) -m pip install --quiet --upgrade -e '.[test,demo]'
	@touch $(STAMP312)

test-py312: $(STAMP312)
	@$(PY312) -c "import sys, jax, jaxlib, flax; print('Python', sys.version.split()[0], '| jax', jax.__version__, '| jaxlib', jaxlib.__version__, '| flax', flax.__version__)"
	$(call SUITE,$(PY312))

# The native C++ kernels' tests (tests/test_native_*.py, tests/autotune/test_*native*.py)
# with every source built under AddressSanitizer and UndefinedBehaviorSanitizer:
# TUNEDJAX_NATIVE_SANITIZE=1 builds them with -fsanitize=address,undefined into
# "<digest>-sanitize" folders apart from the normal libraries. .ci/native-sanitize
# gives Python what it needs to load them (LD_PRELOAD of the ASan runtime and
# libstdc++, ASAN_OPTIONS=detect_leaks=0; the script says why), checks that every
# source built instrumented, and fails on a failed test or any sanitizer report
# (reports and logs in build/native-sanitize/). CI runs it after the two
# environments. TUNEDJAX_NATIVE_CXX=clang++ checks clang's build instead (Debian:
# apt-get install -y clang); extra arguments go to pytest: make
# test-native-sanitize ARGS="-k edges".
test-native-sanitize: $(STAMP)
	.ci/native-sanitize $(PY) $(ARGS)

# The same training twice, default and with set_config(None), side by side
# (under 3 minutes on 2 cores). Run it again: the second run tunes nothing.
demo: $(STAMP)
	$(VENV)/bin/tunedjax demo

# Re-run every notebook at full size and save its outputs in the file.
notebooks: $(STAMP)
	$(PY) notebooks/execute.py

# Every CPU benchmark of benchmarks/harness/registry.py, one after another (an
# hour or more on 2 quiet cores); each rewrites its own sections of BENCHMARKS.md.
# Run one alone with `$(PY) benchmarks/run.py NAME --write`, or `--quick` for a
# smoke run; benchmarks/README.md says how to add one.
bench: $(STAMP)
	$(PY) benchmarks/run.py all --write

# Every benchmark's --quick run (those not in `make test`; about 8 minutes), then
# the train step with each kernel of each family pinned (tests/ops/test_step_pinned_kernels.py,
# about 5 minutes),
# nothing written.
bench-smoke: $(STAMP)
	$(PY) -m pytest tests/test_docs.py -m "bench_smoke or not bench_smoke" -k benchmark
	$(PY) -m pytest tests/ops/test_step_pinned_kernels.py -m "bench_smoke or not bench_smoke"

# The Python 3.12 wheels the GPU image lacks (it has jax 0.11 with CUDA, flax,
# optax, torch): grain and two of its dependencies and the tested orbax-checkpoint,
# into .whl/ (git-ignored, carried to the device machine; 6 MiB); tunedjax runs
# from src/. `.ci/device-wheels --dry-run` prints what it fetches.
# BENCHMARKS.md, "GPU", gives the device command that installs them and runs
# `benchmarks/run.py gpu --json`.
device-wheels:
	PYTHON=$(PYTHON) .ci/device-wheels .whl

clean-venv:
	rm -rf $(VENV) $(VENV312)
