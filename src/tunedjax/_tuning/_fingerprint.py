"""Device fingerprints: what a timing depends on, as one hashable key.

The persistent tuning caches keep one file per device fingerprint, so that
timings measured on one machine (or with other XLA flags, or another jax) are
never reused on another. A fingerprint holds the accelerator, the host CPU and
its vector extensions, the software versions and the performance-relevant
``$XLA_FLAGS``; its `digest` names the cache file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform as _platform
import shlex
from typing import Any, NamedTuple

import jax
import jax.extend as jex
import jaxlib

from tunedjax._errors import TunedJaxError
from tunedjax._errors import did_you_mean
from tunedjax._errors import format_choices
from tunedjax._version import __version__ as _tunedjax_version

# ISA extensions that change which kernel wins (x86 first, then Arm).
CPU_FEATURES = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw",
    "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm",
)

# XLA flags that only write logs or dumps and cannot change a timing. Every
# other flag in $XLA_FLAGS is kept in the fingerprint, to be safe.
NON_PERF_FLAG_PREFIXES = ("--xla_dump_", "--xla_gpu_dump_", "--xla_log_")

_CPUINFO_PATH = "/proc/cpuinfo"
_NO_BACKEND = "No JAX backend {backend!r}{suggestion}; available: {valid}."
# Names JAX knows even where the hardware is absent: no "did you mean" for them.
_PLATFORM_NAMES = ("cpu", "gpu", "cuda", "rocm", "tpu", "METAL")


class CpuInfo(NamedTuple):
  """The host CPU from ``/proc/cpuinfo``: its model name and ISA features."""

  model: str | None
  features: tuple[str, ...]


def parse_cpuinfo(text: str) -> CpuInfo:
  """Reads the model name and performance-relevant flags of the first CPU.

  Understands x86 (``model name``, ``flags``) and Arm (``Features``, and
  ``CPU implementer``/``CPU part`` where there is no model name) layouts.

  Args:
    text: the contents of ``/proc/cpuinfo``.

  Returns:
    A `CpuInfo`; ``model`` is None and ``features`` empty where not found.

  Example:
    >>> parse_cpuinfo("model name\\t: Xeon\\nflags\\t\\t: fpu avx2 avx sse2\\n")
    CpuInfo(model='Xeon', features=('avx', 'avx2'))
  """
  fields: dict[str, str] = {}
  for line in text.splitlines():
    key, sep, value = line.partition(":")
    key = key.strip().lower()
    if sep and key and key not in fields:
      fields[key] = value.strip()
  model = fields.get("model name") or fields.get("cpu model") or None
  if model is None and "cpu part" in fields:
    implementer = fields.get("cpu implementer", "?")
    model = f"arm implementer {implementer} part {fields['cpu part']}"
  present = set((fields.get("flags") or fields.get("features") or "").split())
  return CpuInfo(model, tuple(sorted(present.intersection(CPU_FEATURES))))


@functools.cache
def host_cpu() -> CpuInfo:
  """Parses ``/proc/cpuinfo`` once per process; falls back to `platform`."""
  try:
    with open(_CPUINFO_PATH, encoding="utf-8", errors="replace") as f:
      info = parse_cpuinfo(f.read())
  except OSError:
    info = CpuInfo(None, ())
  if info.model is None:
    fallback = _platform.processor() or _platform.machine() or "unknown"
    info = info._replace(model=fallback)
  return info


def perf_xla_flags(xla_flags: str) -> tuple[str, ...]:
  """Returns the flags of an ``$XLA_FLAGS`` string that may change timings.

  Dump and logging flags (`NON_PERF_FLAG_PREFIXES`) are dropped; every other
  flag is kept. A flag given twice keeps its last value, as in XLA.

  Args:
    xla_flags: the value of ``$XLA_FLAGS``, flags separated by whitespace.

  Returns:
    The kept flags, sorted.

  Example:
    >>> perf_xla_flags("--xla_dump_to=/tmp/d --xla_cpu_enable_fast_math=true")
    ('--xla_cpu_enable_fast_math=true',)
  """
  try:
    tokens = shlex.split(xla_flags)
  except ValueError:  # An unbalanced quote: fall back to plain splitting.
    tokens = xla_flags.split()
  by_name: dict[str, str] = {}
  for token in tokens:
    name = token.split("=", 1)[0]
    if not name.startswith(NON_PERF_FLAG_PREFIXES):
      by_name[name] = token
  return tuple(sorted(by_name.values()))


@dataclasses.dataclass(frozen=True)
class DeviceFingerprint:
  """Everything a measured timing depends on, for one backend of this host.

  Attributes:
    platform: the JAX platform: "cpu", "gpu" or "tpu".
    device_kind: ``device_kind`` of the first device, e.g. "NVIDIA H100".
    device_count: the number of devices of that backend (`jax.device_count`).
    cpu_model: the host CPU's model name.
    cpu_features: the sorted ISA extensions of `CPU_FEATURES` the CPU has.
    compute_capability: the GPU compute capability, e.g. "9.0"; None elsewhere.
    jax_version: ``jax.__version__``.
    jaxlib_version: ``jaxlib.__version__``.
    tunedjax_version: ``tunedjax.__version__``.
    xla_flags: the sorted performance-relevant flags of ``$XLA_FLAGS``.

  Example:
    >>> fp = device_fingerprint("cpu")
    >>> fp.platform, len(fp.digest)
    ('cpu', 16)
  """

  platform: str
  device_kind: str
  device_count: int
  cpu_model: str
  cpu_features: tuple[str, ...]
  compute_capability: str | None
  jax_version: str
  jaxlib_version: str
  tunedjax_version: str
  xla_flags: tuple[str, ...]

  def to_dict(self) -> dict[str, Any]:
    """Returns the fields as a JSON-able dict (tuples become lists)."""
    data = dataclasses.asdict(self)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> DeviceFingerprint:
    """Builds a fingerprint from `to_dict` output, e.g. read from a cache file.

    Raises:
      TunedJaxError: if keys are missing or unknown.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    if set(data) != set(names):
      raise TunedJaxError(
          "A device fingerprint needs exactly the keys "
          f"{format_choices(names)}; got {sorted(data)}."
      )
    return cls(**{k: tuple(v) if isinstance(v, list) else v
                  for k, v in data.items()})

  @property
  def digest(self) -> str:
    """The first 16 hex digits of the sha256 of the canonical JSON form."""
    canonical = json.dumps(self.to_dict(), sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]

  def describe(self) -> str:
    """Returns one line, e.g. ``cpu · 8 × cpu · Xeon · jax 0.10.2``."""
    kind = self.device_kind
    if self.compute_capability is not None:
      kind += f" (cc {self.compute_capability})"
    return (f"{self.platform} · {self.device_count} × {kind} · "
            f"{self.cpu_model} · jax {self.jax_version}")


