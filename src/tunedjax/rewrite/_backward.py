"""The backward of a recognised forward computation, found in a differentiated jaxpr.

A function traced with `jax.grad` inside is a jaxpr *after* differentiation:
the forward's primal equations, extra "residual" equations from JVP rules
(``div q p``, ``mul 2.0 i``) interleaved with them, and the backward's
equations later, reading the forward's intermediates. Replacing only the
forward is useless there (its intermediates are the residuals of the
backward). `find_backward` finds the backward *region* by dataflow and
checks it numerically, so that a forward and its backward can be replaced
together: ``out, vjp = jax.vjp(kernel, *inputs)`` at the forward,
``vjp(cotangent)`` at the backward.

The region is every equation after the forward's first that reads a
forward intermediate (a value the forward defines that is not one of its
outputs), a region value or the cotangent, and whose other operands are
only the forward's inputs and values, region values, literals, or one
outside value with the primary output's type (the output's cotangent);
and, among the forward's equations, those that read only its inputs (a
JVP residual such as ``2 * x`` for ``x ** 2``). The region's
values read outside it are the candidates for the inputs' cotangents: each
must equal, on random inputs of the real shapes, the cotangent of one input
that `jax.vjp` of the forward equations gives for a random output
cotangent. A region equation past the cotangents (a reshape of a cotangent
for the layer upstream) that reads no forward value is trimmed off. If
anything fails, there is no backward (the caller leaves everything alone).

A check compiles a small program (about 0.1-0.2 s), so its outcome is kept by
the structure of the forward and its region (`_signature`: primitives,
parameters, shapes and wiring): for the process (`_PROCESS`, the last
`PROCESS_LIMIT`), and, through a
`VerificationStore` the caller passes, across processes (kernel selection
keeps them in the tuning cache): a warm cache checks nothing again.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def loss(x, s):
  ...   y = jnp.tanh(x) * s          # the "forward": tanh, then mul
  ...   return (y * y).sum()
  >>> jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(jnp.ones(3), jnp.ones(3)).jaxpr
  >>> # tanh's JVP adds a residual, 1 - tanh**2 (`sub`; jax 0.12: `one_minus_square`)
  >>> [e.primitive.name for e in jaxpr.eqns][0:3:2]
  ['tanh', 'mul']
  >>> back = find_backward(jaxpr, (0, 2), jaxpr.invars, (jaxpr.eqns[2].outvars[0],))
  >>> back.wrt  # the region's outputs are the cotangents of x and of s
  (0, 1)

"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from tunedjax.rewrite import _compat

logger = logging.getLogger("tunedjax.rewrite")

# A check runs once: compile it fast rather than well.
_QUICK_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# The largest relative difference between a region output and an input's cotangent.
_TOLERANCE = {"float64": 1e-7, "float32": 2e-3, "bfloat16": 6e-2, "float16": 2e-2}


# Verified regions of this process, by signature (the last PROCESS_LIMIT).
PROCESS_LIMIT = 512
_PROCESS: collections.OrderedDict[Any, Any] = collections.OrderedDict()
_PROCESS_LOCK = threading.Lock()
_UNKNOWN = object()

Verified = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None
"""A check's outcome: the kept region equations, the output values and the
inputs they are cotangents of, as positions; None when it did not verify."""


class VerificationStore(Protocol):
  """Where checks' outcomes outlive the process, by a digest of their signature."""

  def load(self, digest: str) -> Mapping[str, Any] | None:
    """The stored outcome (`outcome_to_json`'s form), or None if none is stored."""

  def save(self, digest: str, value: Mapping[str, Any]) -> None:
    """Keeps an outcome."""


@dataclasses.dataclass(frozen=True)
class Backward:
  """The backward region of a forward computation in a differentiated jaxpr.

  Attributes:
    eqns: indices of the region's equations, in order.
    cotangent: the variable holding the primary output's cotangent.
    outputs: the region's values read outside it, in order.
    wrt: for each of `outputs`, the index (into the forward's inputs) of the
      input whose cotangent it is.
  """

  eqns: tuple[int, ...]
  cotangent: Any
  outputs: tuple[Any, ...]
  wrt: tuple[int, ...]


