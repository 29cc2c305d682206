"""Tests of the `tunedjax` command line (tunedjax.cli)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

import tunedjax
from tunedjax import cli
from tunedjax.autotune import DeviceFingerprint
from tunedjax.autotune import device_fingerprint

JSON_KEYS = {
    "versions", "os", "fingerprint", "fingerprint_digest",
    "fingerprint_summary", "devices", "config", "cache_dir", "cache_exists",
    "cache_files", "cache_bytes", "native", "host_memory",
}


@pytest.fixture
def cache_dir(monkeypatch, tmp_path) -> pathlib.Path:
  """Points $TUNEDJAX_CACHE_DIR at a fresh folder that does not exist yet."""
  path = tmp_path / "tuning-cache"
  monkeypatch.setenv("TUNEDJAX_CACHE_DIR", str(path))
  return path


def _info_json(capsys, *extra: str) -> dict:
  assert cli.main(["info", "--json", *extra]) == 0
  return json.loads(capsys.readouterr().out)


def test_info_prints_fingerprint_and_cache_dir(capsys, cache_dir):
  assert cli.main(["info"]) == 0
  out = capsys.readouterr().out
  fp = device_fingerprint()
  assert fp.digest in out
  assert fp.describe() in out
  assert str(cache_dir) in out
  for name in fp.to_dict():
    assert name in out
  for name in ("tunedjax", "jax", "jaxlib", "flax", "optax", "grain",
               "orbax-checkpoint", "numpy", "python"):
    assert f"\n  {name} " in out
  assert re.search(r"\n  exists +no\n", out)
  assert "Native CPU kernels" in out and re.search(r"\n  sources +.*depthwise", out)
  assert "Host memory (malloc)" in out
  assert re.search(r"\n  mode +(auto|retain|default) \(\$TUNEDJAX_HOST_MEMORY\)", out)


def test_info_says_when_native_kernels_are_off_and_what_is_built(capsys, cache_dir,
                                                                monkeypatch):
  from tunedjax import _native
  monkeypatch.setenv(_native.ENV_VAR, "0")
  native = _info_json(capsys)["native"]
  assert native["enabled"] is False and native["compiler"] is None and native["built"] == []
  assert cli.main(["info"]) == 0
  assert re.search(r"\n  enabled +no \(\$TUNEDJAX_NATIVE\)", capsys.readouterr().out)
  monkeypatch.delenv(_native.ENV_VAR)
  if _native.find_compiler() is None:
    return
  _native.reset()
  assert _native.library("depthwise") is not None  # built (or found) in the native folder
  assert "depthwise" in _info_json(capsys)["native"]["built"]
  _native.reset()


def test_native_build_builds_reports_and_fails_clearly(capsys, tmp_path, monkeypatch):
  from tunedjax import _native
  if _native.find_compiler() is None:
    pytest.skip("no C++ compiler on this machine")
  folder = tmp_path / "csrc"
  folder.mkdir()
  (folder / "tiny.cc").write_text('extern "C" int tj_answer() { return 42; }\n')
  monkeypatch.setattr(_native, "HEADER_DIR", folder)
  monkeypatch.setattr(_native, "_SOURCES", {"tiny": folder / "tiny.cc"})
  monkeypatch.setenv(_native.DIR_ENV_VAR, str(tmp_path / "native"))
  monkeypatch.delenv(_native.ENV_VAR, raising=False)
  assert cli.main(["native", "build"]) == 0
  assert re.fullmatch(rf"tiny +built in \d+\.\d s: {re.escape(str(tmp_path))}/native/\w+/tiny\.so\n",
                      capsys.readouterr().out)
  assert cli.main(["native", "build"]) == 0
  assert "tiny         already built: " in capsys.readouterr().out
  (folder / "broken.cc").write_text("not C++\n")
  _native.register_source(folder / "broken.cc")
  assert cli.main(["native", "build"]) == 1
  assert re.search(r"broken +failed: .*not C\+\+", capsys.readouterr().err, re.S)
  monkeypatch.setenv(_native.ENV_VAR, "0")
  assert cli.main(["native", "build"]) == 1
  assert "native kernels are off ($TUNEDJAX_NATIVE=0)" in capsys.readouterr().err
  assert cli.main(["native"]) == 2  # the action is required


def test_info_json(capsys, cache_dir, monkeypatch):
  from tunedjax import _host_memory
  monkeypatch.setattr(_host_memory, "_FOLDER", cache_dir)  # the decisions' folder: at import
  info = _info_json(capsys)
  assert set(info) == JSON_KEYS
  fp = device_fingerprint()
  assert info["fingerprint"] == fp.to_dict()
  assert info["fingerprint_digest"] == fp.digest
  assert info["config"] == tunedjax.get_config().to_dict()
  assert len(info["devices"]) == jax.device_count()
  assert info["devices"][0]["platform"] == fp.platform
  assert info["versions"]["jax"] == jax.__version__
  assert info["versions"]["tunedjax"] == tunedjax.__version__
  assert info["cache_dir"] == str(cache_dir)
  assert info["cache_exists"] is False
  native = info["native"]
  assert set(native) == {"enabled", "compiler", "folder", "sources", "built"}
  assert "depthwise" in native["sources"] and set(native["built"]) <= set(native["sources"])
  memory = info["host_memory"]
  assert memory == {**tunedjax.host_memory_status().to_dict(),
                    "minor_page_faults": memory["minor_page_faults"],
                    "decisions_file": str(cache_dir / "host-memory.json"), "decisions": []}
  assert memory["minor_page_faults"] > 0


def test_info_shows_the_host_memory_decisions_recorded_on_this_machine(capsys, cache_dir,
                                                                       monkeypatch):
  from tunedjax import _host_memory
  from tunedjax._host_memory import _decisions
  record = _decisions.record_for("script /home/me/train.py", faults=17_938.0, system_s=0.0321,
                                 wall_s=0.0462, program="train_step")
  other = {**_decisions.record_for("script /elsewhere.py", faults=1.0, system_s=0.0,
                                   wall_s=0.001, program="f"), "machine": {"cpu": "other"}}
  assert _decisions.store(cache_dir, record) and _decisions.store(cache_dir, other)
  monkeypatch.setattr(_host_memory, "_FOLDER", cache_dir)
  assert _info_json(capsys)["host_memory"]["decisions"] == [record]  # this machine's only
  assert cli.main(["info"]) == 0
  out = capsys.readouterr().out
  assert re.search(r"\n  decisions +1 on this machine, in " + re.escape(
      f"{cache_dir / 'host-memory.json'}:\n"), out)
  assert (f"    script /home/me/train.py: pays: train_step faulted 17,938 pages, 32.1 ms in "
          f"the kernel per call of 46.2 ms (measured {record['measured_at']})") in out


def test_info_json_follows_config_context(capsys, cache_dir, tmp_path):
  chosen = tmp_path / "from-config"
  with tunedjax.config_context({"cache": {"dir": str(chosen)},
                                "level": "O2"}):
    info = _info_json(capsys)
    assert info["config"] == tunedjax.get_config().to_dict()
  assert info["config"]["level"] == "O2"
  assert info["cache_dir"] == str(chosen) != str(cache_dir)


def test_info_counts_cache_files(capsys, cache_dir):
  (cache_dir / "sub").mkdir(parents=True)
  (cache_dir / "a.json").write_bytes(b"x" * 1000)
  (cache_dir / "sub" / "b.json").write_bytes(b"y" * 1048)
  info = _info_json(capsys)
  assert info["cache_exists"] is True
  assert (info["cache_files"], info["cache_bytes"]) == (2, 2048)
  assert cli.main(["info"]) == 0
  out = capsys.readouterr().out
  assert re.search(r"\n  exists +yes\n", out)
  assert re.search(r"\n  files +2\n", out)
  assert re.search(r"\n  size +2.0 KiB", out)


def test_missing_package_is_not_installed(capsys, monkeypatch, cache_dir):
  real = importlib.metadata.version

  def fake(name):
    if name == "grain":
      raise importlib.metadata.PackageNotFoundError(name)
    return real(name)

  monkeypatch.setattr(importlib.metadata, "version", fake)
  assert _info_json(capsys)["versions"]["grain"] == "not installed"


def test_info_backend_option(capsys, cache_dir):
  assert _info_json(capsys, "--backend", "cpu")["fingerprint"]["platform"] == (
      "cpu")
  assert cli.main(["info", "--backend", "no_such_backend"]) == 1
  err = capsys.readouterr().err
  assert "no_such_backend" in err and "'cpu'" in err


def test_no_subcommand_prints_help_and_returns_2(capsys):
  assert cli.main([]) == 2
  assert "info" in capsys.readouterr().err


def test_unknown_subcommand_returns_2(capsys):
  assert cli.main(["no-such-command"]) == 2
  assert "invalid choice" in capsys.readouterr().err


def test_version(capsys):
  assert cli.main(["--version"]) == 0
  assert capsys.readouterr().out.strip() == f"tunedjax {tunedjax.__version__}"


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"),
    (2**50, "1024.0 TiB"),
])
def test_human_size(n, text):
  assert cli._human_size(n) == text


@pytest.mark.slow
def test_module_entry_point_end_to_end(tmp_path):
  src = str(pathlib.Path(tunedjax.__file__).parents[1])
  env = dict(os.environ, TUNEDJAX_CACHE_DIR=str(tmp_path),
             PYTHONPATH=os.pathsep.join(
                 filter(None, [src, os.environ.get("PYTHONPATH")])))
  result = subprocess.run(
      [sys.executable, "-m", "tunedjax.cli", "info", "--json"],
      capture_output=True, text=True, env=env, timeout=120, check=False,
  )
  assert result.returncode == 0, result.stderr
  info = json.loads(result.stdout)
  assert set(info) == JSON_KEYS
  assert info["cache_dir"] == str(tmp_path)
  assert info["cache_exists"] is True
  fp = DeviceFingerprint.from_dict(info["fingerprint"])
  assert fp.digest == info["fingerprint_digest"]
  assert fp.platform == jax.default_backend()
  assert fp.jax_version == jax.__version__


def _fill(cache_dir: pathlib.Path) -> None:
  from tunedjax._tuning._cache import Cache
  cache = Cache(cache_dir)
  cache.put("test-cli", {"op": "conv", "lhs_shape": [8, 56, 56, 128]}, {"winner": "depthwise"})
  cache.put("test-cli", {"op": "conv", "lhs_shape": [8, 7, 7, 512]}, {"winner": "xla"})


@pytest.fixture
def cli_namespace():
  from tunedjax._tuning import _cache
  def check(value):
    if value.get("winner") not in ("xla", "depthwise"):
      raise ValueError(f"unknown kernel {value.get('winner')!r}")
  _cache.register_validator("test-cli", check)
  yield
  _cache._VALIDATORS.pop("test-cli", None)


def test_cache_show_lists_entries(cache_dir, capsys):
  _fill(cache_dir)
  assert cli.main(["cache", "show"]) == 0
  out = capsys.readouterr().out
  assert device_fingerprint().digest in out and "2 entries (2 test-cli)" in out
  assert "winner=depthwise" in out and "[8,56,56,128]" in out
  assert cli.main(["cache", "show", "--json", "--namespace", "nothing"]) == 0
  assert json.loads(capsys.readouterr().out)["entries"] == []


def test_cache_export_import_and_clear(cache_dir, tmp_path, capsys, cli_namespace):
  _fill(cache_dir)
  exported = tmp_path / "tuned.json"
  assert cli.main(["cache", "export", str(exported)]) == 0
  data = json.loads(exported.read_text())
  data["entries"][0]["value"]["winner"] = "a kernel from nowhere"
  exported.write_text(json.dumps(data))
  other = tmp_path / "cluster-cache"
  assert cli.main(["cache", "import", str(exported), "--dir", str(other)]) == 0
  captured = capsys.readouterr()
  assert "Imported 1 entries" in captured.out and "for this device" in captured.out
  assert "a kernel from nowhere" in captured.err
  assert cli.main(["cache", "clear", "--dir", str(other)]) == 0
  assert "Removed 1 entries" in capsys.readouterr().out
  assert cli.main(["cache", "clear", "--all"]) == 0
  assert not list(cache_dir.glob("*.json"))


def test_cache_import_of_a_bad_file_is_an_error(cache_dir, tmp_path, capsys):
  bad = tmp_path / "bad.json"
  bad.write_text("not json")
  assert cli.main(["cache", "import", str(bad)]) == 1
  assert "Cannot import" in capsys.readouterr().err
  assert cli.main(["cache"]) == 2  # an action is required


@pytest.mark.slow
def test_cache_import_checks_every_tuner_namespace_in_a_fresh_process(tmp_path):
  """`tunedjax cache import` alone (no other tunedjax import first) validates
  conv, layout and dataloader entries with the tuners' own validators."""
  from tunedjax._tuning._cache import Cache
  source = Cache(tmp_path / "source")
  good = {
      "conv": {"winner": "im2col", "timings": {"xla": [0.2], "im2col": [0.1]}},
      "layout": {"choice": "relaid", "target": "NHWC", "seconds": {"relaid": 0.1}},
      "dataloader": {"worker_count": 2, "read_threads": 0, "batches_per_s": 25.4},
  }
  bad = {
      "conv": {"winner": "a kernel from nowhere"},
      "layout": {"choice": "relaid", "target": "NWHC"},
      "dataloader": {"worker_count": -1, "read_threads": 0, "batches_per_s": 1.0},
  }
  for namespace in good:
    source.put(namespace, {"which": "good"}, good[namespace])
    source.put(namespace, {"which": "bad"}, bad[namespace])
  exported = tmp_path / "cluster.json"
  source.export(exported)
  target = tmp_path / "target"
  result = subprocess.run(
      [sys.executable, "-m", "tunedjax.cli", "cache", "import", str(exported),
       "--dir", str(target)],
      capture_output=True, text=True, timeout=120, check=False,
  )
  assert result.returncode == 0, result.stderr
  assert "Imported 3 entries" in result.stdout and "skipped 3" in result.stdout
  for text in ("a kernel from nowhere", "NWHC", "worker_count=...) must be an int >= 0"):
    assert text in result.stderr
  taken = Cache(target).entries()
  assert sorted(e.namespace for e in taken) == ["conv", "dataloader", "layout"]
  assert all(e.key == {"which": "good"} for e in taken)


def test_cache_show_and_clear_include_the_compilation_cache(cache_dir, capsys):
  xla = cache_dir / "xla"
  xla.mkdir(parents=True)
  (xla / "jit_step-abc123").write_bytes(b"x" * 2048)
  assert cli.main(["cache", "show"]) == 0
  out = capsys.readouterr().out
  assert f"Compilation cache {xla} (level O2): 1 files, 2.0 KiB" in out
  assert cli.main(["cache", "show", "--json"]) == 0
  shown = json.loads(capsys.readouterr().out)["xla_cache"]
  assert shown == {"path": str(xla), "files": 1, "bytes": 2048}
  assert cli.main(["cache", "clear", "--all"]) == 0
  assert not (xla / "jit_step-abc123").exists()
