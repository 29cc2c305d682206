"""tunedjax.use_tuned_attention: Flax nnx and linen attention modules on tunedjax.attention.

The swapped model must compute the unswapped model's function (forward and
gradient, random inputs, float32 tolerance) with its state untouched, under
the reference and under a pinned non-reference kernel; calls the tuned
function cannot serve keep Flax's function and say why.
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
from tunedjax.ops.attention import _flax as _attention_flax
from tunedjax.demo import TransformerLM, lm_data, lm_loss

RTOL = 2e-5  # float32: the candidates sum the same products in another order


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _tree_rel(a, b):
  """Relative error over all leaves at once (some, as a key bias's gradient, are ~0)."""
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
  assert jax.tree.structure(a) == jax.tree.structure(b)
  return _rel(flat(a), flat(b))


def _other_kernel() -> str:
  """The non-reference kernel pinned here: blocked online softmax, 128-key blocks
  (it applies from 256 keys on, so the key lengths below are longer than that and
  not multiples of the block)."""
  assert "blocked_128" in [k.name for k in tj.autotune.kernels("attention")]
  return "blocked_128"


def _pinned(kernel: str):
  return tj.config_context({"kernel": {"enable": True, "hints": {"attention": kernel}},
                           "cache": {"dir": None}})


class TwoAttention(nnx.Module):
  """Self-attention with a padding mask, then cross-attention, as a model holds them."""

  def __init__(self, width: int = 16, heads: int = 4, *, seed: int = 0, dropout: float = 0.0):
    rngs = nnx.Rngs(seed)
    self.self_attn = nnx.MultiHeadAttention(num_heads=heads, in_features=width,
                                            dropout_rate=dropout, decode=False, rngs=rngs)
    self.cross = nnx.MultiHeadAttention(num_heads=heads, in_features=width, decode=False,
                                        rngs=rngs)

  def __call__(self, x, context, mask):
    h = x + self.self_attn(x, mask=mask)
    return h + self.cross(h, context)


def _inputs(rng, batch=2, q=260, k=300, width=16):
  x = rng.normal(size=(batch, q, width)).astype(np.float32)
  context = rng.normal(size=(batch, k, width)).astype(np.float32)
  lengths = q - 5 * (np.arange(batch) % 2)  # every second sequence is padded
  valid = np.arange(q)[None, :] < lengths[:, None]
  mask = valid[:, None, None, :] & np.ones((1, 1, q, 1), bool)  # [batch, 1, q, k]
  return x, context, mask


def _loss_and_grads(graphdef, state, x, context, mask):
  """The model's output and the gradients for its state and input: a pure function."""
  def loss(state, x):
    y = nnx.merge(graphdef, state)(x, context, mask)
    return (y * jnp.cos(jnp.arange(y.size).reshape(y.shape))).sum(), y
  (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
  return y, grads


@pytest.mark.parametrize("kernel", [None, "other"])
def test_nnx_swap_keeps_outputs_gradients_and_state(rng, kernel):
  x, context, mask = _inputs(rng)
  model = TwoAttention()
  graphdef, state_before = nnx.split(model)
  want_y, want_grads = jax.jit(lambda state, x: _loss_and_grads(graphdef, state, x, context,
                                                                mask))(state_before, x)
  swap = tj.use_tuned_attention(model)
  assert swap.kind == "nnx" and swap.modules == ("cross", "self_attn")
  assert all(isinstance(m.attention_fn, _attention_flax.TunedAttentionFn)
             for m in (model.self_attn, model.cross))
  state_after = nnx.state(model)
  assert jax.tree.structure(state_after) == jax.tree.structure(state_before)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state_after),
                                                  jax.tree.leaves(state_before)))
  graphdef = nnx.graphdef(model)  # the tuned function is in the graph definition
  if kernel is None:  # outside kernel selection: the reference
    y, grads = jax.jit(lambda state, x: _loss_and_grads(graphdef, state, x, context,
                                                        mask))(state_after, x)
  else:
    name = _other_kernel()
    step = tj.jit(lambda state, x: _loss_and_grads(graphdef, state, x, context, mask))
    with _pinned(name):
      y, grads = step(state_after, x)
    assert step.report().last.kernel_report.of("attention")[0].kernel == name
  assert _rel(y, want_y) < RTOL
  assert _tree_rel(grads, want_grads) < RTOL
  assert set(swap.tuned) == {"cross", "self_attn"} and swap.fallbacks == {}


def test_swapping_twice_changes_nothing_and_shares_the_record(rng):
  model = TwoAttention()
  first = tj.use_tuned_attention(model)
  fns = (model.self_attn.attention_fn, model.cross.attention_fn)
  second = tj.use_tuned_attention(model)
  assert (model.self_attn.attention_fn, model.cross.attention_fn) == fns
  x, context, mask = _inputs(rng)
  model(x, context, mask)
  assert first.tuned == second.tuned == ("cross", "self_attn")
  copy = nnx.clone(model)  # copies of the model share the swapped function
  assert copy.cross.attention_fn is model.cross.attention_fn


