"""The layout ARCHITECTURE.md draws, held: no import circles, layers point down,
the tuning core names no op family, and no procedure is longer than a screen or two.

Imports are read from the source (every `import`, at any depth, in functions
too), so a circle hidden behind a function-level import still counts. Importing
``a.b.c`` runs ``a/b/__init__.py`` too, so the packages above an imported module
count as imported as well (except those the importer is inside of).
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = "tunedjax"

# ARCHITECTURE.md's layers, lowest first: a module may import its own layer
# (without a circle) and the layers below it, never above.
LAYERS = (
    ("_config", "_errors", "_host_memory", "_policy", "_version"),
    ("rewrite",),
    ("_tuning", "_native"),
    ("autotune", "mixed_precision", "layout", "input_pipeline"),
    ("ops",),
    ("_jit", "_pipeline"),
    ("trainer", "callbacks", "demo", "cli", "__main__"),
)
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
  found = {}
  for path in (SRC / PACKAGE).rglob("*.py"):
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
      parts = parts[:-1]
    found[".".join(parts)] = (path, is_package)
  return found


MODULES = _modules()


def _imported(module: str, is_package: bool, node: ast.AST) -> list[str]:
  """The tunedjax modules (or packages) an import statement names."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  assert isinstance(node, ast.ImportFrom)
  base = module.split(".") if is_package else module.split(".")[:-1]
  if node.level:
    base = base[:len(base) - (node.level - 1)]
    prefix = ".".join(base + ([node.module] if node.module else []))
  else:
    prefix = node.module or ""
  return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix
          for a in node.names]


def import_graph() -> dict[str, set[str]]:
  """``{module: the tunedjax modules it imports}``, implicit parent packages included."""
  graph: dict[str, set[str]] = {m: set() for m in MODULES}
  for module, (path, is_package) in MODULES.items():
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if not isinstance(node, (ast.Import, ast.ImportFrom)):
        continue
      for name in _imported(module, is_package, node):
        parts = name.split(".")
        for i in range(2, len(parts) + 1):  # the module and the packages above it
          target = ".".join(parts[:i])
          if target in MODULES and not (module + ".").startswith(target + "."):
            graph[module].add(target)
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import circle as ``[a, b, ..., a]``, or None (depth-first search)."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def layer_of(module: str) -> int | None:
  top = module.split(".")[1] if "." in module else None
  for level, names in enumerate(LAYERS):
    if top in names:
      return level
  return None


def test_find_cycle_finds_a_circle_and_only_a_circle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_there_is_no_import_circle_among_tunedjax_modules():
  cycle = find_cycle(import_graph())
  assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_module_has_a_layer():
  missing = sorted(m for m in MODULES if m != PACKAGE and layer_of(m) is None)
  assert not missing, f"add these to LAYERS (and ARCHITECTURE.md): {missing}"


def test_layers_only_point_down():
  wrong = []
  for module, targets in import_graph().items():
    if module == PACKAGE:
      continue  # the namespace loads its public names lazily, from every layer
    for target in targets:
      same_package = module.split(".")[:2] == target.split(".")[:2]
      if target != PACKAGE and not same_package and layer_of(target) > layer_of(module):
        wrong.append(f"{module} (layer {layer_of(module)}) imports {target} "
                     f"(layer {layer_of(target)})")
  assert not wrong, "\n".join(sorted(wrong))


def test_the_tuning_core_imports_no_op_family():
  core = [m for m in MODULES if m.startswith(f"{PACKAGE}.autotune")]
  graph = import_graph()
  named = sorted(f"{m} -> {t}" for m in core for t in graph[m]
                 if t.startswith(f"{PACKAGE}.ops"))
  assert not named, named


def _code_strings(tree: ast.AST) -> list[ast.Constant]:
  """String constants that are not docstrings."""
  docstrings = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        docstrings.add(id(body[0].value))
  return [n for n in ast.walk(tree) if isinstance(n, ast.Constant)
          and isinstance(n.value, str) and id(n) not in docstrings]


