"""Loader in this process (0 workers): order, epochs, transforms, state, errors."""

from __future__ import annotations

import grain
import numpy as np
import pytest

import tunedjax as tj
from tunedjax import input_pipeline as ip
from tunedjax.input_pipeline import _dataset
from tunedjax.input_pipeline import _tuner


def _loader(source, **kwargs):
  kwargs.setdefault("worker_count", 0)
  kwargs.setdefault("read_threads", 0)
  kwargs.setdefault("batch_size", 4)
  return ip.Loader(source, **kwargs)


def _take(loader, n):
  return [next(loader) for _ in range(n)]


class _Scale(grain.transforms.Map):

  def map(self, x):
    return {"x": x["x"] * 2.0, "y": x["y"]}


class _Noise(grain.transforms.RandomMap):

  def random_map(self, x, rng):
    return {"x": x["x"] + rng.normal(size=x["x"].shape), "y": x["y"]}


class _Odd(grain.transforms.Filter):

  def filter(self, x):
    return x % 2 == 1


@pytest.fixture
def data(rng):
  return {"x": rng.normal(size=(37, 3)).astype(np.float32), "y": np.arange(37)}


@pytest.mark.parametrize("threads", [0, 1, 4])
def test_same_batches_whatever_the_read_threads(data, threads):
  ref = _take(_loader(data, transforms=[_Scale(), _Noise()], seed=5), 20)
  got = _take(_loader(data, transforms=[_Scale(), _Noise()], seed=5, read_threads=threads), 20)
  for a, b in zip(ref, got):
    np.testing.assert_array_equal(a["x"], b["x"])
    np.testing.assert_array_equal(a["y"], b["y"])


def test_epochs_are_permutations_reshuffled_each_epoch(data):
  loader = _loader(data, batch_size=9, seed=3, num_epochs=3)
  assert loader.batches_per_epoch == 4 and len(loader) == 12
  batches = [b["y"] for b in loader]
  assert len(batches) == 12 and loader.epoch == 3
  epochs = [np.concatenate(batches[i * 4:(i + 1) * 4]) for i in range(3)]
  for e in epochs:  # 36 of the 37 records, none twice (drop_remainder per epoch)
    assert len(set(e.tolist())) == 36 and set(e.tolist()) <= set(range(37))
  assert not np.array_equal(epochs[0], epochs[1])
  endless = _take(_loader(data, batch_size=9, seed=3), 8)  # num_epochs=None: same epochs
  assert np.array_equal(np.concatenate([b["y"] for b in endless]), np.concatenate(epochs[:2]))


def test_seed_changes_the_order(data):
  a = np.concatenate([b["y"] for b in _take(_loader(data, seed=1), 5)])
  b = np.concatenate([b["y"] for b in _take(_loader(data, seed=2), 5)])
  assert not np.array_equal(a, b)


def test_no_shuffle_keeps_the_source_order_and_last_short_batch():
  loader = _loader(np.arange(10), shuffle=False, num_epochs=1, drop_remainder=False)
  assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
  with pytest.raises(StopIteration):
    next(loader)


def test_transforms_apply_in_order_and_random_ones_are_seeded(data):
  base = _take(_loader(data, seed=4), 3)
  scaled = _take(_loader(data, seed=4, transforms=[_Scale()]), 3)
  for a, b in zip(base, scaled):
    np.testing.assert_allclose(b["x"], a["x"] * 2.0, rtol=1e-6)
  noisy1 = _take(_loader(data, seed=4, transforms=[_Noise()]), 3)
  noisy2 = _take(_loader(data, seed=4, transforms=[_Noise()]), 3)
  for a, b, c in zip(base, noisy1, noisy2):
    np.testing.assert_array_equal(b["x"], c["x"])
    assert not np.allclose(b["x"], a["x"])
  lam = _take(_loader(data, seed=4, transforms=[lambda r: r["x"].sum()]), 2)
  np.testing.assert_allclose(lam[0], base[0]["x"].sum(axis=1), rtol=1e-5)


def test_state_restores_into_other_threads(data):
  full = _take(_loader(data, seed=7, transforms=[_Noise()]), 15)
  first = _loader(data, seed=7, transforms=[_Noise()], read_threads=2)
  _take(first, 6)
  state = first.get_state()
  assert state["position"] == 6
  second = _loader(data, seed=7, transforms=[_Noise()], read_threads=0)
  second.set_state(state)
  for a, b in zip(full[6:], _take(second, 9)):
    np.testing.assert_array_equal(a["x"], b["x"])


def test_state_survives_json_and_numpy_ints(data):
  import json
  loader = _loader(data, seed=7)
  _take(loader, 3)
  state = json.loads(json.dumps(loader.get_state()))
  state["position"] = np.int64(state["position"])
  other = _loader(data, seed=7)
  other.set_state(state)
  assert other.position == 3


def test_state_from_another_stream_is_refused(data):
  loader = _loader(data, seed=7)
  state = loader.get_state()
  with pytest.raises(ip.StateError, match="seed: checkpoint 7, loader 8"):
    _loader(data, seed=8).set_state(state)
  with pytest.raises(ip.StateError, match="position"):
    loader.set_state({**state, "position": -2})
  with pytest.raises(ip.StateError, match="lacks the field 'num_records'"):
    loader.set_state({"position": 1})