def _is_var(v: Any) -> bool:
  return not isinstance(v, _compat.Literal)


def _cotangent(jaxpr: Any, fwd: frozenset[int], intermediates: set[Any], known: set[Any],
               out_aval: Any) -> Any:
  """The primary output's cotangent: the first outside value of its type read
  together with a forward intermediate (or a value computed from them)."""
  touched = set(intermediates)
  for i in range(min(fwd), len(jaxpr.eqns)):
    if i in fwd:
      continue
    ins = [v for v in jaxpr.eqns[i].invars if _is_var(v)]
    others = {v for v in ins if v not in known and v not in touched}
    if not any(v in touched for v in ins) and not (i < max(fwd) and not others):
      continue
    if not others:
      touched.update(v for v in jaxpr.eqns[i].outvars if _is_var(v))
    elif len(others) == 1:
      (cand,) = others
      if (cand.aval.shape, cand.aval.dtype) == (out_aval.shape, out_aval.dtype):
        return cand
  return None


def _region(jaxpr: Any, fwd: frozenset[int], inputs: Sequence[Any], outputs: Sequence[Any]
            ) -> tuple[list[int], Any, set[Any]] | None:
  """The region's equations, the cotangent and the forward's values (dataflow only)."""
  fwd_vals = {v for i in fwd for v in jaxpr.eqns[i].outvars if _is_var(v)}
  intermediates = fwd_vals - set(outputs)
  known = fwd_vals | {v for v in inputs if _is_var(v)}
  ct = _cotangent(jaxpr, fwd, intermediates, known, outputs[0].aval)
  if ct is None:
    return None
  touch = intermediates | {ct}
  upstream = _upstream(jaxpr, [v for v in inputs if _is_var(v)])
  region: list[int] = []
  for i in range(min(fwd), len(jaxpr.eqns)):
    if i in fwd or i in upstream:
      continue  # (what computes an input, a constant mask or scale, is not the backward)
    ins = [v for v in jaxpr.eqns[i].invars if _is_var(v)]
    if any(v not in known and v not in touch for v in ins):
      continue
    if ins and not any(v in touch for v in ins) and not i < max(fwd):  # a residual of inputs
      continue
    if not ins and not _read_by_later(jaxpr, i, touch):
      continue  # a constant (zeros for a select's cotangent) joins only where the region reads it
    region.append(i)
    touch.update(v for v in jaxpr.eqns[i].outvars if _is_var(v))
  if not region:
    return None
  return region, ct, fwd_vals


def _read_by_later(jaxpr: Any, i: int, touch: set[Any]) -> bool:
  """Whether equation `i` (no variable operands: a constant made where it is used, as
  a program rewritten by a pass can have it) is read by a later equation that
  also reads a region value."""
  outs = {v for v in jaxpr.eqns[i].outvars if _is_var(v)}
  for e in jaxpr.eqns[i + 1:]:
    ins = [v for v in e.invars if _is_var(v)]
    if any(v in outs for v in ins) and any(v in touch for v in ins):
      return True
  return False


def _upstream(jaxpr: Any, vars_: Sequence[Any]) -> set[int]:
  """The equations whose values `vars_` depend on."""
  defined = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars if _is_var(v)}
  found: set[int] = set()
  todo = [defined[v] for v in vars_ if v in defined]
  while todo:
    i = todo.pop()
    if i not in found:
      found.add(i)
      todo.extend(defined[v] for v in jaxpr.eqns[i].invars if _is_var(v) and v in defined)
  return found


def _read_outside(jaxpr: Any, vals: set[Any], inside: set[int]) -> list[Any]:
  """The values of `vals` read by an equation not in `inside`, or by the jaxpr's outputs."""
  found: dict[Any, None] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    if i not in inside:
      found.update((v, None) for v in eqn.invars if _is_var(v) and v in vals)
  found.update((v, None) for v in jaxpr.outvars if _is_var(v) and v in vals)
  return list(found)


