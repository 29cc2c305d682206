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

import dataclasses
import datetime
import os
import pathlib
import platform
from typing import Any

import jax

from tunedjax._version import __version__
from tunedjax.autotune import device_fingerprint
from tunedjax.demo._data import CLASSES as CLASSES
from tunedjax.demo._data import DemoDataError as DemoDataError
from tunedjax.demo._data import EncodedImages as EncodedImages
from tunedjax.demo._data import decoded
from tunedjax.demo._data import folder_dataset as folder_dataset
from tunedjax.demo._data import shapes_dataset as shapes_dataset
from tunedjax.demo._model import DemoNet as DemoNet
from tunedjax.demo._report import format_report
from tunedjax.demo._report import plot
from tunedjax.demo._report import ratios
from tunedjax.demo._report import write_json
from tunedjax.demo._run import QUICK as QUICK
from tunedjax.demo._run import DemoOptions as DemoOptions
from tunedjax.demo._run import RunResult as RunResult
from tunedjax.demo._run import kernel_table
from tunedjax.demo._run import load_data
from tunedjax.demo._run import out_dir
from tunedjax.demo._run import train

__all__ = [
    "CLASSES",
    "QUICK",
    "DemoDataError",
    "DemoNet",
    "DemoOptions",
    "EncodedImages",
    "RunResult",
    "folder_dataset",
    "run_demo",
    "shapes_dataset",
]


def _machine() -> dict[str, Any]:
  fp = device_fingerprint()
  return {"device": fp.describe(), "cpu_count": os.cpu_count(), "jax": jax.__version__,
          "tunedjax": __version__, "python": platform.python_version(),
          "fingerprint": fp.digest}


def run_demo(options: DemoOptions = DemoOptions(), *, out: str | os.PathLike[str] = "tunedjax-demo",
             progress: bool | str = True, echo: Any = print) -> dict[str, Any]:
  """Trains the baseline and the tuned run, prints the table, writes the report.

  Args:
    options: sizes (`QUICK` for a run of well under a minute).
    out: the folder for ``report.json`` and ``demo.png``.
    progress: the trainers' progress display (see `Trainer`).
    echo: where the text goes (``print``; a no-op to stay quiet).

  Returns:
    The report, as written to ``report.json``.
  """
  folder = out_dir(out)
  train_data, held_out = load_data(options)
  eval_data = decoded(held_out, options.image_size)
  description = (f"{len(train_data)} training images from {options.data_dir}"
                 if options.data_dir else
                 f"{len(train_data)} generated {options.image_size}x{options.image_size} "
                 f"PNG images, {len(train_data.classes)} classes")
  description += (f", {options.epochs} epochs of batch {options.batch_size}, "
                  f"{len(held_out)} held out")
  echo(f"tunedjax demo: {description}")
  echo("run 1/2: baseline (jax.jit, float32, grain's default loader) ...")
  baseline, _ = train("baseline", train_data, eval_data, options, tuned=False, progress=progress)
  echo(f"run 2/2: tunedjax (Trainer(autotune=True), i.e. set_config(None)) ...")
  tuned, trainer = train("tunedjax", train_data, eval_data, options, tuned=True,
                         progress=progress)
  sample = {k: v[:options.batch_size] for k, v in eval_data.items()}
  buckets = kernel_table(trainer, sample)
  warm = tuned.kernel_cache_misses == 0 and (tuned.loader.get("from_cache")
                                             or not tuned.loader.get("trials"))
  report: dict[str, Any] = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "machine": _machine(),
      "data": {"description": description, "classes": list(train_data.classes),
               "train_images": len(train_data), "held_out": len(held_out),
               "encoded_mb": train_data.encoded_bytes / 2**20},
      "options": dataclasses.asdict(options),
      "ratios": ratios(baseline, tuned),
      "warm_cache": bool(warm),
      "runs": {"baseline": dataclasses.asdict(baseline), "tunedjax": dataclasses.asdict(tuned)},
      "kernels": [dataclasses.asdict(b) for b in buckets],
  }
  json_path, png_path = folder / "report.json", folder / "demo.png"
  write_json(json_path, report)
  has_png = plot(png_path, baseline, tuned)
  report["files"] = {"json": str(json_path), "png": str(png_path) if has_png else None}
  write_json(json_path, report)
  echo("")
  echo(format_report(report, baseline, tuned, buckets))
  r = report["ratios"]
  echo(f"tunedjax ran {r['wall']:.2f}x faster end to end (tuning included), "
       f"{r['steady_throughput']:.2f}x in steady state.")
  if warm:
    echo("The tuning cache was warm: every kernel and the loader setting came from it.")
  else:
    echo("Run it again: the tuned run will read every choice from the tuning cache "
         "(0 s of tuning).")
  echo(f"report: {json_path}" + (f"\nplot:   {png_path}" if has_png else
                                 "\n(no plot: pip install matplotlib)"))
  return report
