"""The persistent tuning cache: round trips, validation, corruption, concurrency."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import tunedjax as tj
from tunedjax._errors import CacheWarning
from tunedjax._errors import TunedJaxError
from tunedjax._tuning import _cache
from tunedjax._tuning._cache import Cache
from tunedjax._tuning._cache import default_cache
from tunedjax._tuning._cache import import_file
from tunedjax._tuning._cache import register_validator
from tunedjax._tuning._fingerprint import device_fingerprint

KEY = {"op": "conv", "lhs_shape": [8, 56, 56, 64], "dtype": "float32"}
VALUE = {"winner": "im2col", "timings": {"xla": [1.0, 1.1], "im2col": [0.5, 0.6]}}


@pytest.fixture
def cache(tmp_path):
  return Cache(tmp_path)


@pytest.fixture
def checked_namespace():
  def check(value):
    if value.get("winner") not in ("xla", "im2col"):
      raise ValueError(f"unknown kernel {value.get('winner')!r}")
  register_validator("test-checked", check)
  yield "test-checked"
  _cache._VALIDATORS.pop("test-checked", None)


def test_put_get_round_trip_and_survives_a_restart(cache, tmp_path):
  cache.put("conv", KEY, VALUE)
  assert cache.get("conv", KEY) == VALUE
  assert cache.get("layout", KEY) is None  # namespaces are separate
  assert cache.get("conv", {**KEY, "dtype": "bfloat16"}) is None
  restarted = Cache(tmp_path)
  assert restarted.get("conv", KEY) == VALUE
  (entry,) = restarted.entries()
  assert entry.namespace == "conv" and entry.key == KEY and entry.created > 0


def test_key_order_does_not_matter_and_values_are_copies(cache):
  cache.put("conv", KEY, VALUE)
  got = cache.get("conv", dict(reversed(list(KEY.items()))))
  got["timings"]["xla"].append(99.0)
  assert cache.get("conv", KEY) == VALUE


def test_file_is_named_by_the_device_and_holds_full_keys(cache):
  cache.put("conv", KEY, VALUE)
  assert cache.path.name == f"{device_fingerprint().digest}.json"
  data = json.loads(cache.path.read_text())
  assert data["fingerprint"] == device_fingerprint().to_dict()
  assert data["entries"][0]["key"] == KEY


def test_another_device_or_version_misses(tmp_path):
  Cache(tmp_path).put("conv", KEY, VALUE)
  other = dataclasses.replace(device_fingerprint(), jax_version="0.0.1")
  assert Cache(tmp_path, fingerprint=other).get("conv", KEY) is None
  assert Cache(tmp_path).get("conv", KEY) == VALUE  # the original is untouched


@pytest.mark.parametrize("content", [
    b'{"format": "tunedjax-tuning-cache", "version": 1, "entr',  # truncated
    b"\x00\xff\xfe garbage \x80",                                # not even text
    b"[1, 2, 3]",                                                # not a cache file
    b'{"format": "tunedjax-tuning-cache", "version": 999}',      # from the future
])
def test_an_unusable_file_is_moved_aside_with_a_warning(tmp_path, content):
  cache = Cache(tmp_path)
  cache.path.write_bytes(content)
  with pytest.warns(CacheWarning, match="Moved it to"):
    assert cache.get("conv", KEY) is None
  assert not cache.path.exists()
  assert len(list(tmp_path.glob("*.corrupt-*"))) == 1
  cache.put("conv", KEY, VALUE)  # and tuning goes on
  assert Cache(tmp_path).get("conv", KEY) == VALUE


def test_a_file_with_another_devices_fingerprint_is_not_trusted(tmp_path):
  other = dataclasses.replace(device_fingerprint(), device_kind="someone else")
  Cache(tmp_path, fingerprint=other).put("conv", KEY, VALUE)
  mine = Cache(tmp_path)
  os.replace(tmp_path / f"{other.digest}.json", mine.path)  # copied under the wrong name
  with pytest.warns(CacheWarning, match="fingerprint"):
    assert mine.get("conv", KEY) is None


def test_malformed_entries_are_skipped_and_the_rest_kept(cache):
  cache.put("conv", KEY, VALUE)
  data = json.loads(cache.path.read_text())
  data["entries"] += [{"namespace": "conv", "key": "not an object", "value": {}, "created": 1},
                      {"namespace": "conv"}, 42]
  cache.path.write_text(json.dumps(data))
  assert Cache(cache.dir).get("conv", KEY) == VALUE


def test_validator_rejects_a_bad_value_as_a_miss(cache, checked_namespace):
  cache.put(checked_namespace, KEY, {"winner": "im2col"})
  assert cache.get(checked_namespace, KEY) == {"winner": "im2col"}
  cache.put(checked_namespace, KEY, {"winner": "rm -rf /"})
  with pytest.warns(CacheWarning, match="rm -rf"):
    assert cache.get(checked_namespace, KEY) is None


def test_readonly_never_writes_nor_moves(tmp_path):
  Cache(tmp_path).put("conv", KEY, VALUE)
  ro = Cache(tmp_path, readonly=True)
  ro.put("conv", {**KEY, "dtype": "float16"}, VALUE)
  assert len(Cache(tmp_path).entries()) == 1
  ro.path.write_text("{ broken")
  with pytest.warns(CacheWarning, match="readonly"):
    assert ro.get("conv", KEY) is None
  assert ro.path.read_text() == "{ broken"


def test_deferred_writes_are_read_at_once_and_written_once_when_the_last_block_ends(
    tmp_path, monkeypatch):
  cache = Cache(tmp_path)
  writes = []
  real_write = cache._write
  monkeypatch.setattr(cache, "_write", lambda entries: (writes.append(len(entries)),
                                                        real_write(entries)))
  with cache.deferring():
    cache.put("conv", KEY, VALUE)
    with cache.deferring():  # blocks nest
      cache.put("conv", {**KEY, "dtype": "float16"}, VALUE)
    assert writes == [] and not cache.path.exists()
    assert cache.get("conv", KEY) == VALUE and len(cache.entries("conv")) == 2  # read at once
    assert Cache(tmp_path).entries() == []  # another process sees nothing yet
  assert writes == [2]  # one read-merge-write for both
  assert len(Cache(tmp_path).entries("conv")) == 2
  # A block that ends with an error still writes; a readonly cache never does.
  with pytest.raises(RuntimeError), cache.deferring():
    cache.put("conv", {**KEY, "dtype": "bfloat16"}, VALUE)
    raise RuntimeError("the trace failed")
  assert len(Cache(tmp_path).entries("conv")) == 3
  ro = Cache(tmp_path, readonly=True)
  with ro.deferring():
    ro.put("conv", {**KEY, "dtype": "int8"}, VALUE)
  assert len(Cache(tmp_path).entries("conv")) == 3 and len(ro.entries("conv")) == 4


def test_readonly_follows_the_config(tmp_path):
  with tj.config_context({"cache": {"dir": str(tmp_path), "readonly": True}}):
    cache = default_cache()
    assert cache.readonly and cache.dir == tmp_path
    assert default_cache() is cache  # one object per folder and mode
  with tj.config_context({"cache": {"dir": str(tmp_path)}}):
    assert not default_cache().readonly


def test_size_is_bounded_oldest_first(tmp_path):
  cache = Cache(tmp_path, max_entries=3)
  for i in range(5):
    cache.put("conv", {"i": i}, {"winner": "xla"})
  assert [e.key["i"] for e in Cache(tmp_path).entries()] == [2, 3, 4]


@pytest.mark.parametrize("key, value", [({"x": object()}, {}), (KEY, {"t": float("nan")}),
                                        ("not a mapping", {})])
def test_non_json_entries_are_refused(cache, key, value):
  with pytest.raises(TunedJaxError, match="JSON|mappings"):
    cache.put("conv", key, value)
  assert not cache.path.exists()


def test_bad_max_entries():
  with pytest.raises(TunedJaxError, match="max_entries.*0"):
    Cache("/tmp", max_entries=0)


def test_clear(cache):
  cache.put("conv", KEY, VALUE)
  assert cache.clear() == 1
  assert cache.get("conv", KEY) is None and cache.entries() == []


def test_export_then_import_elsewhere(cache, tmp_path, checked_namespace):
  cache.put(checked_namespace, KEY, {"winner": "xla"})
  cache.put(checked_namespace, {"other": 1}, {"winner": "evil"})  # invalid: skipped on import
  cache.put("no-such-tuner", {"k": 1}, {"v": 1})
  exported = tmp_path / "exported.json"
  assert cache.export(exported) == 3
  target, imported, problems = import_file(exported, tmp_path / "elsewhere")
  assert imported == 1 and len(problems) == 2
  assert any("evil" in p for p in problems) and any("no-such-tuner" in p for p in problems)
  assert target.path.name == cache.path.name  # filed under the measuring device
  assert Cache(tmp_path / "elsewhere").get(checked_namespace, KEY) == {"winner": "xla"}


def test_import_refuses_a_foreign_file(tmp_path):
  bad = tmp_path / "x.json"
  bad.write_text('{"hello": 1}')
  with pytest.raises(TunedJaxError, match="not a tuning-cache file"):
    import_file(bad, tmp_path)
  with pytest.raises(TunedJaxError, match="Cannot import"):
    import_file(tmp_path / "missing.json", tmp_path)


_WRITER = textwrap.dedent("""
    import json, sys
    from tunedjax._tuning._cache import Cache
    from tunedjax._tuning._fingerprint import DeviceFingerprint
    fp = DeviceFingerprint.from_dict(json.loads(sys.argv[2]))
    cache = Cache(sys.argv[1], fingerprint=fp)
    worker = int(sys.argv[3])
    for i in range(50):
      cache.put("conv", {"worker": worker, "i": i}, {"winner": "xla", "t": [i * 1e-3]})
