"""The README's Python examples run as written, and every benchmark script
still runs (a smoke run with ``--quick``, nothing written)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = sorted((ROOT / "benchmarks").glob("[!_]*.py"))
# Smoke runs that take minutes (worker-process starts, kernel tuning) or 15-50 s
# each (the others) run with `make bench-smoke`, not in `make test`, which must
# stay under 15 minutes with the demo and the notebooks.
LONG_SMOKE = {"attention", "bn_native", "depthwise_native", "direct_native", "gpu", "host_memory", "input_pipeline", "jit_overhead", "kernels", "layout",
              "mixed_precision", "rewrite_overhead", "trainer", "vs_pytorch", "xla_options"}

# Runs each block in a namespace of its own and names the block that failed.
_DRIVER = """
import sys, traceback
blocks = {blocks!r}
for i, code in enumerate(blocks):
  try:
    exec(compile(code, f"README.md python block {{i + 1}}", "exec"), {{"__name__": "__main__"}})
  except BaseException:
    traceback.print_exc()
    sys.exit(f"README python block {{i + 1}} of {{len(blocks)}} failed:\\n{{code}}")
"""


def python_blocks(markdown: str) -> list[str]:
  """The bodies of the ```python fenced blocks of a Markdown text."""
  return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)


def _env(tmp_path: pathlib.Path) -> dict[str, str]:
  src = str(ROOT / "src")
  return dict(os.environ, TUNEDJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
              PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))


def test_python_blocks_are_found():
  blocks = python_blocks(README.read_text())
  assert len(blocks) >= 5
  assert any("mp.wrap" in b for b in blocks) and any("select_kernels" in b for b in blocks)


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path):
  blocks = python_blocks(README.read_text())
  result = subprocess.run([sys.executable, "-c", _DRIVER.format(blocks=blocks)],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("script", [
    pytest.param(p, marks=pytest.mark.bench_smoke) if p.stem in LONG_SMOKE else p
    for p in BENCHMARKS], ids=lambda p: p.stem)
def test_benchmark_smoke_run(script, tmp_path):
  result = subprocess.run([sys.executable, str(script), "--quick"], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=600,
                          check=False)
  assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
