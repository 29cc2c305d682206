"""What the autocast pass tells the function it traces: the policy, and regions.

The autocast pass rewrites a jaxpr after the function was traced, so a
function that decides something while it is traced (a call-site op family
such as `tunedjax.attention`, which chooses a kernel per shape and dtype)
would otherwise decide for the dtypes it was written in, not those it runs
in. While the pass traces a function, the policy it applies is current
(`tracing_under`, a context variable: nothing is stored between traces), and
a call site asks `trace_compute_dtype` what its matmuls would run in. A call
site that casts its operands itself marks its computation `as_traced`, and
the pass then runs those operations exactly as traced (no second rounding of
what the call site computes in float32, no casts inserted).

Two kinds of regions mark the name stack (a `jax.named_scope`, so they also
show in profiles): `precision_region(dtype)`, inside which allowed and
follow operations run in `dtype`, and `as_traced()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util

from tunedjax._policy import DTypeLike, canonical_dtype
from tunedjax.rewrite import _compat

_REGION_PREFIX = "tunedjax_precision_"
_REGION_RE = re.compile(_REGION_PREFIX + r"([a-z0-9]+)")
AS_TRACED_SCOPE = "tunedjax_as_traced"


@dataclasses.dataclass(frozen=True)
class TracePolicy:
  """What the autocast pass tracing a function applies to it.

  Attributes:
    compute_dtype: the policy's compute dtype.
    allow: the primitives run in it (the resolved allow list).
  """

  compute_dtype: np.dtype
  allow: frozenset[str]


  def key(self) -> str:
    """A string that tells policies apart (JAX's trace caches are keyed by it)."""
    return f"{self.compute_dtype.name}:{','.join(sorted(self.allow))}"


_CURRENT: contextvars.ContextVar[TracePolicy | None] = contextvars.ContextVar(
    "tunedjax_autocast_trace", default=None)
# JAX's caches of traced bodies (a nested `jax.jit`, `scan`, `checkpoint`) keyed by the
# policy too: a body a call site cast to the compute dtype while traced under the pass
# is not reused by a float32 program, nor the other way round.
_JAX_TRACE_KEY = _compat.trace_keyed_state(
    "tunedjax_autocast_trace",
    "The autocast policy tunedjax is tracing a function under (set by tunedjax only).")


@contextlib.contextmanager
def tracing_under(policy: TracePolicy | None) -> Iterator[None]:
  """Makes `policy` the current trace's for the length of the block (None: none)."""
  token = _CURRENT.set(policy)
  try:
    with _JAX_TRACE_KEY(None if policy is None else policy.key()):
      yield
  finally:
    _CURRENT.reset(token)


@contextlib.contextmanager
def precision_region(dtype: DTypeLike) -> Iterator[None]:
  """Marks the ops traced in its block to run allow/follow ops in `dtype`.

  The mark is a `jax.named_scope`, so it also shows in profiles. Inside,
  allowed and follow ops run in `dtype` (deny ops still in float32); the
  innermost region wins.

  Example:
    >>> import jax.numpy as jnp
    >>> from tunedjax import mixed_precision as mp
    >>> def f(x):
    ...   with precision_region("float32"):
    ...     return x @ x
    >>> mp.autocast(f, "mixed_bfloat16")(jnp.eye(2)).dtype
    dtype('float32')
  """
  dtype = canonical_dtype(dtype)
  with jax.named_scope(_REGION_PREFIX + dtype.name):
    yield


@contextlib.contextmanager
def as_traced() -> Iterator[None]:
  """Marks the ops traced in its block to run exactly as traced under autocast.

  For a call site that has already chosen its precision (it asked
  `trace_compute_dtype` and cast its operands): the autocast pass then
  leaves its operations alone, so a kernel that computes in the compute
  dtype with float32 statistics keeps them, and no cast is inserted. Outside
  an autocast pass the mark changes nothing.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax import mixed_precision as mp
    >>> def f(x):
    ...   with as_traced():
    ...     return x @ x  # float32, as written
    >>> jaxpr = jax.make_jaxpr(mp.autocast(f))(jnp.eye(2))
    >>> [e.outvars[0].aval.dtype.name for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    ['float32']
  """
  with jax.named_scope(AS_TRACED_SCOPE):
    yield


def region_dtype() -> np.dtype | None:
  """The innermost `precision_region`'s dtype where the op being traced or rewritten
  stands, or None (the policy decides)."""
  found = _REGION_RE.findall(str(source_info_util.current_name_stack()))
  return jnp.dtype(found[-1]) if found else None


def in_as_traced() -> bool:
  """Whether the op being traced or rewritten stands inside `as_traced`."""
  return AS_TRACED_SCOPE in str(source_info_util.current_name_stack())


def trace_compute_dtype(primitive: str = "dot_general") -> np.dtype | None:
  """The dtype the autocast pass tracing this code would run `primitive` in.

  For a function that decides while it is traced (a call-site op family):
  inside `autocast`, `tunedjax.jit` with ``mixed_precision.enable`` or a
  `wrap`ped model, the policy's compute dtype (or the innermost
  `precision_region`'s) where `primitive` is on the allow list; None where it
  is not (a user's ``deny=["dot_general"]``), inside `as_traced`, and outside
  an autocast pass.

  Args:
    primitive: a primitive's name (default ``"dot_general"``: matmuls).

  Returns:
    A NumPy dtype, or None: the op runs as traced.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tunedjax import mixed_precision as mp
    >>> seen = []
    >>> f = lambda x: seen.append(trace_compute_dtype()) or x
    >>> _ = mp.autocast(f, "mixed_bfloat16")(jnp.ones(2))
    >>> _ = mp.autocast(f, "mixed_bfloat16", deny=["dot_general"])(jnp.ones(2))
    >>> _ = f(jnp.ones(2))
    >>> seen
    [dtype(bfloat16), None, None]
  """
  current = _CURRENT.get()
  if current is None or primitive not in current.allow or in_as_traced():
    return None
  return region_dtype() or current.compute_dtype
