"""Every notebook in `notebooks/` runs top to bottom (small sizes), and keeps its outputs."""

from __future__ import annotations

import pathlib
import shutil
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
import execute  # noqa: E402  # pylint: disable=wrong-import-position

EXPECTED = ["01_quickstart.ipynb", "02_mixed_precision.ipynb", "03_kernels_and_cache.ipynb",
            "04_input_pipeline.ipynb", "05_layout.ipynb", "06_attention.ipynb"]


def test_every_notebook_is_there():
  assert [p.name for p in execute.notebooks()] == EXPECTED


def _code_cells(path: pathlib.Path) -> list:
  return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def _output_kinds(cell) -> set[str]:
  """What a cell shows: "stream:stdout", "image/png", ... (not the text itself)."""
  kinds = set()
  for o in cell.get("outputs", []):
    if o.get("output_type") == "stream":
      kinds.add(f"stream:{o.get('name')}")
    elif o.get("output_type") == "error":
      kinds.add("error")
    else:
      kinds.update(o.get("data", {}))
  return kinds


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs_top_to_bottom(name, monkeypatch, tmp_path):
  """Every code cell runs, in order, without an error, and shows what the saved
  notebook shows (its printed output and its charts; small sizes, so other numbers)."""
  monkeypatch.setenv("TUNEDJAX_NOTEBOOK_QUICK", "1")
  copy = tmp_path / name
  shutil.copyfile(NOTEBOOKS / name, copy)
  execute.execute(copy, write=True)  # runs in notebooks/ as always; writes the copy only
  saved, ran = _code_cells(NOTEBOOKS / name), _code_cells(copy)
  assert [c.source for c in ran] == [c.source for c in saved]
  counts = [c.get("execution_count") for c in ran]
  assert all(counts) and counts == sorted(set(counts)), counts
  for i, (now, before) in enumerate(zip(ran, saved)):
    assert "error" not in _output_kinds(now), (name, i, now.outputs)
    missing = _output_kinds(before) - _output_kinds(now)
    assert not missing, f"{name}: code cell {i} no longer shows {sorted(missing)}: {now.source[:80]!r}"
  charts = sum("image/png" in _output_kinds(c) for c in ran)
  assert charts == sum("image/png" in _output_kinds(c) for c in saved) > 0


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_is_saved_with_its_outputs_and_charts(name):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(c.get("execution_count") for c in code), "run notebooks/execute.py"
  errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors
  images = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
  assert images, f"{name} should show at least one chart"
