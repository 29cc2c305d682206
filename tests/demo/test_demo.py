"""`tunedjax demo`: end to end (--quick, in a fresh process), the report, the warm cache."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.processes import ROOT, cpu_env
from tunedjax import autotune

RUN_FIELDS = {"name", "switch", "wall_s", "epoch_s", "steps", "images", "images_per_s",
              "steady_images_per_s", "median_step_ms", "accuracy", "eval_loss", "precision",
              "layout", "loader", "kernel_tuning_s", "kernel_cache_hits", "kernel_cache_misses",
              "kernels", "losses", "step_times", "first_call"}


def _demo_quick(tmp_path, out: str) -> tuple[subprocess.CompletedProcess, float]:
  env = {**cpu_env(), "TUNEDJAX_CACHE_DIR": str(tmp_path / "cache")}
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "tunedjax.cli", "demo", "--quick", "--no-progress",
                         "--out", str(tmp_path / out)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc, time.perf_counter() - start


@pytest.mark.serial  # its wall time is bounded
@pytest.mark.slow
def test_demo_quick_runs_end_to_end_and_a_second_run_reads_the_cache(tmp_path):
  proc, seconds = _demo_quick(tmp_path, "out")
  # Measured ~45 s on 2 quiet cores; the bound leaves room for a loaded CI machine.
  assert seconds < 90, f"--quick took {seconds:.0f} s; it should stay under a minute"
  out = proc.stdout
  for line in ("time per epoch", "throughput", "median step", "loader", "layout", "precision",
               "kernel cache", "tuning (kernels + loader)", "final accuracy",
               "bucket (conv: lhs * rhs)", "why", "the step's first call", "report:", "plot:"):
    assert line in out, f"{line!r} missing from:\n{out}"
  report = json.loads((tmp_path / "out" / "report.json").read_text())
  assert set(report["runs"]) == {"baseline", "tunedjax"}
  for run in report["runs"].values():
    assert RUN_FIELDS <= set(run)
    assert run["steps"] == len(run["losses"]) > 0 and run["wall_s"] > 0
    assert 0.0 <= run["accuracy"] <= 1.0
    first = run["first_call"]  # where the training step's first call spent its time
    assert {"trace", "compile", "first_run"} <= set(first["stages"])
    assert sum(first["stages"].values()) == pytest.approx(first["total_s"])
  base, tuned = report["runs"]["baseline"], report["runs"]["tunedjax"]
  assert base["loader"]["worker_count"] == 0 and base["kernels"] == {}
  assert tuned["kernel_cache_misses"] > 0 and tuned["kernel_tuning_s"] > 0  # a cold cache
  # Tuned, not read from the cache: searched, or no search because the step,
  # not the loader, is the bottleneck (both times then in the report) or no
  # trial could pay back.
  loader = tuned["loader"]
  assert not loader["from_cache"]
  assert loader["trials"] or loader["stopped"] == "no payback" or (
      loader["stopped"] == "consumer-bound" and loader["step_s"] > loader["batch_s"] > 0)
  # Each bucket was decided in this run: timed, or kept because tuning it could
  # not pay back within the quick run's few steps (on a loaded machine, with
  # more candidates per bucket, that can be every bucket).
  assert tuned["kernels"] and any(k.endswith(("(tuned)", "(cannot pay back)"))
                                  for k in tuned["kernels"])
  assert report["ratios"]["wall"] == pytest.approx(base["wall_s"] / tuned["wall_s"])
  # Convolutions and, routed from Flax's BatchNorm, batch norms: each row's
  # kernel is one of its own family's (the bucket label starts with the family).
  names = {f.name: {k.name for k in autotune.kernels(f.name)} for f in autotune.op_families()}
  assert report["kernels"] and all(row["kernel"] in names[row["bucket"].split()[0]]
                                   for row in report["kernels"])
  # Depthwise buckets (xla's slowest) pay back their tuning even in --quick's
  # few steps; cheaper ones may keep xla as "cannot pay back", with its horizon.
  assert {"depthwise", "depthwise_native"} & {row["kernel"] for row in report["kernels"]}
  assert all(row["kernel"] == "xla" and row["reason"].startswith("cannot pay back")
             for row in report["kernels"] if row["horizon"] is not None)
  assert report["warm_cache"] is False and report["machine"]["device"]
  native = report["native"]  # the suite's native folder may or may not be built yet
  assert native["enabled"] and "depthwise" in native["built_before"] + native["not_built_before"]
  assert ("not built on this machine yet" in out) == bool(native["not_built_before"])
  png = (tmp_path / "out" / "demo.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000

  proc, _ = _demo_quick(tmp_path, "again")  # the same cache, now warm
  again = json.loads((tmp_path / "again" / "report.json").read_text())
  assert again["warm_cache"] and "The tuning cache was warm" in proc.stdout
  assert again["native"]["not_built_before"] == [] and "not built on" not in proc.stdout
  warm = again["runs"]["tunedjax"]
  assert warm["kernel_tuning_s"] == 0.0 and warm["kernel_cache_misses"] == 0
  assert warm["kernel_cache_hits"] > 0 and warm["loader"]["from_cache"]
  assert [r["kernel"] for r in again["kernels"]] == [r["kernel"] for r in report["kernels"]]
  # Same seed, same batches, same initialisation: the baselines train alike.
  assert again["runs"]["baseline"]["losses"] == base["losses"]


def test_cli_demo_names_a_bad_data_folder(tmp_path, capsys):
  from tunedjax import cli
  assert cli.main(["demo", "--data", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 1
  err = capsys.readouterr().err
  assert "tunedjax demo: error:" in err and "nope" in err and "subfolder" in err
  with pytest.raises(SystemExit):
    cli._build_parser().parse_args(["demo", "--epochs", "0"])


def test_the_loader_cell_says_why_nothing_was_measured():
  from types import SimpleNamespace  # pylint: disable=g-import-not-at-top

  from tunedjax.demo import _report  # pylint: disable=g-import-not-at-top

  def cell(**info):
    return _report._loader_cell(SimpleNamespace(loader={
        "worker_count": 0, "read_threads": 0, "seconds": 0.01, "trials": [], **info}))
  assert "no trial could pay back" in cell(stopped="no payback")
  assert "the step is the bottleneck" in cell(stopped="consumer-bound")
  assert cell(stopped="converged").endswith("(as given)")


def test_the_bucket_table_says_which_buckets_were_not_tuned_and_why():
  from tunedjax.demo import _report  # pylint: disable=g-import-not-at-top

  kept = autotune.BucketChoice(bucket="conv 8x8x8x8 * 1x1x8x8 float32 s1x1", count=1,
                               candidates=("xla", "matmul_1x1"), kernel="xla", xla_ms=1.2,
                               kernel_ms=1.2, speedup=1.0, horizon=48, op="conv")
  tuned = autotune.BucketChoice(bucket="conv 8x8x8x8 * 3x3x1x8 float32 s1x1 fg8", count=2,
                                candidates=("xla", "depthwise"), kernel="depthwise",
                                xla_ms=30.0, kernel_ms=1.5, speedup=20.0, op="conv")
  lost = autotune.BucketChoice(bucket="conv 8x8x8x3 * 3x3x3x8 float32 s1x1", count=1,
                               candidates=("xla", "im2col"), kernel="xla", xla_ms=2.0,
                               kernel_ms=2.0, speedup=1.0, op="conv")
  rows = _report.kernel_rows([kept, tuned, lost])
  assert rows[0][3:] == ("1.2", "-", "-", "not tuned: cannot pay back in 48 steps")
  assert rows[1][2:] == ("depthwise", "30.0", "1.5", "20.00x", "fastest")
  assert rows[2][-1] == "xla fastest"