def _random(aval: Any, rng: np.random.Generator) -> np.ndarray:
  """Random values of `aval`'s type, never zero (booleans mostly True)."""
  dtype = np.dtype(aval.dtype)
  shape = tuple(aval.shape)
  if dtype == np.bool_:
    return rng.random(shape) < 0.8
  if np.issubdtype(dtype, np.integer):
    return rng.integers(1, 4, shape).astype(dtype)
  x = rng.normal(size=shape) * (1.0 + rng.random(shape))
  return np.where(np.abs(x) < 1e-2, 0.5, x).astype(dtype)


def _host_operands(eqn: Any, ins: list[Any]) -> list[Any]:
  """A half-precision dot with a float32 result, as a program rewritten for a GPU
  writes it, with float32 operands: the same numbers (a product of two bf16 or
  f16 values is exact in float32), and XLA:CPU, where checks run, lacks some
  layouts of the mixed one ("Unsupported element type for DotThunk")."""
  if (eqn.primitive.name == "dot_general" and jax.default_backend() == "cpu"
      and eqn.params.get("preferred_element_type") == np.dtype(np.float32)
      and all(np.dtype(x.dtype).itemsize == 2 for x in ins)):
    return [x.astype(np.float32) for x in ins]
  return ins


def _evaluate(jaxpr: Any, order: Sequence[int], env: dict[Any, Any]) -> None:
  for i in order:
    eqn = jaxpr.eqns[i]
    ins = _host_operands(eqn, [v.val if not _is_var(v) else env[v] for v in eqn.invars])
    outs = _compat.bind_equation(eqn, ins, eqn.params)
    env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, _compat.DropVar))


def _numbers(jaxpr: Any, fwd: Sequence[int], region: Sequence[int], inputs: Sequence[Any],
             outputs: Sequence[Any], ct: Any, seed: int = 0
             ) -> tuple[dict[Any, np.ndarray], list[Any]]:
  """Every region value, and the forward's input cotangents by `jax.vjp`, on random data."""
  rng = np.random.default_rng(seed)
  in_vars = [v for v in inputs if _is_var(v)]
  args = [_random(v.aval, rng) for v in in_vars]
  ct_val = _random(ct.aval, rng)
  region_vars = [v for i in region for v in jaxpr.eqns[i].outvars if _is_var(v)
                 and not isinstance(v, _compat.DropVar)]

  def forward(*xs: Any) -> list[Any]:
    env = dict(zip(in_vars, xs))
    _evaluate(jaxpr, fwd, env)
    return [env[v] for v in outputs]

  def both(xs: list[Any], c: Any) -> tuple[list[Any], list[Any]]:
    env = dict(zip(in_vars, xs))
    env[ct] = c
    _evaluate(jaxpr, fwd, env)
    _evaluate(jaxpr, region, env)
    outs, vjp = jax.vjp(forward, *xs)
    cts = [c] + [jax.numpy.zeros_like(o) for o in outs[1:]]
    return [env[v] for v in region_vars], list(vjp(cts))

  with jax.ensure_compile_time_eval():
    values, grads = jax.jit(both, compiler_options=_QUICK_COMPILE)(args, ct_val)
  return ({v: np.asarray(x) for v, x in zip(region_vars, values)},
          [None if g.dtype == jax.dtypes.float0 else np.asarray(g) for g in grads])


def _close(a: np.ndarray, b: np.ndarray) -> bool:
  if a.shape != b.shape or a.dtype != b.dtype:
    return False
  a64, b64 = a.astype(np.float64), b.astype(np.float64)
  if not (np.all(np.isfinite(a64)) and np.all(np.isfinite(b64))):
    return False
  scale = max(float(np.max(np.abs(b64), initial=0.0)), 1e-30)
  return float(np.max(np.abs(a64 - b64), initial=0.0)) / scale <= _TOLERANCE.get(
      a.dtype.name, 1e-3)