def _devices(backend: str | None) -> list[jax.Device]:
  """`jax.devices(backend)`, with an error that lists the valid backends."""
  try:
    return jax.devices(backend)
  except RuntimeError as err:
    valid = sorted(jex.backend.backends())
    known = backend in _PLATFORM_NAMES
    suggestion = " on this machine" if known else did_you_mean(backend, valid)
    raise TunedJaxError(_NO_BACKEND.format(
        backend=backend, suggestion=suggestion, valid=format_choices(valid)
    )) from err


def device_fingerprint(backend: str | None = None) -> DeviceFingerprint:
  """Returns the fingerprint of the default backend, or of the one named.

  Computed afresh on each call (it is cheap) so that it follows changes of
  ``$XLA_FLAGS``; only the ``/proc/cpuinfo`` parse is cached.

  Args:
    backend: a JAX backend or platform name ("cpu", "gpu", "cuda", "tpu");
      None for `jax.default_backend()`.

  Returns:
    A `DeviceFingerprint`.

  Raises:
    TunedJaxError: if there is no such backend; the message lists the valid
      ones.

  Example:
    >>> device_fingerprint() == device_fingerprint()
    True
  """
  devices = _devices(backend)
  first = devices[0]
  cpu = host_cpu()
  capability = getattr(first, "compute_capability", None)
  return DeviceFingerprint(
      platform=first.platform,
      device_kind=first.device_kind,
      device_count=jax.device_count(backend),
      cpu_model=cpu.model or "unknown",
      cpu_features=cpu.features,
      compute_capability=None if capability is None else str(capability),
      jax_version=jax.__version__,
      jaxlib_version=jaxlib.__version__,
      tunedjax_version=_tunedjax_version,
      xla_flags=perf_xla_flags(os.environ.get("XLA_FLAGS", "")),
  )
