"""The registry of op families and their kernels.

An **op family** (`OpFamily`) is a kind of operation whose implementation is
chosen per shape bucket: a name (``"conv"``), a spec type that describes one
site (`ConvSpec`), the bucket key a choice is cached under, random operands
for measuring, a reference kernel with its tolerance, and how its sites are
found (a jaxpr primitive, or calls to `dispatch`). A **kernel** (`Kernel`) is
one implementation of a family: ``fn(*operands, spec)`` plus
``applicable(spec, platform)``, and a hash of its module's source so that
timings measured with old code are not reused.

The registry names no family. The families are packages that register
themselves when imported (`register_op_family`, then `register_kernel` for
each kernel, the default first); `load_op_families` imports every package
named by a ``tunedjax.op_families`` entry point (tunedjax's own convolution,
batch norm and attention, and any plug-in's) the first time a family is
looked up, so asking for ``"conv"`` finds it without importing it first.
tunedjax's own entry points are read from the running package's
``entry_points.txt`` (the file its build makes the installed metadata
from), so a source tree on ``PYTHONPATH`` with no metadata has its families,
and an installed copy's metadata never loads another copy's list;
plug-ins come from the installed metadata.

Example:
  >>> import numpy as np
  >>> from tunedjax.ops.conv._spec import ConvSpec
  >>> spec = ConvSpec.from_arrays(
  ...     np.ones((1, 8, 8, 4), np.float32), np.ones((1, 1, 4, 6), np.float32),
  ...     window_strides=(1, 1), padding="VALID",
  ...     dimension_numbers=("NHWC", "HWIO", "NHWC"))
  >>> [k.name for k in applicable_kernels(spec, "tpu")]
  ['xla', 'matmul_1x1']
  >>> [f.name for f in op_families()]
  ['attention', 'batch_norm', 'conv', 'layer_norm']
"""

from __future__ import annotations

import configparser
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.resources
import inspect
import sys
import threading
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tunedjax import _native, _tuning
from tunedjax._errors import AutotuneError, did_you_mean, format_choices
from tunedjax._tuning import canonical_platform
from tunedjax.autotune import _result

# max |candidate - reference| / max |reference| allowed, by output dtype.
_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
# GPUs and TPUs run float32 convolutions and matmuls in TF32/bf16 passes by default.
_TOLERANCE_ACCELERATOR = {"float32": 5e-3}


TIMED = ("forward", "forward+backward")


def default_tolerance(dtype: Any, platform: str = "cpu") -> float:
  """The largest relative difference from the reference a candidate may show.

  Example:
    >>> default_tolerance("float32"), default_tolerance("bfloat16")
    (0.0001, 0.03)
  """
  return tolerance_from(_TOLERANCE, dtype, platform)


def tolerance_from(table: Mapping[str, float], dtype: Any, platform: str = "cpu", *,
                   accelerator: Mapping[str, float] = _TOLERANCE_ACCELERATOR) -> float:
  """A family's tolerance for `dtype` from its `table` (by dtype name; 1e-3 for
  others), or from `accelerator` off CPU, where float32 runs in TF32/bf16 passes.

  Example:
    >>> tolerance_from({"float32": 1e-4}, "float32"), tolerance_from({}, "float32", "gpu")
    (0.0001, 0.005)
  """
  name = np.dtype(dtype).name
  if platform != "cpu" and name in accelerator:
    return accelerator[name]
  return table.get(name, 1e-3)


