"""The one place where tunedjax touches JAX internals.

Everything else in tunedjax uses public `jax` and `jax.extend` APIs. What JAX
does not expose publicly (tracing a function to a jaxpr over given abstract
values, the per-equation context, converting an element type while keeping a
weak type) is wrapped here, with the names of the higher-order primitives, so
that a JAX upgrade touches this file only.

Supported: jax 0.10.x (Python 3.11, CI), 0.11.x (the GPU image) and 0.12.x
(Python 3.12, CI).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.extend.linear_util as lu
import jax.extend.source_info_util as source_info_util
# The only imports of jax._src in tunedjax.
from jax._src import config as _config
from jax._src import core as _core
from jax._src import linear_util as _lu
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax_internal

Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
DropVar = jex_core.DropVar
Var = jex_core.Var
# Raised when an operation's output sharding cannot be inferred on Explicit
# mesh axes (not exported by `jax.errors` in jax 0.10-0.12).
ShardingTypeError = _core.ShardingTypeError

# `jax.monitoring` duration events of lowering a program to StableHLO and of
# XLA's compile (a persistent-cache read included), in jax 0.10-0.12; the first
# call's anatomy (`_tuning._anatomy`) reads them.
LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = frozenset({LOWERING_EVENT, BACKEND_COMPILE_EVENT})

# Higher-order primitives whose sub-jaxprs are code to rewrite, by the names
# they carry across the supported JAX versions, mapped to the params that hold
# those sub-jaxprs. In jax 0.10 `pjit` is named `jit` and `checkpoint` is named
# `remat2`; both spellings are listed so either version matches.
HIGHER_ORDER_PARAMS: dict[str, tuple[str, ...]] = {
    "jit": ("jaxpr",),
    "pjit": ("jaxpr",),
    "closed_call": ("call_jaxpr",),
    "eval_jaxpr": ("call_jaxpr",),  # jax 0.12's name for closed_call
    "core_call": ("call_jaxpr",),
    "call": ("call_jaxpr",),
    "remat2": ("jaxpr",),
    "remat": ("jaxpr",),
    "checkpoint": ("jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr",),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",),
    "scan": ("jaxpr",),
    "while": ("cond_jaxpr", "body_jaxpr"),
    "cond": ("branches",),
}

# Higher-order primitives whose open sub-jaxpr may take the rewritten jaxpr's
# new constants as extra leading operands (they have no per-operand params).
OPERANDS_FROM_CONSTS = frozenset({"remat2", "remat", "checkpoint", "core_call", "call"})

# Primitives whose jaxpr params are combiners (how to merge two elements), not
# code that a pass rewrites. They are bound as written, silently.
COMBINER_PRIMITIVES = frozenset({
    "scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
    "scatter-min", "scatter_min", "scatter-max", "scatter_max", "scatter_sub",
    "scatter-sub", "reduce", "reduce_window", "select_and_scatter",
    "argsort", "sort",
})


def is_higher_order(name: str) -> bool:
  return name in HIGHER_ORDER_PARAMS


def has_jaxpr_params(params: dict[str, Any]) -> bool:
  """Whether any param holds a jaxpr (to spot unknown higher-order primitives)."""
  return next(iter(jex_core.jaxprs_in_params(params)), None) is not None


def bind_equation(eqn: JaxprEqn, invals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
  """Binds `eqn`'s primitive on `invals` with `params`, always returning a list."""
  bind_params = eqn.primitive.get_bind_params(params)
  out = eqn.primitive.bind(*invals, **bind_params)
  return list(out) if eqn.primitive.multiple_results else [out]


def trace_keyed_state(name: str, help_text: str) -> Callable[[str | None], Any]:
  """A thread-local JAX setting (``None`` or a string) that keys JAX's trace caches.

  Setting it (``with state("bfloat16"):``) while a function is traced makes
  every nested `jax.jit`, `scan` or `checkpoint` body traced under another
  value a different entry of JAX's caches, as JAX's own context-dependent
  settings (``jax.default_matmul_precision``) do: what a call site decides
  from it at trace time is never reused where it does not hold. Register a
  name once per process.
  """
  return _config.optional_string_state(name=name, default=None, help=help_text,
                                       include_in_trace_context=True)


@contextlib.contextmanager
def equation_context(eqn: JaxprEqn) -> Iterator[None]:
  """Re-enters what was active when `eqn` was traced: its source location and
  name stack (so profiles and errors point at user code) and its equation
  context (compute type, RNG partitioning, XLA metadata)."""
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager):
    yield


