"""Multi-host agreement: process 0 chooses, the others receive its choice."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from tests import processes
from tunedjax.autotune import _multihost

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_single_process_decides_locally():
  calls = []
  assert _multihost.agree(lambda: calls.append(1) or "xla", ["fft", "xla"]) == "xla"
  assert calls == [1] and not _multihost.is_multiprocess() and _multihost.is_leader()


_WORKER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[4])
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, pid, cache_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=pid)
    import jax.numpy as jnp, numpy as np
    import tunedjax as tj
    from tests.autotune import selection_helpers as h
    from tunedjax import _tuning
    from tunedjax.autotune import _phases, _select

    # Each process's own measurements disagree on purpose: process 0 would
    # pick t_transposed, process 1 would keep xla. Only process 0's counts.
    fast = "t_transposed" if pid == 0 else "xla"
    _tuning.time_interleaved = lambda runners, **kw: {
        n: [0.1 if n == fast else 1.0] * 2 for n in runners}
    tj.set_config({"cache": {"dir": cache_dir}})
    rng = np.random.default_rng(0)
    params = h.mobilenet_params(rng, blocks=1)
    x, y = h.mobilenet_batch(rng)
    counts = {}
    with h.registered("t_transposed"):
      step = jax.jit(_select.select_kernels(
          h.mobilenet_step, rounds=1, budget_s=5.0,
          on_report=lambda r: counts.update(r.counts())))
      loss, _ = step(params, x, y)
    s = _phases.stats()
    print(json.dumps({"counts": counts, "tuned": s.buckets_tuned, "loss": float(loss)}))
    jax.distributed.shutdown()
""")


@pytest.mark.slow
def test_two_processes_choose_identical_kernels(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  dirs = [tmp_path / f"cache{i}" for i in range(2)]
  results = processes.run_distributed(script, [[str(d), str(ROOT)] for d in dirs])
  leader, follower = results
  assert leader["counts"] and any("t_transposed (tuned)" in k for k in leader["counts"])
  # Same kernel per convolution: the follower received process 0's choices.
  strip = lambda counts: sorted((k.split(" (")[0], v) for k, v in counts.items())
  assert strip(follower["counts"]) == strip(leader["counts"])
  assert all(k.endswith("(received)") for k in follower["counts"])
  assert leader["tuned"] > 0 and follower["tuned"] == 0
  assert follower["loss"] == pytest.approx(leader["loss"], rel=1e-6)
  # Only process 0 writes the cache.
  assert list(dirs[0].glob("*.json")) and not dirs[1].exists()
