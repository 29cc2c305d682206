"""The kernel registry: ConvSpec, registration, lookup and its errors."""

from __future__ import annotations

import importlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tunedjax import _native
from tunedjax._errors import TunedJaxError
from tunedjax.ops.conv._spec import ConvSpec
from tunedjax.autotune import _registry as reg


def _conv_kwargs(**extra):
  kwargs = dict(window_strides=(2, 1), padding=((1, 0), (2, 1)),
                lhs_dilation=(1, 2), rhs_dilation=(2, 1),
                dimension_numbers=("NHWC", "HWIO", "NCHW"),
                precision=lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
  kwargs.update(extra)
  return kwargs


def _arrays(rng, dtype=np.float32):
  return (rng.normal(size=(2, 7, 6, 4)).astype(dtype),
          rng.normal(size=(3, 2, 4, 5)).astype(dtype))


def test_convspec_from_arrays_matches_the_equation(rng):
  lhs, rhs = _arrays(rng)
  kwargs = _conv_kwargs()
  closed = jax.make_jaxpr(
      lambda l, r: lax.conv_general_dilated(l, r, **kwargs))(lhs, rhs)
  (eqn,) = [e for e in closed.jaxpr.eqns
            if e.primitive.name == "conv_general_dilated"]
  spec = ConvSpec.from_arrays(lhs, rhs, **kwargs)
  assert spec == ConvSpec.from_equation(eqn)
  assert spec.out_shape == eqn.outvars[0].aval.shape
  assert spec.out_dtype == "float32"
  assert spec.dimension_numbers == ((0, 3, 1, 2), (3, 2, 0, 1), (0, 1, 2, 3))
  assert spec.precision == "(Precision.HIGHEST, Precision.HIGHEST)"
  # params() rebinds to the same result as the original call.
  got = lax.conv_general_dilated_p.bind(
      jnp.asarray(lhs), jnp.asarray(rhs), **spec.params())
  want = lax.conv_general_dilated(lhs, rhs, **kwargs)
  np.testing.assert_array_equal(got, want)
  assert spec.params()["precision"] == eqn.params["precision"]


def test_convspec_json_round_trip_and_hash(rng):
  lhs, rhs = _arrays(rng)
  spec = ConvSpec.from_arrays(lhs, rhs, **_conv_kwargs())
  back = ConvSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
  assert back == spec and hash(back) == hash(spec)
  assert {spec: 1}[back] == 1
  other = ConvSpec.from_arrays(lhs, rhs, **_conv_kwargs(precision=None))
  assert other != spec and other.precision is None
  bf16 = ConvSpec.from_arrays(
      *(a.astype(jnp.bfloat16) for a in (lhs, rhs)),
      **_conv_kwargs(preferred_element_type=None))
  assert bf16.lhs_dtype == "bfloat16" and bf16.out_dtype == "bfloat16"
  assert ConvSpec.from_dict(bf16.to_dict()) == bf16


def test_convspec_from_dict_rejects_bad_dicts(rng):
  d = ConvSpec.from_arrays(*_arrays(rng), **_conv_kwargs()).to_dict()
  with pytest.raises(TunedJaxError, match="exactly the keys"):
    ConvSpec.from_dict({**d, "evil": 1})
  missing = dict(d)
  del missing["padding"]
  with pytest.raises(TunedJaxError, match="padding"):
    ConvSpec.from_dict(missing)
  with pytest.raises(TunedJaxError, match="Invalid ConvSpec"):
    ConvSpec.from_dict({**d, "lhs_dtype": "no_such_dtype"})
  with pytest.raises(TunedJaxError, match="precision"):
    ConvSpec.from_dict({**d, "precision": "__import__('os')"})
  for key, bad in [("lhs_shape", [2, "7", 6, 4]), ("lhs_shape", [2, True, 6, 4]),
                   ("padding", [1, 2]), ("feature_group_count", 0),
                   ("batch_group_count", 1.0), ("out_dtype", None),
                   ("dimension_numbers", [[0, 1, 2, 3], [0, 1, 2, 3]])]:
    with pytest.raises(TunedJaxError, match=key if key != "dimension_numbers"
                       else "dimension_numbers"):
      ConvSpec.from_dict({**d, key: bad})


def test_convspec_from_equation_rejects_other_primitives():
  closed = jax.make_jaxpr(jnp.sin)(1.0)
  with pytest.raises(TunedJaxError, match="'sin'"):
    ConvSpec.from_equation(closed.jaxpr.eqns[0])


def test_builtin_kernels_in_order():
  names = [k.name for k in reg.kernels("conv")]
  assert names[:8] == ["xla", "matmul_1x1", "im2col", "window_matmul", "fft", "depthwise",
                       "depthwise_native", "pallas"]
  for k in reg.kernels("conv"):
    assert k.op == "conv" and len(k.source_hash) == 16
    int(k.source_hash, 16)
  # Kernels of different modules hash differently.
  assert len({k.source_hash for k in reg.kernels("conv")}) >= 5


def test_register_get_and_duplicate_errors():
  fn = reg.get_kernel("conv", "xla").fn
  k = reg.register_kernel("conv", "test_dup", fn,
                          applicable=lambda spec, platform: True)
  try:
    assert reg.get_kernel("conv", "test_dup") is k
    assert reg.kernels("conv")[-1] is k
    with pytest.raises(TunedJaxError, match="'test_dup'.*'conv'"):
      reg.register_kernel("conv", "test_dup", fn,
                          applicable=lambda spec, platform: True)
    k2 = reg.register_kernel("conv", "test_dup", fn,
                             applicable=lambda spec, platform: False,
                             replace=True)
    assert reg.get_kernel("conv", "test_dup") is k2
  finally:
    reg.unregister_kernel("conv", "test_dup")
  assert "test_dup" not in [k.name for k in reg.kernels("conv")]


def test_unknown_op_and_name_errors():
  with pytest.raises(TunedJaxError, match="'cnov'.*did you mean 'conv'"):
    reg.kernels("cnov")
  with pytest.raises(TunedJaxError, match="did you mean 'im2col'") as e:
    reg.get_kernel("conv", "im2colx")
  assert "'depthwise'" in str(e.value) and "'xla'" in str(e.value)
  with pytest.raises(TunedJaxError, match="callable"):
    reg.register_kernel("conv", "bad", None, applicable=lambda s, p: True)


def test_applicable_kernels_platforms(rng):
  spec = ConvSpec.from_arrays(
      np.ones((1, 8, 8, 4), np.float32), np.ones((3, 3, 4, 4), np.float32),
      dimension_numbers=("NHWC", "HWIO", "NHWC"))
  cpu = [k.name for k in reg.applicable_kernels(spec, "cpu")]
  gpu = [k.name for k in reg.applicable_kernels(spec, "cuda")]
  native = ["direct_native"] if _native.available("direct_conv") else []  # CPU only
  assert cpu == ["xla", "im2col", *native]
  assert gpu == ["xla", "im2col", "pallas"]
  with pytest.raises(TunedJaxError, match="'gpx'.*did you mean 'gpu'"):
    reg.applicable_kernels(spec, "gpx")


def test_source_hash_follows_the_source(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(tmp_path))
  path = tmp_path / "tj_kernel_mod.py"
  path.write_text("def kern(l, r, s):\n  return l\n")
  mod = importlib.import_module("tj_kernel_mod")
  try:
    before = reg.source_hash(mod.kern)
    assert before == reg.source_hash(mod.kern)
    path.write_text("def kern(l, r, s):\n  return l * 1  # changed\n")
    mod = importlib.reload(mod)
    assert reg.source_hash(mod.kern) != before
  finally:
    sys.modules.pop("tj_kernel_mod", None)



def test_op_family_packages_are_found_through_entry_points(monkeypatch):
  """A family package named by a `tunedjax.op_families` entry point is imported on the
  first lookup, once; one that fails to import is left out with a warning naming it."""
  import importlib.metadata
  import warnings

  from tunedjax.autotune import _registry

  loaded = []

  def register_on_import():
    loaded.append("tj_plugin")
    _registry.register_op_family(_registry.OpFamily(
        name="tj_plugin", spec_type=tuple, key=lambda spec, bucket: {"n": len(spec)},
        operands=lambda spec, rng: ()), replace=True)

  class Entry:  # what importlib.metadata gives: a name, a value and load()
    def __init__(self, name, value, load):
      self.name, self.value, self.load = name, value, load

  broken = importlib.metadata.EntryPoint("broken", "tj_no_such_module_xyz", "g")
  entries = [Entry("broken", broken.value, broken.load),
             Entry("tj_plugin", "tj_plugin_package", register_on_import)]
  monkeypatch.setattr(_registry.importlib.metadata, "entry_points",
                      lambda group: entries if group == _registry.ENTRY_POINT_GROUP else [])
  monkeypatch.setattr(_registry, "_PLUGINS", {"loading": False, "done": False})
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      names = [f.name for f in _registry.op_families()]
    assert "tj_plugin" in names and loaded == ["tj_plugin"]
    assert any("'tj_no_such_module_xyz'" in str(w.message) and "left out" in str(w.message)
               for w in caught)
    _registry.op_families()
    assert loaded == ["tj_plugin"]  # once per process
  finally:
    if "tj_plugin" in [f.name for f in _registry.op_families()]:
      _registry.unregister_op_family("tj_plugin")


def test_the_running_package_declares_the_families_its_build_installs():
  """`entry_points.txt` in the package is what pyproject.toml builds the metadata from."""
  import pathlib
  import tomllib

  root = pathlib.Path(__file__).resolve().parents[2]
  project = tomllib.loads((root / "pyproject.toml").read_text())
  assert "entry-points" in project["project"]["dynamic"]
  source = project["tool"]["setuptools"]["dynamic"]["entry-points"]["file"]
  assert (root / source).resolve() == (root / "src/tunedjax/entry_points.txt").resolve()
  assert "entry_points.txt" in project["tool"]["setuptools"]["package-data"]["tunedjax"]
  own = {e.name: e.value for e in reg.own_entry_points()}
  assert own == {"conv": "tunedjax.ops.conv", "batch_norm": "tunedjax.ops.batch_norm",
                 "layer_norm": "tunedjax.ops.layer_norm", "attention": "tunedjax.ops.attention"}


_SOURCE_TREE_SCRIPT = """
import json, sys, warnings
sys.path[:0] = {path!r}
import importlib.metadata as md
import tunedjax
from tunedjax import autotune
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  found = {{op: [k.name for k in autotune.kernels(op)]
           for op in ("conv", "attention", "batch_norm")}}
  families = [f.name for f in autotune.op_families()]
print(json.dumps({{
    "found": found, "families": families, "file": tunedjax.__file__,
    "warnings": [str(w.message) for w in caught],
    "installed": sorted(d.version for d in md.distributions()
                        if d.metadata["Name"] == "tunedjax")}}))
"""

_PLUGIN = """
from tunedjax import autotune
autotune.register_op_family(autotune.OpFamily(
    name="tj_toy", spec_type=tuple, key=lambda spec, bucket: {}, operands=lambda s, r: ()))
# A plug-in may add a kernel to a family tunedjax ships: those load first.
autotune.register_kernel("conv", "tj_toy_conv", lambda l, r, s: l,
                         applicable=lambda spec, platform: False)
"""


def _dist_info(folder, name, version, entry_points):
  info = folder / f"{name}-{version}.dist-info"
  info.mkdir(parents=True)
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
  (info / "entry_points.txt").write_text(entry_points)


def test_a_source_tree_without_metadata_loads_its_families_and_plugins_still_load(tmp_path):
  """tunedjax imported from a copy of src/ with no tunedjax metadata (as a checkout
  on PYTHONPATH on a cluster): the shipped families load from the package's own
  declaration; a plug-in's entry point still loads (after them), and a stale
  installed tunedjax's metadata adds nothing."""
  import os
  import pathlib
  import shutil
  import subprocess

  src = pathlib.Path(__file__).resolve().parents[2] / "src" / "tunedjax"
  tree = tmp_path / "checkout"
  shutil.copytree(src, tree / "tunedjax", ignore=shutil.ignore_patterns("__pycache__"))
  # The interpreter's site-packages without any tunedjax metadata (the editable
  # install this suite runs from has some): a folder of links to everything else.
  site = pathlib.Path(jax.__file__).resolve().parents[1]
  deps = tmp_path / "site"
  deps.mkdir()
  for entry in site.iterdir():
    if "tunedjax" not in entry.name.lower():
      os.symlink(entry, deps / entry.name)
  plugins = tmp_path / "plugins"
  plugins.mkdir()
  (plugins / "tj_toy_plugin.py").write_text(_PLUGIN)
  _dist_info(plugins, "tj_toy_plugin", "1.0",
             "[tunedjax.op_families]\ntj_toy = tj_toy_plugin\n")
  # Another tunedjax's metadata (an old install): its entry points are not this copy's.
  _dist_info(plugins, "tunedjax", "0.0.1",
             "[tunedjax.op_families]\nconv = tunedjax.ops.conv\ngone = tunedjax.ops.gone\n")
  script = _SOURCE_TREE_SCRIPT.format(path=[str(tree), str(plugins), str(deps)])
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
  env["JAX_PLATFORMS"] = "cpu"
  done = subprocess.run([sys.executable, "-I", "-S", "-c", script], capture_output=True,
                        text=True, env=env, timeout=240, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert pathlib.Path(out["file"]).resolve().is_relative_to(tree.resolve())
  assert out["installed"] == ["0.0.1"]  # only the stale one: this copy has no metadata
  assert out["found"]["conv"][0] == "xla" and "tj_toy_conv" in out["found"]["conv"]
  assert "cudnn" in out["found"]["attention"] and "fused" in out["found"]["batch_norm"]
  assert out["families"] == ["attention", "batch_norm", "conv", "layer_norm", "tj_toy"]
  assert not [w for w in out["warnings"] if "op family" in w], out["warnings"]
