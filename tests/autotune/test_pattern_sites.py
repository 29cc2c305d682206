"""Pattern sites through the public extension API: a toy family found written out.

The toy family ``toy_tanh_scale`` is ``tanh(x) * s``. Its pattern finds the
two equations; its kernels are ``xla`` (the same two operations) and
``exp`` (tanh through ``exp``: a visibly different jaxpr). Shown: the
forward replaced (an outer `jax.grad` uses the kernel's backward), the
forward and backward replaced together in a differentiated jaxpr, the
default kernel evaluating the equations as written, a near miss left alone,
`explain` listing the site, and a backward region past the cotangents
trimmed (rewrite._backward).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunedjax as tj
from tunedjax import autotune, rewrite
from tunedjax.rewrite import _backward

OP = "toy_tanh_scale"


@dataclasses.dataclass(frozen=True)
class Spec:
  shape: tuple[int, ...]
  dtype: str


def _xla(x, s, spec):
  del spec
  return jnp.tanh(x) * s


def _exp(x, s, spec):
  del spec
  e = jnp.exp(-2.0 * x)
  return (1.0 - e) / (1.0 + e) * s


def find(ctx, jaxpr):
  """The pattern: ``tanh(x) * s`` with x and s of one shape."""
  del ctx
  sites = []
  for i, e in enumerate(jaxpr.eqns):
    if e.primitive.name != "tanh":
      continue
    for j, f in enumerate(jaxpr.eqns):
      if f.primitive.name == "mul" and f.invars[0] is e.outvars[0] and (
          f.invars[1].aval.shape == e.invars[0].aval.shape):
        x, s = e.invars[0], f.invars[1]
        spec = Spec(tuple(x.aval.shape), np.dtype(x.aval.dtype).name)
        sites.append(autotune.PatternSite(
            OP, spec, (i, j), (x, s), (f.outvars[0],),
            call=lambda kernel, x, s: (kernel(x, s),), spelling="tanh*s"))
  return sites


@pytest.fixture
def toy(tmp_path, monkeypatch):
  monkeypatch.setenv("TUNEDJAX_CACHE_DIR", str(tmp_path))
  family = autotune.OpFamily(
      name=OP, spec_type=Spec, key=lambda spec, bucket: {"shape": list(spec.shape)},
      operands=lambda spec, rng: (rng.normal(size=spec.shape).astype(spec.dtype),) * 2,
      patterns=(find,))
  autotune.register_op_family(family)
  autotune.register_kernel(OP, "xla", _xla, applicable=lambda s, p: True)
  autotune.register_kernel(OP, "exp", _exp, applicable=lambda s, p: True)
  try:
    yield family
  finally:
    autotune.unregister_op_family(OP)


def _selecting(kernel):
  return tj.config_context({"kernel": {"enable": True, "hints": {OP: kernel}}})


def _data(n=7):
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.normal(size=(n,)), jnp.float32),
          jnp.asarray(rng.normal(size=(n,)), jnp.float32))


def f(x, s):
  return jnp.sin(jnp.tanh(x) * s)


def _matched(jitted):
  return jitted.report(memory=False).last.kernel_report.matched


def _prims(fn, *args):
  return rewrite.count_primitives(jax.make_jaxpr(fn)(*args))


def test_forward_replaced_and_outer_grad_uses_the_kernel(toy):
  x, s = _data()
  with _selecting("exp"):
    g = tj.jit(f)
    np.testing.assert_allclose(g(x, s), f(x, s), rtol=1e-5, atol=1e-6)
    (site,) = _matched(g)
    assert (site.op, site.spelling, site.kernel, site.replaced) == (OP, "tanh*s", "exp",
                                                                    "forward")
    assert "test_pattern_sites.py" in site.where
    got = jax.grad(lambda x, s: g(x, s).sum(), (0, 1))(x, s)
  want = jax.grad(lambda x, s: f(x, s).sum(), (0, 1))(x, s)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _check_both_replaced(step, x, s):
  """`tj.jit(step)` with the ``exp`` kernel: forward and backward replaced, same results."""
  with _selecting("exp"):
    g = tj.jit(step)
    got = g(x, s)
    (site,) = _matched(g)
  assert site.replaced == "forward+backward"
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(step(x, s))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_grad_inside_replaces_forward_and_backward(toy):
  x, s = _data()
  _check_both_replaced(jax.value_and_grad(lambda x, s: f(x, s).sum(), (0, 1)), x, s)


def test_rewritten_program_runs_the_kernel(toy, tmp_path):
  x, s = _data()
  from tunedjax.autotune import _select  # pylint: disable=import-outside-toplevel
  step = jax.grad(lambda x, s: f(x, s).sum(), (0, 1))
  p = _select.kernel_pass(cache=str(tmp_path))
  with _selecting("exp"):
    counts = _prims(rewrite.transform(step, p), x, s)
  assert counts["tanh"] == 0 and counts["exp"] >= 1  # forward and backward both replaced
  with _selecting("xla"):
    counts = _prims(rewrite.transform(step, p), x, s)
  assert counts == _prims(step, x, s)  # the default: the equations as written


def test_near_miss_left_alone(toy, tmp_path):
  def g(x, s):
    t = jnp.tanh(x)
    return jnp.sin(t * s) + t  # the intermediate is read by something else
  x, s = _data()
  from tunedjax.autotune import _select  # pylint: disable=import-outside-toplevel
  p = _select.kernel_pass(cache=str(tmp_path))
  for fn in (g, jax.grad(lambda x, s: g(x, s).sum())):
    with _selecting("exp"):
      assert _prims(rewrite.transform(fn, p), x, s) == _prims(fn, x, s)


def test_explain_lists_the_site(toy, tmp_path):
  x, s = _data()
  rows = [r for r in autotune.explain(f, x, s, cache=str(tmp_path)) if r.op == OP]
  assert len(rows) == 1 and rows[0].count == 1
  assert rows[0].matched and rows[0].matched[0].startswith("tanh*s at ")


def test_backward_region_past_the_cotangents_is_trimmed():
  # The input of the forward is a reshape of w: the cotangent of x is reshaped back
  # for w's own backward, a region equation the check must trim off.
  def loss(w, s):
    x = w.reshape(6)
    return jnp.sum(jnp.sin(jnp.tanh(x) * s))
  w, s = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), jnp.linspace(0.5, 1.5, 6)
  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(w, s).jaxpr
  names = [e.primitive.name for e in jaxpr.eqns]
  i, j = names.index("tanh"), names.index("mul")
  x = jaxpr.eqns[i].invars[0]
  back = _backward.find_backward(jaxpr, (i, j), (x, jaxpr.invars[1]),
                                 (jaxpr.eqns[j].outvars[0],))
  assert back is not None and sorted(back.wrt) == [0, 1]
  assert all(v.aval.shape == (6,) for v in back.outputs)  # not the reshaped (2, 3)
  kept = {jaxpr.eqns[k].primitive.name for k in back.eqns}
  assert "reshape" not in kept


def test_backward_that_does_not_verify_is_none():
  # Something reads the intermediate with an outside value: not a backward.
  def h(x, s):
    t = jnp.tanh(x)
    return jnp.sum(jnp.sin(t * s)) + jnp.sum(t * jnp.cos(s))
  x, s = _data()
  jaxpr = jax.make_jaxpr(jax.grad(h, (0, 1)))(x, s).jaxpr
  names = [e.primitive.name for e in jaxpr.eqns]
  i, j = names.index("tanh"), names.index("mul")
  assert _backward.find_backward(jaxpr, (i, j), tuple(jaxpr.invars),
                                 (jaxpr.eqns[j].outvars[0],)) is None


# -- backward checks kept: per process, and across processes in the tuning cache --------


def _differentiated():
  x, s = _data()
  jaxpr = jax.make_jaxpr(jax.grad(lambda x, s: f(x, s).sum(), (0, 1)))(x, s).jaxpr
  names = [e.primitive.name for e in jaxpr.eqns]
  i, j = names.index("tanh"), names.index("mul")
  return jaxpr, (i, j), (jaxpr.eqns[i].invars[0], jaxpr.invars[1]), (jaxpr.eqns[j].outvars[0],)


class _DictStore:
  def __init__(self):
    self.values, self.loads = {}, 0

  def load(self, digest):
    self.loads += 1
    return self.values.get(digest)

  def save(self, digest, value):
    self.values[digest] = value


def _no_check(*args, **kwargs):
  raise AssertionError("checked the region again")


def test_a_checked_region_is_not_checked_again_in_the_process(monkeypatch):
  _backward.forget_checks()
  jaxpr, eqns, inputs, outputs = _differentiated()
  first = _backward.find_backward(jaxpr, eqns, inputs, outputs)
  assert first is not None
  monkeypatch.setattr(_backward, "_verify", _no_check)
  again = _backward.find_backward(*_differentiated())  # a new trace, the same structure
  assert again is not None and again.wrt == first.wrt and again.eqns == first.eqns
  _backward.forget_checks()
  with pytest.raises(AssertionError, match="checked the region again"):
    _backward.find_backward(*_differentiated())


def test_a_stored_check_serves_a_new_process_and_a_bad_one_is_checked_again(monkeypatch):
  _backward.forget_checks()
  store = _DictStore()
  first = _backward.find_backward(*_differentiated(), store)
  ((digest, value),) = store.values.items()
  assert value["verified"] is True and len(digest) == 32
  _backward.forget_checks()  # as a new process: only the store knows
  with monkeypatch.context() as m:
    m.setattr(_backward, "_verify", _no_check)
    again = _backward.find_backward(*_differentiated(), store)
  assert (again.eqns, again.wrt) == (first.eqns, first.wrt)
  _backward.forget_checks()
  store.values[digest] = {"verified": True, "kept": "everything"}  # malformed: checked again
  assert _backward.find_backward(*_differentiated(), store).wrt == first.wrt
  assert store.values[digest] == value


def test_a_signature_naming_objects_by_address_is_never_stored():
  assert _backward.signature_digest((("custom_jvp_call", "<function f at 0x7f00>"),)) is None
  digest = _backward.signature_digest((("mul", "{}"),))
  assert digest == _backward.signature_digest((("mul", "{}"),)) and len(digest) == 32


@pytest.mark.parametrize("value", [
    {"verified": "yes"}, {"verified": False, "kept": []}, {"verified": True, "kept": [0]},
    {"verified": True, "kept": [], "outputs": [], "wrt": []},
    {"verified": True, "kept": [0], "outputs": [1, 2], "wrt": [0]},
    {"verified": True, "kept": [-1], "outputs": [1], "wrt": [0]}, [1, 2]])
def test_a_malformed_stored_check_is_refused(value):
  with pytest.raises(ValueError):
    _backward.outcome_from_json(value)


def test_kernel_selection_keeps_checks_in_the_tuning_cache(toy, tmp_path, monkeypatch):
  """A warm tuning cache serves a new process's trace without compiling a check."""
  x, s = _data()
  step = jax.value_and_grad(lambda x, s: f(x, s).sum(), (0, 1))
  _backward.forget_checks()
  with _selecting("exp"):
    tj.jit(step)(x, s)
  entries = autotune.Cache(tmp_path).entries("backward")
  assert len(entries) == 1 and entries[0].value["verified"] is True
  _backward.forget_checks()
  monkeypatch.setattr(_backward, "_verify", _no_check)
  from tunedjax import _tuning  # pylint: disable=import-outside-toplevel
  with _tuning.using_session(_tuning.TuningSession()):  # nothing in the session's memory
    _check_both_replaced(step, x, s)