def trace_to_jaxpr(fn: Callable[..., Sequence[Any]], in_avals: Sequence[Any],
                   debug_info: Any) -> ClosedJaxpr:
  """Traces `fn` (flat arrays in, flat list out) over exactly `in_avals`.

  Unlike `jax.make_jaxpr`, this keeps weak types and any other property of the
  given abstract values, so a rewritten sub-jaxpr has the same input types as
  the original (loop carries are checked for that).
  """
  wrapped = lu.wrap_init(fn, debug_info=debug_info)
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
  return ClosedJaxpr(jaxpr, consts)


def closed_to_open(closed: ClosedJaxpr) -> tuple[Jaxpr, list[Any]]:
  """Turns a closed jaxpr into an open one that takes its consts as leading inputs."""
  if not closed.consts:
    return closed.jaxpr, []
  return _pe.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def convert_element_type(x: Any, dtype: Any, weak_type: bool) -> Any:
  """`lax.convert_element_type` that can also set the result's weak type."""
  return _lax_internal._convert_element_type(x, dtype, weak_type)


def wrap_custom_rule(name: str, params: dict[str, Any],
                     rewrite: Callable[[ClosedJaxpr], ClosedJaxpr]) -> dict[str, Any]:
  """Makes the derivative rule of a custom_jvp/custom_vjp call rewritten too.

  A custom derivative is traced lazily, when the call is differentiated: the
  thunk that builds it returns an open jaxpr and its consts (`custom_vjp`'s
  forward pass), or those and which output tangents are zero (`custom_jvp`'s
  jvp). The wrapper rewrites that jaxpr with the same pass, so that
  `jax.grad(rewritten_f)` runs the rewritten forward computation. The backward
  function of a custom_vjp is user code traced at transpose time and is left
  as written.
  """
  key = {"custom_vjp_call": "fwd_jaxpr_thunk", "custom_jvp_call": "jvp_jaxpr_fun"}.get(name)
  thunk = params.get(key) if key else None
  if thunk is None:
    return params

  def rewritten_thunk(*args: Any) -> Any:
    jaxpr, consts, *rest = thunk.call_wrapped(*args)
    new = rewrite(ClosedJaxpr(jaxpr, consts))
    return (new.jaxpr, list(new.consts), *rest)

  return {**params, key: lu.wrap_init(rewritten_thunk, debug_info=thunk.debug_info)}


def typeof(x: Any) -> Any:
  """The abstract value of `x` (an array, tracer or Python scalar)."""
  return jax.typeof(x)


# -- plain calls and boundary rebuilds (the engine's `Context.inline` and
# `Context.rebuild` hooks) ------------------------------------------------------

# Call primitives whose body can be evaluated in place of the call, by the
# param that holds that body (a closed jaxpr when the call is plain).
CALL_PARAMS: dict[str, str] = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "eval_jaxpr": "call_jaxpr",  # jax 0.12's name for closed_call
    "core_call": "call_jaxpr",
}


def _unspecified_sharding_types() -> tuple[type, ...]:
  """The type of a sharding a call leaves unspecified (it moved between releases)."""
  found = []
  try:
    from jax._src.named_sharding import UnspecifiedValue  # jax >= 0.10
    found.append(UnspecifiedValue)
  except ImportError:
    pass
  try:
    from jax._src.sharding_impls import UnspecifiedValue as _Unspecified
    found.append(_Unspecified)
  except ImportError:
    pass
  return tuple(dict.fromkeys(found))


_UNSPECIFIED = _unspecified_sharding_types()


def _is_unspecified(sharding: Any) -> bool:
  if _UNSPECIFIED:
    return isinstance(sharding, _UNSPECIFIED)
  return type(sharding).__name__ == "UnspecifiedValue"  # an unknown release


def is_plain_call(eqn: JaxprEqn) -> bool:
  """Whether `eqn` is a plain call: evaluating its body in its place changes nothing.

  A nested `jax.jit` (`jit`/`pjit`) that pins no shardings or layouts, donates
  nothing and sets no compiler options, or a `closed_call`, whose body is a
  closed jaxpr. `jax.numpy` functions and Flax modules make such calls; a
  pass that wants values in its own form to flow through them inlines them
  (`Context.inline`).
  """
  key = CALL_PARAMS.get(eqn.primitive.name)
  if key is None or not isinstance(eqn.params.get(key), ClosedJaxpr):
    return False
  params = eqn.params
  for k in ("in_shardings", "out_shardings"):
    if not all(_is_unspecified(s) for s in params.get(k, ())):
      return False
  for k in ("in_layouts", "out_layouts"):
    if any(layout is not None for layout in params.get(k, ())):
      return False
  return not any(params.get("donated_invars", ())) and not params.get("compiler_options_kvs")


