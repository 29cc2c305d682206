"""docs/callbacks.md's Python examples run as written, in order, in one namespace."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests import processes
from tests.test_docs import python_blocks

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "callbacks.md"


def test_the_page_has_its_examples():
  blocks = python_blocks(PAGE.read_text())
  assert len(blocks) == 2 and "EarlyStopping" in blocks[0] and "best_step" in blocks[1]


@pytest.mark.slow
def test_the_page_examples_run(tmp_path):
  code = "\n".join(python_blocks(PAGE.read_text()))
  env = {**processes.cpu_env(), "TUNEDJAX_CACHE_DIR": str(tmp_path / "cache")}
  result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
