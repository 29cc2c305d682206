"""Tests of Policy, get_policy and the config's mixed_precision.policy check."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tunedjax as tj
from tunedjax import _config
from tunedjax import mixed_precision as mp

DTYPES = ("float32", "bfloat16", "float16", "float64")
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


@pytest.fixture(autouse=True)
def _clean_config(monkeypatch):
  monkeypatch.delenv("TUNEDJAX_CONFIG", raising=False)
  _config._reset_for_tests()
  yield
  _config._reset_for_tests()


def test_long_short_and_bare_forms():
  long = mp.Policy.parse("params=float32,compute=bfloat16,output=float32")
  short = mp.Policy.parse("p=f32,c=bf16,o=f32")
  assert long == short == mp.Policy("float32", jnp.bfloat16, np.float32)
  assert long.compute_dtype == jnp.dtype(jnp.bfloat16)
  assert mp.Policy.parse("bf16") == mp.Policy("bfloat16", "bfloat16", "bfloat16")
  # jmp's shorthand: params float32, output follows compute.
  assert mp.Policy.parse(" C = f16 ") == mp.Policy(compute_dtype="float16") == mp.Policy(
      "float32", "float16", "float16")


@given(st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.sampled_from(DTYPES),
       st.booleans())
def test_str_round_trips(p, c, o, short):
  policy = mp.Policy(p, c, o)
  assert mp.Policy.parse(str(policy)) == policy
  text = f"o={SHORT[o]},p={SHORT[p]},c={SHORT[c]}" if short else str(policy)
  assert mp.Policy.parse(text) == policy
  assert str(policy) == f"params={p},compute={c},output={o}"


def test_named_policies():
  assert str(mp.get_policy("mixed_bfloat16")) == "params=float32,compute=bfloat16,output=float32"
  assert str(mp.get_policy("mixed_float16")) == "params=float32,compute=float16,output=float32"
  assert mp.get_policy("float32") == mp.Policy()
  policy = mp.Policy(compute_dtype="bf16")
  assert mp.get_policy(policy) is policy
  assert mp.get_policy("p=f32,c=f16,o=f16").output_dtype == jnp.float16


def test_casts_only_floating_leaves(rng):
  policy = mp.get_policy("mixed_bfloat16")
  tree = {"w": jnp.asarray(rng.normal(size=3), jnp.float32), "n": jnp.arange(3)}
  out = policy.cast_to_compute(tree)
  assert out["w"].dtype == jnp.bfloat16 and out["n"].dtype == tree["n"].dtype
  assert policy.cast_to_output(out)["w"].dtype == jnp.float32
  assert policy.cast_to_param(out)["w"].dtype == jnp.float32


@pytest.mark.parametrize("bad", ["int32", jnp.int32, np.dtype("int8"), "bool"])
def test_integer_compute_dtype_is_rejected(bad):
  with pytest.raises(mp.PolicyError, match="compute_dtype must be a floating dtype") as e:
    mp.Policy(compute_dtype=bad)
  assert "bfloat16 (bf16)" in str(e.value)  # lists the valid dtypes


@pytest.mark.parametrize("text, shows", [
    ("params=float32,compute=bfloat16,outptu=float32", "unknown key 'outptu'"),
    ("p=f32,c=int8", "floating"),
    ("p=f32,c=bf17", "did you mean 'bf16'"),
    ("p=f32,p=f16", "twice"),
    ("p=f32,bf16", "not a key=dtype pair"),
    ("nonsense", "Unknown dtype 'nonsense'"),
])
def test_bad_strings_show_the_string_and_the_grammar(text, shows):
  with pytest.raises(mp.PolicyError) as e:
    mp.Policy.parse(text)
  message = str(e.value)
  assert repr(text) in message and shows in message
  assert "params|p, compute|c, output|o" in message  # the grammar


def test_unknown_named_policy_lists_the_names():
  with pytest.raises(mp.PolicyError, match="mixed_bfloat16") as e:
    mp.get_policy("mixed_bfloat")
  assert "did you mean 'mixed_bfloat16'" in str(e.value)


def test_set_config_validates_the_policy_string():
  with pytest.raises(tj.ConfigError) as e:
    tj.set_config({"mixed_precision": {"policy": "p=f32,compute=bfloat16,out=f32"}})
  message = str(e.value)
  assert "'mixed_precision.policy'" in message
  assert "'p=f32,compute=bfloat16,out=f32'" in message and "unknown key 'out'" in message
  assert "params|p, compute|c, output|o" in message
  tj.set_config({"mixed_precision": {"policy": "p=f32,c=f16,o=f32"}})
  assert tj.get_config().mixed_precision.policy == "p=f32,c=f16,o=f32"


# --- issue 19: the short forms follow jmp's documented shorthand ---------------------------
# Ported from jmp's policy_test.py (test_get_policy, test_get_policy_mixed,
# test_get_policy_compute, test_get_policy_almost_dtype, test_policy_cast_to_*,
# test_policy_with_output_dtype); jmp's `get_policy(str)` is `Policy.parse` here.

JMP_DTYPES = (np.float16, jnp.float16, jnp.bfloat16, np.float32, jnp.float32)
JMP_NAMES = {np.dtype(np.float16): "float16", np.dtype(jnp.bfloat16): "bfloat16",
             np.dtype(np.float32): "float32"}


@pytest.mark.parametrize("name, dtype", [("float16", np.float16), ("float32", np.float32),
                                         ("bfloat16", jnp.bfloat16)])
def test_jmp_get_policy(name, dtype):
  policy = mp.Policy.parse(name)
  assert policy.param_dtype == policy.compute_dtype == policy.output_dtype == dtype


def test_jmp_get_policy_almost_dtype():
  with pytest.raises(ValueError, match="Unknown dtype"):
    mp.Policy.parse("compute_float16")


@pytest.mark.parametrize("dtype", JMP_DTYPES)
def test_jmp_get_policy_mixed(dtype):
  """jmp: "c=f16" is params full, compute and output f16."""
  policy = mp.Policy.parse(f"c={JMP_NAMES[np.dtype(dtype)]}")
  assert policy.param_dtype == jnp.float32
  assert policy.compute_dtype == dtype and policy.output_dtype == dtype


@pytest.mark.parametrize("dtype", JMP_DTYPES)
def test_jmp_get_policy_compute(dtype):
  policy = mp.Policy.parse(f"c={JMP_NAMES[np.dtype(dtype)]},o=full")
  assert policy.param_dtype == jnp.float32 and policy.output_dtype == jnp.float32
  assert policy.compute_dtype == dtype


@pytest.mark.parametrize("text, p, c, o", [
    ("c=bf16", "float32", "bfloat16", "bfloat16"),   # issue 19: was output float32
    ("p=f16", "float16", "float16", "float16"),      # issue 19: was compute float32
    ("p=f16,c=bf16", "float16", "bfloat16", "bfloat16"),
    ("p=f16,c=f16", "float16", "float16", "float16"),
    ("o=f16", "float32", "float32", "float16"),
    ("p=bf16,o=f32", "bfloat16", "bfloat16", "float32"),
])
def test_jmp_shorthand_omitted_keys_follow(text, p, c, o):
  """jmp: params defaults to f32, compute follows params, output follows compute."""
  assert mp.Policy.parse(text) == mp.Policy(p, c, o)
  keys = dict(part.split("=") for part in text.split(","))
  names = {"p": "param_dtype", "c": "compute_dtype", "o": "output_dtype"}
  assert mp.Policy(**{names[k]: v for k, v in keys.items()}) == mp.Policy(p, c, o)


@pytest.mark.parametrize("dtype", JMP_DTYPES)
@pytest.mark.parametrize("np_", [np, jnp])
def test_jmp_policy_casts(dtype, np_):
  policy = mp.Policy(dtype, dtype, dtype)
  assert policy.param_dtype == policy.compute_dtype == policy.output_dtype == dtype
  for cast in (policy.cast_to_param, policy.cast_to_compute, policy.cast_to_output):
    assert cast({"a": np_.ones([])})["a"].dtype == dtype


@pytest.mark.parametrize("dtype", JMP_DTYPES)
def test_jmp_policy_with_output_dtype(dtype):
  policy = mp.Policy(jnp.float32, jnp.float32, jnp.float32).with_dtypes(output_dtype=dtype)
  assert policy.output_dtype == dtype and policy.compute_dtype == jnp.float32


def test_none_is_not_float64():
  """Issue 19: `jnp.dtype(None)` is float64; an omitted param dtype is float32."""
  policy = mp.Policy(None, "float32", "float32")
  assert policy == mp.Policy() and policy.param_dtype == jnp.float32
  assert mp.Policy(None, None, None) == mp.Policy("float32", "float32", "float32")
  assert mp.Policy(None, "bf16", None).output_dtype == jnp.bfloat16


@pytest.mark.parametrize("bad", [1.0, 3, True, 2j])
def test_python_numbers_are_not_dtypes(bad):
  with pytest.raises(mp.PolicyError, match="param_dtype must be a dtype"):
    mp.Policy(bad)