def call_body(eqn: JaxprEqn) -> ClosedJaxpr:
  """The closed jaxpr a plain call (`is_plain_call`) evaluates."""
  return eqn.params[CALL_PARAMS[eqn.primitive.name]]


def boundary_kind(eqn: JaxprEqn) -> str | None:
  """How `Context.rebuild` can rebuild `eqn` on operands held in a pass's own form.

  Returns:
    ``"call"``: a plain call (`is_plain_call`), rebuilt with its closed body
    conjugated; ``"remat"``: `jax.checkpoint`'s open body, conjugated, its new
    constants as extra leading operands; ``"custom_jvp"``: a `custom_jvp_call`
    without constants or symbolic zeros, its body and its JVP rule conjugated;
    None for everything else (`custom_vjp_call`, whose backward rule is user
    code on plain values; `scan`, `while`, `cond`; first-order primitives).
  """
  name = eqn.primitive.name
  params = eqn.params
  if is_plain_call(eqn):
    return "call"
  if name in ("remat2", "remat", "checkpoint") and isinstance(params.get("jaxpr"), Jaxpr):
    return "remat"
  if (name == "custom_jvp_call" and isinstance(params.get("call_jaxpr"), ClosedJaxpr)
      and "jvp_jaxpr_fun" in params and not params.get("num_consts", 0)
      and not params.get("symbolic_zeros")):
    return "custom_jvp"
  return None


# Primitives `boundary_kind` may accept, by name (the engine's dispatch table).
BOUNDARY_PRIMITIVES = (*CALL_PARAMS, "remat2", "remat", "checkpoint", "custom_jvp_call",
                       "custom_vjp_call")


def with_body(eqn: JaxprEqn, body: ClosedJaxpr) -> tuple[dict[str, Any], list[Any]]:
  """`eqn`'s params with its body replaced by `body` (see `boundary_kind`).

  Returns:
    The params, and the constants to pass as extra leading operands (a
    `remat` body is an open jaxpr: `body`'s constants become its inputs).
  """
  name = eqn.primitive.name
  if name in CALL_PARAMS:
    return {**eqn.params, CALL_PARAMS[name]: body}, []
  if name == "custom_jvp_call":
    return {**eqn.params, "call_jaxpr": body}, []
  new_open, consts = closed_to_open(body)
  return {**eqn.params, "jaxpr": new_open}, consts


def with_jvp_rule(params: dict[str, Any],
                  rewrite: Callable[[ClosedJaxpr, Sequence[bool], Sequence[bool]], ClosedJaxpr],
                  ) -> dict[str, Any]:
  """A `custom_jvp_call`'s params with its JVP rule rewritten when it is traced.

  Args:
    params: the equation's params (with ``jvp_jaxpr_fun``).
    rewrite: ``(jvp, in_zeros, out_zeros) -> new jvp``: `jvp` takes the
      primals then the nonzero tangents, and returns the primal outputs then
      the nonzero output tangents; `in_zeros`/`out_zeros` say which tangents
      are symbolically zero (absent).
  """
  thunk = params["jvp_jaxpr_fun"]

  def rewritten_thunk(*in_zeros: bool) -> Any:
    jaxpr, consts, out_zeros = thunk.call_wrapped(*in_zeros)
    new = rewrite(ClosedJaxpr(jaxpr, consts), in_zeros, out_zeros)
    return new.jaxpr, list(new.consts), out_zeros

  return {**params, "jvp_jaxpr_fun": lu.wrap_init(rewritten_thunk, debug_info=thunk.debug_info)}


def triton_compiler_params() -> Any:
  """`pallas_call` compiler params that pick the Triton GPU backend.

  jax 0.10 lowers a `pallas_call` without compiler params to Mosaic GPU
  (``jax_pallas_use_mosaic_gpu`` defaults to True; the flag is gone in 0.11),
  which has no rule for a ``dot`` in a kernel written for Triton. jax 0.12
  warns that the Triton backend is deprecated; it still lowers.
  """
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel
  return pltriton.CompilerParams()


