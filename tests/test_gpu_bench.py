"""`benchmarks/gpu.py`, the device command's benchmark, checked without a GPU.

Its smoke run (``benchmarks/run.py gpu --quick``: every part at tiny sizes, on
the CPU, Pallas in interpret mode) runs here, so that a moved or renamed name
breaks `make test`, not the GPU run; the worker protocol's time limits and
stack dumps (`harness.workers`), its sections and ``make device-wheels``'s
script are checked on their own, quickly.
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
from harness import workers  # noqa: E402  pylint: disable=wrong-import-position

def _env(tmp_path: pathlib.Path) -> dict[str, str]:
  src = str(ROOT / "src")
  return dict(os.environ, TUNEDJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
              PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))


@pytest.mark.serial  # its workers' time limits
@pytest.mark.slow
def test_the_smoke_run_runs_every_part_and_prints_its_json(tmp_path):
  before = (ROOT / "BENCHMARKS.md").read_text()
  start = time.monotonic()
  result = subprocess.run([sys.executable, str(BENCH / "run.py"), "gpu", "--quick", "--json"],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=900, check=False)
  seconds = time.monotonic() - start
  assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-6000:])
  print(f"run.py gpu --quick took {seconds:.0f} s")
  f = json.loads(result.stdout)["figures"]
  assert list(f["parts"]) == list(names.PARTS) and f["problems"] == [], f["problems"]
  for part in f["parts"].values():
    assert all(w["status"] == "done" and not w["stack"] for w in part["workers"]), part["workers"]
  records = [r for p in f["parts"].values() for w in p["workers"] for r in w["records"]]
  for record in (r for r in records if r["kind"] == "skip"):  # no PyTorch: printed, recorded
    print(record["reason"])
    assert "PyTorch rows skipped" in record["reason"] and record["reason"] in result.stderr
  anatomies = [r for r in records if r["kind"] == "anatomy"]
  # every tunedjax variant: 3 ResNet-50 workers, 2 x 2 attention lengths, 2 x 2 Trainers, layout
  assert len(anatomies) == 3 + 4 + 4 + 1, [a["variant"] for a in anatomies]
  assert all(a.get("stages") for a in anatomies), [a for a in anatomies if not a.get("stages")]
  assert "first-call anatomy" in result.stderr
  assert result.stderr.count("gpu.py: ") >= len(names.PARTS)
  sections = render.sections(f)
  assert list(sections) == [f"gpu_{part}" for part in names.PARTS]
  assert "| jax.jit, float32 |" in sections["gpu_resnet50"] and "Target" in sections["gpu_lm"]
  assert (ROOT / "BENCHMARKS.md").read_text() == before  # no --write: BENCHMARKS.md untouched


def _worker(tmp_path: pathlib.Path, body: str, budget_s: float | None = None, **kw):
  script = tmp_path / "worker.py"
  script.write_text("import time\nfrom harness.workers import arm, emit, say\narm()\n" + body)
  lines: list[str] = []
  env = dict(os.environ, PYTHONPATH=str(BENCH))
  return workers.spawn([sys.executable, str(script)], env, name="w", budget_s=budget_s,
                       echo=lines.append, **kw), lines


@pytest.mark.serial  # a time limit's wall time
def test_a_worker_past_its_time_limit_is_stopped_and_what_it_printed_is_kept(tmp_path):
  w, lines = _worker(tmp_path, "emit('row', variant='a', ms=1.5)\n"
                     "say('a line for people')\n"
                     "emit('start', what='a first call that never ends')\n"
                     "time.sleep(60)\n", budget_s=0.5)
  start = time.monotonic()
  w.close()
  assert time.monotonic() - start < 0.5 + workers.GRACE_S + 5
  assert w.status == "budget" and w.returncode != 0
  assert w.in_progress == "a first call that never ends"
  assert [r["kind"] for r in w.records] == ["row", "start"]
  assert lines[0] == "a line for people"


@pytest.mark.serial  # a time limit's wall time
def test_a_hung_worker_dumps_its_stack_before_it_is_killed(tmp_path):
  w, lines = _worker(tmp_path, "def waits_forever():\n  time.sleep(60)\n\n"
                     "emit('start', what='waiting')\nwaits_forever()\n", budget_s=0.5)
  w.close()
  assert w.status == "budget"
  assert w.stack and w.stack[0].startswith("Timeout (")
  assert any("waits_forever" in line for line in w.stack), w.stack
  assert w.to_dict()["stack"] == w.stack and w.stack == lines[-len(w.stack):]


def test_the_ready_run_protocol_answers_each_run_and_the_worker_ends_with_its_stdin(tmp_path):
  w, _ = _worker(tmp_path, "from harness.workers import serve\n"
                 "n = iter(range(10))\nserve(lambda: {'n': next(n)}, ready='set up')\n")
  assert w.reply() == {"ready": "set up"}
  assert workers.run_rounds({"w": w}, 3) == {"w": [{"n": 0}, {"n": 1}, {"n": 2}]}
  assert w.status == "done" and not w.stack


def test_a_worker_that_fails_is_reported_failed(tmp_path):
  w, _ = _worker(tmp_path, "raise SystemExit(3)\n")
  w.close()
  assert (w.status, w.returncode) == ("failed", 3)
  w, _ = _worker(tmp_path, "raise SystemExit(3)\n")
  with pytest.raises(SystemExit, match="w ended early"):
    w.reply()


def test_fit_rounds_keeps_to_the_time_left():
  from _gpu_measure import fit_rounds  # pylint: disable=import-outside-toplevel  # imports JAX
  assert fit_rounds(1.0, 10.0, 7) == 7
  assert fit_rounds(2.0, 10.0, 7) == 4  # one warm-up round and four timed
  assert fit_rounds(5.0, 10.0, 7) == 0  # fewer than two: not timed


def test_the_plan_fits_the_nine_minute_device_command():
  total = sum(b for plan in names.PLAN.values() for _, b in plan)
  assert total <= 500, total  # the rest of 540 s: wheel installs and Python's starts


def _results(workers: list[dict]) -> dict:
  return {"command": "benchmarks/run.py gpu", "date": "2026-11-27", "smoke": False,
          "env": {"device": "NVIDIA H100 80GB HBM3", "backend": "gpu", "jax": "0.11.2"},
          "parts": {"resnet50": {"seconds": 100.0, "workers": workers}}}


def _worker_dict(name: str, records: list[dict], status: str = "done", **kw) -> dict:
  return {"name": name, "budget_s": 50.0, "status": status, "records": records, **kw}


def test_sections_judge_the_targets_and_name_what_ran_out_of_time():
  rows = [
      _worker_dict("resnet50.jax", [
          {"kind": "row", "variant": names.JIT_F32, "first_call_s": 18.0},
          {"kind": "row", "variant": names.JIT_BF16, "first_call_s": 20.0,
           "images_per_s": 3000.0}]),
      _worker_dict("resnet50.tj_mp_layout", [
          {"kind": "row", "variant": names.TJ_MP_LAYOUT, "first_call_s": 25.0},
          {"kind": "anatomy", "variant": names.TJ_MP_LAYOUT, "total_s": 25.0,
           "stages": {"trace": 1.0, "xla_compile": 23.0, "first_execution": 1.0}}]),
      _worker_dict("resnet50.tj_all_mp", [{"kind": "start", "what": "first call"}],
              status="budget", in_progress=f"{names.TJ_ALL_MP}: first call"),
      _worker_dict("resnet50.torch",
                   [{"kind": "skip", "reason": "PyTorch rows skipped: no torch"}]),
  ]
  text = render.sections(_results(rows))["gpu_resnet50"]
  assert "NVIDIA H100 80GB HBM3" in text and "2026-11-27" in text
  assert "at most 1.5x: met (1.25x)" in text
  assert "at most 3x: not measured" in text
  assert f"stopped at its 50 s time limit, during: {names.TJ_ALL_MP}: first call" in text
  assert "xla_compile 23.00 s" in text and "PyTorch rows skipped: no torch" in text


def test_a_saved_result_makes_the_sections_again(tmp_path):
  import harness  # pylint: disable=import-outside-toplevel
  path = tmp_path / "gpu.json"
  path.write_text(harness.Result("gpu", figures=_results([_worker_dict("resnet50.jax", [
      {"kind": "row", "variant": names.JIT_F32, "first_call_s": 18.0}])]), machine="").to_json())
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(BENCH)]))
  result = subprocess.run([sys.executable, "-m", "harness.saved", str(path)], env=env,
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
