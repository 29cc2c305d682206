"""A constant causal mask makes an attention causal, on every route to the family.

`_causal.split_mask` on each way of writing a causal mask (alone, broadcast,
ANDed with a padding mask) and on near misses, which stay general masks; then
the routes: the attention pattern, `tj.use_tuned_attention` (nnx and linen,
traced and eager), `tj.jit`'s routing of Flax modules, and the `Trainer` on a
small miniGPT written as the JAX AI stack tutorial writes it. Each checks the
bucket key (``causal``, no mask operand, or only the padding one) and the
values: forward and gradient against Flax's own attention with the mask,
random data, float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh

import tunedjax as tj
from tunedjax.autotune import _routes
from tunedjax.ops.attention import _causal, _view
from tunedjax.ops.attention._pattern import attention_matches
from tunedjax.ops.attention._view import FlatView
from tests.ops.attention.test_pattern import SPELLINGS, _check

B, T, HEADS, WIDTH = 2, 10, 2, 16
RTOL = 2e-5


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _tree_rel(a, b):
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
  assert jax.tree.structure(a) == jax.tree.structure(b)
  return _rel(flat(a), flat(b))


def _valid(b=B, t=T):
  """Key padding ``[b, t]``: row 0 padded at the end, row 1 at the start (its first
  queries then see no key at all under the causal mask: fully masked rows)."""
  valid = np.ones((b, t), bool)
  valid[0, t - 3:] = False
  valid[1 % b, :2] = False
  return jnp.asarray(valid)


def _iota(t, s):
  return jax.lax.broadcasted_iota(jnp.int32, (t, s), 0) >= jax.lax.broadcasted_iota(
      jnp.int32, (t, s), 1)


# name: mask(batch, tokens, valid [batch, tokens], data [batch, tokens, width])
FORMS = {
    "tril": lambda b, t, valid, x: jnp.tril(jnp.ones((t, t))),  # the miniGPT tutorial's
    "tril_bool_11tt": lambda b, t, valid, x: jnp.tril(jnp.ones((t, t), bool))[None, None],
    "iota_bhtt": lambda b, t, valid, x: jnp.broadcast_to(_iota(t, t), (b, HEADS, t, t)),
    "arange": lambda b, t, valid, x: jnp.arange(t)[:, None] >= jnp.arange(t)[None, :],
    "nnx_make_causal_mask": lambda b, t, valid, x: nnx.make_causal_mask(jnp.ones((b, t))),
    "linen_make_causal_mask": lambda b, t, valid, x: nn.make_causal_mask(jnp.ones((b, t))),
    "nnx_combine_padding": lambda b, t, valid, x: nnx.combine_masks(
        nnx.make_causal_mask(valid), valid[:, None, None, :]),
    "linen_combine_padding": lambda b, t, valid, x: nn.combine_masks(
        nn.make_causal_mask(valid), nn.make_attention_mask(valid, valid)),
    "logical_and_padding": lambda b, t, valid, x: jnp.logical_and(
        jnp.tril(jnp.ones((t, t), bool)), valid[:, None, None, :]),
    # near misses: general masks
    "tril_k1": lambda b, t, valid, x: jnp.tril(jnp.ones((t, t)), k=1),
    "tril_k-1": lambda b, t, valid, x: jnp.tril(jnp.ones((t, t)), k=-1),
    "triu": lambda b, t, valid, x: jnp.triu(jnp.ones((t, t))),
    "tril_times_padding": lambda b, t, valid, x: (
        jnp.tril(jnp.ones((t, t))) * valid[:, None, None, :].astype(jnp.float32)),
    "tril_or_padding": lambda b, t, valid, x: (
        jnp.tril(jnp.ones((t, t), bool)) | valid[:, None, None, :]),
    "tril_plus_data": lambda b, t, valid, x: (
        jnp.tril(jnp.ones((t, t))) + 0.0 * jnp.mean(x)),  # causal values, but data
    "data": lambda b, t, valid, x: x[:, None, :, :1] > x[:, None, None, :, 0],
}
# name: (causal, the rest's shape: None for no mask left; "same" for unchanged)
SPLIT = {
    "tril": (True, None), "tril_bool_11tt": (True, None), "iota_bhtt": (True, None),
    "arange": (True, None), "nnx_make_causal_mask": (True, None),
    "linen_make_causal_mask": (True, None),
    "nnx_combine_padding": (True, (B, 1, 1, T)), "logical_and_padding": (True, (B, 1, 1, T)),
    "linen_combine_padding": (True, (B, 1, T, T)),  # make_attention_mask pairs query and key
    **{k: (False, "same") for k in ("tril_k1", "tril_k-1", "triu", "tril_times_padding",
                                    "tril_or_padding", "tril_plus_data", "data")},
}
# The bucket's mask and causality, as `describe_attention` ends a swapped call's bucket.
BUCKET_END = {
    **{k: "causal" for k, (c, rest) in SPLIT.items() if c and rest is None},
    "nnx_combine_padding": "bool(b..s) causal", "logical_and_padding": "bool(b..s) causal",
    "linen_combine_padding": "bool(b.ts) causal",
    "tril_k1": "bool(..ts)", "tril_k-1": "bool(..ts)", "triu": "bool(..ts)",
    "tril_times_padding": "bool(b.ts)", "tril_or_padding": "bool(b.ts)",
    "tril_plus_data": "bool(..ts)", "data": "bool(b.ts)",
}


def _data(seed=0, b=B, t=T):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(b, t, WIDTH)), jnp.float32)


# -- the rule ------------------------------------------------------------------------------


@pytest.mark.parametrize("form", sorted(FORMS))
def test_split_mask_of_each_form_under_a_trace(form):
  """Traced: causal or not as expected, and causal AND the rest is the mask, entry by entry."""
  seen = []

  def f(valid, x):
    mask = FORMS[form](B, T, valid, x)
    causal, rest = _causal.split_mask(mask, T, T)
    seen.append((causal, "same" if rest is mask else None if rest is None else rest.shape))
    keep = _iota(T, T) if causal else True
    left = True if rest is None else rest.astype(bool)
    return jnp.broadcast_to(mask.astype(bool), (B, HEADS, T, T)), \
        jnp.broadcast_to(keep & left, (B, HEADS, T, T))

  want, got = jax.jit(f)(_valid(), _data())
  assert seen == [SPLIT[form]]
  np.testing.assert_array_equal(got, want)


def test_split_mask_of_arrays_and_arguments():
  """Concrete masks by their value; a mask that is an argument of the traced function
  is data; non-square masks are causal aligned top-left only (as JAX's is_causal)."""
  tril = np.tril(np.ones((T, T)))
  assert _causal.split_mask(tril, T, T) == (True, None)
  assert _causal.split_mask(jnp.asarray(tril, bool)[None, None], T, T) == (True, None)
  assert _causal.split_mask(np.tril(np.ones((T, T)), 1), T, T)[0] is False
  combined = tril.astype(bool) & np.asarray(_valid())[:, None, None, :]  # concrete: unsplit
  assert _causal.split_mask(combined, T, T)[0] is False
  assert _causal.split_mask(np.tril(np.ones((T, T + 3))), T, T + 3) == (True, None)
  assert _causal.split_mask(np.tril(np.ones((T, T + 3)), 3), T, T + 3)[0] is False
  assert _causal.split_mask(None, T, T) == (False, None)
  seen = []
  jax.make_jaxpr(lambda m: seen.append(_causal.split_mask(m, T, T)[0]) or m)(tril)
  jax.make_jaxpr(lambda: seen.append(_causal.split_mask(
      jnp.tril(jnp.ones((T, T + 3)), k=3), T, T + 3)[0]))()
  assert seen == [False, False]


def test_mask_constants_evaluated_in_numpy_equal_xla():
  """The view evaluates masks' constants in NumPy (no compile per primitive): the same
  values and dtypes as XLA, integers wrapping."""
  def f():
    i, j = (jax.lax.broadcasted_iota(jnp.int32, (4, 5), d) for d in (0, 1))
    causal = i >= j
    choice = causal.astype(jnp.int32) + (j > 2).astype(jnp.int32)
    return [i + j, i - 3, i * j, -i, jnp.int32(2**31 - 1) + i, causal, i > j, i <= j, i < j,
            i == j, i != j, causal & (i < 3), causal | (j == 0), ~causal, causal ^ (j > 1),
            i & j, jax.lax.select_n(causal, i, j), jax.lax.select_n(choice, i, j, i + j),
            jnp.reshape(i, (2, 10)), causal[None, :, None], jnp.squeeze(i[None], 0),
            causal.astype(jnp.float32), i.astype(jnp.float32) != 2.0,
            jnp.tril(jnp.ones((4, 5))), nnx.make_causal_mask(jnp.ones((2, 4)))]

  closed = jax.make_jaxpr(f)()
  view = FlatView(closed.jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts)))
  for var, want in zip(closed.jaxpr.outvars, jax.jit(f)(), strict=True):
    got = view.constant(var)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
  in_numpy = [e.name for e in view.eqns
              if _view._in_numpy(e, [view.constant(x) for x in e.ins]) is not None]
  assert {"iota", "add", "sub", "mul", "neg", "ge", "and", "or", "not", "xor", "select_n",
          "reshape", "squeeze", "broadcast_in_dim", "convert_element_type", "ne"} <= set(
              in_numpy)