def test_failing_transform_names_its_record(data):
  def fails_on_record_11(record):
    if record["y"] == 11:
      raise KeyError("no such label")
    return record

  loader = _loader(data, shuffle=False, transforms=[_Scale(), fails_on_record_11])
  _take(loader, 2)
  with pytest.raises(ip.TransformError) as info:
    _take(loader, 1)
  err = info.value
  assert err.record_index == 11
  assert "Transform 1" in str(err) and "fails_on_record_11" in str(err)
  assert "no such label" in err.original_traceback and "raise KeyError" in err.original_traceback
  assert isinstance(err, tj.TunedJaxError)


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 0}, "batch_size"),
    ({"worker_count": "many"}, "worker_count.*'auto'"),
    ({"read_threads": -1}, "read_threads"),
    ({"num_epochs": 0}, "num_epochs"),
    ({"batch_size": 100}, "no batch"),
    ({"tuning_budget_s": -1}, "tuning_budget_s"),
])
def test_bad_options_name_the_value(data, kwargs, match):
  with pytest.raises(tj.ConfigError, match=match):
    _loader(data, **kwargs)


def test_bad_source_and_transform_are_explained():
  with pytest.raises(tj.TunedJaxError, match="random access"):
    ip.Loader(iter(range(5)), batch_size=2)
  with pytest.raises(tj.TunedJaxError, match="Filters"):
    ip.Loader(np.arange(5), batch_size=2, transforms=[_Odd()])
  with pytest.raises(tj.TunedJaxError, match="different first dimensions"):
    ip.Loader({"a": np.zeros(3), "b": np.zeros(4)}, batch_size=2)


def test_endless_stream_has_no_len_and_closed_loader_refuses(data):
  loader = _loader(data)
  with pytest.raises(TypeError, match="batches_per_epoch"):
    len(loader)
  loader.close()
  with pytest.raises(tj.TunedJaxError, match="closed"):
    next(loader)


def test_ints_are_used_as_given_without_tuning(data):
  loader = _loader(data, worker_count=0, read_threads=3)
  assert loader.tune() is None and (loader.worker_count, loader.read_threads) == (0, 3)
  off = ip.Loader(data, batch_size=4, tuning_budget_s=0)
  assert off.tune() is None and (off.worker_count, off.read_threads) == (0, 16)


def test_needs_tuning_follows_the_knobs_and_the_config():
  fixed = ip.Loader(np.arange(8), batch_size=2, worker_count=0, read_threads=0)
  assert not fixed.needs_tuning
  with tj.config_context({"dataloader": {"enable": True}}):
    assert fixed.needs_tuning  # the switch measures even given integers
  assert ip.Loader(np.arange(8), batch_size=2).needs_tuning  # "auto"
  assert not ip.Loader(np.arange(8), batch_size=2, tuning_budget_s=0).needs_tuning


@pytest.fixture
def grain_calls(monkeypatch):
  """Records the options the loader hands grain; workers then read in this process."""
  calls = []
  to_iter = grain.MapDataset.to_iter_dataset

  def to_iter_dataset(self, read_options=None, **kwargs):
    calls.append(("read", read_options))
    return to_iter(self, read_options, **kwargs)

  def mp_prefetch(self, options=None, worker_init_fn=None, **kwargs):
    calls.append(("mp", options))
    return self  # read in this process: what is tested is what grain was asked

  monkeypatch.setattr(grain.MapDataset, "to_iter_dataset", to_iter_dataset)
  monkeypatch.setattr(grain.IterDataset, "mp_prefetch", mp_prefetch)
  return calls


def test_the_loader_hands_its_settings_to_grain(data, grain_calls):
  loader = _loader(data, worker_count=3, read_threads=2, prefetch_buffer=5, seed=1)
  assert loader.settings == ip.LoaderSettings(3, 2, 5)
  got = _take(loader, 2)
  (_, read), (_, mp) = grain_calls
  assert (read.num_threads, read.prefetch_buffer_size) == (2, 4)
  assert (mp.num_workers, mp.per_worker_buffer_size) == (3, 5)
  ref = _take(_loader(data, seed=1), 2)  # same batches as 0 workers
  for a, b in zip(ref, got):
    np.testing.assert_array_equal(a["x"], b["x"])
  grain_calls.clear()
  _take(_loader(data, worker_count=0, prefetch_buffer=5), 1)
  assert [kind for kind, _ in grain_calls] == ["read"]  # no workers: no mp_prefetch


def test_the_loader_applies_a_cached_choice_of_buffer(data, grain_calls, tmp_path):
  cache = tj.autotune.Cache(tmp_path)
  loader = _loader(data, worker_count="auto", read_threads="auto", max_workers=4,
                   tuning_steps=10)
  stored = ip.LoaderSettings(2, 1, 8)
  # stored by hand under the key the loader will ask for
  key = _tuner.cache_key(_dataset.as_source(data), batch_size=4, transforms=(),
                         shuffle=True, drop_remainder=True, start=ip.LoaderSettings(),
                         maxima={"worker_count": 4, "read_threads": 16,
                                 "prefetch_buffer": _tuner.DEFAULT_MAX_PREFETCH_BUFFER},
                         tune=("workers", "read_threads", "prefetch_buffer"),
                         consumer=None, consumer_s=None)
  cache.put("dataloader", key, {**stored.to_dict(), "batches_per_s": 50.0,
                                "batch_bytes": 64})
  assert loader.tune(cache=cache).from_cache and loader.settings == stored
  _take(loader, 1)
  mp = [options for kind, options in grain_calls if kind == "mp"]
  assert [(o.num_workers, o.per_worker_buffer_size) for o in mp] == [(2, 8)]


def test_bad_prefetch_buffer_is_explained(data):
  with pytest.raises(tj.ConfigError, match="prefetch_buffer.*>= 1"):
    _loader(data, prefetch_buffer=0)