# Custom calls that tunedjax's own kernels put in a program and that
# `jax.export` has no stability guarantee for, by lowering platform.
# cuDNN's fused attention (the attention family's ``cudnn`` kernel) has no export
# compatibility guarantee either.
_CUDNN_ATTENTION = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward",
                    "__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")
_TUNEDJAX_CUSTOM_CALLS = {"cuda": ("__gpu$xla.gpu.triton", *_CUDNN_ATTENTION),
                          "rocm": ("__gpu$xla.gpu.triton",)}
_LOWERING_PLATFORMS = {"gpu": "cuda"}


def lowering_platform(platform: str) -> str:
  """The `jax.export` platform for a tunedjax platform ("gpu" lowers for CUDA)."""
  name = str(platform).lower()
  return _LOWERING_PLATFORMS.get(name, name)


def tunedjax_custom_call_checks(platforms: Sequence[str]) -> list[Any]:
  """The `jax.export.DisabledSafetyCheck`s that let tunedjax's kernels be exported."""
  targets = dict.fromkeys(t for p in platforms for t in _TUNEDJAX_CUSTOM_CALLS.get(p, ()))
  return [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]


def _explicit_axes(avals: Sequence[Any]) -> tuple[str, ...]:
  """The Explicit mesh axes the types of `avals` are sharded over (jax 0.11+:
  `jax.make_mesh` makes Explicit axes by default)."""
  axes: dict[str, None] = {}
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  for aval in avals:
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if mesh is None or spec is None or explicit is None:
      continue
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
    for entry in spec:
      for name in (entry if isinstance(entry, tuple) else (entry,)):
        if name is not None and types.get(name) == explicit:
          axes[name] = None
  return tuple(axes)


def on_auto_axes(fn: Callable[..., Any], args: Sequence[Any], out_aval: Any) -> Any:
  """Runs `fn(*args)` with the args' Explicit mesh axes made Auto (`auto_axes`).

  A kernel that replaces one equation (a convolution as reshapes and
  matmuls) would otherwise have to say the output sharding of every reshape
  and every contraction over a sharded dim, as explicit sharding demands;
  under Auto axes XLA propagates them, as for an unsharded program, and the
  result gets the sharding the replaced equation's output has (`out_aval`).
  Without explicitly sharded args, just `fn(*args)`.
  """
  axes = _explicit_axes([typeof(a) for a in args])
  if not axes:
    return fn(*args)
  return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_aval.sharding)(*args)


# The GPU a program is lowered for when this process has none: Triton kernels
# are lowered for its compute capability.
DEFAULT_GPU_KIND = "NVIDIA H100"


def lowering_for(platforms: Sequence[str], device_kind: str | None = None
                 ) -> contextlib.AbstractContextManager[Any]:
  """A context in which tracing and lowering target `platforms`' devices.

  jax 0.11 and 0.12 lower a Triton `pallas_call` only for a known GPU: the
  local one, or the abstract device of `jax.sharding.use_abstract_mesh` (jax
  0.10 lowered it without one). For a CUDA or ROCm lowering on a machine
  without a GPU, this sets that abstract device (`device_kind`, default
  `DEFAULT_GPU_KIND` for CUDA); otherwise it does nothing.
  """
  gpu = [p for p in platforms if p in ("cuda", "rocm")]
  local_gpu = jax.default_backend() == "gpu"
  if not gpu or (local_gpu and device_kind is None):
    return contextlib.nullcontext()
  kind = device_kind or (DEFAULT_GPU_KIND if gpu[0] == "cuda" else None)
  if kind is None:
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
  mesh = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))
  if local_gpu or gpu[0] != "cuda":
    return mesh
  stack = contextlib.ExitStack()
  stack.enter_context(mesh)
  stack.enter_context(_cudnn_stand_in())
  return stack


# What cuDNN attention is lowered for when exporting for CUDA on a machine with no
# CUDA: the cuDNN version jax 0.10's wheels bundle and the export's default GPU's
# (an H100's) compute capability. Only the lowering's own checks read them.
_EXPORT_CUDNN_VERSION = 91000
_EXPORT_COMPUTE_CAPABILITY = 9.0


