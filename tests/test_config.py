"""Tests for tunedjax._config: schema, validation, files, env vars, scoping."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tunedjax as tj
from tunedjax import _config
from tunedjax._config import (CacheConfig, Config, DataloaderConfig,
                              FrozenDict, KernelConfig, LayoutConfig,
                              MixedPrecisionConfig)

TUNERS = ("kernel", "layout", "dataloader")


@pytest.fixture(autouse=True)
def _clean_config(monkeypatch):
  monkeypatch.delenv("TUNEDJAX_CONFIG", raising=False)
  monkeypatch.delenv("TUNEDJAX_CACHE_DIR", raising=False)
  _config._reset_for_tests()
  yield
  _config._reset_for_tests()


def _write_json(path: pathlib.Path, data) -> pathlib.Path:
  path.write_text(json.dumps(data), encoding="utf-8")
  return path


def _run_in_thread(fn):
  """Runs fn in a new thread; returns its result or raises its exception."""
  out = {}

  def target():
    try:
      out["value"] = fn()
    except BaseException as e:  # Re-raised in the calling thread.
      out["error"] = e
  thread = threading.Thread(target=target)
  thread.start()
  thread.join(timeout=10)
  assert not thread.is_alive()
  if "error" in out:
    raise out["error"]
  return out["value"]


# Defaults and the public surface.


def test_public_names_are_exported():
  for name in ("Config", "set_config", "get_config", "config_context",
               "ConfigError"):
    assert name in tj.__all__ and hasattr(tj, name)
  assert tj.Config is Config


def test_defaults():
  cfg = tj.get_config()
  assert cfg == Config()
  assert cfg.kernel == KernelConfig(enable=False, tuning_range=(1, 10),
                                    bucket="exact", hints=FrozenDict())
  assert cfg.layout == LayoutConfig(enable=False, mode="heuristic")
  assert cfg.dataloader == DataloaderConfig(enable=False, tuning_steps=500,
                                            max_workers=None)
  assert cfg.mixed_precision == MixedPrecisionConfig(
      enable=False, policy="params=float32,compute=bfloat16,output=float32",
      loss_scale="auto")
  assert cfg.cache == CacheConfig(dir=None, readonly=False)
  assert cfg.level == "O1"


def test_to_dict_is_plain_json_in_schema_shape():
  cfg = Config.from_dict({"kernel": {"hints": {"conv": "im2col"}}})
  d = cfg.to_dict()
  assert d == {
      "kernel": {"enable": False, "tuning_range": [1, 10], "bucket": "exact",
                 "hints": {"conv": "im2col"}, "objective": "time", "payback": True,
                 "predict": True},
      "layout": {"enable": False, "mode": "heuristic"},
      "dataloader": {"enable": False, "tuning_steps": 500,
                     "max_workers": None},
      "mixed_precision": {
          "enable": False,
          "policy": "params=float32,compute=bfloat16,output=float32",
          "loss_scale": "auto"},
      "cache": {"dir": None, "readonly": False},
      "level": "O1",
  }
  assert type(d["kernel"]["tuning_range"]) is list
  assert type(d["kernel"]["hints"]) is dict
  assert json.loads(json.dumps(d)) == d


def test_repr_is_readable():
  text = repr(Config.all_tuners_on())
  assert text.startswith("Config(\n")
  assert "  kernel=KernelConfig(enable=True, tuning_range=(1, 10)" in text
  assert "level='O1'" in text


# set_config semantics.


def test_set_config_none_turns_exactly_the_three_tuners_on():
  tj.set_config(None)
  cfg = tj.get_config()
  for name in TUNERS:
    assert getattr(cfg, name).enable is True
  assert cfg.mixed_precision.enable is False
  expected = Config()
  for name in TUNERS:
    expected = dataclasses.replace(
        expected, **{name: dataclasses.replace(getattr(expected, name),
                                               enable=True)})
  assert cfg == expected == Config.all_tuners_on()


def test_set_config_default_argument_is_none():
  tj.set_config()
  assert tj.get_config() == Config.all_tuners_on()


def test_set_config_dict_keeps_defaults_and_does_not_merge():
  tj.set_config({"kernel": {"enable": True, "tuning_range": [2, 4]}})
  cfg = tj.get_config()
  assert cfg.kernel.enable and cfg.kernel.tuning_range == (2, 4)
  assert cfg.kernel.bucket == "exact" and cfg.layout == LayoutConfig()
  tj.set_config({"layout": {"enable": True}})
  cfg = tj.get_config()
  assert cfg.layout.enable
  assert cfg.kernel == KernelConfig()  # The first call is forgotten.


def test_set_config_takes_a_config_as_is():
  cfg = Config(level="O2", cache=CacheConfig(readonly=True))
  assert tj.set_config(cfg) is None
  assert tj.get_config() is cfg


@pytest.mark.parametrize("bad", [42, 1.5, [1, 2], b"config.json", object()])
def test_set_config_rejects_other_kinds(bad):
  with pytest.raises(tj.ConfigError) as info:
    tj.set_config(bad)
  message = str(info.value)
  assert "tunedjax.set_config" in message and repr(bad) in message
  for kind in ("None", "dict", "JSON file", "os.PathLike", "tunedjax.Config"):
    assert kind in message


def test_config_error_is_a_value_error():
  with pytest.raises(ValueError):
    tj.set_config({"level": "O9"})


# Validation: every bad input names the dotted key, the value, what is allowed.

_RANGE = "two integers with 0 <= start < stop"
BAD_INPUTS = [
    ({"kernel": {"enable": 1}}, ["'kernel.enable'", "got 1", "bool"]),
    ({"layout": {"enable": "yes"}}, ["'layout.enable'", "'yes'", "bool"]),
    ({"cache": {"readonly": 0}}, ["'cache.readonly'", "got 0", "bool"]),
    ({"kernel": {"tuning_range": [10, 1]}},
     ["'kernel.tuning_range'", "[10, 1]", _RANGE, "e.g. [1, 10]"]),
    ({"kernel": {"tuning_range": [1]}},
     ["'kernel.tuning_range'", "[1]", _RANGE]),
    ({"kernel": {"tuning_range": [-1, 3]}},
     ["'kernel.tuning_range'", "[-1, 3]", _RANGE]),
    ({"kernel": {"tuning_range": [3, 3]}},
     ["'kernel.tuning_range'", "[3, 3]", _RANGE]),
    ({"kernel": {"tuning_range": [1, 2, 3]}},
     ["'kernel.tuning_range'", "[1, 2, 3]", _RANGE]),
    ({"kernel": {"tuning_range": [1.0, 10]}},
     ["'kernel.tuning_range'", "[1.0, 10]", _RANGE]),
    ({"kernel": {"tuning_range": [False, True]}},
     ["'kernel.tuning_range'", "[False, True]", _RANGE]),
    ({"kernel": {"tuning_range": 10}},
     ["'kernel.tuning_range'", "got 10", _RANGE]),
    ({"kernel": {"bucket": "linear"}},
     ["'kernel.bucket'", "'linear'", "'exact' or 'pow2'"]),
    ({"kernel": {"objective": "speed"}},
     ["'kernel.objective'", "'speed'", "'time' or 'memory'"]),
    ({"level": "O3"}, ["'level'", "'O3'", "'O0', 'O1' or 'O2'"]),
    ({"level": 1}, ["'level'", "got 1", "'O0', 'O1' or 'O2'"]),
    ({"layout": {"mode": "fast"}},
     ["'layout.mode'", "'fast'", "'heuristic' or 'measure'"]),
    ({"mixed_precision": {"loss_scale": "always"}},
     ["'mixed_precision.loss_scale'", "'always'",
      "'auto', 'dynamic', 'static' or 'none'"]),
    ({"dataloader": {"tuning_steps": 0}},
     ["'dataloader.tuning_steps'", "got 0", "an integer >= 1"]),
    ({"dataloader": {"tuning_steps": True}},
     ["'dataloader.tuning_steps'", "True", "an integer >= 1", "bool"]),
    ({"dataloader": {"tuning_steps": 2.5}},
     ["'dataloader.tuning_steps'", "2.5", "an integer >= 1"]),
    ({"dataloader": {"max_workers": -1}},
     ["'dataloader.max_workers'", "got -1", "None", "an integer >= 0"]),
    ({"dataloader": {"max_workers": "4"}},
     ["'dataloader.max_workers'", "'4'", "an integer >= 0"]),
    ({"mixed_precision": {"policy": ""}},
     ["'mixed_precision.policy'", "''", "non-empty string"]),
    ({"mixed_precision": {"policy": None}},
     ["'mixed_precision.policy'", "None", "non-empty string"]),
    ({"cache": {"dir": 3}}, ["'cache.dir'", "got 3", "None", "path"]),
    ({"cache": {"dir": ""}}, ["'cache.dir'", "''", "non-empty path"]),
    ({"kernel": {"tuning_rnage": [1, 10]}},
     ["'kernel.tuning_rnage'", "did you mean 'tuning_range'",
      "'enable', 'tuning_range', 'bucket', 'hints', 'objective', 'payback' or 'predict'"]),
    ({"kernal": {"enable": True}},
     ["'kernal'", "did you mean 'kernel'", "'mixed_precision'", "'level'"]),
    ({"dataloader": {"workers": 2}},
     ["'dataloader.workers'", "'enable', 'tuning_steps' or 'max_workers'"]),
    ({1: {}}, ["'1'", "'kernel'", "'level'"]),
    ({"kernel": True}, ["'kernel'", "True", "a dict", "'tuning_range'"]),
    ({"cache": "/tmp/x"}, ["'cache'", "'/tmp/x'", "a dict", "'readonly'"]),
    ({"kernel": {"hints": {"conv": ""}}},
     ["'kernel.hints.conv'", "''", "non-empty kernel name"]),
    ({"kernel": {"hints": {"conv": 3}}},
     ["'kernel.hints.conv'", "got 3", "non-empty kernel name"]),
    ({"kernel": {"hints": ["conv"]}},
     ["'kernel.hints'", "['conv']", "{op: kernel name}"]),
]


@pytest.mark.parametrize("config, expected", BAD_INPUTS)
def test_bad_input_raises_a_specific_config_error(config, expected):
  with pytest.raises(tj.ConfigError) as info:
    tj.set_config(config)
  message = str(info.value)
  for fragment in expected:
    assert fragment in message, (fragment, message)
  assert tj.get_config() == Config()  # Nothing was set.


@pytest.mark.parametrize("config, expected", BAD_INPUTS[:6])
def test_bad_input_in_a_context_raises_and_sets_nothing(config, expected):
  with pytest.raises(tj.ConfigError, match=expected[0]):
    with tj.config_context(config):
      pytest.fail("the block must not run")
  assert tj.get_config() == Config()


@pytest.mark.parametrize("make", [
    lambda: KernelConfig(tuning_range=[10, 1]),
    lambda: KernelConfig(enable=1),
    lambda: LayoutConfig(mode="fast"),
    lambda: Config(level="O3"),
    lambda: Config(kernel={"enable": True}),
])
def test_direct_construction_is_validated(make):
  with pytest.raises(tj.ConfigError):
    make()


def test_direct_construction_normalizes():
  kernel = KernelConfig(tuning_range=[2, 5], hints={"conv": "fft"})
  assert kernel.tuning_range == (2, 5)
  assert isinstance(kernel.hints, FrozenDict)
  assert CacheConfig(dir=pathlib.Path("/tmp/tj")).dir == "/tmp/tj"


def test_from_dict_rejects_a_non_dict():
  with pytest.raises(tj.ConfigError, match="Config.from_dict expects a dict"):
    Config.from_dict([("level", "O2")])


def test_from_dict_base_keeps_unnamed_keys():
  base = Config.from_dict({"layout": {"enable": True}, "level": "O0"})
  cfg = Config.from_dict({"layout": {"mode": "measure"}}, base=base)
  assert cfg.layout == LayoutConfig(enable=True, mode="measure")
  assert cfg.level == "O0"


# Immutability and hashing.


def test_config_is_frozen_and_hints_are_read_only():
  cfg = Config.from_dict({"kernel": {"hints": {"conv": "im2col"}}})
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.kernel.enable = True  # type: ignore[misc]
  with pytest.raises(TypeError):
    cfg.kernel.hints["conv"] = "fft"  # type: ignore[index]
  with pytest.raises(AttributeError):
    cfg.kernel.hints.update({"conv": "fft"})  # type: ignore[attr-defined]
  assert cfg.kernel.hints == {"conv": "im2col"}


def test_equal_configs_hash_equal_and_work_as_cache_keys():
  a = Config.from_dict({"kernel": {"hints": {"conv": "im2col"},
                                   "tuning_range": [2, 3]}})
  b = Config.from_dict({"kernel": {"tuning_range": (2, 3),
                                   "hints": {"conv": "im2col"}}})
  c = Config.from_dict({"kernel": {"tuning_range": [2, 4]}})
  assert a == b and hash(a) == hash(b)
  assert a != c
  assert len({a: 1, b: 2, c: 3}) == 2


def test_frozen_dict_behaves_like_a_read_only_mapping():
  d = FrozenDict({"conv": "im2col"})
  assert dict(d) == {"conv": "im2col"} and len(d) == 1 and "conv" in d
  assert d == FrozenDict(conv="im2col") and d != FrozenDict(conv="fft")
  assert hash(d) == hash(FrozenDict(conv="im2col"))
  assert repr(d) == "FrozenDict({'conv': 'im2col'})"


# JSON files.


def test_json_file_round_trips(tmp_path):
  cfg = Config.from_dict({
      "kernel": {"enable": True, "tuning_range": [3, 7], "bucket": "pow2",
                 "hints": {"conv": "im2col"}},
      "dataloader": {"max_workers": 0, "tuning_steps": 20},
      "mixed_precision": {"enable": True, "loss_scale": "dynamic"},
      "cache": {"dir": "/tmp/tj-cache", "readonly": True},
      "level": "O2"})
  path = tmp_path / "tj.json"
  text = cfg.to_json(path)
  assert json.loads(path.read_text()) == json.loads(text) == cfg.to_dict()
  tj.set_config(path)
  assert tj.get_config() == cfg
  tj.set_config(str(path))
  assert tj.get_config() == cfg


def test_json_file_keeps_defaults_for_unnamed_keys(tmp_path):
  path = _write_json(tmp_path / "tj.json", {"layout": {"enable": True}})
  tj.set_config(path)
  assert tj.get_config() == Config(layout=LayoutConfig(enable=True))


@pytest.mark.parametrize("content, reason", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "top level is a list"),
    ('"kernel"', "top level is a str"),
    (b"\xff\xfe{", "not valid JSON"),
])
def test_bad_json_file_names_the_path(tmp_path, content, reason):
  path = tmp_path / "bad.json"
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content)
  with pytest.raises(tj.ConfigError) as info:
    tj.set_config(path)
  assert repr(str(path)) in str(info.value)
  assert reason in str(info.value)


def test_missing_json_file_names_the_path(tmp_path):
  path = tmp_path / "missing.json"
  with pytest.raises(tj.ConfigError) as info:
    tj.set_config(path)
  assert repr(str(path)) in str(info.value)
  assert "cannot be opened" in str(info.value)


def test_invalid_keys_in_a_json_file_name_the_file_and_key(tmp_path):
  path = _write_json(tmp_path / "tj.json", {"kernel": {"bucket": "linear"}})
  with pytest.raises(tj.ConfigError) as info:
    tj.set_config(path)
  message = str(info.value)
  assert repr(str(path)) in message and "'kernel.bucket'" in message
  assert "'linear'" in message and "'pow2'" in message


# Environment variables.


def test_tunedjax_config_env_var_is_read(tmp_path, monkeypatch):
  path = _write_json(tmp_path / "env.json", {"level": "O2"})
  monkeypatch.setenv("TUNEDJAX_CONFIG", str(path))
  assert tj.get_config() == Config(level="O2")


def test_tunedjax_config_is_reread_when_the_variable_changes(
    tmp_path, monkeypatch):
  first = _write_json(tmp_path / "a.json", {"level": "O0"})
  second = _write_json(tmp_path / "b.json", {"level": "O2"})
  monkeypatch.setenv("TUNEDJAX_CONFIG", str(first))
  assert tj.get_config().level == "O0"
  _write_json(first, {"level": "O1"})  # Same value: the cached copy is kept.
  assert tj.get_config().level == "O0"
  monkeypatch.setenv("TUNEDJAX_CONFIG", str(second))
  assert tj.get_config().level == "O2"
  monkeypatch.delenv("TUNEDJAX_CONFIG")
  assert tj.get_config() == Config()


@pytest.mark.parametrize("content, fragment", [
    ('{"kernel": {"enable": 1}}', "'kernel.enable'"),
    ("{oops", "not valid JSON"),
    (None, "cannot be opened"),
])
def test_bad_tunedjax_config_names_file_and_variable(
    tmp_path, monkeypatch, content, fragment):
  path = tmp_path / "env.json"
  if content is not None:
    path.write_text(content)
  monkeypatch.setenv("TUNEDJAX_CONFIG", str(path))
  with pytest.raises(tj.ConfigError) as info:
    tj.get_config()
  message = str(info.value)
  assert repr(str(path)) in message and "$TUNEDJAX_CONFIG" in message
  assert fragment in message


def test_set_config_beats_tunedjax_config(tmp_path, monkeypatch):
  path = _write_json(tmp_path / "env.json", {"level": "O2"})
  monkeypatch.setenv("TUNEDJAX_CONFIG", str(path))
  tj.set_config({"layout": {"enable": True}})
  assert tj.get_config() == Config(layout=LayoutConfig(enable=True))


def test_resolved_dir_prefers_dir_then_env_then_home(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert CacheConfig().resolved_dir == tmp_path / "home/.cache/tunedjax"
  monkeypatch.setenv("TUNEDJAX_CACHE_DIR", "~/env-cache")
  assert CacheConfig().resolved_dir == tmp_path / "home/env-cache"
  explicit = CacheConfig(dir=str(tmp_path / "explicit"))
  assert explicit.resolved_dir == tmp_path / "explicit"
  assert CacheConfig(dir="~/mine").resolved_dir == tmp_path / "home/mine"


def test_resolved_max_workers(monkeypatch):
  monkeypatch.setattr(_config.os, "cpu_count", lambda: 12)
  assert DataloaderConfig().resolved_max_workers == 12
  assert DataloaderConfig(max_workers=3).resolved_max_workers == 3
  assert DataloaderConfig(max_workers=0).resolved_max_workers == 0


# config_context.


def test_contexts_nest_and_restore():
  tj.set_config(None)
  outer_cfg = tj.get_config()
  with tj.config_context({"kernel": {"enable": False}}) as cfg:
    assert cfg is tj.get_config()
    assert not cfg.kernel.enable and cfg.layout.enable and cfg.dataloader.enable
    with tj.config_context({"level": "O2"}) as inner:
      assert inner.level == "O2" and not inner.kernel.enable
      assert inner.layout.enable
    assert tj.get_config() is cfg
  assert tj.get_config() is outer_cfg


def test_context_none_turns_tuners_on_over_the_current_config():
  tj.set_config({"level": "O0", "mixed_precision": {"enable": True}})
  with tj.config_context(None) as cfg:
    assert all(getattr(cfg, name).enable for name in TUNERS)
    assert cfg.level == "O0" and cfg.mixed_precision.enable
  assert not tj.get_config().kernel.enable


def test_context_takes_a_config_as_is_and_a_json_path(tmp_path):
  given_cfg = Config(level="O0")
  with tj.config_context(given_cfg) as cfg:
    assert cfg is given_cfg
  path = _write_json(tmp_path / "c.json", {"cache": {"readonly": True}})
  with tj.config_context({"level": "O2"}):
    with tj.config_context(path) as cfg:
      assert cfg.cache.readonly and cfg.level == "O2"


def test_context_restores_after_an_exception():
  with pytest.raises(RuntimeError, match="boom"):
    with tj.config_context({"layout": {"enable": True}}):
      with tj.config_context({"level": "O2"}):
        raise RuntimeError("boom")
  assert tj.get_config() == Config()


def test_context_does_not_leak_into_another_thread():
  entered, checked = threading.Event(), threading.Event()

  def worker():
    with tj.config_context({"layout": {"enable": True}}):
      entered.set()
      assert checked.wait(timeout=10)
      return tj.get_config().layout.enable

  def observer():
    assert entered.wait(timeout=10)
    try:
      return tj.get_config().layout.enable  # While the worker is inside.
    finally:
      checked.set()

  results = {}
  threads = [threading.Thread(target=lambda n=n, f=f: results.update({n: f()}))
             for n, f in (("worker", worker), ("observer", observer))]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(timeout=10)
  assert results == {"worker": True, "observer": False}
  assert tj.get_config() == Config()


def test_context_in_main_thread_is_not_seen_by_a_new_thread():
  with tj.config_context({"level": "O2"}):
    assert _run_in_thread(lambda: tj.get_config().level) == "O1"


def test_set_config_is_seen_by_a_new_thread():
  tj.set_config({"dataloader": {"enable": True, "tuning_steps": 7}})
  seen = _run_in_thread(tj.get_config)
  assert seen.dataloader.enable and seen.dataloader.tuning_steps == 7


def test_contexts_in_asyncio_tasks_are_isolated():
  async def task(level, mine_set, other_set):
    with tj.config_context({"level": level}):
      mine_set.set()
      await other_set.wait()  # Both tasks are now inside their contexts.
      return tj.get_config().level

  async def main():
    a_in, b_in = asyncio.Event(), asyncio.Event()
    return await asyncio.gather(task("O0", a_in, b_in), task("O2", b_in, a_in))

  assert asyncio.run(main()) == ["O0", "O2"]
  assert tj.get_config().level == "O1"


# Property tests.

_NO_FIXTURE_RESET = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    deadline=None)


@_NO_FIXTURE_RESET
@given(start=st.integers(0, 10**9), width=st.integers(1, 10**9))
def test_valid_tuning_ranges_round_trip(start, width):
  cfg = Config.from_dict({"kernel": {"tuning_range": [start, start + width]}})
  assert cfg.kernel.tuning_range == (start, start + width)
  assert cfg.to_dict()["kernel"]["tuning_range"] == [start, start + width]
  assert Config.from_dict(cfg.to_dict()) == cfg


@_NO_FIXTURE_RESET
@given(stop=st.integers(-10**9, 10**9), extra=st.integers(0, 10**9))
def test_invalid_tuning_ranges_always_raise(stop, extra):
  start = stop + extra  # start >= stop
  with pytest.raises(tj.ConfigError, match="kernel.tuning_range"):
    Config.from_dict({"kernel": {"tuning_range": [start, stop]}})


@pytest.mark.parametrize("name", ["mixed_bfloat16", "mixed_float16", "float32",
                                  "p=f32,c=bf16,o=f32"])
def test_policy_key_takes_the_names_get_policy_takes(name):
  with tj.config_context({"mixed_precision": {"enable": True, "policy": name}}):
    assert tj.get_config().mixed_precision.policy == name
    assert str(tj.mixed_precision.get_policy(tj.get_config().mixed_precision.policy))


def test_an_unknown_policy_name_is_a_clear_config_error():
  with pytest.raises(tj.ConfigError, match=r"'mixed_precision.policy'.*mixed_bfloat17"):
    tj.set_config({"mixed_precision": {"policy": "mixed_bfloat17"}})
