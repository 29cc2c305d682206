"""Tests of tunedjax.autotune.device_fingerprint and its helpers."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import pytest

from tunedjax import autotune
from tunedjax._errors import TunedJaxError
from tunedjax._version import __version__
from tunedjax._tuning import _fingerprint
from tunedjax.autotune import DeviceFingerprint
from tunedjax.autotune import device_fingerprint

X86_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse2 avx avx2 fma avx512f avx512bw amx_tile amx_bf16 sse4_2

processor\t: 1
model name\t: Some Other CPU
flags\t\t: fpu sse2
"""

ARM_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes sve sve2 i8mm bf16 cpuid
CPU implementer\t: 0x41
CPU part\t: 0xd4f
"""

PERF_FLAG = "--xla_cpu_enable_fast_math=true"


@pytest.fixture
def base_flags(monkeypatch: pytest.MonkeyPatch) -> str:
  """Pins $XLA_FLAGS to its current value, restored after the test."""
  flags = os.environ.get("XLA_FLAGS", "")
  monkeypatch.setenv("XLA_FLAGS", flags)
  return flags


def _perturb(value: object) -> object:
  """Returns a different value of the same kind, for each field type."""
  if value is None:
    return "9.0"
  if isinstance(value, bool):
    return not value
  if isinstance(value, int):
    return value + 1
  if isinstance(value, str):
    return value + "x"
  if isinstance(value, tuple):
    return (*value, "zz_extra")
  raise TypeError(f"no perturbation for {value!r}")


def test_public_names():
  assert {"DeviceFingerprint", "device_fingerprint"} <= set(autotune.__all__)
  assert autotune.DeviceFingerprint is _fingerprint.DeviceFingerprint
  assert autotune.device_fingerprint is _fingerprint.device_fingerprint


def test_deterministic_and_hashable():
  a, b = device_fingerprint(), device_fingerprint()
  assert a == b
  assert a.digest == b.digest
  assert {a: 1}[b] == 1
  assert len(a.digest) == 16
  int(a.digest, 16)  # hex


def test_fields_describe_this_machine():
  fp = device_fingerprint()
  assert fp.platform == jax.default_backend()
  assert fp.device_count == jax.device_count()
  assert fp.device_kind == jax.devices()[0].device_kind
  assert fp.jax_version == jax.__version__
  assert fp.tunedjax_version == __version__
  assert fp.cpu_model
  assert list(fp.cpu_features) == sorted(fp.cpu_features)
  assert set(fp.cpu_features) <= set(_fingerprint.CPU_FEATURES)


def test_cpu_backend_by_name():
  fp = device_fingerprint("cpu")
  assert fp.platform == "cpu"
  assert fp.compute_capability is None
  assert fp.device_count == jax.device_count("cpu")


@pytest.mark.parametrize(
    "field", [f.name for f in dataclasses.fields(DeviceFingerprint)]
)
def test_digest_changes_with_every_field(field):
  fp = device_fingerprint()
  other = dataclasses.replace(fp, **{field: _perturb(getattr(fp, field))})
  assert other != fp
  assert other.digest != fp.digest


def test_to_dict_round_trips_json():
  fp = device_fingerprint()
  data = fp.to_dict()
  assert json.loads(json.dumps(data)) == data
  assert set(data) == {f.name for f in dataclasses.fields(fp)}
  assert DeviceFingerprint.from_dict(json.loads(json.dumps(data))) == fp


def test_from_dict_rejects_wrong_keys():
  data = device_fingerprint().to_dict()
  del data["platform"]
  with pytest.raises(TunedJaxError, match="platform"):
    DeviceFingerprint.from_dict(data)


def test_digest_is_sha256_of_canonical_json():
  fp = device_fingerprint()
  canonical = json.dumps(fp.to_dict(), sort_keys=True, separators=(",", ":"))
  assert fp.digest == hashlib.sha256(canonical.encode()).hexdigest()[:16]


def test_describe():
  fp = dataclasses.replace(
      device_fingerprint(), platform="gpu", device_count=8,
      device_kind="NVIDIA H100", compute_capability="9.0", cpu_model="EPYC",
  )
  text = fp.describe()
  assert text.startswith("gpu · 8 × NVIDIA H100 (cc 9.0) · EPYC")
  assert text.endswith(f"jax {fp.jax_version}")


def test_perf_xla_flag_changes_fingerprint(monkeypatch, base_flags):
  before = device_fingerprint()
  monkeypatch.setenv("XLA_FLAGS", f"{base_flags} {PERF_FLAG}")
  after = device_fingerprint()
  assert PERF_FLAG in after.xla_flags
  assert PERF_FLAG not in before.xla_flags
  assert after.digest != before.digest


def test_dump_xla_flag_keeps_fingerprint(monkeypatch, base_flags):
  before = device_fingerprint()
  monkeypatch.setenv(
      "XLA_FLAGS",
      f"{base_flags} --xla_dump_to=/tmp/dump --xla_dump_hlo_as_text",
  )
  after = device_fingerprint()
  assert after.xla_flags == before.xla_flags
  assert after.digest == before.digest


@pytest.mark.parametrize(
    "flags, expected",
    [
        ("", ()),
        ("  ", ()),
        ("--b=1 --a=2", ("--a=2", "--b=1")),
        ("--a=1 --a=2", ("--a=2",)),  # the last value wins, as in XLA
        ("--xla_dump_to=/x --xla_gpu_dump_llvmir --xla_foo", ("--xla_foo",)),
        ("--xla_force_host_platform_device_count=8",
         ("--xla_force_host_platform_device_count=8",)),
        ('--a="x y" --b', ("--a=x y", "--b")),
        ('--a="unbalanced', ('--a="unbalanced',)),
    ],
)
def test_perf_xla_flags(flags, expected):
  assert _fingerprint.perf_xla_flags(flags) == expected


def test_unknown_backend_names_it_and_lists_valid_ones():
  with pytest.raises(TunedJaxError, match="no_such_backend") as info:
    device_fingerprint("no_such_backend")
  message = str(info.value)
  for name in jax.extend.backend.backends():
    assert repr(name) in message


def test_parse_cpuinfo_x86():
  info = _fingerprint.parse_cpuinfo(X86_CPUINFO)
  assert info.model == "Intel(R) Xeon(R) Platinum 8480+"
  assert info.features == (
      "amx_bf16", "amx_tile", "avx", "avx2", "avx512bw", "avx512f", "fma",
  )


def test_parse_cpuinfo_arm():
  info = _fingerprint.parse_cpuinfo(ARM_CPUINFO)
  assert info.model == "arm implementer 0x41 part 0xd4f"
  assert info.features == ("asimd", "bf16", "i8mm", "sve", "sve2")


def test_parse_cpuinfo_empty():
  assert _fingerprint.parse_cpuinfo("") == _fingerprint.CpuInfo(None, ())


@pytest.fixture
def fresh_cpu_cache():
  _fingerprint.host_cpu.cache_clear()
  yield
  _fingerprint.host_cpu.cache_clear()


def test_host_cpu_falls_back_without_proc_cpuinfo(
    monkeypatch, tmp_path, fresh_cpu_cache
):
  del fresh_cpu_cache
  monkeypatch.setattr(_fingerprint, "_CPUINFO_PATH", str(tmp_path / "none"))
  info = _fingerprint.host_cpu()
  assert info.model  # platform.processor() or platform.machine()
  assert info.features == ()


def test_host_cpu_reads_the_file(monkeypatch, tmp_path, fresh_cpu_cache):
  del fresh_cpu_cache
  path = tmp_path / "cpuinfo"
  path.write_text(X86_CPUINFO)
  monkeypatch.setattr(_fingerprint, "_CPUINFO_PATH", str(path))
  fp = device_fingerprint()
  assert fp.cpu_model == "Intel(R) Xeon(R) Platinum 8480+"
  assert "amx_tile" in fp.cpu_features