@contextlib.contextmanager
def _cudnn_stand_in() -> Iterator[None]:
  """`jax.nn.dot_product_attention(implementation="cudnn")` traced and lowered for
  CUDA on a host without CUDA (jax checks the local cuDNN at trace time)."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as _fa  # pylint: disable=import-outside-toplevel
  except ImportError:  # another jax: nothing to stand in for
    yield
    return
  saved = (_fa.check_cudnn_version, _fa.check_compute_capability)
  _fa.check_cudnn_version = lambda: _EXPORT_CUDNN_VERSION
  _fa.check_compute_capability = lambda capability: (
      float(capability) <= _EXPORT_COMPUTE_CAPABILITY)
  try:
    yield
  finally:
    _fa.check_cudnn_version, _fa.check_compute_capability = saved


def where(eqn: JaxprEqn) -> str:
  """Where `eqn` was traced, as ``file:line (function)`` of the user's code."""
  try:
    return source_info_util.summarize(eqn.source_info)
  except Exception:  # pylint: disable=broad-except  # a location is for display only
    return "unknown location"


def in_scope(eqn: JaxprEqn, scope: str) -> bool:
  """Whether `eqn` was traced inside ``jax.named_scope(scope)``."""
  return any(getattr(frame, "name", None) == scope
             for frame in getattr(eqn.source_info.name_stack, "stack", ()))


def traced_computation(x: Any, max_eqns: int = 256
                       ) -> tuple[Jaxpr, dict[Any, Any], dict[Any, Any]] | None:
  """How the tracer `x` was computed so far in the trace that is recording it.

  Walks back from `x` through the equations its trace has recorded (a jaxpr
  being built by `jax.jit`, `jax.make_jaxpr` or `tunedjax.jit`) and returns
  them as an open jaxpr whose one output is `x`'s variable: its inputs are
  the trace's inputs that `x` depends on, its constants those of the trace's
  constants it reads. What each variable's tracer is comes with it, so a
  caller can keep computing with part of the computation.

  Args:
    x: any value.
    max_eqns: a computation of more equations is not returned.

  Returns:
    ``(jaxpr, consts, tracers)``: the jaxpr, ``{constvar: value}``, and
    ``{var: tracer}`` for every variable with a tracer; or None when `x` is
    not a tracer of such a trace, or its computation is longer.
  """
  if not isinstance(x, _pe.DynamicJaxprTracer) or not isinstance(getattr(x, "val", None), Var):
    return None
  try:
    return _traced_computation(x, max_eqns)
  except (AttributeError, TypeError):  # a JAX whose trace keeps its state elsewhere
    return None


def _traced_computation(x: Any, max_eqns: int
                        ) -> tuple[Jaxpr, dict[Any, Any], dict[Any, Any]] | None:
  known = x._trace.frame.constvar_to_val  # pylint: disable=protected-access
  order: list[Any] = []  # TracingEqns, each after those computing its inputs
  tracers: dict[Any, Any] = {}
  done: set[int] = set()
  stack: list[tuple[Any, bool]] = [(x, False)]
  while stack:
    t, expanded = stack.pop()
    parent = getattr(t, "parent", None)
    if isinstance(t.val, Var):
      tracers.setdefault(t.val, t)
    if parent is None or (id(parent) in done and not expanded):
      continue
    if expanded:
      order.append(parent)
      continue
    done.add(id(parent))
    if len(done) > max_eqns:
      return None
    stack.append((t, True))
    stack.extend((u, False) for u in parent.in_tracers)
  defined = {v for e in order for v in e.outvars}
  leaves = [v for v in tracers if v not in defined]
  consts = {v: known[v] for v in leaves if v in known}
  eqns = [JaxprEqn([u.val for u in e.in_tracers], list(e.outvars), e.primitive, e.params,
                   e.effects, e.source_info, e.ctx) for e in order]
  invars = [v for v in leaves if v not in consts]
  debug = _lu.DebugInfo("traced_computation", "<traced value>", ("",) * len(invars), ("",))
  return Jaxpr(list(consts), invars, [x.val], eqns, debug_info=debug), consts, tracers


def current_trace() -> Any:
  """The trace values bound now land in (JAX's innermost trace context)."""
  return _core.trace_ctx.trace


def pallas_gpu_attention() -> Any | None:
  """JAX's Pallas (Triton) flash-attention module, or None where this JAX has none.

  jax 0.12 deprecates ``jax.experimental.pallas.ops.gpu.attention`` in favour
  of tokamax (not a dependency here) and 0.12.1 removes it; where it is gone
  the ``pallas_gpu`` attention kernel is not a candidate.
  """
  import warnings  # pylint: disable=import-outside-toplevel
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning,
                            message=r".*pallas\.ops\.gpu\.attention is deprecated")
    try:
      from jax.experimental.pallas.ops.gpu import attention  # pylint: disable=import-outside-toplevel
    except ImportError:
      return None
  return attention
