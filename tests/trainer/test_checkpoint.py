"""Checkpointer: exact round trips of real training states, pruning, saving
rules, shardings from the target, errors that name what is wrong, and a
process SIGKILLed in the middle of writing a step."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tunedjax.trainer import _checkpoint
from tunedjax.trainer._checkpoint import Checkpointer


class _Net(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.lin = nnx.Linear(3, 4, rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)  # puts a typed key in the state


def _randomized(tree, rng):
  """`tree` with every non-key array replaced by random, non-zero values."""

  def fill(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return x
    if jnp.issubdtype(x.dtype, jnp.integer):
      return jnp.asarray(rng.integers(1, 1000, x.shape), x.dtype)
    return jnp.asarray(rng.uniform(0.5, 2.0, x.shape) * rng.choice([-1, 1], x.shape),
                       x.dtype)

  return jax.tree.map(fill, tree)


def _mixed_state(rng):
  params = {"w": jnp.asarray(rng.standard_normal((4, 3)) + 3, jnp.float32),
            "b": jnp.asarray(rng.standard_normal(3) + 3, jnp.bfloat16)}
  opt = optax.adam(1e-2)
  opt_state = opt.init(params)
  grads = jax.tree.map(lambda p: p * 0.5 + 1, params)
  _, opt_state = opt.update(grads, opt_state, params)
  return {
      "step": jnp.int32(123),
      "np_step": np.int32(7),
      "lr": 0.25,
      "params": params,
      "opt": opt_state,
      "model": _randomized(nnx.state(_Net(nnx.Rngs(0))), rng),
      "rng": jax.random.key(42),
      "keys": jax.random.split(jax.random.key(5, impl="rbg"), 3),
      "host": rng.standard_normal((2, 5)).astype(np.float32) + 1,
      "nothing": None,
      "empty": (),
  }


def _bits(x):
  if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
    return str(x.dtype), np.asarray(jax.random.key_data(x)).tobytes()
  a = np.asarray(x)
  return str(a.dtype), a.shape, a.tobytes()


def _assert_same(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
  for path, g, w in zip(paths, got_leaves, want_leaves, strict=True):
    assert isinstance(g, jax.Array) == isinstance(w, jax.Array), path
    assert _bits(g) == _bits(w), path


def test_round_trip_of_a_mixed_training_state(tmp_path, rng):
  state = _mixed_state(rng)
  metadata = {"loader": {"position": 96, "seed": 3}, "history": [[1, 2.5], [2, 1.25]],
              "tuned": {"batch": 64, "policy": "p=f32,c=bf16"}, "note": None}
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.save(10, state, metadata)
    ckpt.wait()
  with Checkpointer(tmp_path / "ckpt") as ckpt:  # a fresh process's view
    assert ckpt.directory.is_absolute()
    assert ckpt.latest_step() == 10
    restored, meta = ckpt.restore(target=state)
    assert meta == metadata
    np_step = restored.pop("np_step")
    want = dict(state)
    assert _bits(np_step) == _bits(want.pop("np_step"))  # back as a 0-d array
    _assert_same(restored, want)
    assert type(restored["lr"]) is float
    assert str(jax.random.key_impl(restored["keys"])) == "rbg"

    # Without a target: orbax's containers, the same values, keys rebuilt.
    plain, meta = ckpt.restore(10)
    assert meta == metadata
    assert _bits(plain["rng"]) == _bits(state["rng"])
    assert _bits(plain["keys"]) == _bits(state["keys"])
    assert _bits(plain["model"]["drop"]["rngs"]["key"]["value"]) == _bits(
        state["model"]["drop"]["rngs"]["key"].get_value())
    assert _bits(plain["opt"][0]["mu"]["b"]) == _bits(state["opt"][0].mu["b"])
    assert _bits(plain["params"]["b"]) == _bits(state["params"]["b"])


def test_max_to_keep_keeps_the_newest_steps(tmp_path):
  with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    for step in range(1, 6):
      assert ckpt.save(step, {"x": np.full(3, step, np.float32)})
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]
  with Checkpointer(tmp_path, max_to_keep=None) as ckpt:
    assert ckpt.all_steps() == [4, 5]
    assert ckpt.restore(4)[0]["x"].tolist() == [4.0] * 3


def test_save_interval_force_and_existing_steps(tmp_path):
  with Checkpointer(tmp_path, max_to_keep=None, save_interval_steps=3) as ckpt:
    first = {"x": np.arange(4.0)}
    assert not ckpt.save(1, first)  # not a multiple of 3, not even the first
    assert ckpt.save(3, first)
    assert ckpt.save(4, {"x": np.ones(4)}, force=True)
    assert ckpt.save(6, {"x": np.ones(4)})
    # An existing step is never overwritten, force or not.
    assert not ckpt.save(3, {"x": -np.ones(4)})
    assert not ckpt.save(3, {"x": -np.ones(4)}, force=True)
    # Steps only go forward: an older step is not added, even with force.
    assert not ckpt.save(0, first)
    assert not ckpt.save(2, first, force=True)
    assert ckpt.save(7, first, force=True)
    assert ckpt.all_steps() == [3, 4, 6, 7]
    assert ckpt.latest_step() == 7
    assert ckpt.restore(3)[0]["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_restore_takes_the_targets_shardings_and_dtypes(tmp_path, mesh8, rng):
  x = rng.standard_normal((16, 4)).astype(np.float32) + 1
  keys = jax.random.split(jax.random.key(3), 8)
  with Checkpointer(tmp_path) as ckpt:  # saved from one device
    ckpt.save(1, {"x": jnp.asarray(x), "y": jnp.asarray(x.T), "keys": keys,
                  "one": jax.random.key(11)})
    rows = NamedSharding(mesh8, P("data"))
    on_5 = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    cols = NamedSharding(mesh8, P(None, "data"))
    target = {"x": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=rows),
              "y": jax.ShapeDtypeStruct((4, 16), jnp.bfloat16, sharding=cols),
              "keys": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=rows),
              "one": jax.ShapeDtypeStruct((), keys.dtype, sharding=on_5)}
    restored, _ = ckpt.restore(target=target)
  assert restored["x"].sharding == rows
  assert restored["x"].addressable_shards[0].data.shape == (2, 4)
  np.testing.assert_array_equal(np.asarray(restored["x"]), x)
  assert restored["y"].dtype == jnp.bfloat16 and restored["y"].sharding == cols
  np.testing.assert_array_equal(np.asarray(restored["y"]),
                                np.asarray(jnp.asarray(x.T).astype(jnp.bfloat16)))
  assert restored["keys"].dtype == keys.dtype
  assert restored["keys"].sharding.is_equivalent_to(rows, 1)
  assert len(restored["keys"].sharding.device_set) == 8
  assert _bits(restored["keys"]) == _bits(keys)
  assert restored["one"].sharding == on_5
  assert _bits(restored["one"]) == _bits(jax.random.key(11))


def test_key_data_is_restored_straight_onto_the_targets_mesh(mesh8):
  # Restoring the data with the saved sharding and moving it afterwards would
  # need the saving job's devices; the data's target has the key's mesh.
  rows = NamedSharding(mesh8, P("data"))
  key = jax.ShapeDtypeStruct((8,), jax.random.key(0).dtype, sharding=rows)
  data = _checkpoint._abstract_leaf(key)
  assert (data.shape, data.dtype) == ((8, 2), jnp.uint32)
  assert data.sharding == NamedSharding(mesh8, P("data"))


def test_sharded_state_round_trips_on_its_mesh(tmp_path, mesh8, rng):
  rows = NamedSharding(mesh8, P("data"))
  w = jnp.asarray(rng.standard_normal((8, 3)) + 2, jnp.bfloat16)
  state = {"w": jax.device_put(w, rows),
           "keys": jax.device_put(jax.random.split(jax.random.key(9), 8), rows)}
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(2, state)
    restored, _ = ckpt.restore(target=state)
    plain, _ = ckpt.restore()
  _assert_same(restored, state)
  assert restored["w"].sharding == rows and restored["keys"].sharding == rows
  assert _bits(plain["keys"]) == _bits(state["keys"])


def test_no_checkpoint_and_missing_step_errors(tmp_path):
  with Checkpointer(tmp_path / "empty") as ckpt:
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    with pytest.raises(FileNotFoundError, match="empty"):
      ckpt.restore()
    ckpt.save(1, {"x": np.ones(2)})
    ckpt.save(2, {"x": np.ones(2)})
    with pytest.raises(FileNotFoundError, match=r"step 7 .*\[1, 2\]"):
      ckpt.restore(7)


def test_directory_that_is_a_file(tmp_path):
  path = tmp_path / "not_a_dir"
  path.write_text("x")
  with pytest.raises(NotADirectoryError, match="not_a_dir"):
    Checkpointer(path)


def test_unsavable_leaf_is_a_type_error_naming_its_path(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    state = {"params": {"w": np.ones(2)}, "extra": [np.ones(1), {"act": object()}]}
    with pytest.raises(TypeError, match=r"\['extra'\]\[1\]\['act'\].*object"):
      ckpt.save(1, state)
    with pytest.raises(TypeError, match="JSON"):
      ckpt.save(1, {"w": np.ones(2)}, {"config": np.float32(1)})
    with pytest.raises(ValueError, match="no arrays"):
      ckpt.save(1, {"a": None})
    ckpt.wait()
    assert ckpt.all_steps() == []
  assert list(tmp_path.iterdir()) == []  # nothing half-started


def test_target_that_does_not_fit(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"w": np.ones(4, np.float32), "key": jax.random.key(0)})
    with pytest.raises(ValueError, match="does not fit `target`"):
      ckpt.restore(target={"w": np.ones(5, np.float32), "key": jax.random.key(0)})
    with pytest.raises(ValueError, match="does not fit `target`"):
      ckpt.restore(target={"v": np.ones(4, np.float32), "key": jax.random.key(0)})
    with pytest.raises(ValueError, match=r"\['w'\].*plain array"):
      ckpt.restore(target={"w": jax.random.split(jax.random.key(0), 2),
                           "key": jax.random.key(0)})


def test_close_is_idempotent_and_final(tmp_path):
  ckpt = Checkpointer(tmp_path)
  assert ckpt.save(1, {"x": np.ones(1)})
  ckpt.close()
  ckpt.close()
  assert (tmp_path / "1").is_dir()
  with pytest.raises(RuntimeError, match="closed"):
    ckpt.save(2, {"x": np.ones(1)})


_CRASHING_CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    import numpy as np
    from tunedjax.trainer._checkpoint import Checkpointer

    def state(step, n):
      rng = np.random.default_rng(step)
      return {"w": rng.standard_normal(n, dtype=np.float32) + 1, "step": np.int32(step)}

    def kill_once_step_2_is_half_written(directory, min_bytes):
      while True:
        for name in os.listdir(directory):
          if name.startswith("2.") and "tmp" in name:
            tmp = os.path.join(directory, name)
            written = sum(os.path.getsize(os.path.join(d, f))
                          for d, _, files in os.walk(tmp) for f in files)
            if written > min_bytes:
              print("killing", name, written, flush=True)
              os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.0005)

    if __name__ == "__main__":
      directory, n = sys.argv[1], int(sys.argv[2])
      ckpt = Checkpointer(directory)
      ckpt.save(1, state(1, 1000))
      ckpt.wait()
      print("saved 1", flush=True)
      threading.Thread(target=kill_once_step_2_is_half_written,
                       args=(directory, 4 * n // 32), daemon=True).start()
      ckpt.save(2, state(2, n))  # 4n bytes; killed after 1/32 of them
      ckpt.wait()
      print("saved 2", flush=True)
""")


