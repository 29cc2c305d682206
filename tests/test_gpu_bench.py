"""`benchmarks/gpu.py`, the device command's benchmark, checked without a GPU.

Its ``--smoke`` run (every part at tiny sizes, on the CPU, Pallas in interpret
mode) runs here, so that a moved or renamed name breaks `make test`, not the
GPU run; its worker supervision (time limits), its sections and
``make device-wheels``'s script are checked on their own, quickly.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import _gpu_names as names  # noqa: E402  pylint: disable=wrong-import-position
import _gpu_render as render  # noqa: E402  pylint: disable=wrong-import-position
import _gpu_run as run  # noqa: E402  pylint: disable=wrong-import-position


def _env(tmp_path: pathlib.Path) -> dict[str, str]:
  src = str(ROOT / "src")
  return dict(os.environ, TUNEDJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
              PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))


@pytest.mark.serial  # its workers' time limits
@pytest.mark.slow
def test_the_smoke_run_runs_every_part_and_writes_its_json(tmp_path):
  before = (ROOT / "BENCHMARKS.md").read_text()
  out = tmp_path / "out"
  start = time.monotonic()
  result = subprocess.run([sys.executable, str(BENCH / "gpu.py"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=900, check=False)
  seconds = time.monotonic() - start
  assert result.returncode == 0, (result.stdout[-6000:], result.stderr[-3000:])
  print(f"gpu.py --smoke took {seconds:.0f} s")
  results = json.loads((out / "gpu.json").read_text())
  assert list(results["parts"]) == list(names.PARTS)
  for part in results["parts"].values():
    assert all(w["status"] == "done" for w in part["workers"]), part["workers"]
  skipped = [r for p in results["parts"].values() for w in p["workers"]
             for r in w["records"] if r["kind"] == "skip"]
  for record in skipped:  # no PyTorch here: the reason is printed and recorded
    print(record["reason"])
    assert "PyTorch rows skipped" in record["reason"] and record["reason"] in result.stdout
  anatomies = [r for p in results["parts"].values() for w in p["workers"]
               for r in w["records"] if r["kind"] == "anatomy"]
  # every tunedjax variant: 3 ResNet-50 workers, 2 x 2 attention lengths, 2 x 2 Trainers, layout
  assert len(anatomies) == 3 + 4 + 4 + 1, [a["variant"] for a in anatomies]
  assert all(a.get("stages") for a in anatomies), [a for a in anatomies if not a.get("stages")]
  assert "first-call anatomy" in result.stdout
  sections = (out / "gpu.md").read_text()
  for part in names.PARTS:
    assert f"<!-- gpu_{part}:start -->" in sections
  assert "| jax.jit, float32 |" in sections and "Targets" in sections
  assert (out / "gpu.log").read_text().count("gpu.py: ") >= len(names.PARTS)
  assert (ROOT / "BENCHMARKS.md").read_text() == before  # no --write: BENCHMARKS.md untouched


@pytest.mark.serial  # a time limit's wall time
def test_a_worker_past_its_time_limit_is_stopped_and_what_it_printed_is_kept(tmp_path):
  worker = tmp_path / "worker.py"
  worker.write_text(
      "import time\n"
      "from _gpu_run import emit, say\n"
      "emit('row', variant='a', ms=1.5)\n"
      "say('a line for people')\n"
      "emit('start', what='a first call that never ends')\n"
      "time.sleep(60)\n")
  lines = []
  env = dict(os.environ, PYTHONPATH=str(BENCH))
  start = time.monotonic()
  result = run.supervise("w", [sys.executable, str(worker)], 0.5, env=env, echo=lines.append)
  assert time.monotonic() - start < 0.5 + run.GRACE_S + 5
  assert result.status == "budget" and result.returncode != 0
  assert result.in_progress == "a first call that never ends"
  assert [r["kind"] for r in result.records] == ["row", "start"]
  assert lines == ["a line for people"]


def test_a_worker_that_fails_is_reported_failed(tmp_path):
  worker = tmp_path / "worker.py"
  worker.write_text("raise SystemExit(3)\n")
  result = run.supervise("w", [sys.executable, str(worker)], 30, echo=lambda line: None)
  assert (result.status, result.returncode) == ("failed", 3)


def test_fit_rounds_keeps_to_the_time_left():
  assert run.fit_rounds(1.0, 10.0, 7) == 7
  assert run.fit_rounds(2.0, 10.0, 7) == 4  # one warm-up round and four timed
  assert run.fit_rounds(5.0, 10.0, 7) == 0  # fewer than two: not timed


def test_the_plan_fits_the_nine_minute_device_command():
  total = sum(b for plan in names.PLAN.values() for _, b in plan)
  assert total <= 500, total  # the rest of 540 s: wheel installs and Python's starts


def _results(workers: list[dict]) -> dict:
  return {"command": "python benchmarks/gpu.py", "date": "2026-11-27", "smoke": False,
          "env": {"device": "NVIDIA H100 80GB HBM3", "backend": "gpu", "jax": "0.11.2"},
          "parts": {"resnet50": {"seconds": 100.0, "workers": workers}}}


def _worker(name: str, records: list[dict], status: str = "done", **kw) -> dict:
  return {"name": name, "budget_s": 50.0, "status": status, "records": records, **kw}


def test_sections_judge_the_targets_and_name_what_ran_out_of_time():
  rows = [
      _worker("resnet50.jax", [
          {"kind": "row", "variant": names.JIT_F32, "first_call_s": 18.0},
          {"kind": "row", "variant": names.JIT_BF16, "first_call_s": 20.0,
           "images_per_s": 3000.0}]),
      _worker("resnet50.tj_mp_layout", [
          {"kind": "row", "variant": names.TJ_MP_LAYOUT, "first_call_s": 25.0},
          {"kind": "anatomy", "variant": names.TJ_MP_LAYOUT, "total_s": 25.0,
           "stages": {"trace": 1.0, "xla_compile": 23.0, "first_execution": 1.0}}]),
      _worker("resnet50.tj_all_mp", [{"kind": "start", "what": "first call"}],
              status="budget", in_progress=f"{names.TJ_ALL_MP}: first call"),
      _worker("resnet50.torch", [{"kind": "skip", "reason": "PyTorch rows skipped: no torch"}]),
  ]
  text = render.sections(_results(rows))["gpu_resnet50"]
  assert "NVIDIA H100 80GB HBM3" in text and "2026-11-27" in text
  assert "at most 1.5x: met (1.25x)" in text
  assert "at most 3x: not measured" in text
  assert f"stopped at its 50 s time limit, during: {names.TJ_ALL_MP}: first call" in text
  assert "xla_compile 23.00 s" in text and "PyTorch rows skipped: no torch" in text


def test_render_makes_the_sections_again_from_a_runs_json(tmp_path):
  path = tmp_path / "gpu.json"
  path.write_text(json.dumps(_results([_worker("resnet50.jax", [
      {"kind": "row", "variant": names.JIT_F32, "first_call_s": 18.0}])])))
  result = subprocess.run([sys.executable, str(BENCH / "gpu.py"), "--render", str(path)],
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr
  assert "| jax.jit, float32 | 18.0 |" in result.stdout


def test_device_wheels_dry_run_lists_the_wheels_and_downloads_nothing(tmp_path):
  script = ROOT / ".ci" / "device-wheels"
  subprocess.run(["bash", "-n", str(script)], check=True)
  dest = tmp_path / "wheels"
  result = subprocess.run([str(script), "--dry-run", str(dest)], capture_output=True, text=True,
                          timeout=60, check=False)
  assert result.returncode == 0, result.stderr
  for wheel in ("grain==", "array-record==", "portpicker==", "orbax-checkpoint=="):
    assert wheel in result.stdout
  assert "--python-version 3.12" in result.stdout
  assert not dest.exists()
