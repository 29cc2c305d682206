"""The persistent tuning cache: one JSON file per device, safe to share.

Every tuner (kernel selection, layout, input pipeline) stores what it measured
here, so that a restart, or another process on the same kind of machine,
repeats nothing. Unlike Paddle's in-memory cache or cuDNN's benchmark cache:

* **Keyed by device.** One file per `DeviceFingerprint` (``<digest>.json``):
  another GPU, CPU, jax version or set of XLA flags reads another file, so a
  timing is never reused where it was not measured.
* **Full keys.** Entries are stored under their whole key (a JSON object), not
  a hash, so a collision cannot return a wrong answer, and the file is
  readable with ``tunedjax cache show``.
* **Safe for a cluster.** Writers take an exclusive ``fcntl`` lock, re-read the
  file, merge their entry and replace the file atomically (temp file, fsync,
  rename): many processes tuning at once lose nothing, and a writer killed
  mid-write leaves the old file whole.
* **Never trusted blindly.** The files are JSON, never pickle. A file that
  does not parse is moved aside with a warning (the tuners re-measure); every
  entry is checked for its structure, and its value by the validator its
  namespace registered (`register_validator`) before anyone uses it.
* **Bounded.** At most `max_entries` per file; the oldest go first.

Example:
  >>> import tempfile
  >>> cache = Cache(tempfile.mkdtemp())
  >>> cache.put("demo", {"shape": [8, 8]}, {"winner": "xla"})
  >>> cache.get("demo", {"shape": [8, 8]})
  {'winner': 'xla'}
  >>> cache.get("demo", {"shape": [16, 16]}) is None
  True
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import math
import os
import pathlib
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any, NamedTuple

from tunedjax._config import get_config
from tunedjax._errors import CacheWarning
from tunedjax._errors import TunedJaxError
from tunedjax._tuning._fingerprint import DeviceFingerprint
from tunedjax._tuning._fingerprint import device_fingerprint

log = logging.getLogger("tunedjax.autotune.cache")

FORMAT = "tunedjax-tuning-cache"
FORMAT_VERSION = 1
DEFAULT_MAX_ENTRIES = 10_000

Validator = Callable[[dict[str, Any]], None]
_VALIDATORS: dict[str, Validator] = {}


class CacheEntry(NamedTuple):
  """One measured result: what was tuned (`key`), what was learned (`value`).

  Attributes:
    namespace: the tuner that wrote it: "conv", "layout", "dataloader", ...
    key: the full key, a JSON object.
    value: the result, a JSON object.
    created: when it was measured (seconds since the epoch).
  """

  namespace: str
  key: dict[str, Any]
  value: dict[str, Any]
  created: float


def register_validator(namespace: str, validate: Validator) -> None:
  """Registers the check that every value read under `namespace` must pass.

  Tuners call this at import time. `validate(value)` raises `ValueError` or
  `TypeError` for a value that must not be used (an unknown kernel name, a
  field of the wrong type); such an entry reads as a miss, with a warning.

  Args:
    namespace: the namespace the tuner writes, e.g. "conv".
    validate: a function of the entry's value that raises on a bad one.

  Example:
    >>> def check(value):
    ...   if not isinstance(value.get("winner"), str):
    ...     raise TypeError("winner must be a string")
    >>> register_validator("doc-example", check)
  """
  _VALIDATORS[namespace] = validate


def _canonical(key: Mapping[str, Any]) -> str:
  return json.dumps(key, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _entry_problem(raw: Any) -> str | None:
  """Why a stored entry is malformed, or None when its structure is fine."""
  if not isinstance(raw, dict):
    return f"an entry is a {type(raw).__name__}, not an object"
  if set(raw) != {"namespace", "key", "value", "created"}:
    return f"an entry has the fields {sorted(raw)}"
  if not isinstance(raw["namespace"], str):
    return "an entry's namespace is not a string"
  if not isinstance(raw["key"], dict) or not isinstance(raw["value"], dict):
    return "an entry's key or value is not an object"
  created = raw["created"]
  if (isinstance(created, bool) or not isinstance(created, (int, float))
      or not math.isfinite(created)):
    return "an entry's created time is not a number"
  return None


def _value_problem(namespace: str, value: dict[str, Any]) -> str | None:
  validate = _VALIDATORS.get(namespace)
  if validate is None:
    return None
  try:
    validate(value)
  except (ValueError, TypeError, KeyError) as err:
    return str(err) or type(err).__name__
  return None


class _Parsed(NamedTuple):
  entries: dict[tuple[str, str], CacheEntry]
  problem: str | None  # why the whole file cannot be used, if it cannot


def _parse(raw: bytes, fingerprint: DeviceFingerprint) -> _Parsed:
  try:
    data = json.loads(raw.decode("utf-8"))
  except ValueError as err:  # UnicodeDecodeError is a ValueError too
    return _Parsed({}, f"it is not valid JSON ({err})")
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    return _Parsed({}, f"it is not a {FORMAT} file")
  if data.get("version") != FORMAT_VERSION:
    return _Parsed({}, f"it has format version {data.get('version')!r}, "
                       f"this tunedjax reads {FORMAT_VERSION}")
  if data.get("fingerprint") != fingerprint.to_dict():
    return _Parsed({}, "its device fingerprint is not this device's")
  raw_entries = data.get("entries")
  if not isinstance(raw_entries, list):
    return _Parsed({}, "its entries are not a list")
  entries: dict[tuple[str, str], CacheEntry] = {}
  for raw in raw_entries:
    problem = _entry_problem(raw)
    if problem is not None:
      log.warning("Skipping a malformed tuning-cache entry: %s.", problem)
      continue
    entry = CacheEntry(raw["namespace"], raw["key"], raw["value"],
                       float(raw["created"]))
    entries[(entry.namespace, _canonical(entry.key))] = entry
  return _Parsed(entries, None)


class Cache:
  """The tuning cache of one device, stored as ``<dir>/<digest>.json``.

  Args:
    dir: the cache folder; None for ``get_config().cache.resolved_dir``
      (``$TUNEDJAX_CACHE_DIR`` or ``~/.cache/tunedjax``).
    readonly: read but never write (for a cluster's shared, curated cache);
      None for ``get_config().cache.readonly``.
    fingerprint: the device the timings belong to; None for this process's
      default backend.
    max_entries: the most entries the file keeps; the oldest go first.

  Example:
    >>> import tempfile
    >>> cache = Cache(tempfile.mkdtemp())
    >>> cache.put("layout", {"f": "resnet", "sig": "f32[8,3,224,224]"}, {"target": "NHWC"})
    >>> [e.value for e in cache.entries("layout")]
    [{'target': 'NHWC'}]
  """

  def __init__(self, dir: str | os.PathLike[str] | None = None, *,
               readonly: bool | None = None,
               fingerprint: DeviceFingerprint | None = None,
               max_entries: int = DEFAULT_MAX_ENTRIES):
    config = get_config().cache
    self.dir = pathlib.Path(dir).expanduser() if dir is not None else config.resolved_dir
    self.readonly = config.readonly if readonly is None else bool(readonly)
    self.fingerprint = fingerprint if fingerprint is not None else device_fingerprint()
    if not isinstance(max_entries, int) or max_entries < 1:
      raise TunedJaxError(f"Cache max_entries must be a positive int, got {max_entries!r}.")
    self.max_entries = max_entries
    self.path = self.dir / f"{self.fingerprint.digest}.json"
    self._lock = threading.Lock()
    self._stamp: tuple[int, int] | None = None
    self._entries: dict[tuple[str, str], CacheEntry] = {}
    self._warned: set[str] = set()

  def __repr__(self) -> str:
    mode = ", readonly" if self.readonly else ""
    return f"Cache({str(self.dir)!r}{mode}, device={self.fingerprint.digest})"

  # -- reading ---------------------------------------------------------------

  def _warn_once(self, message: str) -> None:
    if message not in self._warned:
      self._warned.add(message)
      warnings.warn(message, CacheWarning, stacklevel=4)

  def _file_stamp(self) -> tuple[int, int] | None:
    try:
      st = self.path.stat()
    except FileNotFoundError:
      return None
    return (st.st_mtime_ns, st.st_size)

  def _read_file(self) -> dict[tuple[str, str], CacheEntry]:
    """The file's valid entries; moves an unusable file aside (with a warning)."""
    try:
      raw = self.path.read_bytes()
    except FileNotFoundError:
      return {}
    except OSError as err:
      self._warn_once(f"Cannot read the tuning cache {self.path} ({err}); "
                      "tuning from scratch.")
      return {}
    parsed = _parse(raw, self.fingerprint)
    if parsed.problem is None:
      return parsed.entries
    if self.readonly:
      self._warn_once(f"Ignoring the tuning cache {self.path}: {parsed.problem}. "
                      "It is readonly, so it is left in place; tuning from scratch.")
    else:
      aside = self.path.with_name(f"{self.path.name}.corrupt-{time.time_ns()}")
      with contextlib.suppress(OSError):
        os.replace(self.path, aside)
      self._warn_once(f"The tuning cache {self.path} is unusable: {parsed.problem}. "
                      f"Moved it to {aside.name}; tuning from scratch.")
    return {}

  def _current(self) -> dict[tuple[str, str], CacheEntry]:
    stamp = self._file_stamp()
    if stamp != self._stamp or stamp is None:
      self._entries = self._read_file()
      self._stamp = self._file_stamp()
    return self._entries

  def get(self, namespace: str, key: Mapping[str, Any]) -> dict[str, Any] | None:
    """Returns the value stored under `key`, or None on a miss.

    An entry whose value fails its namespace's validator reads as a miss,
    with a warning, and is replaced by the next `put`.
    """
    with self._lock:
      entry = self._current().get((namespace, _canonical(key)))
    if entry is None:
      return None
    problem = _value_problem(namespace, entry.value)
    if problem is not None:
      self._warn_once(f"Ignoring an invalid {namespace!r} entry in the tuning "
                      f"cache {self.path}: {problem}. It will be re-tuned.")
      return None
    return copy.deepcopy(entry.value)

  def entries(self, namespace: str | None = None) -> list[CacheEntry]:
    """Every stored entry (of one namespace, if given), oldest first."""
    with self._lock:
      found = list(self._current().values())
    return sorted((e for e in found if namespace is None or e.namespace == namespace),
                  key=lambda e: e.created)

  # -- writing ---------------------------------------------------------------

  @contextlib.contextmanager
  def _exclusive(self) -> Iterator[None]:
    """Holds this thread's lock and an exclusive lock on ``<file>.lock``."""
    self.dir.mkdir(parents=True, exist_ok=True)
    with self._lock, open(self.path.with_name(self.path.name + ".lock"), "a") as f:
      fcntl.flock(f.fileno(), fcntl.LOCK_EX)
      try:
        yield
      finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)

  def _write(self, entries: dict[tuple[str, str], CacheEntry]) -> None:
    kept = sorted(entries.values(), key=lambda e: e.created)[-self.max_entries:]
    data = {"format": FORMAT, "version": FORMAT_VERSION,
            "fingerprint": self.fingerprint.to_dict(),
            "entries": [e._asdict() for e in kept]}
    fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{self.path.name}.",
                               suffix=".tmp")
    try:
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, self.path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.unlink(tmp)
      raise
    self._entries = {(e.namespace, _canonical(e.key)): e for e in kept}
    self._stamp = self._file_stamp()

  def put(self, namespace: str, key: Mapping[str, Any],
          value: Mapping[str, Any]) -> None:
    """Stores `value` under `key`, merged with what other processes wrote.

    Does nothing in readonly mode. The write is atomic: readers see the old
    file or the new one, never a part.

    Raises:
      TunedJaxError: if `key` or `value` is not a JSON object of plain values.
    """
    self.put_many(namespace, [(key, value)])

  def put_many(self, namespace: str,
               items: list[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> None:
    """Stores several entries with one locked read-merge-write."""
    if self.readonly:
      log.debug("Tuning cache %s is readonly; not storing %d entries.",
                self.path, len(items))
      return
    now = time.time()
    new = []
    for key, value in items:
      if not isinstance(key, Mapping) or not isinstance(value, Mapping):
        raise TunedJaxError("A tuning-cache key and value must be mappings; got "
                            f"{type(key).__name__} and {type(value).__name__}.")
      try:
        canonical = _canonical(key)
        value = json.loads(json.dumps(value, allow_nan=False))
      except (TypeError, ValueError) as err:
        raise TunedJaxError(f"A tuning-cache entry must be plain JSON ({err}): "
                            f"key {key!r}, value {value!r}.") from None
      new.append(CacheEntry(namespace, json.loads(canonical), value, now))
    with self._exclusive():
      entries = self._read_file()
      for entry in new:
        entries[(entry.namespace, _canonical(entry.key))] = entry
      self._write(entries)

  def clear(self) -> int:
    """Deletes this device's file; returns how many entries it held."""
    with self._exclusive():
      count = len(self._read_file())
      with contextlib.suppress(FileNotFoundError):
        self.path.unlink()
      self._entries, self._stamp = {}, None
    return count

  # -- moving caches between machines -------------------------------------------

  def export(self, path: str | os.PathLike[str]) -> int:
    """Writes this device's entries to `path` (a cache file); returns the count."""
    entries = self.entries()
    data = {"format": FORMAT, "version": FORMAT_VERSION,
            "fingerprint": self.fingerprint.to_dict(),
            "entries": [e._asdict() for e in entries]}
    pathlib.Path(path).write_text(json.dumps(data, indent=1, sort_keys=True),
                                  encoding="utf-8")
    return len(entries)


def import_file(path: str | os.PathLike[str], dir: str | os.PathLike[str] | None = None,
                ) -> tuple[Cache, int, list[str]]:
  """Merges an exported cache file into the cache folder `dir`.

  The entries go to the file of the device they were measured on (the one the
  exported file names), so importing another machine's timings never makes
  this machine use them. Every entry is validated as on reading; invalid ones
  are skipped and reported.

  Returns:
    ``(cache, imported, problems)``: the cache written to, how many entries
    were merged, and why any were skipped.

  Raises:
    TunedJaxError: if the file cannot be read or is not a tuning-cache file.
  """
  try:
    data = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, ValueError) as err:
    raise TunedJaxError(f"Cannot import the tuning cache {str(path)!r}: {err}.") from None
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    raise TunedJaxError(f"{str(path)!r} is not a tuning-cache file (written by "
                        "`tunedjax cache export`).")
  try:
    fingerprint = DeviceFingerprint.from_dict(data.get("fingerprint") or {})
  except (TunedJaxError, TypeError) as err:
    raise TunedJaxError(f"{str(path)!r} has no valid device fingerprint: {err}") from None
  if data.get("version") != FORMAT_VERSION:
    raise TunedJaxError(f"{str(path)!r} has format version {data.get('version')!r}; "
                        f"this tunedjax reads {FORMAT_VERSION}.")
  cache = Cache(dir, fingerprint=fingerprint)
  problems: list[str] = []
  by_namespace: dict[str, list[tuple[dict, dict]]] = {}
  for i, raw in enumerate(data.get("entries") or []):
    problem = _entry_problem(raw)
    if problem is None and raw["namespace"] not in _VALIDATORS:
      problem = f"unknown namespace {raw['namespace']!r}"
    if problem is None:
      problem = _value_problem(raw["namespace"], raw["value"])
    if problem is not None:
      problems.append(f"entry {i}: {problem}")
      continue
    by_namespace.setdefault(raw["namespace"], []).append((raw["key"], raw["value"]))
  for namespace, items in by_namespace.items():
    cache.put_many(namespace, items)
  return cache, sum(map(len, by_namespace.values())), problems


_DEFAULTS: dict[tuple[str, bool, str], Cache] = {}
_DEFAULTS_LOCK = threading.Lock()


def default_cache() -> Cache:
  """The cache of the active config and this process's default device.

  One `Cache` object per (folder, readonly, device), so that its in-memory
  copy of the file is shared by every tuner of the process.

  Example:
    >>> import tunedjax as tj
    >>> with tj.config_context({"cache": {"dir": "/tmp/tj-doc", "readonly": True}}):
    ...   default_cache().readonly
    True
  """
  config = get_config().cache
  fingerprint = device_fingerprint()
  memo_key = (str(config.resolved_dir), config.readonly, fingerprint.digest)
  with _DEFAULTS_LOCK:
    cache = _DEFAULTS.get(memo_key)
    if cache is None:
      cache = _DEFAULTS[memo_key] = Cache(config.resolved_dir, readonly=config.readonly,
                                          fingerprint=fingerprint)
  return cache


CacheLike = Any  # Cache | str | os.PathLike | None | False


def resolve_cache(cache: CacheLike) -> Cache | None:
  """The one meaning of a tuner's ``cache=`` argument, for every tuner.

  Args:
    cache: None (or True) for the config's default cache (`default_cache`);
      False for no persistent cache (measurements kept in memory only); a
      `Cache`; or a folder path.

  Returns:
    A `Cache`, or None for no persistent cache.

  Raises:
    TypeError: anything else (the message names the value).

  Example:
    >>> resolve_cache(False) is None
    True
    >>> isinstance(resolve_cache("/tmp/tj-doc-cache"), Cache)
    True
  """
  if cache is None or cache is True:
    return default_cache()
  if cache is False:
    return None
  if isinstance(cache, Cache):
    return cache
  if isinstance(cache, (str, os.PathLike)):
    return Cache(cache)
  raise TypeError(f"cache must be None or True (the default cache), False (none), a "
                  f"tunedjax.autotune.Cache or a folder path, got {cache!r} "
                  f"(type {type(cache).__name__}).")