def test_pattern_splits_causal_and_padding():
  """Written by hand (PyTorch's layout): ``where(tril & valid, s, -1e9)`` is a causal
  site whose mask is the padding alone, and the rewritten program computes the same
  forward and gradients."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, HEADS, 8)), jnp.float32) for _ in range(3))

  def f(q, k, v, valid):
    mask = jnp.tril(jnp.ones((T, T), bool)) & valid[:, None, None, :]
    return SPELLINGS["bhtd_matmul"](q, k, v, lambda s: jnp.where(mask, s, -1e9))

  args = (q, k, v, _valid())
  (match,) = attention_matches(jax.make_jaxpr(f)(*args).jaxpr)
  assert match.spec.causal and match.spec.mask_shape == (B, 1, 1, T)
  _check(f, args, ("bool", True), jnp.float32)


# -- tj.use_tuned_attention --------------------------------------------------------------


class NnxBlock(nnx.Module):
  """A miniGPT block's attention, its mask written one of `FORMS`' ways."""

  def __init__(self, form: str, seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.form = form
    self.attention = nnx.MultiHeadAttention(num_heads=HEADS, in_features=WIDTH, decode=False,
                                            rngs=rngs)
    self.out = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x, valid):
    mask = FORMS[self.form](x.shape[0], x.shape[1], valid, x)
    return self.out(nnx.gelu(x + self.attention(x, mask=mask)))


class LinenBlock(nn.Module):
  form: str

  @nn.compact
  def __call__(self, x, valid):
    mask = FORMS[self.form](x.shape[0], x.shape[1], valid, x)
    h = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(x, mask=mask)
    return nn.Dense(WIDTH)(nn.gelu(h))


def _loss(y):
  return (y * jnp.cos(jnp.arange(y.size).reshape(y.shape))).sum()


def _nnx_value_and_grad(graphdef):
  return jax.value_and_grad(lambda state, x, valid: _loss(nnx.merge(graphdef, state)(x, valid)),
                            argnums=(0, 1))


def _buckets(swap):
  return [r.bucket for r in swap.buckets(cache=False)]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_nnx_and_linen_swap_bucket_of_each_form(form):
  """Traced (not compiled): each form's bucket, causal or as general as before."""
  x, valid = _data(), _valid()
  want = [f"attention {B}x{T}x{T} h{HEADS}/{HEADS} d8 float32 {BUCKET_END[form]}"]
  model = NnxBlock(form)
  swap = tj.use_tuned_attention(model)
  jax.eval_shape(_nnx_value_and_grad(nnx.graphdef(model)), nnx.state(model), x, valid)
  assert _buckets(swap) == want
  module = LinenBlock(form)
  variables = jax.eval_shape(module.init, jax.random.key(0), x, valid)
  swap = tj.use_tuned_attention(module)
  with swap:
    jax.eval_shape(jax.grad(lambda v, x: _loss(module.apply(v, x, valid))), variables, x)
  assert _buckets(swap) == want