def _child_state(step, n):
  rng = np.random.default_rng(step)
  return {"w": rng.standard_normal(n, dtype=np.float32) + 1, "step": np.int32(step)}


def test_a_step_killed_mid_write_is_never_restored(tmp_path):
  n = 8_000_000  # 32 MB: the kill lands while tensorstore is writing
  script = tmp_path / "child.py"
  script.write_text(_CRASHING_CHILD)
  directory = tmp_path / "ckpt"
  proc = subprocess.run([sys.executable, str(script), str(directory), str(n)],
                        capture_output=True, text=True, timeout=120, cwd=tmp_path)
  assert "saved 1" in proc.stdout, proc.stderr
  leftovers = [p.name for p in directory.iterdir() if "tmp" in p.name]
  if proc.returncode == -signal.SIGKILL:
    assert "killing 2." in proc.stdout
    assert leftovers == ["2.orbax-checkpoint-tmp"]
    assert "saved 2" not in proc.stdout
    expected_latest = 1
  else:  # the write beat the watcher: step 2 is complete and must be exact
    assert proc.returncode == 0 and "saved 2" in proc.stdout, proc.stderr
    expected_latest = 2

  with Checkpointer(directory) as ckpt:
    assert ckpt.latest_step() == expected_latest
    assert ckpt.all_steps() == list(range(1, expected_latest + 1))
    for step in ckpt.all_steps():
      size = 1000 if step == 1 else n
      restored, _ = ckpt.restore(step, target=_child_state(step, size))
      _assert_same(restored, jax.tree.map(np.asarray, _child_state(step, size)))
    if expected_latest == 1:  # the leftover does not block step 2
      assert ckpt.save(2, _child_state(2, 1000))
      ckpt.wait()
      assert ckpt.latest_step() == 2
      restored, _ = ckpt.restore()
      assert _bits(restored["w"]) == _bits(_child_state(2, 1000)["w"])
  assert not [p for p in directory.iterdir() if "tmp" in p.name]
  assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]