def _signature(jaxpr: Any, order: Sequence[int], inputs: Sequence[Any],
               outputs: Sequence[Any]) -> tuple[Any, ...]:
  """The structure of the forward and candidate region (equal for equal computations)."""
  names: dict[Any, int] = {}
  name = lambda v: (("lit", repr(v.val)) if not _is_var(v)
                    else names.setdefault(v, len(names)))
  sig: list[Any] = [tuple(name(v) for v in inputs)]
  for i in order:
    e = jaxpr.eqns[i]
    sig.append((e.primitive.name, str(e.params), tuple(name(v) for v in e.invars),
                tuple(str(v.aval) for v in e.invars),
                tuple(name(v) for v in e.outvars)))
  sig.append(tuple(name(v) for v in outputs))
  return tuple(sig)


def find_backward(jaxpr: Any, eqns: Sequence[int], inputs: Sequence[Any],
                  outputs: Sequence[Any], store: VerificationStore | None = None
                  ) -> Backward | None:
  """The verified backward region of a forward computation, or None.

  Args:
    jaxpr: the (open) jaxpr.
    eqns: the forward's equations (indices).
    inputs: the forward's inputs (variables or literals), in order.
    outputs: the forward's outputs; the first is the one whose cotangent
      the backward receives, the others get zero cotangents.
    store: where checks are kept across processes (None: this process only,
      `_PROCESS`), by the structure of the forward and its region.

  Returns:
    A `Backward`, or None when there is none, or it does not verify.
  """
  fwd = frozenset(eqns)
  found = _region(jaxpr, fwd, inputs, outputs)
  if found is None:
    return None
  region, ct, fwd_vals = found
  inside = set(fwd) | set(region)
  escaping = set(_read_outside(jaxpr, fwd_vals, inside)) - set(outputs)
  if escaping:
    return None
  signature = _signature(jaxpr, [*sorted(fwd), *region], [*inputs, ct], outputs)
  hit = _known(signature, store,
               lambda: _verify(jaxpr, sorted(fwd), region, inputs, outputs, ct))
  if hit is None:
    return None
  kept, out_positions, wrt = hit
  # The outcome holds positions: map them back onto this jaxpr's variables.
  kept_eqns = tuple(region[k] for k in kept)
  region_vars = [v for i in region for v in jaxpr.eqns[i].outvars if _is_var(v)]
  return Backward(kept_eqns, ct, tuple(region_vars[p] for p in out_positions), wrt)


def signature_digest(signature: tuple[Any, ...]) -> str | None:
  """A stable hash of a signature, or None when it names objects by address
  (a custom rule's function in its parameters): those differ per process."""
  text = repr(signature)
  if " at 0x" in text:
    return None
  return hashlib.sha256(f"{jax.__version__}\n{text}".encode()).hexdigest()[:32]


def outcome_to_json(outcome: Verified) -> dict[str, Any]:
  """A check's outcome as the store keeps it.

  Example:
    >>> outcome_to_json(((0, 2), (1,), (0,))), outcome_to_json(None)
    ({'verified': True, 'kept': [0, 2], 'outputs': [1], 'wrt': [0]}, {'verified': False})
  """
  if outcome is None:
    return {"verified": False}
  kept, outputs, wrt = outcome
  return {"verified": True, "kept": list(kept), "outputs": list(outputs), "wrt": list(wrt)}


def outcome_from_json(value: Mapping[str, Any]) -> Verified:
  """`outcome_to_json`'s inverse; raises ValueError on anything else.

  Example:
    >>> outcome_from_json({"verified": True, "kept": [0, 2], "outputs": [1], "wrt": [0]})
    ((0, 2), (1,), (0,))
  """
  if not isinstance(value, Mapping) or not isinstance(value.get("verified"), bool):
    raise ValueError(f"a backward check's outcome must hold 'verified' (a bool): {value!r}")
  if not value["verified"]:
    if set(value) != {"verified"}:
      raise ValueError(f"an unverified outcome holds 'verified' alone: {value!r}")
    return None
  if set(value) != {"verified", "kept", "outputs", "wrt"}:
    raise ValueError(f"a verified outcome holds 'verified', 'kept', 'outputs' and 'wrt': "
                     f"{value!r}")
  parts = [value[k] for k in ("kept", "outputs", "wrt")]
  if not all(isinstance(p, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                         and i >= 0 for i in p) for p in parts):
    raise ValueError(f"'kept', 'outputs' and 'wrt' must be lists of positions: {value!r}")
  if len(parts[1]) != len(parts[2]) or not parts[0]:
    raise ValueError(f"one 'wrt' per output, and a region to keep: {value!r}")
  return tuple(parts[0]), tuple(parts[1]), tuple(parts[2])


