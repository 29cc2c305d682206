"""Loader with worker processes: same data for 0-3 workers and any buffer, resumes across
worker counts, reports failing records, and leaves no process behind.

Each worker process takes about a second to start here, so these tests share
runs where they can and are marked slow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import grain
import numpy as np
import pytest

from tunedjax import input_pipeline as ip
from tunedjax.input_pipeline import _processes

DEADLINE_S = 30.0


class _Jitter(grain.transforms.RandomMap):

  def random_map(self, x, rng):
    return {"x": x["x"] + rng.normal(size=x["x"].shape), "y": x["y"]}


def _fails_on_record_23(record):
  if int(record["y"]) == 23:
    raise ValueError("corrupt record")
  return record


def _source():
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(90, 4)).astype(np.float32), "y": np.arange(90)}


def _worker_pids(parent=None):
  """Live worker processes (multiprocessing spawn children) of `parent`."""
  pids = []
  for pid in _processes.child_pids(parent):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if b"spawn_main" in f.read():
          pids.append(pid)
    except OSError:
      pass
  return pids


def _wait_gone(pids, deadline_s=DEADLINE_S):
  end = time.monotonic() + deadline_s
  alive = [p for p in pids if _processes.is_running(p)]
  while alive and time.monotonic() < end:
    time.sleep(0.05)  # polling, bounded by the deadline
    alive = [p for p in alive if _processes.is_running(p)]
  return alive


def _equal(a, b):
  return all(np.array_equal(x["x"], y["x"]) and np.array_equal(x["y"], y["y"])
             for x, y in zip(a, b, strict=True))


def _loader(workers, **kwargs):
  return ip.Loader(_source(), batch_size=8, transforms=[_Jitter()], seed=11,
                   worker_count=workers, read_threads=1, **kwargs)


@pytest.mark.slow
def test_same_batches_for_0_to_3_workers_any_buffer_and_resume_from_2_into_3():
  total, k = 14, 5  # 90 records, 11 batches per epoch: crosses an epoch
  with _loader(0, prefetch_buffer=7) as l0:
    reference = [next(l0) for _ in range(total)]
  with _loader(1, prefetch_buffer=1) as l1:
    assert _equal([next(l1) for _ in range(total)], reference)
  with _loader(2) as l2:
    first = [next(l2) for _ in range(k)]
    state = l2.get_state()
    rest = [next(l2) for _ in range(total - k)]
    assert len(_worker_pids()) == 2
  assert _equal(first + rest, reference)
  assert state["position"] == k
  with _loader(3, prefetch_buffer=4) as l3:
    l3.set_state(state)
    assert _equal([next(l3) for _ in range(total - k)], reference[k:])
    assert len(_worker_pids()) == 3
  assert not _wait_gone(_worker_pids())


@pytest.mark.slow
def test_failing_transform_in_a_worker_names_its_record_and_stops_workers():
  loader = ip.Loader(_source(), batch_size=8, shuffle=False, worker_count=2,
                     read_threads=0, transforms=[_fails_on_record_23])
  next(loader)
  pids = _worker_pids()
  assert len(pids) == 2
  with pytest.raises(ip.TransformError) as info:
    for _ in range(5):
      next(loader)
  assert info.value.record_index == 23
  assert "corrupt record" in info.value.original_traceback
  assert "_fails_on_record_23" in str(info.value)
  assert not _wait_gone(pids), "workers left after an exception"
  loader.close()


def test_workers_exit_on_close_and_on_garbage_collection():
  loader = _loader(1)
  next(loader)
  pids = _worker_pids()
  assert len(pids) == 1
  loader.close()
  assert not _wait_gone(pids), "workers left after close()"
  loader = _loader(1)
  next(loader)
  pids = _worker_pids()
  del loader
  assert not _wait_gone(pids), "workers left after the loader was collected"


_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from tunedjax import input_pipeline as ip
    from tunedjax.input_pipeline import _processes

    def double(x):
      return x * 2

    if __name__ == "__main__":
      loader = ip.Loader(np.arange(400.0), batch_size=4, transforms=[double],
                         worker_count=2, read_threads=1)
      next(loader)
      print(" ".join(map(str, _processes.child_pids())), flush=True)
      if sys.argv[1] == "hang":
        sys.stdin.read()  # until killed
      # "exit": leave without closing the loader
""")


def _start_child(tmp_path, mode):
  script = tmp_path / "child.py"
  script.write_text(_CHILD)
  return subprocess.Popen([sys.executable, str(script), mode], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=tmp_path)


def _child_workers(proc):
  line = proc.stdout.readline()
  pids = [int(p) for p in line.split()]
  workers = [p for p in pids if p in _worker_pids(proc.pid)]
  return pids, workers


@pytest.mark.slow
def test_workers_exit_when_the_parent_is_sigkilled(tmp_path):
  proc = _start_child(tmp_path, "hang")
  workers = []
  try:
    pids, workers = _child_workers(proc)
    assert len(workers) == 2, pids
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=DEADLINE_S)
    assert not _wait_gone(workers), "workers outlived a SIGKILLed parent"
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    for pid in workers:  # only if the assertion failed: don't leak them
      if _processes.is_running(pid):
        os.kill(pid, signal.SIGKILL)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
      pipe.close()  # not communicate(): orphaned workers may hold the pipes


@pytest.mark.slow
def test_interpreter_exit_stops_workers_without_tracebacks(tmp_path):
  proc = _start_child(tmp_path, "exit")
  pids, workers = _child_workers(proc)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 0, err
  assert len(workers) == 2
  assert "Traceback" not in err and "Exception ignored" not in err, err
  assert not _wait_gone(workers)


_REPORT_IMPORTS = textwrap.dedent("""
    import sys
    import numpy as np
    from tunedjax import input_pipeline as ip

    def imports(record):  # runs in the worker: what has it imported?
      return np.array(["tunedjax" in sys.modules, "flax" in sys.modules,
                       "optax" in sys.modules])

    with ip.Loader(np.zeros((8, 2)), batch_size=4, transforms=[imports], shuffle=False,
                   worker_count=1, read_threads=0) as loader:
      print(next(loader)[0].tolist())
""")


@pytest.mark.slow
def test_a_worker_unpickles_the_pipeline_without_importing_tunedjax():
  # grain's workers start with spawn and import every module the pickled pipeline
  # names: tunedjax's would bring jax, Flax, optax and orbax, seconds per worker.
  out = subprocess.run([sys.executable, "-c", _REPORT_IMPORTS], capture_output=True, check=False,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip().splitlines()[-1] == "[False, False, False]", out.stdout


def test_import_tunedjax_loads_its_parts_when_used():
  code = ("import sys, tunedjax as tj; assert 'flax' not in sys.modules; "
          "assert 'tunedjax.trainer' not in sys.modules; tj.Trainer; "
          "assert 'tunedjax.trainer' in sys.modules; print(sorted(set(tj.__all__) - set(dir(tj))))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                       timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"
