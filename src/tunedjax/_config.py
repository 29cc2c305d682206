"""The tunedjax configuration: frozen dataclasses behind `set_config`.

A dict (or a JSON file holding one) is the user-facing edge, as in Paddle's
autotune `set_config`; it is validated at once, strictly, into hashable frozen
dataclasses whose attributes mirror the schema (``cfg.kernel.tuning_range``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
import pathlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Union

from tunedjax._errors import (BAD_CHOICE, BAD_FILE, BAD_RANGE, BAD_SOURCE,
                              BAD_TYPE, FROM_ENV, IN_FILE, UNKNOWN_KEY,
                              ConfigError, did_you_mean, format_choices)

CONFIG_ENV_VAR = "TUNEDJAX_CONFIG"
CACHE_DIR_ENV_VAR = "TUNEDJAX_CACHE_DIR"
LEVELS = ("O0", "O1", "O2")
BUCKETS = ("exact", "pow2")
OBJECTIVES = ("time", "memory")
LAYOUT_MODES = ("heuristic", "measure")
LOSS_SCALES = ("auto", "dynamic", "static", "none")
DEFAULT_POLICY = "params=float32,compute=bfloat16,output=float32"

_RANGE_EXPECTED = (
    "a list [start, stop] of two integers with 0 <= start < stop, e.g. [1, 10]")
_ACCEPTED = (
    "None (turn every tuner on), a dict such as {'kernel': {'enable': True}}, "
    "a path (str or os.PathLike) to a JSON file holding such a dict, or a "
    "tunedjax.Config")
# What `None` means: every tuner on. Mixed precision changes numerics: opt-in.
_ALL_TUNERS_ON = {name: {"enable": True}
                  for name in ("kernel", "layout", "dataloader")}

ConfigLike = Union["Config", Mapping[str, Any], str, os.PathLike, None]
_Check = Callable[[str, Any], Any]


class FrozenDict(Mapping):
  """A read-only, hashable mapping (used for ``kernel.hints``).

  Example:
    >>> hints = FrozenDict({"conv": "im2col"})
    >>> hints["conv"], hash(hints) == hash(FrozenDict(conv="im2col"))
    ('im2col', True)
  """

  __slots__ = ("_data",)

  def __init__(self, *args: Any, **kwargs: Any):
    self._data = dict(*args, **kwargs)

  def __getitem__(self, key: Any) -> Any:
    return self._data[key]

  def __iter__(self) -> Iterator[Any]:
    return iter(self._data)

  def __len__(self) -> int:
    return len(self._data)

  def __hash__(self) -> int:
    return hash(frozenset(self._data.items()))

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, Mapping):
      return NotImplemented
    return self._data == dict(other.items())

  def __repr__(self) -> str:
    return f"FrozenDict({self._data!r})"


# Field checks: each takes the dotted key and the value, returns the value
# normalized (list -> tuple, dict -> FrozenDict) or raises ConfigError.


def _type_error(key: str, value: Any, expected: str) -> ConfigError:
  return ConfigError(BAD_TYPE.format(key=key, expected=expected, value=value,
                                     type_name=type(value).__name__))


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _check_bool(key: str, value: Any) -> bool:
  if not isinstance(value, bool):
    raise _type_error(key, value, "a bool (true or false)")
  return value


def _choice(*choices: str) -> _Check:
  def check(key: str, value: Any) -> str:
    if not isinstance(value, str) or value not in choices:
      raise ConfigError(BAD_CHOICE.format(
          key=key, choices=format_choices(choices), value=value))
    return value
  return check


def _int_at_least(minimum: int, *, optional: bool = False) -> _Check:
  expected = f"an integer >= {minimum}"
  if optional:
    expected = f"None (null in JSON) or {expected}"

  def check(key: str, value: Any) -> int | None:
    if optional and value is None:
      return None
    if not _is_int(value):
      raise _type_error(key, value, expected)
    if value < minimum:
      raise ConfigError(BAD_RANGE.format(key=key, expected=expected,
                                         value=value))
    return value
  return check


def _check_text(key: str, value: Any) -> str:
  if not isinstance(value, str) or not value:
    raise _type_error(key, value, "a non-empty string")
  return value


def _check_policy(key: str, value: Any) -> str:
  """A policy name or string that `tunedjax.mixed_precision.get_policy` reads."""
  value = _check_text(key, value)
  if value == DEFAULT_POLICY:  # Valid; also read while this module loads.
    return value
  # Imported here, not at the top: it imports JAX, which this module does not need.
  from tunedjax._policy import PolicyError, get_policy  # pylint: disable=import-outside-toplevel
  try:
    get_policy(value)
  except PolicyError as e:
    raise ConfigError(f"Configuration key {key!r} is not a valid mixed-precision "
                      f"policy: {e}") from None
  return value


def _check_dir(key: str, value: Any) -> str | None:
  if value is None or (isinstance(value, str) and value and "\x00" not in value):
    return value
  if isinstance(value, os.PathLike):  # Kept as str so that JSON can hold it.
    return _check_dir(key, os.fspath(value))
  raise _type_error(key, value, "None (null in JSON) or a non-empty path")


def _check_range(key: str, value: Any) -> tuple[int, int]:
  if not isinstance(value, (list, tuple)):
    raise _type_error(key, value, _RANGE_EXPECTED)
  if not (len(value) == 2 and all(_is_int(v) for v in value)
          and 0 <= value[0] < value[1]):
    raise ConfigError(BAD_RANGE.format(key=key, expected=_RANGE_EXPECTED,
                                       value=value))
  return tuple(value)


def _check_hints(key: str, value: Any) -> FrozenDict:
  """A mapping of op family names to kernel names; both are checked against the
  registry when the hints are used (`tunedjax.autotune`), not here: the families
  are plug-ins of a layer above this one."""
  if not isinstance(value, Mapping):
    raise _type_error(key, value,
                      "a dict {op: kernel name}, e.g. {'conv': 'im2col'}")
  for op, name in value.items():
    if not isinstance(op, str) or not op:
      raise _type_error(f"{key}.{op}", op, "a non-empty op family name string")
    if not isinstance(name, str) or not name:
      raise _type_error(f"{key}.{op}", name, "a non-empty kernel name string")
  return value if isinstance(value, FrozenDict) else FrozenDict(value)


def _field(check: _Check, default: Any = dataclasses.MISSING, *,
           factory: Any = dataclasses.MISSING) -> Any:
  return dataclasses.field(default=default, default_factory=factory,
                           metadata={"check": check})


def _join(prefix: str, name: str) -> str:
  return f"{prefix}.{name}" if prefix else name


def _plain(value: Any) -> Any:
  """Turns dataclasses, tuples and FrozenDicts into JSON-ready values."""
  if dataclasses.is_dataclass(value):
    return {f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)}
  if isinstance(value, tuple):
    return [_plain(v) for v in value]
  if isinstance(value, Mapping):
    return {k: _plain(v) for k, v in value.items()}
  return value


class _Section:
  """Checks and normalizes every field when an instance is made."""

  _name = ""  # The dotted prefix of this section's keys in error messages.

  def __post_init__(self) -> None:
    for f in dataclasses.fields(self):
      value = f.metadata["check"](_join(self._name, f.name),
                                  getattr(self, f.name))
      object.__setattr__(self, f.name, value)

  def to_dict(self) -> dict[str, Any]:
    """Returns the options as a plain JSON-serializable dict.

    Example:
      >>> KernelConfig(hints={"conv": "fft"}).to_dict()["hints"]
      {'conv': 'fft'}
    """
    return _plain(self)


@dataclasses.dataclass(frozen=True)
class KernelConfig(_Section):
  """Per-shape kernel selection (the ``"kernel"`` section).

  Attributes:
    enable: pick a kernel per conv shape by measuring (default: False).
    tuning_range: the steps ``[start, stop)`` tuning may use (default (1, 10)).
    bucket: how shapes share a cache entry: ``"exact"`` or ``"pow2"``.
    hints: ``{op: kernel name}`` that beats the tuner; ops: the op families
      (``"conv"``, ``"batch_norm"``, ``"attention"``).
    objective: what the tuner minimises: ``"time"`` (default), or
      ``"memory"``: among the candidates within 10% of the fastest, the one
      whose compiled program needs the fewest temporary bytes.
    payback: tune a bucket only when tuning it can pay back within the
      run's horizon (the `Trainer` gives the steps of its fit; `tj.jit`
      alone has none, so it tunes everything): default True. False tunes
      every bucket, as for pre-tuning a cache with a short run.
    predict: before compiling a bucket's candidates, predict their times
      from what this machine measured and the family's shipped priors, and
      compile and time only those that could win (default True). False
      compiles and times every applicable candidate (exhaustive tuning).

  Example:
    >>> KernelConfig(tuning_range=[2, 5]).tuning_range
    (2, 5)
  """

  _name = "kernel"
  enable: bool = _field(_check_bool, False)
  tuning_range: tuple[int, int] = _field(_check_range, (1, 10))
  bucket: str = _field(_choice(*BUCKETS), "exact")
  hints: FrozenDict = _field(_check_hints, factory=FrozenDict)
  objective: str = _field(_choice(*OBJECTIVES), "time")
  payback: bool = _field(_check_bool, True)
  predict: bool = _field(_check_bool, True)


@dataclasses.dataclass(frozen=True)
class LayoutConfig(_Section):
  """NHWC/NCHW layout selection (``"layout"`` section).

  Attributes:
    enable: rewrite convolutions to the preferred layout (default: False).
    mode: ``"heuristic"`` (by dtype and platform) or ``"measure"`` (time both).

  Example:
    >>> LayoutConfig(enable=True).mode
    'heuristic'
  """

  _name = "layout"
  enable: bool = _field(_check_bool, False)
  mode: str = _field(_choice(*LAYOUT_MODES), "heuristic")


@dataclasses.dataclass(frozen=True)
class DataloaderConfig(_Section):
  """Input-pipeline worker-count tuning (``"dataloader"`` section).

  Attributes:
    enable: tune the loader's worker count (default: False).
    tuning_steps: how many batches the tuner may spend measuring (>= 1).
    max_workers: the most workers to try; None means the CPU count.

  Example:
    >>> DataloaderConfig(max_workers=4).resolved_max_workers
    4
  """

  _name = "dataloader"
  enable: bool = _field(_check_bool, False)
  tuning_steps: int = _field(_int_at_least(1), 500)
  max_workers: int | None = _field(_int_at_least(0, optional=True), None)

  @property
  def resolved_max_workers(self) -> int:
    """`max_workers`, or the CPU count when it is None."""
    if self.max_workers is not None:
      return self.max_workers
    return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class MixedPrecisionConfig(_Section):
  """Mixed precision (the ``"mixed_precision"`` section); opt-in.

  Attributes:
    enable: cast per `policy` (default: False, even for `set_config(None)`).
    policy: a policy string, parsed by ``tunedjax.mixed_precision``.
    loss_scale: ``"auto"`` (dynamic for float16 compute, else none),
      ``"dynamic"``, ``"static"`` or ``"none"``.

  Example:
    >>> MixedPrecisionConfig().policy
    'params=float32,compute=bfloat16,output=float32'
  """

  _name = "mixed_precision"
  enable: bool = _field(_check_bool, False)
  policy: str = _field(_check_policy, DEFAULT_POLICY)
  loss_scale: str = _field(_choice(*LOSS_SCALES), "auto")


@dataclasses.dataclass(frozen=True)
class CacheConfig(_Section):
  """Where tuning results are kept (``"cache"`` section).

  Attributes:
    dir: the cache folder; None means `resolved_dir`'s fallback chain.
    readonly: read the cache but never write it (default: False).

  Example:
    >>> CacheConfig(dir="/tmp/tj").resolved_dir.as_posix()
    '/tmp/tj'
  """

  _name = "cache"
  dir: str | None = _field(_check_dir, None)
  readonly: bool = _field(_check_bool, False)

  @property
  def resolved_dir(self) -> pathlib.Path:
    """`dir` if set, else ``$TUNEDJAX_CACHE_DIR``, else ``~/.cache/tunedjax``.

    The environment is read at each call and ``~`` is expanded.
    """
    chosen = (self.dir or os.environ.get(CACHE_DIR_ENV_VAR)
              or "~/.cache/tunedjax")
    return pathlib.Path(chosen).expanduser()


def _section(cls: type[_Section]) -> Any:
  def check(key: str, value: Any) -> _Section:
    if not isinstance(value, cls):
      raise _type_error(key, value, f"a {cls.__name__}")
    return value
  return dataclasses.field(default_factory=cls,
                           metadata={"check": check, "section": True})


@dataclasses.dataclass(frozen=True, repr=False)
class Config(_Section):
  """Every tunedjax option, validated, frozen and hashable.

  Build one from a dict with `from_dict` (what `set_config` does), or directly
  from section objects. Attributes mirror the schema; `to_dict` gives it back.

  Example:
    >>> cfg = Config.from_dict({"kernel": {"enable": True}})
    >>> cfg.kernel.enable, cfg.kernel.tuning_range, cfg.level
    (True, (1, 10), 'O1')
    >>> cfg == Config.from_dict(cfg.to_dict()) and hash(cfg) == hash(
    ...     Config.from_dict(cfg.to_dict()))
    True
  """

  kernel: KernelConfig = _section(KernelConfig)
  layout: LayoutConfig = _section(LayoutConfig)
  dataloader: DataloaderConfig = _section(DataloaderConfig)
  mixed_precision: MixedPrecisionConfig = _section(MixedPrecisionConfig)
  cache: CacheConfig = _section(CacheConfig)
  level: str = _field(_choice(*LEVELS), "O1")

  @classmethod
  def from_dict(cls, data: Mapping[str, Any], *,
                base: Config | None = None) -> Config:
    """Validates a schema dict into a Config.

    Args:
      data: a dict in the schema's shape; it may name only some keys.
      base: the Config whose values the keys `data` does not name keep
        (default: the defaults, as Paddle's `set_config` does).

    Raises:
      ConfigError: for an unknown key, a wrong type or a bad value.

    Example:
      >>> base = Config.from_dict({"layout": {"enable": True}})
      >>> Config.from_dict({"level": "O2"}, base=base).layout.enable
      True
    """
    if not isinstance(data, Mapping):
      raise ConfigError(BAD_SOURCE.format(
          func="Config.from_dict", accepted="a dict such as "
          "{'kernel': {'enable': True}}", value=data,
          type_name=type(data).__name__))
    return _merge(cls() if base is None else base, data, "")

  @classmethod
  def all_tuners_on(cls) -> Config:
    """What `set_config(None)` sets: kernel, layout and dataloader tuning on.

    Mixed precision stays off: it changes numerics, so it is opt-in.

    Example:
      >>> cfg = Config.all_tuners_on()
      >>> cfg.layout.enable, cfg.mixed_precision.enable
      (True, False)
    """
    return cls.from_dict(_ALL_TUNERS_ON)

  def to_json(self, path: str | os.PathLike | None = None) -> str:
    """Returns the config as JSON text, and writes it to `path` if given.

    `set_config(path)` reads such a file back to an equal Config.

    Example:
      >>> Config().to_json().startswith('{\\n  "kernel": {')
      True
    """
    text = json.dumps(self.to_dict(), indent=2)
    if path is not None:
      pathlib.Path(path).write_text(text + "\n", encoding="utf-8")
    return text

  def __repr__(self) -> str:
    lines = [f"  {f.name}={getattr(self, f.name)!r}"
             for f in dataclasses.fields(self)]
    return "Config(\n" + ",\n".join(lines) + ")"


def _merge(base: _Section, data: Any, prefix: str) -> Any:
  """Returns `base` with the keys that `data` names replaced, checked."""
  fields = {f.name: f for f in dataclasses.fields(base)}
  if not isinstance(data, Mapping):
    raise _type_error(prefix, data,
                      f"a dict with any of the keys {format_choices(fields)}")
  changes = {}
  for key, value in data.items():
    field = fields.get(key) if isinstance(key, str) else None
    if field is None:
      raise ConfigError(UNKNOWN_KEY.format(
          key=_join(prefix, str(key)),
          suggestion=did_you_mean(str(key), fields),
          valid=format_choices(fields)))
    if field.metadata.get("section"):
      value = _merge(getattr(base, key), value, _join(prefix, key))
    changes[key] = value
  return dataclasses.replace(base, **changes)


def _load_file(path: str | os.PathLike, *, base: Config,
               env_var: str | None = None) -> Config:
  """Reads a JSON file holding a schema dict; errors name the file."""
  where = os.fspath(path)
  hint = FROM_ENV.format(var=env_var) if env_var else ""
  if not where or "\x00" in str(where):
    reason = "that is not a file path (it is empty or holds a NUL character)"
    raise ConfigError(BAD_FILE.format(path=where, reason=reason) + hint)
  try:
    data = json.loads(pathlib.Path(where).read_text(encoding="utf-8"))
  except OSError as e:
    reason = f"it cannot be opened ({e.strerror or e})"
    raise ConfigError(BAD_FILE.format(path=where, reason=reason) + hint) from e
  except ValueError as e:  # JSONDecodeError and UnicodeDecodeError.
    reason = f"it is not valid JSON ({e})"
    raise ConfigError(BAD_FILE.format(path=where, reason=reason) + hint) from e
  if not isinstance(data, dict):
    reason = f"its top level is a {type(data).__name__}, not a JSON object"
    raise ConfigError(BAD_FILE.format(path=where, reason=reason) + hint)
  try:
    return Config.from_dict(data, base=base)
  except ConfigError as e:
    raise ConfigError(IN_FILE.format(path=where, message=e) + hint) from None


def _coerce(config: ConfigLike, *, base: Config, func: str) -> Config:
  """Turns anything `set_config` accepts into a Config over `base`."""
  if isinstance(config, Config):
    return config
  if config is None:
    config = _ALL_TUNERS_ON
  if isinstance(config, (str, os.PathLike)):
    return _load_file(config, base=base)
  if isinstance(config, Mapping):
    return Config.from_dict(config, base=base)
  raise ConfigError(BAD_SOURCE.format(func=func, accepted=_ACCEPTED,
                                      value=config,
                                      type_name=type(config).__name__))


_DEFAULTS = Config()
_LOCK = threading.Lock()
_chosen: Config | None = None  # What set_config set; None: the base config.
_env_cache: tuple[str, Config] | None = None  # ($TUNEDJAX_CONFIG, its Config)
_overlay: contextvars.ContextVar[Config | None] = contextvars.ContextVar(
    "tunedjax_config_overlay", default=None)


def _base_config() -> Config:
  """The Config of the file `$TUNEDJAX_CONFIG` names, cached; else defaults."""
  global _env_cache
  path = os.environ.get(CONFIG_ENV_VAR, "")
  if not path:
    return _DEFAULTS
  with _LOCK:
    if _env_cache is not None and _env_cache[0] == path:
      return _env_cache[1]
  config = _load_file(path, base=_DEFAULTS, env_var=CONFIG_ENV_VAR)
  with _LOCK:
    _env_cache = (path, config)
  return config


def _reset_for_tests() -> None:
  """Forgets the set_config value and the cached ``$TUNEDJAX_CONFIG`` file."""
  global _chosen, _env_cache
  with _LOCK:
    _chosen = None
    _env_cache = None


def set_config(config: ConfigLike = None) -> None:
  """Sets the process-wide configuration, as Paddle's autotune `set_config`.

  Every thread sees it; a `config_context` still wins inside its block.

  Args:
    config: None turns every tuner on (kernel, layout and dataloader) with
      everything else at its default; mixed precision is *not* turned on,
      since it changes numerics: enable it explicitly. A dict sets the keys it
      names and the defaults for the rest (it does not merge into the previous
      config). A str or os.PathLike is the path of a JSON file holding such a
      dict. A `Config` is taken as is.

  Raises:
    ConfigError: for any other kind of value, an unknown key, a wrong type or
      a bad value; the message names the dotted key and lists what is allowed.

  Example:
    >>> import tunedjax as tj
    >>> tj.set_config(None)
    >>> cfg = tj.get_config()
    >>> cfg.kernel.enable, cfg.layout.enable, cfg.mixed_precision.enable
    (True, True, False)
    >>> tj.set_config({})  # Back to the defaults.
  """
  global _chosen
  new = _coerce(config, base=_DEFAULTS, func="tunedjax.set_config")
  with _LOCK:
    _chosen = new


def get_config() -> Config:
  """Returns the active configuration.

  That is the innermost `config_context` of this thread or task if any, else
  what `set_config` set, else the JSON file named by ``$TUNEDJAX_CONFIG`` (read
  at first use and again when the variable changes), else the defaults.

  Raises:
    ConfigError: if ``$TUNEDJAX_CONFIG`` names a missing or invalid file.

  Example:
    >>> import tunedjax as tj
    >>> with tj.config_context({"level": "O2"}):
    ...   tj.get_config().level
    'O2'
  """
  overlay = _overlay.get()
  if overlay is not None:
    return overlay
  chosen = _chosen  # one reference read: atomic, no lock needed (every tj.jit call reads it)
  return chosen if chosen is not None else _base_config()


@contextlib.contextmanager
def config_context(config: ConfigLike) -> Iterator[Config]:
  """Overlays options on the current configuration for a ``with`` block.

  Unlike `set_config`, a dict (or JSON file) is merged into the config active
  on entry, so contexts nest. The overlay is scoped with `contextvars`: other
  threads and asyncio tasks do not see it. It is undone on exit, also when
  the block raises.

  Args:
    config: a dict or the path of a JSON file holding one, merged into the
      current config; None turns the kernel, layout and dataloader tuners on
      (not mixed precision); a `Config` replaces the current one as is.

  Yields:
    The Config active inside the block.

  Raises:
    ConfigError: as `set_config` does.

  Example:
    >>> import tunedjax as tj
    >>> with tj.config_context(None):
    ...   with tj.config_context({"kernel": {"enable": False}}) as cfg:
    ...     cfg.kernel.enable, cfg.layout.enable
    (False, True)
  """
  new = _coerce(config, base=get_config(), func="tunedjax.config_context")
  token = _overlay.set(new)
  try:
    yield new
  finally:
    _overlay.reset(token)
