"""The input pipeline's modules depend one way, at any level of the code."""

from __future__ import annotations

import ast
import pathlib
import sys

import tunedjax.input_pipeline

PACKAGE = "tunedjax.input_pipeline"
ROOT = pathlib.Path(tunedjax.input_pipeline.__file__).parent


def _imports(path: pathlib.Path) -> list[str]:
  """Every module `path` imports, in function bodies too (absolute names)."""
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      out += ([f"{node.module}.{a.name}" for a in node.names] if node.module == PACKAGE
              else [node.module])
  return out


def _graph() -> dict[str, set[str]]:
  graph = {}
  for path in ROOT.glob("_*.py"):
    if path.stem == "__init__":
      continue
    graph[path.stem] = {name.split(".")[2] for name in _imports(path)
                        if name.startswith(PACKAGE + ".")} - {path.stem}
  return graph


def test_no_module_imports_one_that_imports_it_back():
  graph = _graph()

  def reaches(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
      for dep in graph.get(todo.pop(), ()):
        if dep not in seen:
          seen.add(dep)
          todo.append(dep)
    return seen

  circles = sorted(m for m in graph if m in reaches(m))
  assert not circles, {m: sorted(graph[m]) for m in circles}
  assert "_worker" in graph["_dataset"] and "_dataset" not in reaches("_worker")


def test_the_worker_module_imports_the_standard_library_and_numpy():
  # a worker process unpickles `_worker` by value and must not import tunedjax
  # (only its error path does, lazily: `_errors`)
  allowed = set(sys.stdlib_module_names) | {"numpy", "cloudpickle", "absl"}
  names = _imports(ROOT / "_worker.py")
  assert {n.split(".")[0] for n in names} - allowed <= {"tunedjax"}
  assert [n for n in names if n.startswith("tunedjax")] == [PACKAGE + "._errors"]
  assert _graph()["_errors"] == set()