""")


@pytest.mark.slow
def test_eight_concurrent_writers_lose_nothing(tmp_path):
  fp = json.dumps(device_fingerprint().to_dict())
  procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), fp, str(w)])
           for w in range(8)]
  assert [p.wait(timeout=120) for p in procs] == [0] * 8
  entries = Cache(tmp_path).entries()
  assert len(entries) == 400
  assert {(e.key["worker"], e.key["i"]) for e in entries} == {
      (w, i) for w in range(8) for i in range(50)}
  json.loads(Cache(tmp_path).path.read_text())  # a valid file
  assert not list(tmp_path.glob("*.tmp"))


_KILLED_WRITER = textwrap.dedent("""
    import json, os, sys
    from tunedjax._tuning._cache import Cache
    from tunedjax._tuning._fingerprint import DeviceFingerprint
    fp = DeviceFingerprint.from_dict(json.loads(sys.argv[2]))
    def stall(fd):  # the new contents are half on disk: wait here to be killed
      print("writing", flush=True)
      sys.stdin.read()
    os.fsync = stall
    Cache(sys.argv[1], fingerprint=fp).put("conv", {"new": 1}, {"winner": "fft"})
""")


def test_a_writer_killed_mid_write_leaves_the_old_file(tmp_path):
  fingerprint = device_fingerprint()
  Cache(tmp_path).put("conv", KEY, VALUE)
  before = Cache(tmp_path).path.read_bytes()
  proc = subprocess.Popen(
      [sys.executable, "-c", _KILLED_WRITER, str(tmp_path), json.dumps(fingerprint.to_dict())],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    proc.kill()
  cache = Cache(tmp_path)
  assert cache.path.read_bytes() == before
  assert cache.get("conv", KEY) == VALUE and cache.get("conv", {"new": 1}) is None
  cache.put("conv", {"after": 1}, VALUE)  # the dead writer's lock was released
  assert Cache(tmp_path).get("conv", {"after": 1}) == VALUE