@pytest.mark.parametrize("case", ["no batch axis", "two batch axes", "float mask and bias",
                                  "grouped heads"])
def test_flax_shapes_and_mask_conventions_map_onto_tunedjax_attention(rng, case):
  """The swapped function on Flax's operands against Flax's own, forward and gradient."""
  layer = nnx.MultiHeadAttention(num_heads=2, in_features=4, decode=False, rngs=nnx.Rngs(0))
  tj.use_tuned_attention(layer)
  fn = layer.attention_fn
  q_len, k_len, heads, depth = 7, 261, 4, 8
  batch = {"no batch axis": (), "two batch axes": (2, 3)}.get(case, (2,))
  kv_heads = 2 if case == "grouped heads" else heads
  q = rng.normal(size=batch + (q_len, heads, depth)).astype(np.float32)
  k = rng.normal(size=batch + (k_len, kv_heads, depth)).astype(np.float32)
  v = rng.normal(size=batch + (k_len, kv_heads, depth)).astype(np.float32)
  # (Flax's own function needs every batch axis in the mask when there are several.)
  mask = rng.random(size=batch + (1, q_len, k_len)) < 0.7
  mask[..., 0] = True  # no fully masked row
  bias = None
  if case == "float mask and bias":
    mask = mask.astype(np.float32)  # Flax's make_causal_mask style: 1.0 attends
    bias = rng.normal(size=batch + (heads, q_len, k_len)).astype(np.float32)

  def run(f):
    def loss(q, k, v):
      y = f(q, k, v, bias=bias, mask=mask, deterministic=True)
      return (y * jnp.sin(jnp.arange(y.size).reshape(y.shape))).sum(), y
    (_, y), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return y, g

  want_y, want_g = jax.jit(lambda q, k, v: run(nnx.dot_product_attention))(q, k, v)
  y, g = jax.jit(lambda q, k, v: run(fn))(q, k, v)
  assert y.shape == want_y.shape
  assert _rel(y, want_y) < RTOL and _tree_rel(g, want_g) < RTOL
  with _pinned(_other_kernel()):
    y, g = tj.jit(lambda q, k, v: run(fn))(q, k, v)
  assert _rel(y, want_y) < RTOL and _tree_rel(g, want_g) < RTOL


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")
def test_dropout_in_training_and_sown_weights_keep_flax_and_say_why(rng):
  x, context, mask = _inputs(rng)
  reference = TwoAttention(dropout=0.3, seed=1)
  model = TwoAttention(dropout=0.3, seed=1)
  swap = tj.use_tuned_attention(model)
  rngs = nnx.Rngs(dropout=7)
  want = reference.self_attn(x, mask=mask, rngs=nnx.Rngs(dropout=7), deterministic=False)
  got = model.self_attn(x, mask=mask, rngs=rngs, deterministic=False)
  np.testing.assert_array_equal(got, want)  # Flax's own function: the same dropout
  assert swap.tuned == ()
  reasons = swap.fallbacks["self_attn"]
  assert len(reasons) == 1 and "dropout" in reasons[0] and "0.3" in reasons[0]
  # Evaluating (deterministic) is tuned.
  got = model.self_attn(x, mask=mask, deterministic=True)
  assert _rel(got, reference.self_attn(x, mask=mask, deterministic=True)) < RTOL
  assert swap.tuned == ("self_attn",)
  # Sown attention weights need the weights: Flax's function, which sows them.
  model.cross(x, context, sow_weights=True)
  assert any("sow_weights" in r for r in swap.fallbacks["cross"])
  sown = nnx.pop(model, nnx.Intermediate)
  assert jax.tree.leaves(sown)[0].shape == (2, 4, 260, 300)


def test_a_custom_attention_fn_is_left_alone():
  def mine(query, key, value, **kwargs):
    return nnx.dot_product_attention(query, key, value, **kwargs) * 2.0
  layer = nnx.MultiHeadAttention(num_heads=2, in_features=4, attention_fn=mine, decode=False,
                                 rngs=nnx.Rngs(0))
  swap = tj.use_tuned_attention(layer)
  assert layer.attention_fn is mine
  assert swap.left_alone == {"<root>": _attention_flax.CUSTOM}


def test_not_a_flax_module_is_an_error_naming_it():
  with pytest.raises(tj.TunedJaxError, match=r"nnx.Module or linen.Module, got 42"):
    tj.use_tuned_attention(42)


# --- linen -------------------------------------------------------------------------


class LinenEncoder(nn.Module):
  heads: int = 4
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x, mask, train: bool = False):
    h = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=self.dropout,
                                            deterministic=not train)(x, mask=mask)
    h = nn.LayerNorm()(h)
    return h + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="second")(h)