@pytest.mark.parametrize("family", ["conv", "batch_norm", "layer_norm", "attention"])
def test_the_tuning_core_names_no_op_family_in_its_code(family):
  """Outside docstrings and error-message examples, the core never says a family's name."""
  for module, (path, _) in MODULES.items():
    if not module.startswith(f"{PACKAGE}.autotune"):
      continue
    for const in _code_strings(ast.parse(path.read_text())):
      assert const.value != family, f"{path}:{const.lineno} names the {family!r} family"


def test_each_op_family_is_one_package_that_imports_no_other_family():
  graph = import_graph()
  families = {m.split(".")[2] for m in MODULES if m.startswith(f"{PACKAGE}.ops.")}
  assert families == {"conv", "batch_norm", "layer_norm", "attention"}
  for module, targets in graph.items():
    if module.startswith(f"{PACKAGE}.ops."):
      own = module.split(".")[2]
      others = [t for t in targets if t.startswith(f"{PACKAGE}.ops.")
                and t.split(".")[2] != own]
      assert not others, f"{module} imports another family: {others}"


def test_no_function_is_longer_than_the_limit():
  long = []
  for path, _ in MODULES.values():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
          long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
  assert not long, "split these into named steps:\n" + "\n".join(long)


# -- sizes: lines, code lines and instance fields per unit -------------------------


@functools.lru_cache(maxsize=None)
def _parsed(path: pathlib.Path) -> tuple[str, ast.Module]:
  source = path.read_text()
  return source, ast.parse(source)


def _docstring_lines(tree: ast.AST) -> set[int]:
  """The line numbers docstrings cover."""
  lines: set[int] = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
          and isinstance(body[0].value.value, str)):
        lines.update(range(body[0].lineno, body[0].end_lineno + 1))
  return lines


def code_lines(source: str, tree: ast.AST, first: int = 1, last: int | None = None) -> int:
  """Lines in ``first..last`` that are not blank, comments or docstrings."""
  text = source.splitlines()
  last = len(text) if last is None else last
  docs = _docstring_lines(tree)
  return sum(1 for n in range(first, last + 1)
             if n not in docs and text[n - 1].strip() and not text[n - 1].strip().startswith("#"))


def instance_fields(node: ast.ClassDef) -> set[str]:
  """A class's instance fields: ``self.x`` assigned in its methods, annotated
  class-level names (dataclass and NamedTuple fields) and ``__slots__``."""
  fields: set[str] = set()
  for item in node.body:
    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
      if "ClassVar" not in ast.unparse(item.annotation):
        fields.add(item.target.id)
    if (isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                             for t in item.targets)):
      for const in ast.walk(item.value):
        if isinstance(const, ast.Constant) and isinstance(const.value, str):
          fields.add(const.value)
  for method in node.body:
    if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    if not method.args.args or method.args.args[0].arg != "self":
      continue
    for sub in ast.walk(method):
      targets: list[ast.AST] = []
      if isinstance(sub, ast.Assign):
        targets = list(sub.targets)
      elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
        targets = [sub.target]
      for target in targets:
        for t in ast.walk(target):
          if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
              and t.value.id == "self" and isinstance(t.ctx, ast.Store)):
            fields.add(t.attr)
  return fields


def class_sizes() -> dict[str, tuple[int, int, int]]:
  """``{"module.Class": (lines, code lines, instance fields)}`` for every class."""
  out = {}
  for module, (path, _) in MODULES.items():
    source, tree = _parsed(path)
    for node in ast.walk(tree):
      if isinstance(node, ast.ClassDef):
        lines = node.end_lineno - node.lineno + 1
        code = code_lines(source, tree, node.lineno, node.end_lineno)
        out[f"{module}.{node.name}"] = (lines, code, len(instance_fields(node)))
  return out


def module_sizes() -> dict[str, tuple[int, int]]:
  """``{module: (lines, code lines)}`` for every module."""
  out = {}
  for module, (path, _) in MODULES.items():
    source, tree = _parsed(path)
    out[module] = (len(source.splitlines()), code_lines(source, tree))
  return out