def test_checkpointer_keeps_the_best_n_besides_the_latest_n_and_restores_the_latest(tmp_path):
  values = {1: 5.0, 2: 1.0, 3: 3.0, 4: 0.5, 5: 4.0, 6: 2.0}
  with Checkpointer(tmp_path, max_to_keep=1, best_metric="eval_loss", keep_best=2) as ckpt:
    for step, value in values.items():
      ckpt.save(step, {"w": np.full(2, step, np.float32)}, metrics={"eval_loss": value})
    ckpt.save(7, {"w": np.full(2, 7, np.float32)})  # no metrics: kept as the latest only
    ckpt.save(8, {"w": np.full(2, 8, np.float32)}, metrics={"eval_loss": float("nan")})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 4, 8] and ckpt.best_step() == 4  # nan ranks last
    state, _ = ckpt.restore()
    assert state["w"].tolist() == [8.0, 8.0]
    with pytest.raises(ValueError, match=r"no 'eval_loss' \(the best_metric\); it has \['acc'\]"):
      ckpt.save(9, {"w": np.zeros(2)}, metrics={"acc": 1.0})
  with Checkpointer(tmp_path, max_to_keep=1, best_metric="eval_loss", keep_best=2) as ckpt:
    assert ckpt.best_step() == 4  # orbax read the metrics back from the folder
  with pytest.raises(ValueError, match=r"best_mode must be 'min' or 'max', got 'low'"):
    Checkpointer(tmp_path, best_metric="eval_loss", best_mode="low")
  with pytest.raises(ValueError, match="max_to_keep .* must be an int >= 1"):
    Checkpointer(tmp_path, max_to_keep=0)