@pytest.mark.slow
def test_linen_swap_keeps_variables_outputs_and_gradients(rng):
  x, _, mask = _inputs(rng)
  module = LinenEncoder()
  variables = module.init(jax.random.key(0), x, mask)
  swap = tj.use_tuned_attention(module)
  with swap:
    assert jax.tree.map(np.shape, module.init(jax.random.key(0), x, mask)) == \
        jax.tree.map(np.shape, variables)

  def run(variables, x):
    def loss(variables, x):
      y = module.apply(variables, x, mask)
      return (y * jnp.cos(jnp.arange(y.size).reshape(y.shape))).sum(), y
    (_, y), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(variables, x)
    return y, g

  want_y, want_g = run(variables, x)
  with swap:
    y, g = run(variables, x)
  assert _rel(y, want_y) < RTOL and _tree_rel(g, want_g) < RTOL
  assert set(swap.tuned) == {"MultiHeadDotProductAttention_0", "second"}
  step = tj.jit(run)
  with swap, _pinned(_other_kernel()):
    y, g = step(variables, x)
  assert _rel(y, want_y) < RTOL and _tree_rel(g, want_g) < RTOL
  assert step.report().last.kernel_report.of("attention")[0].count == 2
  # Outside `with swap:` the module is Flax's, untouched.
  assert module.apply(variables, x, mask, method=lambda m, x, mask: m(x, mask)).shape == x.shape


def test_linen_dropout_in_training_keeps_flax_and_says_why(rng):
  x, _, mask = _inputs(rng)
  module = LinenEncoder(dropout=0.2)
  variables = module.init(jax.random.key(0), x, mask)
  rngs = {"dropout": jax.random.key(3)}
  want = module.apply(variables, x, mask, train=True, rngs=rngs)
  swap = tj.use_tuned_attention(module)
  with swap:
    got = module.apply(variables, x, mask, train=True, rngs=rngs)
  # The same dropout (Flax's function, the same key); the second module is tuned.
  assert _rel(got, want) < RTOL
  assert list(swap.fallbacks) == ["MultiHeadDotProductAttention_0"]
  assert "dropout" in swap.fallbacks["MultiHeadDotProductAttention_0"][0]
  assert swap.tuned == ("second",)  # no dropout there


# --- the Trainer -------------------------------------------------------------------


def _lm_trainer(autotune, **kwargs):
  lm = TransformerLM(vocab=32, tokens=16, width=16, layers=1, heads=2)
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  trainer = tj.Trainer(lm, optax.sgd(0.1), lm_loss, autotune=autotune, mesh=mesh,
                       progress=False, **kwargs)
  return lm, trainer


@pytest.mark.slow
def test_trainer_without_kernel_selection_leaves_attention_alone():
  lm, trainer = _lm_trainer(False)
  assert trainer.attention is None
  assert lm.blocks[0].attention.attention_fn is nnx.dot_product_attention
  history = trainer.fit(lm_data(2, 2, 16, vocab=32), batch_size=2, epochs=1)
  assert "attention" not in history.tuning
  lm, trainer = _lm_trainer({"kernel": {"enable": True}, "cache": {"dir": None}})
  assert isinstance(lm.blocks[0].attention.attention_fn, _attention_flax.TunedAttentionFn)
  assert trainer.attention.modules == ("blocks.0.attention",)


@pytest.mark.slow
def test_trainer_swaps_linen_attention_and_reports_its_fallbacks(rng):
  x, _, mask = _inputs(rng, batch=4)
  data = {"x": np.concatenate([x] * 2), "mask": np.concatenate([mask] * 2)}

  def loss_fn(model, batch, train=True):
    return (model(batch["x"], batch["mask"], train=train) ** 2).mean()

  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  config = {"kernel": {"enable": True, "tuning_range": [0, 10]}, "cache": {"dir": None},
            "layout": {"enable": False}, "dataloader": {"enable": False}}
  example = {k: v[:4] for k, v in data.items()}
  runs = {}
  for autotune in (config, False):
    trainer = tj.Trainer(LinenEncoder(dropout=0.1), optax.sgd(0.05), loss_fn,
                         autotune=autotune, mesh=mesh, progress=False, example_batch=example)
    runs[bool(autotune)] = trainer.fit(data, batch_size=4, epochs=2)
  tuned, plain = runs[True], runs[False]
  np.testing.assert_allclose(tuned.losses, plain.losses, rtol=1e-5)
  report = tuned.tuning["attention"]
  assert report["kind"] == "linen" and report["tuned"] == ["second"]
  assert list(report["fallbacks"]) == ["MultiHeadDotProductAttention_0"]
  assert report["buckets"] and report["buckets"][0]["count"] == 1
