"""Filesystem faults under the tuning cache: each ends in a warning, never a crash.

The tests run as root, so `chmod` proves nothing: a read-only folder is a
read-only bind mount (in a private mount namespace, `unshare -m`) or an
immutable folder (`chattr +i`); a full disk is a tiny tmpfs or a file-size
limit (`RLIMIT_FSIZE`). Where the machine cannot set a fault up, its test is
skipped with the reason. Each fault must end in one `CacheWarning` naming the
folder and the reason, with every entry stored by the process still found by
it (in memory).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from tests import processes
import tunedjax as tj
from tunedjax import cli
from tunedjax import input_pipeline as ip
from tunedjax._errors import CacheWarning
from tunedjax._tuning import _cache
from tunedjax._tuning._cache import Cache
from tunedjax._tuning._fingerprint import device_fingerprint

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEY = {"op": "conv", "lhs_shape": [8, 56, 56, 64], "dtype": "float32"}
KEY2 = {**KEY, "dtype": "bfloat16"}
KEY3 = {**KEY, "dtype": "float16"}
VALUE = {"winner": "im2col", "timings": {"xla": [1.0, 1.1], "im2col": [0.5, 0.6]}}


def _env() -> dict[str, str]:
  env = {k: v for k, v in processes.cpu_env().items() if not k.startswith("TUNEDJAX_")}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                    os.environ.get("PYTHONPATH")]))
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _cache_warnings(caught) -> list[str]:
  return [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]


@pytest.fixture
def blocker(tmp_path):
  """A regular file: a cache folder under it cannot exist."""
  path = tmp_path / "a-file"
  path.write_text("not a folder")
  return path


# --- a folder under a regular file ----------------------------------------------------------


def test_a_folder_under_a_regular_file_warns_once_and_keeps_entries_in_memory(blocker):
  cache = Cache(blocker / "cache")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert cache.get("conv", KEY) is None
    cache.put("conv", KEY, VALUE)
    cache.put_many("conv", [(KEY2, VALUE)])
    assert cache.get("conv", KEY) == VALUE and cache.get("conv", KEY2) == VALUE
    assert [e.key for e in cache.entries("conv")] == [KEY, KEY2]
  (message,) = _cache_warnings(caught)  # once, though read and written three times
  assert str(blocker / "cache") in message and "regular file" in message
  assert "in memory" in message
  assert blocker.read_text() == "not a folder"


def test_a_folder_that_is_a_file_warns_and_keeps_entries(blocker):
  cache = Cache(blocker)
  with pytest.warns(CacheWarning, match="it is a regular file, not a folder"):
    cache.put("conv", KEY, VALUE)
  assert cache.get("conv", KEY) == VALUE


def test_a_readonly_cache_remembers_what_this_process_stored(tmp_path):
  Cache(tmp_path).put("conv", KEY, VALUE)
  ro = Cache(tmp_path, readonly=True)
  ro.put("conv", KEY2, {"winner": "xla"})
  assert ro.get("conv", KEY2) == {"winner": "xla"} and ro.get("conv", KEY) == VALUE
  assert [e.key for e in Cache(tmp_path).entries()] == [KEY]  # the file is untouched


_JIT_SCRIPT = textwrap.dedent("""
    import json, warnings
    import jax, jax.numpy as jnp, numpy as np
    import tunedjax as tj
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 8, 8, 3)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 3, 3, 4)), jnp.float32)
    def conv(x, w):
      return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                          dimension_numbers=("NHWC", "HWIO", "NHWC"))
    ref = jax.jit(conv)(x, w)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      for level in ("O1", "O2"):
        with tj.config_context({"kernel": {"enable": True}, "level": level}):
          f = tj.jit(lambda x, w: conv(x, w) * 1.0)
          y = f(x, w)
          out[level] = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
          rep = f.report(memory=False).last
          out[level + "_lookups"] = rep.cache_hits + rep.cache_misses
    print(json.dumps({"rel_err": out, "tuned": tj.autotune.stats().buckets_tuned,
                      "xla_dir": jax.config.jax_compilation_cache_dir,
                      "warnings": [str(w.message) for w in caught
                                   if w.category.__name__ == "CacheWarning"]}))
