"""Every notebook in `notebooks/` runs top to bottom (small sizes), and keeps its outputs."""

from __future__ import annotations

import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
import execute  # noqa: E402  # pylint: disable=wrong-import-position

EXPECTED = ["01_quickstart.ipynb", "02_mixed_precision.ipynb", "03_kernels_and_cache.ipynb",
            "04_input_pipeline.ipynb", "05_layout.ipynb"]


def test_every_notebook_is_there():
  assert [p.name for p in execute.notebooks()] == EXPECTED


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs_top_to_bottom(name, monkeypatch):
  monkeypatch.setenv("TUNEDJAX_NOTEBOOK_QUICK", "1")
  execute.execute(NOTEBOOKS / name, write=False)


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_is_saved_with_its_outputs_and_charts(name):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(c.get("execution_count") for c in code), "run notebooks/execute.py"
  errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors
  images = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
  assert images, f"{name} should show at least one chart"