def _known(signature: tuple[Any, ...], store: VerificationStore | None,
           verify: Any) -> Verified:
  """The outcome of `signature`'s check: this process's, else the store's, else `verify()`."""
  with _PROCESS_LOCK:
    hit = _PROCESS.get(signature, _UNKNOWN)
    if hit is not _UNKNOWN:
      _PROCESS.move_to_end(signature)
      return hit
  digest = signature_digest(signature) if store is not None else None
  stored = store.load(digest) if digest is not None else None
  if stored is not None:
    try:
      outcome = outcome_from_json(stored)
    except ValueError as e:  # the store validates; this is the last line of defence
      logger.debug("backward check: stored outcome ignored (%s)", e)
      stored = None
  if stored is None:
    outcome = verify()
    if digest is not None:
      store.save(digest, outcome_to_json(outcome))
  with _PROCESS_LOCK:
    _PROCESS[signature] = outcome
    while len(_PROCESS) > PROCESS_LIMIT:
      _PROCESS.popitem(last=False)
  return outcome


def forget_checks() -> None:
  """Forgets this process's verified regions (tests)."""
  with _PROCESS_LOCK:
    _PROCESS.clear()


def _verify(jaxpr: Any, fwd: list[int], region: list[int], inputs: Sequence[Any],
            outputs: Sequence[Any], ct: Any) -> tuple[tuple[int, ...], tuple[int, ...],
                                                      tuple[int, ...]] | None:
  """Checks the region numerically; trims equations past the cotangents."""
  try:
    values, grads = _numbers(jaxpr, fwd, region, inputs, outputs, ct)
  except Exception as e:  # pylint: disable=broad-except  # an unverifiable region is left alone
    logger.debug("backward region could not be evaluated: %s: %s", type(e).__name__, e)
    return None
  var_inputs = [j for j, v in enumerate(inputs) if _is_var(v)]
  fwd_vals = {v for i in fwd for v in jaxpr.eqns[i].outvars if _is_var(v)}
  kept = list(region)
  while True:
    outs = _read_outside(jaxpr, {v for i in kept for v in jaxpr.eqns[i].outvars
                                 if _is_var(v)}, set(fwd) | set(kept))
    wrt = [next((j for j, g in zip(var_inputs, grads)
                 if g is not None and _close(values[o], g)), None) for o in outs]
    bad = [o for o, j in zip(outs, wrt) if j is None]
    if not bad:
      break
    trimmed = _trim(jaxpr, kept, bad, fwd_vals)
    if trimmed is None:
      return None
    kept = trimmed
  region_vars = [v for i in region for v in jaxpr.eqns[i].outvars if _is_var(v)]
  return (tuple(region.index(i) for i in kept), tuple(region_vars.index(o) for o in outs),
          tuple(wrt))


def _trim(jaxpr: Any, kept: list[int], bad: Sequence[Any], fwd_vals: set[Any]
          ) -> list[int] | None:
  """`kept` without the equations defining `bad` and the region equations that read
  what they define (in order), if none of those reads a forward value; else None."""
  drop = {next(i for i in kept if v in jaxpr.eqns[i].outvars) for v in bad}
  # With them, the region equations downstream of them (what the layer upstream
  # does with a cotangent: a concatenate of split operands' cotangents, a bias's
  # gradient, an optimizer's update), none of which may read a forward value.
  outs = {v for i in drop for v in jaxpr.eqns[i].outvars}
  for i in kept:
    if i not in drop and any(_is_var(u) and u in outs for u in jaxpr.eqns[i].invars):
      drop.add(i)
      outs.update(jaxpr.eqns[i].outvars)
  if any(_is_var(u) and u in fwd_vals for i in drop for u in jaxpr.eqns[i].invars):
    return None
  rest = [i for i in kept if i not in drop]
  return rest or None
