"""Host memory (`tunedjax._host_memory`): what `import tunedjax` does to glibc's malloc:
decided by measurement (``auto``, the default), forced (``retain``) or never (``default``).

The import-time behaviour is checked in fresh processes: each runs a function
under `tunedjax.jit` whose temporaries (five 16 MiB buffers, kept alive together
by an optimization barrier: 80 MiB, more than a glibc thread arena can hold as
one block) are allocated by XLA:CPU, and counts the minor page faults of each
call after warm-up (the median of 15 calls). Page faults are counted, not
timed, so these tests do not depend on the machine's load.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import types

import numpy as np
import pytest

import tunedjax as tj
from tests import processes
from tunedjax import _host_memory
from tunedjax._host_memory import _decisions, _xla

# Page-fault counts and the first process's decision: not beside other tests
# (the serial phase of `make test`).
pytestmark = pytest.mark.serial
TEMP_BYTES = 80 * 2**20
PAGES = TEMP_BYTES // 4096

# Runs in a fresh process: argv[1] = "jax-first" starts JAX's backend before
# importing tunedjax. Prints the status (at import and at the end) and the page
# faults per call. The workload is this code (`python -c`): CODE + a comment is
# another workload.
_CHILD = r"""
import json, resource, statistics, sys, warnings
warnings.simplefilter("always")
if sys.argv[1] == "jax-first":
  import jax.numpy as jnp
  jnp.ones(3).block_until_ready()
with warnings.catch_warnings(record=True) as caught:
  import tunedjax as tj
  at_import = tj.host_memory_status().to_dict()
import jax, jax.numpy as jnp
from tunedjax._host_memory import CallProbe
FIRST_SPAN = CallProbe.WARMUP + CallProbe.SPANS[0]  # tunedjax.jit's first measurement
if sys.argv[1] == "tiny":  # the same workload, now with tiny calls only
  tiny = tj.jit(lambda v: v * 2.0)
  for _ in range(FIRST_SPAN + 2):
    tiny(jnp.ones(4)).block_until_ready()
  print(json.dumps({"status": tj.host_memory_status().to_dict()}))
  sys.exit(0)

@tj.jit
def f(x):  # 80 MiB of temporaries: five 16 MiB concatenations, kept alive by the barrier
  parts = tuple(jnp.concatenate([x * (i + 2.0), x * (i + 3.0)]) for i in range(5))
  return sum(p.sum() for p in jax.lax.optimization_barrier(parts))

