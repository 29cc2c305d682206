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
* **Never in the way.** A folder that is missing is created; one that cannot
  be used (under a regular file, read-only, full, not readable) is reported
  once, by one function (`warn_unusable`; `usable_folder` for a folder that
  must be writable up front, as JAX's compilation cache of level O2), with a
  `CacheWarning` naming the path and the reason, and the cache carries on in
  memory: what this process tunes is still found by this process, it is only
  not kept for the next one. `get`, `put`, `put_many` and `entries` never
  raise `OSError`.

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
import errno
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
from tunedjax._tuning._platform import canonical_platform

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


# -- the one decision on a folder that cannot be used ----------------------------

_REASONS = {
    errno.EROFS: "it is on a read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted (an immutable or protected path)",
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "the file-size limit was reached",
    errno.EISDIR: "a folder stands where the cache file should be",
    errno.ENAMETOOLONG: "the path is too long",
    errno.ELOOP: "the path has a symbolic-link loop",
}
_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()


def _not_a_folder(path: pathlib.Path) -> str:
  """Why `path` cannot be a folder: it, or a parent of it, is a file."""
  for part in (path, *path.parents):
    try:
      if part.exists() and not part.is_dir():
        return ("it is a regular file, not a folder" if part == path
                else f"{part} is a regular file, not a folder")
    except OSError:
      continue
  return "a part of the path is not a folder"


def describe_problem(path: str | os.PathLike[str], err: OSError) -> str:
  """The reason an `OSError` on `path` makes a cache unusable, in plain words.

  Example:
    >>> import errno
    >>> describe_problem("/ro/cache", OSError(errno.EROFS, "Read-only file system"))
    'it is on a read-only file system (Read-only file system)'
  """
  path = pathlib.Path(path)
  if err.errno in (errno.ENOTDIR, errno.EEXIST):
    reason = _not_a_folder(path)
  else:
    reason = _REASONS.get(err.errno, type(err).__name__)
  detail = err.strerror or str(err)
  return f"{reason} ({detail})" if detail and detail != reason else reason


def warn_unusable(path: str | os.PathLike[str], err: OSError | str, *,
                  what: str = "tuning cache",
                  consequence: str = "results are kept in memory for this process "
                                     "only") -> None:
  """Warns, once per folder and reason, that a cache folder cannot be used.

  Every cache of tunedjax reports here: the tuning cache (kernels, layout,
  input pipeline, the CLI) and JAX's compilation cache of level O2.

  Args:
    path: the folder (or file) that failed.
    err: the `OSError`, or the reason as a sentence part.
    what: which cache, for the message.
    consequence: what happens instead, for the message.
  """
  reason = describe_problem(path, err) if isinstance(err, OSError) else err
  key = (str(path), reason)
  with _WARNED_LOCK:
    if key in _WARNED:
      return
    _WARNED.add(key)
  warnings.warn(
      f"The {what} folder {str(path)!r} cannot be used: {reason}. The {consequence}; "
      "point $TUNEDJAX_CACHE_DIR or set_config({'cache': {'dir': ...}}) at a "
      "writable folder to keep them across runs.", CacheWarning, stacklevel=3)
  log.warning("%s %s unusable: %s", what, path, reason)


def folder_problem(path: str | os.PathLike[str], *, write: bool = True) -> OSError | None:
  """Creates the folder `path` if missing; returns why it cannot be used, or None.

  With `write`, a probe file is created and removed, so that a read-only
  mount, an immutable folder or missing permissions show now (a check of
  the mode bits would prove nothing to root).

  Example:
    >>> import tempfile
    >>> folder_problem(tempfile.mkdtemp()) is None
    True
  """
  path = pathlib.Path(path)
  try:
    if write:
      path.mkdir(parents=True, exist_ok=True)
      fd, probe = tempfile.mkstemp(dir=path, prefix=".tunedjax-probe-")
      os.close(fd)
      os.unlink(probe)
    elif path.exists() and not path.is_dir():
      raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
  except FileExistsError as err:  # mkdir of a path that is a file
    return NotADirectoryError(errno.ENOTDIR, err.strerror, str(path))
  except OSError as err:
    return err
  return None


def usable_folder(path: str | os.PathLike[str], *, what: str = "tuning cache",
                  consequence: str = "results are kept in memory for this process "
                                     "only") -> pathlib.Path | None:
  """The folder `path`, created if missing, or None (with one warning) if unusable.

  The single decision on a cache folder that is missing, not a folder,
  read-only or full: callers never see an `OSError`, and carry on without
  the folder when this returns None.

  Example:
    >>> import tempfile, pathlib
    >>> usable_folder(pathlib.Path(tempfile.mkdtemp()) / "new").name
    'new'
  """
  path = pathlib.Path(path).expanduser()
  problem = folder_problem(path)
  if problem is not None:
    warn_unusable(path, problem, what=what, consequence=consequence)
    return None
  return path


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
      None for ``get_config().cache.readonly``. What this process stores is
      still kept in memory, for this process.
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
    # Entries stored by this process that are not (yet) in the file: readonly
    # mode, or a folder that cannot be written. Merged into every read, and
    # into the next write that succeeds.
    self._memory: dict[tuple[str, str], CacheEntry] = {}
    self._deferring = 0  # open `deferring` blocks: writes wait in `_memory` for the last to end
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
    except OSError:  # missing, or a path that cannot hold it: read() says why
      return None
    return (st.st_mtime_ns, st.st_size)

  def _unusable(self, err: OSError, *, reading: bool = False) -> None:
    where = self.dir if err.errno in (errno.ENOTDIR, errno.EEXIST) or not reading else self.path
    warn_unusable(where, err, consequence=(
        "tuning cache is not read: what this process tunes is kept in memory for "
        "this process only" if reading else
        "results are kept in memory for this process only"))

  def _read_file(self) -> dict[tuple[str, str], CacheEntry]:
    """The file's valid entries; moves an unusable file aside (with a warning)."""
    try:
      raw = self.path.read_bytes()
    except FileNotFoundError:
      return {}
    except OSError as err:
      self._unusable(err, reading=True)
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
    if not self._memory:
      return self._entries
    merged = dict(self._entries)
    for k, entry in self._memory.items():
      if k not in merged or merged[k].created <= entry.created:
        merged[k] = entry
    return merged

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
    """Holds this thread's lock and an exclusive lock on ``<file>.lock``.

    Raises:
      OSError: if the folder cannot be created or the lock file opened.
    """
    try:
      self.dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where the folder should be
      raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(self.dir)) from None
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

    The write is atomic: readers see the old file or the new one, never a
    part. In readonly mode, or when the folder cannot be written (missing
    permissions, a read-only or full disk, a path under a regular file), the
    entry is kept in memory for this process, with one `CacheWarning` naming
    the folder and the reason; no `OSError` escapes.

    Raises:
      TunedJaxError: if `key` or `value` is not a JSON object of plain values.
    """
    self.put_many(namespace, [(key, value)])

  def put_many(self, namespace: str,
               items: list[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> None:
    """Stores several entries with one locked read-merge-write (see `put`)."""
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
    new_entries = {(e.namespace, _canonical(e.key)): e for e in new}
    with self._lock:
      if self.readonly or self._deferring:
        if self.readonly:
          log.debug("Tuning cache %s is readonly; keeping %d entries in memory.",
                    self.path, len(new))
        self._memory.update(new_entries)
        return
    self._write_merged(new_entries)

  def _write_merged(self, new_entries: dict[tuple[str, str], CacheEntry]) -> None:
    """One locked read-merge-write of the file with `_memory` and `new_entries`."""
    try:
      with self._exclusive():
        entries = self._read_file()
        entries.update(self._memory)
        entries.update(new_entries)
        self._write(entries)
        self._memory.clear()
    except OSError as err:
      self._unusable(err)
      with self._lock:
        self._memory.update(new_entries)

  @contextlib.contextmanager
  def deferring(self) -> Iterator[Cache]:
    """Inside the block, `put` keeps entries in memory; the end of the
    outermost block writes them all in one locked read-merge-write.

    Every read in this process sees the kept entries at once; other
    processes see them when the block ends. `tunedjax.jit` defers the
    writes of one trace (a first call that tunes 40 buckets writes the file
    once, not 40 times, each with its ``fsync``). Blocks nest, in any thread.

    Example:
      >>> import tempfile
      >>> cache = Cache(tempfile.mkdtemp())
      >>> with cache.deferring():
      ...   cache.put("demo", {"n": 1}, {"winner": "xla"})
      ...   on_disk = cache.path.exists()
      >>> on_disk, cache.path.exists(), cache.get("demo", {"n": 1})
      (False, True, {'winner': 'xla'})
    """
    with self._lock:
      self._deferring += 1
    try:
      yield self
    finally:
      with self._lock:
        self._deferring -= 1
        flush = not self._deferring and not self.readonly and bool(self._memory)
      if flush:
        self._write_merged({})

  def clear(self) -> int:
    """Deletes this device's file; returns how many entries it held.

    Raises:
      TunedJaxError: if the file cannot be deleted (naming it and why).
    """
    try:
      with self._exclusive():
        count = len(self._read_file())
        with contextlib.suppress(FileNotFoundError):
          self.path.unlink()
        self._entries, self._stamp = {}, None
        count += len(self._memory)
        self._memory.clear()
    except OSError as err:
      raise TunedJaxError(f"Cannot clear the tuning cache {str(self.path)!r}: "
                          f"{describe_problem(self.dir, err)}.") from None
    return count

  # -- moving caches between machines -------------------------------------------

  def export(self, path: str | os.PathLike[str]) -> int:
    """Writes this device's entries to `path` (a cache file); returns the count."""
    entries = self.entries()
    data = {"format": FORMAT, "version": FORMAT_VERSION,
            "fingerprint": self.fingerprint.to_dict(),
            "entries": [e._asdict() for e in entries]}
    try:
      pathlib.Path(path).write_text(json.dumps(data, indent=1, sort_keys=True),
                                    encoding="utf-8")
    except OSError as err:
      raise TunedJaxError(f"Cannot export the tuning cache to {str(path)!r}: "
                          f"{describe_problem(path, err)}.") from None
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
    TunedJaxError: if the file cannot be read or is not a tuning-cache file,
      or the folder `dir` cannot be written.
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
  unusable = folder_problem(cache.dir)
  if unusable is not None:  # importing into memory only would keep nothing
    raise TunedJaxError(f"Cannot import into the tuning cache folder {str(cache.dir)!r}: "
                        f"{describe_problem(cache.dir, unusable)}.")
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


