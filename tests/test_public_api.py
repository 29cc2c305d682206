"""Every public name is importable from where DESIGN.md says, and nothing
private leaks into a public namespace."""

from __future__ import annotations

import importlib
import types

import pytest

import tunedjax as tj

PUBLIC = {
    "tunedjax": {"AutotuneError", "CacheWarning", "Config", "LayoutError", "ConfigError", "FirstCall", "JitReport", "Jitted", "RewriteError", "ShapeError",
                 "TunedJaxError", "__version__", "attention", "autotune", "config_context", "get_config",
                 "input_pipeline", "jit", "layout", "mixed_precision", "rewrite", "set_config",
                 "History", "Trainer", "trainer", "AttentionSwap", "use_tuned_attention",
                 "HostMemoryStatus", "HostMemoryWarning", "host_memory_status",
                 "release_host_memory", "callbacks", "ops"},
    "tunedjax.callbacks": {"BestCheckpoint", "CSVLogger", "Callback", "EarlyStopping",
                           "JSONLinesLogger", "TensorBoard"},
    "tunedjax.rewrite": {"Boundary", "Context", "Match", "Pass", "Pattern", "Rule", "count_primitives", "eval_jaxpr",
                         "iter_equations", "rewrite_jaxpr", "trace", "transform"},
    "tunedjax.autotune": {"BucketChoice", "BucketDecision", "BucketTemporaries", "Cache", "CacheEntry", "DeviceFingerprint",
                          "HintWarning", "Kernel", "KernelChoice", "KernelReport", "MatchedSite", "OpFamily", "PatternSite",
                          "Stats", "TuningSession", "default_session", "device_fingerprint",
                          "dispatch", "explain", "hint", "kernels", "op_families", "op_family",
                          "register_kernel", "register_op_family", "select_kernels", "stats",
                          "step", "unregister_kernel", "unregister_op_family"},
    "tunedjax.mixed_precision": {
        "DEFAULT_ALLOW", "DEFAULT_DENY", "DEFAULT_FOLLOW", "DynamicLossScale",
        "LinenMixedPrecision", "MasterWeightsState", "MixedPrecision", "NoOpLossScale", "OpLists",
        "Policy", "PolicyError", "SkipNonFiniteState", "StaticLossScale", "all_finite",
        "allreduce_gradients", "autocast", "autocast_pass", "data_parallel_value_and_grad",
        "get_policy", "loss_scale_for", "master_weights", "precision_region",
        "scaled_value_and_grad", "select_tree", "skip_nonfinite", "wrap", "as_traced",
        "trace_compute_dtype"},
    "tunedjax.ops": {"attention", "batch_norm", "conv", "layer_norm"},
    "tunedjax.ops.conv": {"ConvSpec"},
    "tunedjax.ops.batch_norm": {"BatchNormSpec", "batch_norm", "batch_norm_stats",
                                "route_batch_norm"},
    "tunedjax.ops.layer_norm": {"LayerNormSpec", "layer_norm", "route_layer_norm"},
    "tunedjax.ops.attention": {"AttentionSpec", "AttentionSwap", "attention",
                               "use_tuned_attention"},
    "tunedjax.layout": {"LayoutReport", "Optimized", "explain", "optimize", "preferred"},
    "tunedjax.input_pipeline": {"Loader", "LoaderSettings", "LoaderState", "StateError",
                                "TransformError", "Trial", "TuningResult", "tune_worker_count"},
    "tunedjax.demo": {"CLASSES", "DEFAULT", "DemoDataError", "DemoNet", "DemoOptions",
                      "EncodedImages", "QUICK", "RunResult", "TransformerLM", "folder_dataset",
                      "lm_data", "lm_loss", "run_demo",
                      "shapes_dataset"},
    "tunedjax.trainer": {"Callback", "Checkpointer", "History", "Progress", "TrainState",
                         "Trainer", "TrainerError"},
}


@pytest.mark.parametrize("module_name", PUBLIC)
def test_all_lists_exactly_the_public_names(module_name):
  module = importlib.import_module(module_name)
  assert set(module.__all__) == PUBLIC[module_name]
  for name in module.__all__:
    assert getattr(module, name) is not None
  # Submodules (tunedjax.cli once imported) are attributes of their package, not leaks.
  exported = {n for n, v in vars(module).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
  assert exported <= set(module.__all__) | {"annotations"}, exported - set(module.__all__)


def test_errors_form_one_hierarchy():
  assert issubclass(tj.ConfigError, tj.TunedJaxError)
  assert issubclass(tj.ConfigError, ValueError)
  assert issubclass(tj.RewriteError, tj.TunedJaxError)
  assert issubclass(tj.trainer.TrainerError, tj.TunedJaxError)
  assert issubclass(tj.AutotuneError, tj.TunedJaxError)
  assert issubclass(tj.LayoutError, tj.ConfigError)


def test_each_option_has_one_list_of_valid_choices():
  """A choice list lives in `_config` and the modules that check it use that very object."""
  from tunedjax import _config
  from tunedjax.layout import _optimize
  with pytest.raises(tj.ConfigError) as config_error:
    tj.set_config({"layout": {"mode": "guess"}})
  with pytest.raises(tj.LayoutError) as layout_error:
    tj.layout.optimize(lambda x: x, mode="guess")
  for error in (config_error, layout_error):
    assert all(repr(m) in str(error.value) for m in _config.LAYOUT_MODES)
  assert _optimize.MODES is _config.LAYOUT_MODES
  from tunedjax.mixed_precision import _loss_scale
  assert not hasattr(_loss_scale, "LOSS_SCALE_CHOICES")


def test_version_matches_package_metadata():
  from importlib.metadata import version
  assert tj.__version__ == version("tunedjax")


def test_jax_internals_are_reached_from_compat_only():
  """DESIGN.md: `jax._src` is imported in `rewrite/_compat.py` and nowhere else."""
  import pathlib
  import re
  package = pathlib.Path(tj.__file__).parent
  offenders = [str(p.relative_to(package)) for p in package.rglob("*.py")
               if re.search(r"^\s*(from|import)\s+jax\._src", p.read_text(), re.MULTILINE)]
  assert offenders == [str(pathlib.Path("rewrite", "_compat.py"))]


def test_the_lazy_table_and_the_type_checking_imports_list_every_public_name():
  import ast
  import inspect
  source = inspect.getsource(tj)
  checked = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      checked |= {alias.asname or alias.name for stmt in node.body
                  for alias in getattr(stmt, "names", ())}
  assert set(tj._LAZY) == set(tj.__all__) == checked