x = jnp.arange(TEMP_BYTES // 40, dtype=jnp.float32) / 1e6
assert f.lower(x).compile().memory_analysis().temp_size_in_bytes >= TEMP_BYTES
for _ in range(FIRST_SPAN + 2):  # tunedjax.jit measures calls 4-11 while deciding
  f(x).block_until_ready()
faults = []
for _ in range(15):  # the heap may still grow in a few calls: the median is the steady state
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(x).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
import numpy as np
block = np.ones(64 * 2**20 // 8)  # with the settings, from the heap: mapping is off
del block
released = tj.release_host_memory()
print(json.dumps({"status": tj.host_memory_status().to_dict(), "at_import": at_import,
                  "faults": statistics.median(faults), "released": released,
                  "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))
""".replace("TEMP_BYTES", str(TEMP_BYTES))


# Every variable the decision reads: cleared, so the machine's environment cannot steer a test.
_ALLOCATOR_ENV = (*_host_memory._MALLOC_ENV, "GLIBC_TUNABLES", "LD_PRELOAD", _host_memory.ENV_VAR)


def _clean_env(**extra: str) -> dict[str, str]:
  env = processes.cpu_env()
  for name in _ALLOCATOR_ENV:
    env.pop(name, None)
  # A private cache: a child's decisions never reach the user's.
  env["TUNEDJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="tunedjax-host-memory-test-")
  return {**env, **extra}


def _child(order: str = "tunedjax-first", *, code: str = _CHILD, **env: str) -> dict:
  out = subprocess.run([sys.executable, "-c", code, order], capture_output=True, text=True,
                       env=_clean_env(**env), cwd=processes.ROOT, timeout=240, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  return processes.last_json(out.stdout)


def _records(folder: pathlib.Path) -> list[dict]:
  data = json.loads((folder / _decisions.FILE_NAME).read_text())
  assert data["format"] == _decisions.FORMAT
  return data["records"]


needs_glibc = pytest.mark.skipif(_host_memory._glibc() is None,
                                 reason="the host-memory settings are glibc's")


RETAIN = {_host_memory.ENV_VAR: "retain"}


@needs_glibc
def test_retain_reuses_memory_so_a_step_does_not_fault_its_temporaries_again(tmp_path):
  retained = _child(**RETAIN, TUNEDJAX_CACHE_DIR=str(tmp_path))
  assert retained["status"]["applied"] is True
  assert retained["status"]["settings"] == _host_memory.SETTINGS
  assert retained["warnings"] == []
  assert retained["faults"] < 0.05 * PAGES, retained
  assert retained["released"] is True  # the freed 64 MiB block went back to the OS
  assert not (tmp_path / _decisions.FILE_NAME).exists()  # forced: nothing measured


@needs_glibc
def test_auto_measures_records_and_applies_from_the_next_import_of_that_workload_only(tmp_path):
  cache = {"TUNEDJAX_CACHE_DIR": str(tmp_path)}
  # Nothing decided yet: malloc untouched at import; the measured calls fault, and what
  # can act mid-process is set the moment the measurement shows it pays.
  first = _child(**cache)
  assert first["at_import"]["applied"] is False and first["at_import"]["settings"] == {}
  assert first["status"]["mode"] == "auto" and first["status"]["applied"] is True
  assert first["status"]["settings"] == _host_memory.RETENTION
  assert "in this process as soon as" in first["status"]["reason"]
  assert first["faults"] < 0.05 * PAGES, first
  assert first["warnings"] == []
  (record,) = _records(tmp_path)
  assert record["pays"] is True and record["program"] == "f"
  assert record["workload"] == first["status"]["workload"]
  assert record["workload"].startswith("python -c ")
  assert record["faults_per_call"] > 0.5 * PAGES  # measured before they were set
  assert first["status"]["decision"] == record

  second = _child(**cache)  # the same workload: all of them at import (one arena)
  assert second["at_import"]["applied"] is True
  assert second["status"]["settings"] == _host_memory.SETTINGS
  assert second["status"]["decision"] == record
  assert record["measured_at"] in second["status"]["reason"]
  assert second["faults"] < 0.05 * PAGES, second
  assert record in _records(tmp_path)  # its large program confirmed the decision

  other = _child(code=_CHILD + "# another workload\n", **cache)  # not this decision's
  assert other["at_import"]["applied"] is False  # its own first process: it measures
  assert other["status"]["workload"] != record["workload"]
  assert other["status"]["settings"] == _host_memory.RETENTION

  opted_out = _child(**cache, **{_host_memory.ENV_VAR: "default"})
  assert opted_out["status"] == {"mode": "default", "applied": False, "settings": {},
                                 "reason": opted_out["status"]["reason"], "workload": None,
                                 "decision": None}
  assert opted_out["faults"] > 0.5 * PAGES, opted_out
  assert record in _records(tmp_path)  # left as it was

  # The workload changed: applied, tiny calls only, so withdrawn at exit (measured again).
  tiny = _child("tiny", **cache)
  assert tiny["status"]["applied"] is True
  assert record not in _records(tmp_path)


@needs_glibc
def test_backend_started_before_import_warns_and_leaves_malloc_alone():
  got = _child("jax-first", **RETAIN)
  status = got["status"]
  assert status["applied"] is False and status["settings"] == {}
  assert "started before tunedjax was imported" in status["reason"]
  (warning,) = [w for w in got["warnings"] if w.startswith("HostMemoryWarning")]
  assert "Import tunedjax before running JAX code" in warning
  assert _host_memory.ENVIRONMENT_HINT in warning
  quiet = _child("jax-first")  # auto, nothing decided: nothing to warn about
  assert quiet["warnings"] == []
  # XLA read its flags when its backend started: its temporaries stay one block, which
  # only the next import's one arena keeps. Measured and recorded for it, and said so.
  assert "apply from the next import" in quiet["at_import"]["reason"]
  assert quiet["status"]["applied"] is False and quiet["faults"] > 0.5 * PAGES, quiet
  assert "recorded for the next import" in quiet["status"]["reason"]


def _decide(monkeypatch, folder: pathlib.Path | None = None, **env: str
            ) -> _host_memory.HostMemoryStatus:
  """The decision `configure` would make in this process under `env`, with its decisions
  in `folder` (mallopt is never called here: this process keeps its allocator)."""
  for name in _ALLOCATOR_ENV:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # what the decision adds is undone after
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  monkeypatch.setattr(_xla, "likely_cpu_only",  # no accelerator unless env says one
                      lambda: os.environ.get("JAX_PLATFORMS", "cpu").startswith("cpu"))
  monkeypatch.setattr(_host_memory, "_UNSPLIT", "not asked for")
  monkeypatch.setattr(_host_memory, "_STATUS", None)
  monkeypatch.setattr(_host_memory, "_MEASURING", False)
  monkeypatch.setattr(_host_memory, "_CONFIRMING", False)
  monkeypatch.setattr(_host_memory, "_MEASURED", [])
  monkeypatch.setattr(_host_memory, "_FOLDER", folder or pathlib.Path("/nonexistent/tunedjax"))
  monkeypatch.setattr(_host_memory, "_jax_default_backend_if_started", lambda: None)
  monkeypatch.setattr(_host_memory, "_mallopt", lambda libc, settings=None: None)  # "set"
  return _host_memory.configure()


def _paying_record(workload: str = "script /train.py", **changes) -> dict:
  record = _decisions.record_for(workload, faults=18_000.0, system_s=0.032, wall_s=0.046,
                                 program="step")
  return {**record, **changes}


@pytest.mark.parametrize("name,value", [("MALLOC_ARENA_MAX", "2"),
                                        ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),
                                        ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2"),
                                        ("LD_PRELOAD", "libtcmalloc_minimal.so.4")])
@pytest.mark.parametrize("mode", ["retain", "auto"])
def test_an_environment_that_tunes_malloc_is_respected(monkeypatch, tmp_path, name, value, mode):
  if _host_memory._glibc() is None:
    pytest.skip("the check follows the glibc check")
  monkeypatch.setattr(_decisions, "workload", lambda: "script /train.py")
  _decisions.store(tmp_path, _paying_record())
  status = _decide(monkeypatch, tmp_path, **{name: value, _host_memory.ENV_VAR: mode})
  assert status.applied is False and status.mode == mode
  assert status.reason == f"the environment already tunes malloc (${name})"
  assert not _host_memory.measuring()


def test_a_bad_mode_warns_naming_the_value_and_the_valid_ones(monkeypatch):
  with pytest.warns(tj.HostMemoryWarning) as caught:
    status = _decide(monkeypatch, **{_host_memory.ENV_VAR: "always"})
  (warning,) = [str(w.message) for w in caught]
  assert "'always'" in warning and "'auto', 'retain' or 'default'" in warning
  assert status.applied is False and not _host_memory.measuring()


def test_without_glibc_nothing_is_set(monkeypatch):
  monkeypatch.setattr(_host_memory, "_glibc", lambda: None)
  status = _decide(monkeypatch, **RETAIN)
  assert status == _host_memory.HostMemoryStatus(
      "retain", False, "the C library is not glibc (nothing to set)")
  assert tj.release_host_memory() is False


@needs_glibc
def test_auto_applies_a_paying_decision_for_this_machine_and_workload_only(monkeypatch, tmp_path):
  monkeypatch.setattr(_decisions, "workload", lambda: "script /train.py")
  other_machine = {**_decisions.machine(), "cpu": "another CPU"}
  _decisions.store(tmp_path, _paying_record(machine=other_machine))
  status = _decide(monkeypatch, tmp_path)
  assert not status.applied and status.decision is None and _host_memory.measuring()
  assert status.workload == "script /train.py"
  _decisions.store(tmp_path, _paying_record())
  status = _decide(monkeypatch, tmp_path)
  assert status.applied and status.settings == _host_memory.SETTINGS
  assert status.decision == _paying_record(measured_at=status.decision["measured_at"])
  assert "18,000 pages" in status.reason and _host_memory.measuring()  # to confirm it
  status = _decide(monkeypatch, tmp_path, **{_host_memory.ENV_VAR: "default"})
  assert not status.applied and status.decision is None and not _host_memory.measuring()


@needs_glibc
def test_a_paying_decision_after_jax_started_warns_and_leaves_malloc_alone(monkeypatch, tmp_path):
  monkeypatch.setattr(_decisions, "workload", lambda: "script /train.py")
  _decisions.store(tmp_path, _paying_record())
  with pytest.warns(tj.HostMemoryWarning, match="they pay for this workload"):
    _decide(monkeypatch, tmp_path)  # sets the environment; JAX's backend is then reported started
    monkeypatch.setattr(_host_memory, "_STATUS", None)
    monkeypatch.setattr(_host_memory, "_jax_default_backend_if_started", lambda: "cpu")
    status = _host_memory.configure()
  assert not status.applied and "started before tunedjax was imported" in status.reason


@pytest.mark.parametrize("text", ["{not json", '{"format": "x"}', "[]",
                                  '{"format": "tunedjax-host-memory", "version": 9}',
                                  '{"format": "tunedjax-host-memory", "version": 1}'])
def test_a_corrupt_decisions_file_warns_is_moved_aside_and_is_measured_again(
    monkeypatch, tmp_path, text):
  (tmp_path / _decisions.FILE_NAME).write_text(text)
  with pytest.warns(tj.HostMemoryWarning, match="is corrupt"):
    status = _decide(monkeypatch, tmp_path)
  assert not status.applied and _host_memory.measuring()
  assert (tmp_path / (_decisions.FILE_NAME + ".corrupt")).read_text() == text
  assert not (tmp_path / _decisions.FILE_NAME).exists()
  # Measured again: a paying program is recorded in a new file.
  monkeypatch.setattr(_host_memory, "_MEASURED", [])
  assert _host_memory.observe("step", faults=18_000, system_s=0.03, wall_s=0.05) is True
  (record,) = _records(tmp_path)
  assert record["pays"] and record["workload"] == status.workload


@pytest.mark.parametrize("bad", [{"pays": "yes"}, {"faults_per_call": float("nan")},
                                 {"machine": None}, {"measured_at": 3}])
def test_an_invalid_record_warns_and_is_ignored(monkeypatch, tmp_path, bad):
  monkeypatch.setattr(_decisions, "workload", lambda: "script /train.py")
  good = _paying_record("script /other.py")
  (tmp_path / _decisions.FILE_NAME).write_text(json.dumps(
      {"format": _decisions.FORMAT, "version": 1, "records": [_paying_record(**bad), good]}))
  with pytest.warns(tj.HostMemoryWarning, match="is not valid"):
    status = _decide(monkeypatch, tmp_path)
  assert not status.applied and _host_memory.measuring()
  with pytest.warns(tj.HostMemoryWarning, match="is not valid"):
    assert _decisions.load(tmp_path) == [good]


def test_observe_records_only_a_program_whose_faults_cost_and_keeps_memory_at_once(
    monkeypatch, tmp_path):
  _decide(monkeypatch, tmp_path)
  monkeypatch.setattr(_host_memory, "_MEASURED", [])
  set_now = []
  monkeypatch.setattr(_host_memory, "_mallopt", lambda libc, settings=None: set_now.append(
      settings))
  assert _host_memory.observe("tiny", faults=0, system_s=0.0, wall_s=2e-5) is False
  assert _host_memory.observe("few faults", faults=1000, system_s=0.002, wall_s=0.01) is False
  assert _host_memory.observe("cheap faults", faults=5000, system_s=0.01, wall_s=0.5) is False
  assert not (tmp_path / _decisions.FILE_NAME).exists() and _host_memory.measuring()
  assert set_now == [] and not _host_memory.host_memory_status().applied
  assert _host_memory.observe("step", faults=18_000, system_s=0.032, wall_s=0.046) is True
  assert [r["program"] for r in _host_memory.measurements()] == [
      "tiny", "few faults", "cheap faults", "step"]
  assert not _host_memory.measuring()  # decided: tunedjax.jit stops measuring
  assert set_now == [_host_memory.RETENTION]  # in this process, at once
  status = _host_memory.host_memory_status()
  assert status.applied and status.settings == _host_memory.RETENTION
  assert status.decision == _records(tmp_path)[0] and "18,000 pages" in status.reason
  assert "recorded for the next import" in status.reason


def test_memory_kept_per_xla_thread_must_fit_or_waits_for_the_next_import(monkeypatch, tmp_path):
  _decide(monkeypatch, tmp_path)
  set_now = []
  monkeypatch.setattr(_host_memory, "_mallopt", lambda libc, settings=None: set_now.append(1))
  monkeypatch.setattr("os.cpu_count", lambda: 4096)  # a copy per thread: more than a quarter
  assert _host_memory.observe("step", faults=18_000, system_s=0.032, wall_s=0.046) is True
  status = _host_memory.host_memory_status()
  assert set_now == [] and not status.applied and status.decision["pays"]
  assert "could take more than 25% of this machine's memory" in status.reason
  monkeypatch.setattr("os.cpu_count", lambda: 2)
  assert _host_memory._retention_fits(18_000) and not _host_memory._retention_fits(1e12)


def test_auto_has_xla_split_temporaries_where_it_can_still_act_on_the_cpu(monkeypatch, tmp_path):
  flag = _xla.HEAP_FLAG
  assert "in blocks of at most 48 MiB" in _decide(monkeypatch, tmp_path).reason
  assert os.environ["XLA_FLAGS"] == flag and _host_memory._UNSPLIT is None
  _decide(monkeypatch, tmp_path, XLA_FLAGS="--xla_cpu_enable_fast_math=false")
  assert os.environ["XLA_FLAGS"] == f"--xla_cpu_enable_fast_math=false {flag}"  # added
  theirs = f"--{_xla.HEAP_OPTION}=16777216"
  _decide(monkeypatch, tmp_path, XLA_FLAGS=theirs)
  assert os.environ["XLA_FLAGS"] == theirs and _host_memory._UNSPLIT is None  # kept
  status = _decide(monkeypatch, tmp_path, XLA_FLAGS=f"--{_xla.HEAP_OPTION}=-1")
  assert "apply from the next import" in status.reason and f"to -1" in status.reason
  for env in ({_host_memory.ENV_VAR: "default"}, RETAIN, {"MALLOC_ARENA_MAX": "2"}):
    _decide(monkeypatch, tmp_path, **env)
    assert "XLA_FLAGS" not in os.environ  # only where the process measures and may act
  _decide(monkeypatch, tmp_path)
  monkeypatch.delenv("XLA_FLAGS")
  monkeypatch.setattr(_xla, "likely_cpu_only", lambda: False)  # an accelerator reads it too
  monkeypatch.setattr(_host_memory, "_STATUS", None)
  status = _host_memory.configure()
  assert "XLA_FLAGS" not in os.environ and "may run on an accelerator" in status.reason
  # After JAX's backend started, XLA has read its flags: nothing added, and a paying
  # measurement waits for the next import.
  _decide(monkeypatch, tmp_path)
  monkeypatch.delenv("XLA_FLAGS")
  monkeypatch.setattr(_host_memory, "_jax_default_backend_if_started", lambda: "cpu")
  monkeypatch.setattr(_host_memory, "_STATUS", None)
  assert "started before tunedjax" in _host_memory.configure().reason
  assert "XLA_FLAGS" not in os.environ
  assert _host_memory.observe("step", faults=18_000, system_s=0.032, wall_s=0.046) is True
  status = _host_memory.host_memory_status()
  assert not status.applied and "recorded for the next import" in status.reason


def test_an_applied_decision_is_confirmed_by_a_large_program_or_withdrawn_at_exit(
    monkeypatch, tmp_path):
  monkeypatch.setattr(_decisions, "workload", lambda: "script /train.py")
  record = _paying_record()
  _decisions.store(tmp_path, record)
  assert _decide(monkeypatch, tmp_path).applied and _host_memory.measuring()
  assert _host_memory._withdraw_if_unconfirmed() is False  # nothing measured: no evidence
  _host_memory.observe("tiny", faults=0, system_s=0.0, wall_s=1e-4)
  assert _host_memory.measuring()
  assert _host_memory._withdraw_if_unconfirmed() is True
  assert _decisions.load(tmp_path) == []
  _decisions.store(tmp_path, record)
  assert _decide(monkeypatch, tmp_path).applied
  _host_memory.observe("tiny", faults=0, system_s=0.0, wall_s=1e-4)
  _host_memory.observe("step", faults=0, system_s=0.0, wall_s=0.03)  # with the settings
  assert not _host_memory.measuring()
  assert _host_memory._withdraw_if_unconfirmed() is False
  assert _decisions.load(tmp_path) == [record]


def test_a_readonly_cache_records_nothing(monkeypatch, tmp_path):
  _decide(monkeypatch, tmp_path)
  with tj.config_context({"cache": {"readonly": True}}):
    assert _host_memory.observe("step", faults=18_000, system_s=0.03, wall_s=0.05) is True
  assert not (tmp_path / _decisions.FILE_NAME).exists()
  status = _host_memory.host_memory_status()  # this process still keeps its memory
  assert status.applied and "recorded" not in status.reason


def test_tunedjax_jit_measures_spans_of_cpu_calls_then_nothing(monkeypatch, tmp_path):
  import jax
  import jax.numpy as jnp
  _decide(monkeypatch, tmp_path)
  seen = []

  def observe(program, **figures):
    seen.append((program, figures))
    return False  # never pays: every span is measured

  monkeypatch.setattr(_host_memory, "observe", observe)
  f = tj.jit(lambda x: jnp.tanh(x) * 2.0, level="O0")
  x = jnp.arange(16.0)
  probe = _host_memory.CallProbe
  for _ in range(probe.WARMUP + sum(probe.SPANS) + 2):
    np.testing.assert_allclose(f(x), np.tanh(np.arange(16.0)) * 2.0, rtol=1e-6)
  assert len(seen) == len(probe.SPANS)
  for program, figures in seen:
    assert program.endswith("<lambda>") and set(figures) == {"faults", "system_s", "wall_s"}
    assert figures["wall_s"] > 0 and figures["faults"] >= 0
  assert f._probe is None  # the calls after it go straight to the compiled program
  monkeypatch.setattr(_host_memory, "_MEASURING", False)
  assert tj.jit(jax.numpy.sin)._probe is None


def test_a_probe_stops_at_the_span_that_pays_and_averages_since_its_start(monkeypatch):
  """The faults of one call in three (XLA's threads fault a block in on some calls
  only) count at their mean per call, over every call since the warm-up."""
  seen = []
  monkeypatch.setattr(_host_memory, "measuring", lambda: True)
  monkeypatch.setattr(_host_memory, "observe",
                      lambda program, **figures: seen.append(figures) or len(seen) == 2)
  faults = iter(range(10**6))
  usage = types.SimpleNamespace(ru_minflt=0, ru_stime=0.0)

  def getrusage(_):
    return types.SimpleNamespace(ru_minflt=usage.ru_minflt, ru_stime=usage.ru_stime)

  monkeypatch.setattr(_host_memory.resource, "getrusage", getrusage)
  probe = _host_memory.CallProbe("step")

  def call():  # every third call (3, 6, ...) faults 12,000 pages, 30 ms in the kernel
    if next(faults) % 3 == 2:
      usage.ru_minflt += 12_000
      usage.ru_stime += 0.03
    return "out"

  calls = probe.WARMUP + sum(probe.SPANS[:2])
  assert [probe.call(call, lambda out: out) for _ in range(calls)] == ["out"] * calls
  assert probe.done and len(seen) == 2
  first, both = seen
  assert first["faults"] == pytest.approx(12_000 * 2 / 8)  # calls 4-11: 6 and 9 fault
  assert both["faults"] == pytest.approx(12_000 * 10 / 32)  # calls 4-35: 6, 9, ..., 33
  assert both["system_s"] == pytest.approx(0.03 * 10 / 32)
  assert first["wall_s"] > 0 and both["wall_s"] > 0


def test_workload_names_the_script_the_code_or_the_notebook(monkeypatch, tmp_path):
  script = tmp_path / "train.py"
  monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
  monkeypatch.setattr("sys.argv", [str(script), "--epochs", "3"])
  assert _decisions.workload() == f"script {script.resolve()}"
  monkeypatch.setattr("sys.argv", ["-c", "x"])
  monkeypatch.setattr("sys.orig_argv", ["python", "-c", "print(1)", "x"])
  one = _decisions.workload()
  monkeypatch.setattr("sys.orig_argv", ["python", "-c", "print(2)", "x"])
  assert one.startswith("python -c ") and _decisions.workload() != one
  monkeypatch.setattr("sys.argv", [""])
  assert _decisions.workload() == "interactive"
  monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/cnn.ipynb")
  assert _decisions.workload() == "notebook /home/me/cnn.ipynb"


@needs_glibc
def test_apply_for_training_acts_before_jax_starts_on_the_cpu_only(monkeypatch, tmp_path):
  calls = []
  _decide(monkeypatch, tmp_path, JAX_PLATFORMS="cpu")
  monkeypatch.setattr(_host_memory, "_mallopt", lambda libc, settings=None: calls.append(1))
  status = _host_memory.apply_for_training("a test started")
  assert status.applied and calls == [1] and "a test started" in status.reason
  # XLA's temporaries split: the arenas are left alone (one arena slows XLA's compiles).
  assert _host_memory._UNSPLIT is None and status.settings == _host_memory.RETENTION
  assert "in blocks of at most 48 MiB" in status.reason
  assert _host_memory.host_memory_status() is status and not _host_memory.measuring()
  assert _host_memory.apply_for_training("again") is status and calls == [1]
  for env, started in [({"JAX_PLATFORMS": "cuda,cpu"}, None), ({}, "cpu"),
                       ({_host_memory.ENV_VAR: "default", "JAX_PLATFORMS": "cpu"}, None)]:
    before = _decide(monkeypatch, tmp_path, **env)
    monkeypatch.setattr(_host_memory, "_jax_default_backend_if_started", lambda: started)
    assert _host_memory.apply_for_training("a test started") is before
    assert not before.applied


@needs_glibc
def test_apply_for_training_sets_every_setting_where_xla_keeps_one_block(monkeypatch, tmp_path):
  asked = []
  _decide(monkeypatch, tmp_path, JAX_PLATFORMS="cpu",
          XLA_FLAGS=f"--{_xla.HEAP_OPTION}={2**30}")  # the user's own heaps: not split
  assert _host_memory._UNSPLIT is not None
  monkeypatch.setattr(_host_memory, "_mallopt", lambda libc, settings=None: asked.append(settings))
  status = _host_memory.apply_for_training("a test started")
  assert asked == [_host_memory.SETTINGS] and status.settings == _host_memory.SETTINGS


def test_cpu_only_is_read_from_jax_platforms_or_the_installed_plugins(monkeypatch, tmp_path):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert _host_memory._likely_cpu_only() is True
  monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
  assert _host_memory._likely_cpu_only() is False
  monkeypatch.delenv("JAX_PLATFORMS")
  import importlib.metadata
  import importlib.util
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  monkeypatch.setattr("sys.path", [str(tmp_path)])
  (tmp_path / "numpy-2.0.dist-info").mkdir()  # a distribution without entry points
  (tmp_path / "tool-1.0.dist-info").mkdir()
  (tmp_path / "tool-1.0.dist-info" / "entry_points.txt").write_text("[console_scripts]\nt=t\n")
  assert _host_memory._likely_cpu_only() is True  # no plugin installed
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: name == "libtpu" or None)
  assert _host_memory._likely_cpu_only() is False
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  plugin = tmp_path / "jax_cuda12_plugin-0.10.2.dist-info"
  plugin.mkdir()
  (plugin / "entry_points.txt").write_text("[jax_plugins]\nxla_cuda12 = jax_cuda12_plugin\n")
  assert _host_memory._likely_cpu_only() is False
  # The same answer as importlib.metadata's, which reads the same files.
  assert _xla.jax_plugins_installed() == bool(importlib.metadata.entry_points(
      group="jax_plugins"))


def test_the_trainer_and_the_demo_command_ask_for_the_settings_first(monkeypatch):
  from tunedjax import cli
  from tunedjax import demo
  from tunedjax.trainer import Trainer
  from tests.trainer import models as m
  asked = []
  monkeypatch.setattr(_host_memory, "apply_for_training", lambda who: asked.append(who))
  Trainer(m.NnxMLP(), m.optimizer(), m.nnx_loss, autotune=False, progress=False)
  monkeypatch.setattr(demo, "run_demo", lambda *a, **k: asked.append("demo ran"))
  assert cli.main(["demo", "--quick", "--no-progress"]) == 0
  assert asked == ["a tunedjax Trainer was created", "tunedjax demo started", "demo ran"]


# Importing the command line and the Trainer starts no JAX backend, so `tunedjax demo`
# and a Trainer of a Flax linen model (unbound: no parameters yet) come first.
_FIRST_PROCESS = r"""
import json, sys
from tunedjax import _host_memory, cli
from tunedjax.trainer import Trainer
from tests.trainer import models as m
started = _host_memory._jax_default_backend_if_started()
Trainer(m.LinenMLP(), m.optimizer(), m.linen_loss, progress=False,
        example_batch=m.batches(m.regression_data(), 8)[0])
print(json.dumps({"started": started, "status": _host_memory.host_memory_status().to_dict()}))
"""


@needs_glibc
def test_a_trainer_created_first_applies_the_settings_in_the_first_process():
  out = subprocess.run([sys.executable, "-c", _FIRST_PROCESS], capture_output=True, text=True,
                       env=_clean_env(), cwd=processes.ROOT, timeout=240, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  got = processes.last_json(out.stdout)
  assert got["started"] is None
  assert got["status"]["applied"] is True
  assert "when a tunedjax Trainer was created" in got["status"]["reason"]


def test_status_is_decided_once(monkeypatch):
  first = tj.host_memory_status()
  monkeypatch.setenv(_host_memory.ENV_VAR, "retain" if first.mode != "retain" else "default")
  assert tj.host_memory_status() is first


def test_opting_out_changes_nothing_and_measures_nothing(monkeypatch):
  monkeypatch.setattr(_host_memory, "_glibc", lambda: pytest.fail("looked at the C library"))
  status = _decide(monkeypatch, **{_host_memory.ENV_VAR: "default"})
  assert status.mode == "default" and not status.applied and status.settings == {}
  assert not _host_memory.measuring()


def test_status_is_json_able():
  status = tj.host_memory_status()
  assert json.loads(json.dumps(status.to_dict()))["mode"] == status.mode
  assert status.applied == bool(status.settings)


def test_minor_page_faults_count_up():
  before = _host_memory.minor_page_faults()
  block = np.ones(8 * 2**20 // 8)  # 8 MiB touched: new pages unless memory is reused
  assert _host_memory.minor_page_faults() >= before
  del block