""")


@pytest.mark.slow
def test_a_tuned_jit_with_the_cache_dir_under_a_file_warns_and_runs(blocker):
  """Issue 19, item 1: a bare NotADirectoryError at O1, and at O2 from `<dir>/xla`."""
  env = {**_env(), "TUNEDJAX_CACHE_DIR": str(blocker / "cache")}
  result = subprocess.run([sys.executable, "-c", _JIT_SCRIPT], capture_output=True,
                          text=True, env=env, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  got = json.loads(result.stdout.strip().splitlines()[-1])
  assert got["rel_err"]["O1"] < 1e-5 and got["rel_err"]["O2"] < 1e-5
  assert got["rel_err"]["O1_lookups"] >= 1 and got["rel_err"]["O2_lookups"] >= 1
  assert got["tuned"] == 1  # O2's trace found O1's winner in memory
  assert not got["xla_dir"]  # no compilation cache in a folder that cannot exist
  tuning = [m for m in got["warnings"] if "tuning cache folder" in m]
  xla = [m for m in got["warnings"] if "compilation cache" in m]
  assert len(tuning) == 1 and str(blocker / "cache") in tuning[0], got["warnings"]
  assert len(xla) == 1 and str(blocker / "cache" / "xla") in xla[0], got["warnings"]
  assert all("regular file" in m for m in tuning + xla)


def test_the_o2_compilation_cache_asks_the_same_function(blocker):
  from tunedjax import _jit  # pylint: disable=import-outside-toplevel
  # An earlier O2 test of this process may have set the folder: leave none for this one.
  before = _jit.jax.config.jax_compilation_cache_dir
  _jit.jax.config.update("jax_compilation_cache_dir", None)
  try:
    with tj.config_context({"cache": {"dir": str(blocker / "cache")}}):
      config = tj.get_config()
    with pytest.warns(CacheWarning, match=r"compilation cache .*regular file"):
      assert _jit.enable_compilation_cache(config) is None
    assert not _jit.jax.config.jax_compilation_cache_dir
  finally:
    _jit.jax.config.update("jax_compilation_cache_dir", before)


# --- the input pipeline's tuner (issue 19, item 2) ------------------------------------------


@pytest.mark.parametrize("fault", ["under a file", "file is a folder"])
def test_loader_tuning_with_a_cache_it_cannot_write(tmp_path, blocker, fault):
  """The worker-count tuner's `put` raised IsADirectoryError/NotADirectoryError from
  `next(loader)` after the whole search."""
  if fault == "under a file":
    folder = blocker / "cache"
  else:
    folder = tmp_path / "cache"
    (folder / f"{device_fingerprint().digest}.json").mkdir(parents=True)
  src = np.arange(240.0)
  kwargs = dict(batch_size=6, seed=1, max_workers=0, tuning_steps=20, tuning_budget_s=5)
  with tj.config_context({"cache": {"dir": str(folder)}}):
    loader = ip.Loader(src, **kwargs)
    with pytest.warns(CacheWarning, match=str(folder)):
      first = next(loader)
    plain = ip.Loader(src, batch_size=6, seed=1, worker_count=0, read_threads=0)
    np.testing.assert_array_equal(first, next(plain))
    assert loader.tuning is not None and not loader.tuning.from_cache
    again = ip.Loader(src, **kwargs)
    next(again)  # the same process finds its own result in memory
    assert again.tuning.from_cache and again.tuning.setting == loader.tuning.setting


# --- read-only and full folders, set up for real ----------------------------------------------

_FAULT_SCRIPT = textwrap.dedent("""
    import errno, json, os, resource, signal, sys, warnings
    from tunedjax._tuning._cache import Cache
    from tunedjax._tuning._fingerprint import DeviceFingerprint
    folder, fault = sys.argv[1], sys.argv[2]
    fp = DeviceFingerprint.from_dict(json.loads(sys.argv[3]))
    key = {key!r}; key2 = {key2!r}; key3 = {key3!r}; value = {value!r}
    got = {{}}
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      cache = Cache(folder, fingerprint=fp)
      if fault in ("tmpfs", "fsize"):
        cache.put("conv", key, value)  # fits
        before = open(cache.path, "rb").read()
        if fault == "tmpfs":  # fill the disk
          with open(os.path.join(folder, "filler"), "wb", buffering=0) as f:
            try:
              while True:
                f.write(b"x" * 4096)
            except OSError as e:
              assert e.errno == errno.ENOSPC, e
        else:  # a file-size limit just above the file's size
          signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
          resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 16, len(before) + 16))
      else:
        before = open(cache.path, "rb").read()
      got["read"] = cache.get("conv", key)
      cache.put("conv", key2, value)
      cache.put_many("conv", [(key3, value)])
      got["key2"] = cache.get("conv", key2)
      got["key3"] = cache.get("conv", key3)
      got["entries"] = len(cache.entries())
      got["file_unchanged"] = open(cache.path, "rb").read() == before
      got["stray"] = sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))
    got["warnings"] = [str(w.message) for w in caught
                       if w.category.__name__ == "CacheWarning"]
    print(json.dumps(got))