def default_cache(platform: str | None = None) -> Cache:
  """The cache of the active config and this process's default device (or its
  `platform` device: ``"cpu"``, ``"gpu"``, ...).

  One `Cache` object per (folder, readonly, device), so that its in-memory
  copy of the file is shared by every tuner of the process.

  Example:
    >>> import tunedjax as tj
    >>> with tj.config_context({"cache": {"dir": "/tmp/tj-doc", "readonly": True}}):
    ...   default_cache().readonly
    True
  """
  config = get_config().cache
  fingerprint = device_fingerprint(platform)
  memo_key = (str(config.resolved_dir), config.readonly, fingerprint.digest)
  with _DEFAULTS_LOCK:
    cache = _DEFAULTS.get(memo_key)
    if cache is None:
      cache = _DEFAULTS[memo_key] = Cache(config.resolved_dir, readonly=config.readonly,
                                          fingerprint=fingerprint)
  return cache


CacheLike = Any  # Cache | str | os.PathLike | None | False


def resolve_cache(cache: CacheLike, platform: str | None = None) -> Cache | None:
  """The one meaning of a tuner's ``cache=`` argument, for every tuner.

  With a `platform`, the cache of that platform's device: what is measured
  for a GPU is read from and written to the GPU's file, never the CPU's (a
  `Cache` of another platform's device is swapped for its folder's file of
  this one), and a platform this process has no device of gets none
  (nothing of it can have been measured here).

  Args:
    cache: None (or True) for the config's default cache (`default_cache`);
      False for no persistent cache (measurements kept in memory only); a
      `Cache`; or a folder path.
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (or a JAX backend name), or
      None for the device a `Cache` names (the default backend's otherwise).

  Returns:
    A `Cache`, or None for no persistent cache.

  Raises:
    TypeError: anything else (the message names the value).

  Example:
    >>> resolve_cache(False) is None
    True
    >>> isinstance(resolve_cache("/tmp/tj-doc-cache"), Cache)
    True
    >>> resolve_cache("/tmp/tj-doc-cache", platform="tpu") is None  # no TPU here
    True
  """
  if cache is False:
    return None
  if platform is not None:
    return _for_platform(cache, platform)
  if cache is None or cache is True:
    return default_cache()
  if isinstance(cache, Cache):
    return cache
  if isinstance(cache, (str, os.PathLike)):
    return Cache(cache)
  raise _not_a_cache(cache)


def _for_platform(cache: CacheLike, platform: str) -> Cache | None:
  """`resolve_cache` for the device of `platform`; None without one here."""
  platform = canonical_platform(platform)
  if isinstance(cache, Cache) and canonical_platform(cache.fingerprint.platform) == platform:
    return cache
  if not (cache is None or cache is True or isinstance(cache, (Cache, str, os.PathLike))):
    raise _not_a_cache(cache)
  try:
    fingerprint = device_fingerprint(platform)
  except TunedJaxError:  # no such device in this process
    return None
  if cache is None or cache is True:
    return default_cache(platform)
  if isinstance(cache, Cache):
    return Cache(cache.dir, readonly=cache.readonly, fingerprint=fingerprint,
                 max_entries=cache.max_entries)
  return Cache(cache, fingerprint=fingerprint)


def _not_a_cache(cache: Any) -> TypeError:
  return TypeError(f"cache must be None or True (the default cache), False (none), a "
                   f"tunedjax.autotune.Cache or a folder path, got {cache!r} "
                   f"(type {type(cache).__name__}).")
