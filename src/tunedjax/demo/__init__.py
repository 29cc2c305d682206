"""`tunedjax demo`: the same training twice, default and with the one switch.

A small ResNet-style network with a depthwise-separable and a 1x1 stage
(`DemoNet`) trains on generated images stored as PNG bytes (`shapes_dataset`),
decoded and augmented by the loader: first as a baseline (``jax.jit``,
float32, grain's default loader), then with ``Trainer(autotune=True)``, which
is ``set_config(None)``. `run_demo` prints both side by side (time per epoch,
throughput, the loader's worker search, each conv bucket's kernel and
speedup, layout, precision, cache hits, tuning time, accuracy) and writes a
JSON report and a PNG. Run it again and the tuned run reads every choice from
the tuning cache: no tuning.

Example:
  >>> from tunedjax.demo import DemoNet, shapes_dataset, QUICK
  >>> len(shapes_dataset(8, image_size=16)), QUICK.epochs
  (8, 1)
"""

from __future__ import annotations

import dataclasses as _dataclasses
import datetime as _datetime
import os as _os
import platform as _platform
from typing import Any as _Any

import jax as _jax

from tunedjax import _native
from tunedjax._version import __version__ as _tunedjax_version
from tunedjax.autotune import device_fingerprint as _device_fingerprint
from tunedjax.autotune import op_families as _op_families
from tunedjax.demo import _data
from tunedjax.demo import _report
from tunedjax.demo import _run
from tunedjax.demo._data import CLASSES as CLASSES
from tunedjax.demo._data import DemoDataError as DemoDataError
from tunedjax.demo._data import EncodedImages as EncodedImages
from tunedjax.demo._data import folder_dataset as folder_dataset
from tunedjax.demo._data import shapes_dataset as shapes_dataset
from tunedjax.demo._lm import TransformerLM as TransformerLM
from tunedjax.demo._lm import lm_data as lm_data
from tunedjax.demo._lm import lm_loss as lm_loss
from tunedjax.demo._model import DemoNet as DemoNet
from tunedjax.demo._run import DEFAULT as DEFAULT
from tunedjax.demo._run import QUICK as QUICK
from tunedjax.demo._run import DemoOptions as DemoOptions
from tunedjax.demo._run import RunResult as RunResult

__all__ = [
    "CLASSES",
    "DEFAULT",
    "QUICK",
    "DemoDataError",
    "DemoNet",
    "DemoOptions",
    "EncodedImages",
    "RunResult",
    "TransformerLM",
    "folder_dataset",
    "lm_data",
    "lm_loss",
    "run_demo",
    "shapes_dataset",
]


def _machine() -> dict[str, _Any]:
  fp = _device_fingerprint()
  return {"device": fp.describe(), "cpu_count": _os.cpu_count(), "jax": _jax.__version__,
          "tunedjax": _tunedjax_version, "python": _platform.python_version(),
          "fingerprint": fp.digest}


def _native_state() -> dict[str, _Any]:
  """Which native sources were built for this machine before the runs (none: the run builds)."""
  _op_families()  # each family registers its sources when its package loads
  status = _native.status()
  return {"enabled": status["enabled"], "built_before": status["built"],
          "not_built_before": [s for s in status["sources"] if s not in status["built"]]
                              if status["compiler"] else []}


def run_demo(options: DemoOptions = DEFAULT, *, out: str | _os.PathLike[str] = "tunedjax-demo",
             progress: bool | str = True, echo: _Any = print) -> dict[str, _Any]:
  """Trains the baseline and the tuned run, prints the table, writes the report.

  Args:
    options: sizes (`QUICK` for a run of well under a minute).
    out: the folder for ``report.json`` and ``demo.png``.
    progress: the trainers' progress display (see `Trainer`).
    echo: where the text goes (``print``; a no-op to stay quiet).

  Returns:
    The report, as written to ``report.json``.
  """
  folder = _run.out_dir(out)
  train_data, held_out = _run.load_data(options)
  eval_data = _data.decoded(held_out, options.image_size)
  description = (f"{len(train_data)} training images from {options.data_dir}"
                 if options.data_dir else
                 f"{len(train_data)} generated {options.image_size}x{options.image_size} "
                 f"PNG images, {len(train_data.classes)} classes")
  description += (f", {options.epochs} epochs of batch {options.batch_size}, "
                  f"{len(held_out)} held out")
  echo(f"tunedjax demo: {description}")
  native = _native_state()
  if native["enabled"] and native["not_built_before"]:
    echo("The native CPU kernels are not built on this machine yet: run 2 builds them "
         f"({', '.join(native['not_built_before'])}; once per machine, several seconds "
         "of its time). `tunedjax native build` builds them ahead, as `make` does.")
  echo("run 1/2: baseline (jax.jit, float32, grain's default loader) ...")
  baseline, _ = _run.train("baseline", train_data, eval_data, options, tuned=False, progress=progress)
  echo("run 2/2: tunedjax (Trainer(autotune=True), i.e. set_config(None)) ...")
  tuned, trainer = _run.train("tunedjax", train_data, eval_data, options, tuned=True,
                         progress=progress)
  sample = {k: v[:options.batch_size] for k, v in eval_data.items()}
  buckets = _run.kernel_table(trainer, sample)
  warm = tuned.kernel_cache_misses == 0 and (tuned.loader.get("from_cache")
                                             or not tuned.loader.get("trials"))
  report: dict[str, _Any] = {
      "date": _datetime.datetime.now(_datetime.timezone.utc).isoformat(timespec="seconds"),
      "machine": _machine(),
      "data": {"description": description, "classes": list(train_data.classes),
               "train_images": len(train_data), "held_out": len(held_out),
               "encoded_mb": train_data.encoded_bytes / 2**20},
      "options": _dataclasses.asdict(options),
      "ratios": _report.ratios(baseline, tuned),
      "warm_cache": bool(warm),
      "native": native,
      "runs": {"baseline": _dataclasses.asdict(baseline), "tunedjax": _dataclasses.asdict(tuned)},
      "kernels": [_dataclasses.asdict(b) for b in buckets],
  }
  json_path, png_path = folder / "report.json", folder / "demo.png"
  has_png = _report.plot(png_path, baseline, tuned)
  report["files"] = {"json": str(json_path), "png": str(png_path) if has_png else None}
  _report.write_json(json_path, report)
  echo("")
  echo(_report.format_report(report, baseline, tuned, buckets))
  r = report["ratios"]
  if r["wall"] >= 1.0:
    echo(f"tunedjax ran {r['wall']:.2f}x faster end to end (tuning included), "
         f"{r['steady_throughput']:.2f}x in steady state.")
  else:
    echo(f"tunedjax took {1 / r['wall']:.2f}x the baseline's time end to end (tuning "
         f"included; steady-state throughput {r['steady_throughput']:.2f}x): a run this small "
         "cannot pay back its tuning and compiling. The full-size demo shows the gain.")
  if warm:
    echo("The tuning cache was warm: every kernel and the loader setting came from it.")
  else:
    echo("Run it again: the tuned run will read every choice from the tuning cache "
         "(0 s of tuning).")
  echo(f"report: {json_path}" + (f"\nplot:   {png_path}" if has_png else
                                 "\n(no plot: pip install matplotlib)"))
  return report