# -- limits on classes, modules and fields, and private attributes ----------------

MAX_CLASS_LINES = 250
MAX_MODULE_LINES = 600
MAX_INSTANCE_FIELDS = 12  # a class's mutable state; frozen records are values
# Units over a limit today. These lists may only shrink: a unit back within
# its limit fails the test below until it is taken off.
LONG_CLASSES = {
    "tunedjax._tuning._cache.Cache",
    "tunedjax._tuning._session.TuningSession",
    "tunedjax.input_pipeline._loader.Loader",
    "tunedjax.layout._rules._Rules",
    "tunedjax.rewrite._engine.Context",
    "tunedjax.trainer._checkpoint.Checkpointer",
    "tunedjax.trainer._history.History",
    "tunedjax.trainer._trainer.Trainer",
}
LONG_MODULES = {
    "tunedjax._config",
    "tunedjax._tuning._cache",
    "tunedjax.autotune._select",
    "tunedjax.autotune._tuner",
    "tunedjax.input_pipeline._search",
    "tunedjax.ops.attention._kernels",
    "tunedjax.rewrite._engine",
    "tunedjax.trainer._trainer",
}
MANY_FIELDS = {
    "tunedjax.autotune._select.Selection",
    "tunedjax.autotune._tuner._Bucket",
    "tunedjax.autotune._verify.Verifier",
    "tunedjax.demo._run.RunResult",
    "tunedjax.input_pipeline._loader.Loader",
    "tunedjax.input_pipeline._search.Run",
    "tunedjax.trainer._trainer.Trainer",
    "tunedjax.trainer._trainer._Loop",
}
# ``module: obj._attr`` reads or writes of another unit's private attribute.
PRIVATE_ACCESS = {
    "tunedjax.callbacks._best_checkpoint: trainer._save_to",
    "tunedjax.callbacks._early_stopping: trainer._set_weights",
    "tunedjax.callbacks._early_stopping: trainer._weights_copy",
    "tunedjax.demo._run: trainer._programs",
}
# NamedTuple's own API, underscored so as not to clash with field names.
_NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _is_record(node: ast.ClassDef) -> bool:
  """A frozen dataclass or a NamedTuple: an immutable value, not state."""
  for base in node.bases:
    if ast.unparse(base).split(".")[-1] == "NamedTuple":
      return True
  for deco in node.decorator_list:
    if (isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("dataclass")
        and any(k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value
                for k in deco.keywords)):
      return True
  return False


def _over(sizes: dict[str, int], limit: int) -> set[str]:
  return {name for name, size in sizes.items() if size > limit}


def _check_limit(what: str, over: set[str], allowed: set[str], sizes: dict[str, int],
                 limit: int) -> None:
  new = sorted(f"{n} ({sizes[n]})" for n in over - allowed)
  assert not new, f"{what} over {limit}: split these into parts with one job each:\n" + \
      "\n".join(new)
  back = sorted(f"{n} ({sizes.get(n, 'gone')})" for n in allowed - over)
  assert not back, f"{what} within {limit} now: take these off the allow-list:\n" + \
      "\n".join(back)


def test_no_class_is_longer_than_the_limit():
  sizes = {name: lines for name, (lines, _, _) in class_sizes().items()}
  _check_limit("classes", _over(sizes, MAX_CLASS_LINES), LONG_CLASSES, sizes, MAX_CLASS_LINES)


def test_no_module_is_longer_than_the_limit():
  sizes = {name: lines for name, (lines, _) in module_sizes().items()}
  _check_limit("modules", _over(sizes, MAX_MODULE_LINES), LONG_MODULES, sizes,
               MAX_MODULE_LINES)


def test_no_instance_has_more_fields_than_the_limit():
  sizes = {}
  for module, (path, _) in MODULES.items():
    for node in ast.walk(_parsed(path)[1]):
      if isinstance(node, ast.ClassDef) and not _is_record(node):
        sizes[f"{module}.{node.name}"] = len(instance_fields(node))
  _check_limit("instance fields", _over(sizes, MAX_INSTANCE_FIELDS), MANY_FIELDS, sizes,
               MAX_INSTANCE_FIELDS)