@pytest.mark.parametrize("form", ["tril", "iota_bhtt", "nnx_make_causal_mask",
                                  "nnx_combine_padding", "tril_k1"])
def test_nnx_swap_values(form):
  """Forward and gradients equal Flax's own attention with the mask: the reference
  kernel (jax.jit), and for two forms a pinned other kernel (tj.jit)."""
  model = NnxBlock(form)
  graphdef, state = nnx.split(model)
  x, valid = _data(1), _valid()
  want = jax.jit(_nnx_value_and_grad(graphdef))(state, x, valid)  # Flax's own attention
  swap = tj.use_tuned_attention(model)
  tuned = _nnx_value_and_grad(nnx.graphdef(model))
  runs = [jax.jit(tuned)(state, x, valid)]
  if form in ("tril", "nnx_combine_padding"):
    step = tj.jit(tuned)
    with tj.config_context({"kernel": {"enable": True, "hints": {"attention": "einsum"}},
                            "cache": {"dir": None}}):
      runs.append(step(state, x, valid))
    assert step.report(memory=False).last.kernel_report.of("attention")[0].kernel == "einsum"
  assert _buckets(swap) == [f"attention {B}x{T}x{T} h{HEADS}/{HEADS} d8 float32 {BUCKET_END[form]}"]
  for loss, grads in runs:
    assert _rel(loss, want[0]) < RTOL and _tree_rel(grads, want[1]) < RTOL