""").format(key=KEY, key2=KEY2, key3=KEY3, value=VALUE)


def _can_unshare() -> str | None:
  """None when `unshare -m` can mount here; else why not."""
  if sys.platform != "linux":
    return "mount namespaces are Linux only"
  if shutil.which("unshare") is None or shutil.which("mount") is None:
    return "no unshare or mount command"
  probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                          "mount -t tmpfs -o size=8k tmpfs /mnt"],
                         capture_output=True, text=True, check=False)
  if probe.returncode:
    return f"unshare -m cannot mount here: {probe.stderr.strip()}"
  return None


def _run_fault(folder: pathlib.Path, fault: str, *, mount: str | None = None) -> dict:
  args = [sys.executable, "-c", _FAULT_SCRIPT, str(folder), fault,
          json.dumps(device_fingerprint().to_dict())]
  if mount is not None:
    command = " ".join(["exec", *map(_quote, args)])
    args = ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f"{mount} && {command}"]
  result = subprocess.run(args, capture_output=True, text=True, env=_env(), timeout=300,
                          check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def _quote(text: str) -> str:
  return "'" + text.replace("'", "'\\''") + "'"


@contextlib.contextmanager
def _immutable(folder: pathlib.Path):
  if shutil.which("chattr") is None:
    pytest.skip("no chattr command to make a folder immutable")
  made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True,
                        check=False)
  if made.returncode:
    pytest.skip(f"chattr +i does not work here: {made.stderr.strip()}")
  try:
    yield
  finally:
    subprocess.run(["chattr", "-i", str(folder)], check=False)


def _assert_in_memory(got: dict, folder: pathlib.Path, reasons: tuple[str, ...]) -> None:
  assert got["key2"] == VALUE and got["key3"] == VALUE, got
  assert got["entries"] == 3, got  # the one on disk and the two in memory
  assert got["file_unchanged"] and got["stray"] == [], got
  (message,) = got["warnings"]
  assert str(folder) in message and any(r in message for r in reasons), message


@pytest.mark.slow
@pytest.mark.parametrize("how", ["bind mount", "chattr +i"])
def test_a_readonly_folder_root_cannot_write(tmp_path, how):
  folder = tmp_path / "cache"
  Cache(folder).put("conv", KEY, VALUE)
  if how == "bind mount":
    why = _can_unshare()
    if why:
      pytest.skip(why)
    mount = f"mount --bind {_quote(str(folder))} {_quote(str(folder))} && " \
            f"mount -o remount,bind,ro {_quote(str(folder))}"
    got = _run_fault(folder, "readonly", mount=mount)
    reasons = ("read-only file system",)
  else:
    with _immutable(folder):
      probe = folder / "probe"
      try:
        probe.write_text("x")
      except OSError:
        pass
      else:
        probe.unlink()
        pytest.skip("chattr +i did not stop root writing here")
      got = _run_fault(folder, "readonly")
    reasons = ("not permitted", "permission denied")
  assert got["read"] == VALUE  # reading a read-only cache still works
  _assert_in_memory(got, folder, reasons)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tmpfs", "fsize"])
def test_a_full_disk(tmp_path, how):
  folder = tmp_path / "cache"
  folder.mkdir()
  if how == "tmpfs":
    why = _can_unshare()
    if why:
      pytest.skip(why)
    got = _run_fault(folder, "tmpfs",
                     mount=f"mount -t tmpfs -o size=64k tmpfs {_quote(str(folder))}")
    reasons = ("the disk is full",)
  else:
    got = _run_fault(folder, "fsize")
    reasons = ("file-size limit",)
  assert got["read"] == VALUE
  _assert_in_memory(got, folder, reasons)


# --- another process replaces the file between our read and our write -----------------------


def _other_process(code: str) -> None:
  subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=_env())


def test_a_file_replaced_by_another_process_is_merged_not_clobbered(tmp_path):
  cache = Cache(tmp_path)
  cache.put("conv", KEY, VALUE)
  assert cache.get("conv", KEY) == VALUE  # read
  theirs = Cache(tmp_path / "theirs")
  theirs.put("conv", KEY2, {"winner": "xla"})
  # Another process copies its file over ours without our lock (an rsync, a cp).
  _other_process(f"import os, shutil; shutil.copy({str(theirs.path)!r}, "
                 f"{str(cache.path) + '.new'!r}); "
                 f"os.replace({str(cache.path) + '.new'!r}, {str(cache.path)!r})")
  with warnings.catch_warnings():
    warnings.simplefilter("error", CacheWarning)
    cache.put("conv", KEY3, VALUE)  # write: re-reads under the lock and merges
  assert cache.get("conv", KEY2) == {"winner": "xla"} and cache.get("conv", KEY3) == VALUE
  on_disk = {json.dumps(e.key, sort_keys=True) for e in Cache(tmp_path).entries()}
  assert on_disk == {json.dumps(k, sort_keys=True) for k in (KEY2, KEY3)}


def test_a_file_replaced_by_a_folder_between_read_and_write(tmp_path, monkeypatch):
  cache = Cache(tmp_path)
  cache.put("conv", KEY, VALUE)
  read = cache._read_file  # pylint: disable=protected-access
  path = str(cache.path)

  def read_then_replaced():
    entries = read()
    _other_process(f"import os; os.rename({path!r}, {path + '.old'!r}); os.mkdir({path!r})")
    return entries

  monkeypatch.setattr(cache, "_read_file", read_then_replaced)
  with pytest.warns(CacheWarning, match="a folder stands where the cache file should be"):
    cache.put("conv", KEY2, VALUE)
  monkeypatch.undo()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert cache.get("conv", KEY2) == VALUE  # kept in memory
  assert any(str(cache.path) in m for m in _cache_warnings(caught))  # cannot read it now
  os.rmdir(path)
  os.rename(path + ".old", path)
  cache.put("conv", KEY3, VALUE)  # the next write that works keeps what was in memory
  assert {json.dumps(e.key, sort_keys=True) for e in Cache(tmp_path).entries()} == {
      json.dumps(k, sort_keys=True) for k in (KEY, KEY2, KEY3)}


# --- the command line -------------------------------------------------------------------------


def test_cli_on_a_cache_folder_under_a_file(blocker, capsys):
  folder = str(blocker / "cache")
  with pytest.warns(CacheWarning, match="regular file"):
    assert cli.main(["cache", "show", "--dir", folder]) == 0
  assert "0 entries" in capsys.readouterr().out
  assert cli.main(["cache", "clear", "--dir", folder]) == 1
  assert "regular file" in capsys.readouterr().err
  export = blocker.parent / "export.json"
  Cache(blocker.parent / "ok").put("conv", KEY, VALUE)
  assert cli.main(["cache", "export", str(export), "--dir", str(blocker.parent / "ok")]) == 0
  assert cli.main(["cache", "import", str(export), "--dir", folder]) == 1
  assert "regular file" in capsys.readouterr().err
  assert cli.main(["cache", "export", str(blocker / "x.json"), "--dir", folder]) == 1
  assert "regular file" in capsys.readouterr().err


def test_reasons_are_plain_words(tmp_path):
  import errno  # pylint: disable=import-outside-toplevel
  assert _cache.describe_problem(tmp_path, OSError(errno.ENOSPC, "No space left on device")
                                 ).startswith("the disk is full")
  assert _cache.describe_problem(tmp_path, OSError(errno.EROFS, "Read-only file system")
                                 ).startswith("it is on a read-only file system")


def test_cli_clear_all_on_a_folder_it_cannot_write(tmp_path, capsys):
  """`cache clear --all` deletes files itself: an OSError becomes exit status 1."""
  folder = tmp_path / "cache"
  Cache(folder).put("conv", KEY, VALUE)
  with _immutable(folder):
    assert cli.main(["cache", "clear", "--all", "--dir", str(folder)]) == 1
  err = capsys.readouterr().err
  assert "tunedjax cache: error:" in err and "not permitted" in err
  assert Cache(folder).get("conv", KEY) == VALUE