@dataclasses.dataclass(frozen=True)
class OpFamily:
  """A kind of operation whose kernel is chosen per shape bucket.

  Attributes:
    name: the family's name: its cache namespace, its ``kernel.hints`` key
      and the ``op`` of its kernels (``"conv"``, ``"attention"``).
    spec_type: the type of a site's spec (hashable; for `applicable` and keys).
    key: ``key(spec, bucket) -> dict``: what a timing of this spec depends on,
      as plain JSON (``bucket`` is the config's ``kernel.bucket``: ``"exact"``
      or ``"pow2"``). The selector adds the family, a version and the
      candidates' source hashes.
    operands: ``operands(spec, rng) -> tuple of NumPy arrays``: random (never
      all-zero) operands of the spec's shapes, for checking and timing.
    default: the reference kernel's name: always a candidate, the choice in
      the observe phase and wherever nothing beats it.
    tolerance: ``tolerance(dtype, platform) -> float``: the largest relative
      difference from the default kernel's output a candidate may show: a
      sanity bound. What decides is the accuracy rule every family shares
      (`autotune._accuracy`): a candidate's error against a high-precision
      reference may be at most 3 times the default's.
    primitive: a jaxpr primitive whose equations are this family's sites
      (found by the kernel-selection pass), or None for a family whose sites
      call `dispatch`.
    from_equation: ``from_equation(eqn) -> spec`` for `primitive`'s equations.
    describe: ``describe(key) -> str``: a short bucket name for logs and reports.
    timed: what the tuner checks and times: ``"forward"`` (the kernel's
      output), or ``"forward+backward"`` (its output and the gradients of
      its floating operands for a random cotangent, in one compiled call):
      for families whose kernels differ mostly in their backward, such as
      a fused batch norm or a flash attention.
    features: ``features(key) -> {name: float}``: numbers describing a
      bucket from its key (`key`'s dict, plus the fields the selector adds),
      for predicting its kernels' times from buckets measured before
      (`autotune._predict`): sizes on a log2 scale, flags for the kinds of
      site that behave differently, scaled so that a distance of 1 is a
      notable difference. None: no predictions; every candidate is timed.
    priors: a folder of ``<machine class>.json`` files of measurements
      shipped with the family (`autotune._predict.read_priors`), used where
      this machine has measured nothing near a bucket; None: none.
    patterns: functions ``(ctx, jaxpr) -> [autotune.PatternSite, ...]``
      that find this family's computations written out in other primitives
      (a batch norm as reductions and arithmetic) in each jaxpr kernel
      selection evaluates; each site found is decided like any other and,
      when its kernel is not the default, replaced by it (its forward, and
      in a differentiated jaxpr its backward too, `autotune._sites`).
    precise: ``precise(*operands, spec)``: the family's outputs computed as
      exactly as the operands' dtype allows, the high-precision reference
      candidates are judged against. The tuner calls it on the floating
      operands upcast to float64 (under `jax.enable_x64`, where the
      platform has float64), else to float32 with every product at
      `Precision.HIGHEST`. None (the default): the default kernel's ``fn``;
      a family gives its own where that computes in a fixed dtype (a
      softmax taken in float32 whatever the inputs) or fixes a precision.
    presumed: ``presumed(key, platform) -> {kernel: time ratio to the
      default}``: the family's rule for a platform where nothing measured
      (this device's cache, priors of its machine class) is near a bucket,
      such as "on a GPU, cuDNN's fused attention first": each kernel it names
      is ranked at that ratio, with a wide spread, until the platform has
      measured it; a kernel it leaves out is unknown (compiled). Used only
      with `features`. None: no rule.
  """

  name: str
  spec_type: type
  key: Callable[[Any, str], Mapping[str, Any]]
  operands: Callable[[Any, np.random.Generator], tuple[Any, ...]]
  default: str = "xla"
  tolerance: Callable[[Any, str], float] = default_tolerance
  primitive: str | None = None
  from_equation: Callable[[Any], Any] | None = None
  describe: Callable[[Mapping[str, Any]], str] | None = None
  timed: str = "forward"
  features: Callable[[Mapping[str, Any]], Mapping[str, float]] | None = None
  priors: Any = None
  patterns: tuple[Callable[..., Any], ...] = ()
  precise: Callable[..., Any] | None = None
  presumed: Callable[[Mapping[str, Any], str], Mapping[str, float]] | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name.isidentifier():
      raise AutotuneError(f"OpFamily.name must be an identifier such as 'conv', got "
                          f"{self.name!r}.")
    if not isinstance(self.spec_type, type):
      raise AutotuneError(f"OpFamily({self.name!r}).spec_type must be a type, got "
                          f"{self.spec_type!r}.")
    for field in ("key", "operands", "tolerance"):
      if not callable(getattr(self, field)):
        raise AutotuneError(f"OpFamily({self.name!r}).{field} must be callable, got "
                            f"{getattr(self, field)!r}.")
    for field in ("features", "presumed", "precise"):
      if getattr(self, field) is not None and not callable(getattr(self, field)):
        raise AutotuneError(f"OpFamily({self.name!r}).{field} must be callable or None, got "
                            f"{getattr(self, field)!r}.")
    object.__setattr__(self, "patterns", tuple(self.patterns))
    if not all(callable(p) for p in self.patterns):
      raise AutotuneError(f"OpFamily({self.name!r}).patterns must be functions "
                          f"(ctx, jaxpr) -> [PatternSite, ...], got {self.patterns!r}.")
    if self.timed not in TIMED:
      raise AutotuneError(f"OpFamily({self.name!r}).timed must be one of "
                          f"{format_choices(TIMED)}, got {self.timed!r}"
                          f"{did_you_mean(str(self.timed), TIMED)}.")
    if (self.primitive is None) != (self.from_equation is None):
      raise AutotuneError(f"OpFamily({self.name!r}): give primitive and from_equation "
                          "together (sites found in the jaxpr), or neither (sites call "
                          "autotune.dispatch).")

  def label(self, key: Mapping[str, Any]) -> str:
    """The bucket's short name (`describe`, or the family and the key's values)."""
    if self.describe is not None:
      return self.describe(key)
    skip = {"version", "op", "bucket", "candidates"}
    return f"{self.name} " + " ".join(str(v) for k, v in key.items() if k not in skip)


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One registered implementation of an op family.

  Attributes:
    op: the op family's name, e.g. "conv".
    name: the kernel's name, unique within `op`, e.g. "im2col".
    fn: ``fn(*operands, spec) -> out`` (for "conv": ``fn(lhs, rhs, spec)``),
      with the reference's output shape and dtype, differentiable.
    applicable: `applicable(spec, platform) -> bool`, platform being "cpu",
      "gpu" or "tpu".
    source_hash: 16 hex digits of the sha256 of the kernel's module source, so
      that changing the kernel's code invalidates its timings.
  """

  op: str
  name: str
  fn: Callable[..., Any]
  applicable: Callable[[Any, str], bool]
  source_hash: str


_LOCK = threading.Lock()
_FAMILIES: dict[str, OpFamily] = {}
_REGISTRY: dict[str, dict[str, Kernel]] = {}

ENTRY_POINT_GROUP = "tunedjax.op_families"
"""The entry-point group whose packages register op families when imported."""

# The top-level package this registry belongs to, and the file in it that declares its
# own entry points (the build writes the installed metadata's from it).
_PACKAGE = __name__.partition(".")[0]
_OWN_ENTRY_POINTS = "entry_points.txt"

_PLUGIN_LOCK = threading.RLock()  # re-entrant: a family's own registrations look families up
_PLUGINS = {"loading": False, "done": False}


def load_op_families() -> None:
  """Imports the packages of the ``tunedjax.op_families`` entry points, once per process.

  tunedjax's own first, then the plug-ins' (`family_entry_points`), so a
  plug-in may add kernels to a family tunedjax ships. Each registers its
  family and kernels on import. A package that fails to
  import is left out with a warning that names it; the others still load.
  Called by every lookup that could miss, so nobody needs to call it.

  Example:
    >>> load_op_families()
    >>> "conv" in [f.name for f in op_families()]
    True
  """
  if _PLUGINS["done"]:
    return
  with _PLUGIN_LOCK:
    if _PLUGINS["done"] or _PLUGINS["loading"]:
      return
    _PLUGINS["loading"] = True
    try:
      for entry in family_entry_points():
        try:
          entry.load()
        except Exception as err:  # pylint: disable=broad-except  # a broken plug-in
          warnings.warn(f"tunedjax: the op family package {entry.value!r} (entry point "
                        f"{entry.name!r} of {ENTRY_POINT_GROUP!r}) failed to import and is "
                        f"left out: {err!r}", RuntimeWarning, stacklevel=2)
    finally:
      _PLUGINS["done"] = True


def own_entry_points(group: str = ENTRY_POINT_GROUP) -> list[importlib.metadata.EntryPoint]:
  """The entry points of `group` the running tunedjax package declares itself.

  Read from the package's ``entry_points.txt`` (the file ``pyproject.toml``
  builds the installed metadata's entry points from), so they are there
  whether or not tunedjax is installed: a source tree on ``PYTHONPATH`` has
  them too. Empty when the file is missing (a package someone trimmed).

  Example:
    >>> sorted(e.name for e in own_entry_points())
    ['attention', 'batch_norm', 'conv', 'layer_norm']
  """
  try:
    text = importlib.resources.files(_PACKAGE).joinpath(_OWN_ENTRY_POINTS).read_text(
        encoding="utf-8")
  except (OSError, ModuleNotFoundError):
    return []
  parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
  parser.optionxform = str  # entry-point names keep their case
  parser.read_string(text)
  if not parser.has_section(group):
    return []
  return [importlib.metadata.EntryPoint(name, value.strip(), group)
          for name, value in parser.items(group)]


def family_entry_points() -> list[Any]:
  """The ``tunedjax.op_families`` entry points to load, each once: the running
  tunedjax's own first (`own_entry_points`), then the installed metadata's
  that point outside tunedjax (plug-ins).

  An installed entry point into tunedjax's own modules is left out: the
  running package's list stands for it, so an installed copy's metadata
  (another version, or an editable install of another checkout) never adds
  a family this tunedjax does not ship, and none is listed twice.
  """
  own = own_entry_points()
  plugins = [e for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
             if e.value.partition(":")[0].strip().split(".")[0] != _PACKAGE]
  return [*own, *plugins]


def _source_of(obj: Any) -> str:
  try:
    return inspect.getsource(obj)
  except (OSError, TypeError):
    return ""


def source_hash(fn: Callable[..., Any]) -> str:
  """The sha256 (16 hex digits) of the source a kernel function depends on.

  That is the source of `fn`'s module, plus the modules of its own package
  it imports (a family's shared helpers, such as the convolutions' layout
  module), plus the C++ sources of the native
  libraries the module names in ``NATIVE_SOURCES`` (`tunedjax._native`):
  editing a native kernel re-tunes its buckets too. When the source is not
  available (a function typed at a prompt), the function's own code object
  is hashed instead.

  Args:
    fn: the kernel function.

  Returns:
    16 lowercase hex characters.
  """
  h = hashlib.sha256()
  module = inspect.getmodule(fn)
  text = _source_of(module) if module is not None else ""
  if not text:
    text = _source_of(fn)
  if not text:
    code = getattr(fn, "__code__", None)
    text = repr((getattr(fn, "__qualname__", repr(fn)),
                 getattr(code, "co_code", b""), getattr(code, "co_consts", ())))
  h.update(text.encode())
  if module is not None:
    package = module.__name__.rpartition(".")[0] + "."
    deps = sorted(
        v.__name__ for v in vars(module).values()
        if isinstance(v, types.ModuleType) and v.__name__.startswith(package)
        and v.__name__ != module.__name__ and package != ".")
    for name in deps:
      h.update(_source_of(sys.modules[name]).encode())
    for stem in getattr(module, "NATIVE_SOURCES", ()):
      h.update(_native.source_bytes(stem))
  return h.hexdigest()[:16]


def register_op_family(family: OpFamily, *, replace: bool = False) -> OpFamily:
  """Registers an op family, so its kernels can be registered, tuned and hinted.

  Args:
    family: the `OpFamily`.
    replace: replace a family of the same name (its kernels are kept).

  Returns:
    The family.

  Raises:
    AutotuneError: a family of that name exists and `replace` is False.

  Example:
    >>> op_family("conv").primitive
    'conv_general_dilated'
  """
  if not isinstance(family, OpFamily):
    raise AutotuneError(f"register_op_family expects an autotune.OpFamily, got {family!r}.")
  with _LOCK:
    if family.name in _FAMILIES and not replace:
      raise AutotuneError(f"An op family named {family.name!r} is already registered; "
                          "pick another name or pass replace=True.")
    _FAMILIES[family.name] = family
    _REGISTRY.setdefault(family.name, {})
  _tuning.register_validator(family.name, functools.partial(validate_cache_value,
                                                            op=family.name))
  return family


def validate_cache_value(value: Any, op: str) -> None:
  """Checks a cache value of family `op` (`_result.validate_value`) against its kernels.

  The validator the cache runs on each entry of the family's namespace.

  Raises:
    ValueError, TypeError: what is wrong with the value.
  """
  _result.validate_value(value, op, known={k.name for k in kernels(op)})


def unregister_op_family(name: str) -> None:
  """Removes an op family and its kernels (for tests and plug-ins); raises if unknown."""
  op_family(name)
  with _LOCK:
    del _FAMILIES[name]
    _REGISTRY.pop(name, None)


def op_family(name: str) -> OpFamily:
  """The registered family `name`; the error lists the known ones.

  Raises:
    AutotuneError: an unknown name.
  """
  _load_unless_known(name)
  with _LOCK:
    family = _FAMILIES.get(name) if isinstance(name, str) else None
    if family is None:
      raise AutotuneError(
          f"Unknown op family {name!r}{did_you_mean(str(name), _FAMILIES)}. Known op "
          f"families: {format_choices(_FAMILIES)}.")
    return family


def op_families() -> tuple[OpFamily, ...]:
  """Every registered op family, by name (whatever order their packages were imported in)."""
  load_op_families()
  with _LOCK:
    return tuple(_FAMILIES[name] for name in sorted(_FAMILIES))


def family_of(spec: Any) -> OpFamily:
  """The family whose `spec_type` `spec` is an instance of.

  Raises:
    AutotuneError: no registered family has that spec type.
  """
  for family in op_families():
    if isinstance(spec, family.spec_type):
      return family
  raise AutotuneError(
      f"No op family has specs of type {type(spec).__name__}; registered families and "
      f"their spec types: "
      f"{', '.join(f'{f.name}: {f.spec_type.__name__}' for f in op_families())}.")


def register_kernel(
    op: str,
    name: str,
    fn: Callable[..., Any],
    *,
    applicable: Callable[[Any, str], bool],
    replace: bool = False,
) -> Kernel:
  """Registers `fn` as kernel `name` of operation `op`.

  Args:
    op: the operation, e.g. "conv" (a new name starts a new operation).
    name: the kernel's name, unique within `op`.
    fn: `fn(lhs, rhs, spec) -> out`; must return the equation's output shape
      and dtype and be differentiable.
    applicable: `applicable(spec, platform) -> bool`; the tuner only tries the
      kernel where this is true.
    replace: replace an existing kernel of the same name instead of raising.

  Returns:
    The registered Kernel.

  Example:
    >>> from tunedjax.autotune import _registry as reg
    >>> k = reg.register_kernel(
    ...     "conv", "my_xla", lambda l, r, s: reg.get_kernel("conv", "xla").fn(l, r, s),
    ...     applicable=lambda spec, platform: platform == "cpu", replace=True)
    >>> reg.get_kernel("conv", "my_xla") is k
    True
    >>> reg.unregister_kernel("conv", "my_xla")
  """
  if not isinstance(op, str) or not op or not isinstance(name, str) or not name:
    raise AutotuneError(
        f"register_kernel needs non-empty string op and name, got op={op!r}, "
        f"name={name!r}.")
  op_family(op)  # an unknown family: the error lists the known ones
  if not callable(fn) or not callable(applicable):
    raise AutotuneError(
        f"register_kernel({op!r}, {name!r}): fn and applicable must be "
        f"callable, got fn={fn!r}, applicable={applicable!r}.")
  kernel = Kernel(op=op, name=name, fn=fn, applicable=applicable,
                  source_hash=source_hash(fn))
  with _LOCK:
    table = _REGISTRY.setdefault(op, {})
    if name in table and not replace:
      raise AutotuneError(
          f"A kernel named {name!r} is already registered for op {op!r}; "
          "pick another name or pass replace=True.")
    table[name] = kernel
  return kernel


def unregister_kernel(op: str, name: str) -> None:
  """Removes kernel `name` of `op` (for tests and plug-ins); raises if unknown."""
  get_kernel(op, name)
  with _LOCK:
    del _REGISTRY[op][name]


def _load_unless_known(op: Any) -> None:
  """`load_op_families` when `op` is not registered yet; never under `_LOCK` (imports register)."""
  if not _PLUGINS["done"] and (not isinstance(op, str) or op not in _FAMILIES):
    load_op_families()


def _table(op: str) -> dict[str, Kernel]:
  table = _REGISTRY.get(op) if isinstance(op, str) else None
  if table is None:
    raise AutotuneError(
        f"Unknown op family {op!r}{did_you_mean(str(op), _REGISTRY)}. Known op "
        f"families: {format_choices(_REGISTRY)}.")
  return table


def kernels(op: str) -> tuple[Kernel, ...]:
  """The kernels registered for `op`, in registration order ("xla" first).

  Args:
    op: the operation, e.g. "conv".

  Returns:
    A tuple of Kernels.

  Example:
    >>> from tunedjax.autotune import _registry as reg
    >>> [k.name for k in reg.kernels("conv")]  # doctest: +NORMALIZE_WHITESPACE
    ['xla', 'matmul_1x1', 'im2col', 'window_matmul', 'fft', 'depthwise',
     'depthwise_native', 'pallas', 'direct_native', 'matmul_1x1_native']
  """
  _load_unless_known(op)
  with _LOCK:
    return tuple(_table(op).values())


def get_kernel(op: str, name: str) -> Kernel:
  """The kernel `name` of `op`; the error lists the known names.

  Args:
    op: the operation, e.g. "conv".
    name: the kernel's name.

  Returns:
    The Kernel.
  """
  _load_unless_known(op)
  with _LOCK:
    table = _table(op)
    kernel = table.get(name)
    if kernel is None:
      raise AutotuneError(
          f"Unknown {op!r} kernel {name!r}{did_you_mean(str(name), table)}. "
          f"Known kernels: {format_choices(table)}.")
    return kernel


def applicable_kernels(spec: Any, platform: str, op: str | None = None,
                       ) -> tuple[Kernel, ...]:
  """The kernels of `spec`'s family that handle `spec` on `platform`, the default first.

  Args:
    spec: a site's spec (a `ConvSpec`, ...).
    platform: "cpu", "gpu" or "tpu" ("cuda" and "rocm" mean "gpu").
    op: the family (default: the one whose spec type `spec` has).

  Returns:
    A tuple of Kernels, in registration order.
  """
  platform = canonical_platform(platform)
  family = family_of(spec) if op is None else op_family(op)
  return tuple(k for k in kernels(family.name) if k.applicable(spec, platform))