@pytest.mark.parametrize("form,bucket_end", [("tril", BUCKET_END["tril"]),
                                             ("nnx_combine_padding", "bool(b.ts)")])
def test_nnx_swap_eager(form, bucket_end):
  """Outside a trace the mask is a value: causal when all of it is; a combination of
  concrete masks cannot be split and stays general (the same function either way)."""
  model = NnxBlock(form)
  reference = nnx.clone(model)
  swap = tj.use_tuned_attention(model)
  x, valid = _data(2), _valid()
  assert _rel(model(x, valid), reference(x, valid)) < RTOL
  assert _buckets(swap)[0].endswith(bucket_end)


@pytest.mark.parametrize("form", ["tril", "linen_combine_padding", "tril_k1"])
def test_linen_swap_values(form):
  module = LinenBlock(form)
  x, valid = _data(3), _valid()
  variables = module.init(jax.random.key(0), x, valid)
  run = jax.jit(jax.value_and_grad(lambda v, x: _loss(module.apply(v, x, valid)),
                                   argnums=(0, 1)))
  want = run(variables, x)
  swap = tj.use_tuned_attention(module)
  with swap:
    got = jax.jit(jax.value_and_grad(lambda v, x: _loss(module.apply(v, x, valid)),
                                     argnums=(0, 1)))(variables, x)
  assert swap.tuned == ("MultiHeadDotProductAttention_0",)
  assert _buckets(swap) == [f"attention {B}x{T}x{T} h{HEADS}/{HEADS} d8 float32 {BUCKET_END[form]}"]
  assert _rel(got[0], want[0]) < RTOL and _tree_rel(got[1], want[1]) < RTOL


# -- tj.jit's routing --------------------------------------------------------------------


def _routed_buckets(f, *args):
  """The attention buckets of ``f(*args)`` as `tj.jit` routes Flax modules."""
  with _routes.routed():
    return [r.bucket for r in tj.autotune.explain(f, *args, cache=False) if r.op == "attention"]