def _defined_names(tree: ast.AST) -> set[str]:
  """Every name a module defines: module-level names, classes, functions and
  methods, class attributes, and attributes set on ``self``, ``cls`` or any
  object it builds."""
  names: set[str] = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
      names.add(node.id)
    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
      names.add(node.attr)
    elif isinstance(node, ast.alias):
      names.add((node.asname or node.name).split(".")[0])
  return names


def private_accesses() -> dict[str, set[str]]:
  """``{module: {"obj._attr", ...}}``: private attributes of other tunedjax units
  a module reads or writes (``obj`` not ``self``/``cls``, the attribute defined
  by another tunedjax module and not by this one)."""
  trees = {m: _parsed(path)[1] for m, (path, _) in MODULES.items()}
  defined = {m: _defined_names(t) for m, t in trees.items()}
  everywhere = set().union(*defined.values())
  found: dict[str, set[str]] = {}
  for module, tree in trees.items():
    for node in ast.walk(tree):
      if not isinstance(node, ast.Attribute):
        continue
      attr = node.attr
      if (not attr.startswith("_") or attr.startswith("__") or attr in _NAMEDTUPLE_API
          or attr in defined[module] or attr not in everywhere):
        continue
      if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
        continue
      found.setdefault(module, set()).add(f"{ast.unparse(node.value)}.{attr}")
  return found


def test_no_unit_reads_or_writes_another_units_private_attributes():
  found = {f"{m}: {a}" for m, accesses in private_accesses().items() for a in accesses}
  new = sorted(found - PRIVATE_ACCESS)
  assert not new, ("another unit's private attribute (give it a public method or "
                   "property, or pass what it needs):\n" + "\n".join(new))
  back = sorted(PRIVATE_ACCESS - found)
  assert not back, "no longer there: take these off PRIVATE_ACCESS:\n" + "\n".join(back)


def test_the_limits_find_what_they_bound():
  src = ("class A:\n  def __init__(self, o):\n    self.a, self.b = 1, 2\n"
         "    o._hidden = 3\n  x: int = 0\n")
  tree = ast.parse(src)
  assert instance_fields(tree.body[0]) == {"a", "b", "x"}
  module = '"""doc"""\n\n# note\nx = 1\n'
  assert code_lines(module, ast.parse(module)) == 1
  record = ast.parse("@dataclasses.dataclass(frozen=True)\nclass R:\n  a: int\n").body[0]
  assert _is_record(record) and not _is_record(tree.body[0])


def size_table(wanted: list[str]) -> str:
  """The size table (markdown) of the units whose names contain one of
  `wanted`; without any, of those over a limit."""
  rows = ["| unit | lines | code lines | instance fields |", "|---|---:|---:|---:|"]
  for name, (n, code) in sorted(module_sizes().items()):
    if any(w in name for w in wanted) or (not wanted and n > MAX_MODULE_LINES):
      rows.append(f"| `{name}` (module) | {n} | {code} | |")
  for name, (n, code, fields) in sorted(class_sizes().items()):
    if any(w in name for w in wanted) or (not wanted and (n > MAX_CLASS_LINES
                                                          or fields > MAX_INSTANCE_FIELDS)):
      rows.append(f"| `{name}` | {n} | {code} | {fields} |")
  return "\n".join(rows)


def test_jitted_is_a_facade_over_its_parts():
  """`Jitted` holds its parts, not their state (issue 48: at most about 10 fields)."""
  _, _, fields = class_sizes()[f"{PACKAGE}._jit._jitted.Jitted"]
  assert fields <= 10


def test_the_size_table_measures_the_units_asked_for():
  table = size_table(["_jit._jitted"])
  assert "| `tunedjax._jit._jitted.Jitted` |" in table
  assert "| `tunedjax._jit._jitted` (module) |" in table


if __name__ == "__main__":  # PYTHONPATH=src python tests/test_architecture.py [name ...]
  import sys
  print(size_table(sys.argv[1:]))