@pytest.mark.parametrize("kind", ["nnx", "linen"])
@pytest.mark.parametrize("form", ["tril", "combine_padding", "tril_k1"])
def test_jit_routing_bucket_and_values(tmp_path, kind, form):
  """Modules nobody swapped: `tj.jit` routes them, and a causal mask makes them causal."""
  form = f"{kind}_{form}" if form == "combine_padding" else form
  x, valid = _data(4), _valid()
  if kind == "nnx":
    graphdef, state = nnx.split(NnxBlock(form))
    step, params = _nnx_value_and_grad(graphdef), state
  else:
    module = LinenBlock(form)
    params = module.init(jax.random.key(0), x, valid)
    step = jax.value_and_grad(lambda v, x, valid: _loss(module.apply(v, x, valid)),
                              argnums=(0, 1))
  assert _routed_buckets(step, params, x, valid) == [
      f"attention {B}x{T}x{T} h{HEADS}/{HEADS} d8 float32 {BUCKET_END[form]}"]
  if kind == "linen" and form != "tril":
    return  # their values: the linen swap's test (the route makes the same call)
  want = jax.jit(step)(params, x, valid)
  with tj.config_context({"kernel": {"enable": True, "hints": {"attention": "einsum"}},
                          "cache": {"dir": str(tmp_path)}}):
    f = tj.jit(step)
    got = f(params, x, valid)
  report = f.report(memory=False).last.kernel_report
  assert [(c.kernel, c.why) for c in report.of("attention")] == [("einsum", "hint")]
  assert [m for m in report.matched if m.op == "attention"] == []  # routed, not a pattern
  assert _rel(got[0], want[0]) < RTOL and _tree_rel(got[1], want[1]) < RTOL


@pytest.mark.slow
def test_a_causal_kernel_runs_the_tutorial_mask(tmp_path):
  """At 256 tokens a ``jnp.tril`` mask now reaches a causal block-skipping kernel (one
  that takes no mask operand), with the values of Flax's own attention."""
  model = NnxBlock("tril")
  graphdef, state = nnx.split(model)
  x, valid = _data(5, b=1, t=256), _valid(1, 256)
  want = jax.jit(_nnx_value_and_grad(graphdef))(state, x, valid)
  tj.use_tuned_attention(model)
  step = tj.jit(_nnx_value_and_grad(nnx.graphdef(model)))
  with tj.config_context({"kernel": {"enable": True,
                                     "hints": {"attention": "blocked_causal_128"}},
                          "cache": {"dir": str(tmp_path)}}):
    got = step(state, x, valid)
  choice, = step.report(memory=False).last.kernel_report.of("attention")
  assert (choice.kernel, choice.why) == ("blocked_causal_128", "hint")
  assert _rel(got[0], want[0]) < RTOL and _tree_rel(got[1], want[1]) < RTOL


# -- the Trainer on a miniGPT --------------------------------------------------------------


class MiniGPT(nnx.Module):
  """The JAX AI stack tutorial's miniGPT, small: its mask is ``jnp.tril(jnp.ones((T, T)))``."""

  def __init__(self, vocab=32, tokens=16, width=16, heads=2, layers=2, seed=0):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.position = nnx.Embed(tokens, width, rngs=rngs)
    self.attention = nnx.List([nnx.MultiHeadAttention(num_heads=heads, in_features=width,
                                                      decode=False, rngs=rngs)
                               for _ in range(layers)])
    self.norm = nnx.List([nnx.LayerNorm(width, rngs=rngs) for _ in range(layers)])
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, ids):
    t = ids.shape[1]
    x = self.embed(ids) + self.position(jnp.arange(t)[None])
    for attention, norm in zip(self.attention, self.norm):
      x = norm(x + attention(x, mask=jnp.tril(jnp.ones((t, t))), decode=False))
    return self.head(x)


def _lm_loss(model, batch):
  return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


@pytest.mark.slow
def test_trainer_minigpt_bucket_is_causal_and_losses_match(tmp_path):
  ids = np.random.default_rng(0).integers(0, 32, size=(4, 17)).astype(np.int32)
  data = {"x": ids[:, :-1], "y": ids[:, 1:]}
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  runs = {}
  for autotune in ({"kernel": {"enable": True}, "cache": {"dir": str(tmp_path)}}, False):
    trainer = tj.Trainer(MiniGPT(), optax.adam(1e-2), _lm_loss, autotune=autotune, mesh=mesh,
                         progress=False)
    runs[bool(autotune)] = trainer.fit(data, batch_size=2, epochs=1)
  tuned, plain = runs[True], runs[False]
  np.testing.assert_allclose(tuned.losses, plain.losses, rtol=1e-5)
  report = tuned.tuning["attention"]
  assert report["tuned"] == ["attention.0", "attention.1"] and report["fallbacks"] == {}
  (bucket,) = report["buckets"]
  assert bucket["bucket"] == "attention 2x16x16 h2/2 d8 float32 causal"
  assert bucket["count"] == 2
