"""The demo's two training runs: the baseline, then the one switch.

Both runs train the same `DemoNet` from the same initialisation on the same
batches through the same `Trainer` loop; what differs is the switch:

* **baseline**: ``Trainer(autotune=False)``: the step compiled by plain
  `jax.jit` (level O0), float32, the loader at grain's defaults (0 worker
  processes, 16 read threads);
* **tunedjax**: ``Trainer(autotune=True)``, which is ``set_config(None)``:
  kernel selection and layout in the step, the loader's workers measured with
  the training step as the consumer, every choice read from or written to the
  persistent tuning cache.

Each run's wall time counts everything a user waits for: compiling, tuning
(kernels and loader) and training.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any

import numpy as np
import optax

from tunedjax import autotune
from tunedjax.demo import _data
from tunedjax.demo import _model
from tunedjax.input_pipeline import Loader
from tunedjax.trainer import Trainer

# grain's own defaults: no worker processes, 16 read threads.
DEFAULT_WORKERS, DEFAULT_READ_THREADS = 0, 16


@dataclasses.dataclass(frozen=True)
class DemoOptions:
  """Sizes of the demo. `QUICK` is the small version the tests run.

  Attributes:
    train_images: generated training images (ignored with `data_dir`).
    eval_images: held-out images for the final accuracy.
    image_size: height and width the images are decoded to.
    batch_size: images per step.
    epochs: training epochs of each run.
    width: channels of the network's first stage.
    learning_rate: AdamW's learning rate.
    seed: seed of the data, the initialisation and the shuffle.
    loader_budget_s: seconds the loader's worker tuning may take.
    loader_steps: batches (training steps) each of its trials may read.
    data_dir: a folder with one subfolder of images per class, instead of the
      generated images.
  """

  train_images: int = 3072
  eval_images: int = 512
  image_size: int = 32
  batch_size: int = 128
  epochs: int = 2
  width: int = 32
  learning_rate: float = 3e-3
  seed: int = 0
  loader_budget_s: float = 12.0
  loader_steps: int = 8
  data_dir: str | None = None


DEFAULT = DemoOptions()
QUICK = DemoOptions(train_images=512, eval_images=64, image_size=16, batch_size=64, epochs=1,
                    width=8, loader_budget_s=2.0, loader_steps=4)


@dataclasses.dataclass
class RunResult:
  """What one run measured (JSON-able through `dataclasses.asdict`)."""

  name: str
  switch: str
  wall_s: float
  epoch_s: list[float]
  steps: int
  images: int
  images_per_s: float
  steady_images_per_s: float
  median_step_ms: float
  accuracy: float
  eval_loss: float
  precision: str
  layout: str
  loader: dict[str, Any]
  kernel_tuning_s: float
  kernel_cache_hits: int
  kernel_cache_misses: int
  kernels: dict[str, int]
  losses: list[float]
  step_times: list[float]
  # The training step's first call (`tunedjax.FirstCall.as_dict`: total and stages).
  first_call: dict[str, Any] | None = None


def load_data(options: DemoOptions) -> tuple[_data.EncodedImages, _data.EncodedImages]:
  """The training and held-out images, as encoded bytes."""
  if options.data_dir is not None:
    data = _data.folder_dataset(options.data_dir)
    held = max(1, min(options.eval_images, len(data) // 5))
    order = np.random.default_rng(options.seed).permutation(len(data))
    data = _data.EncodedImages(tuple(data.images[i] for i in order), data.labels[order],
                               data.classes)
    return data.split(held)
  data = _data.shapes_dataset(options.train_images + options.eval_images,
                              image_size=options.image_size, seed=options.seed)
  return data.split(options.eval_images)


def _trainer(options: DemoOptions, classes: int, tuned: bool, progress: bool | str) -> Trainer:
  model = _model.DemoNet(classes, width=options.width, seed=options.seed)
  return Trainer(model, optax.adamw(options.learning_rate), _model.loss_fn,
                 metrics={"accuracy": _model.accuracy}, autotune=tuned, seed=options.seed,
                 progress=progress)


def _loader(train: _data.EncodedImages, options: DemoOptions) -> Loader:
  return Loader(train, batch_size=options.batch_size,
                transforms=_data.train_transforms(options.image_size), seed=options.seed,
                worker_count=DEFAULT_WORKERS, read_threads=DEFAULT_READ_THREADS,
                tuning_budget_s=options.loader_budget_s, tuning_steps=options.loader_steps)


def train(name: str, train_data: _data.EncodedImages, eval_data: dict[str, np.ndarray],
          options: DemoOptions, *, tuned: bool, progress: bool | str = False
          ) -> tuple[RunResult, Trainer]:
  """One run: builds the trainer and loader, fits, evaluates, reports."""
  trainer = _trainer(options, len(train_data.classes), tuned, progress)
  start = time.perf_counter()
  with _loader(train_data, options) as loader:
    history = trainer.fit(loader, epochs=options.epochs)
  wall = time.perf_counter() - start
  results = trainer.evaluate(eval_data, batch_size=options.batch_size)
  tuning = history.tuning
  layout = tuning.get("layout") or {}
  images = int(sum(history.samples))
  loader_info = tuning.get("dataloader") or {
      "worker_count": DEFAULT_WORKERS, "read_threads": DEFAULT_READ_THREADS, "seconds": 0.0,
      "from_cache": False, "trials": [], "stopped": "not tuned"}
  result = RunResult(
      name=name, switch="Trainer(autotune=True): set_config(None)" if tuned else
      "Trainer(autotune=False): jax.jit, float32, grain's default loader",
      wall_s=wall, epoch_s=[float(e["seconds"]) for e in history.epochs],
      steps=len(history.losses), images=images, images_per_s=images / wall,
      steady_images_per_s=float(history.throughput()),
      median_step_ms=1e3 * float(np.median(history.step_times[1:] or history.step_times)),
      accuracy=float(results.get("accuracy", float("nan"))),
      eval_loss=float(results.get("loss", float("nan"))),
      precision=str(tuning.get("precision", "float32")),
      layout=(f"{layout.get('decision')} ({layout.get('reason')})" if layout else
              "as written (layout pass off)"),
      loader=loader_info, kernel_tuning_s=float(tuning.get("tuning_s", 0.0)),
      kernel_cache_hits=int(tuning.get("kernel_cache_hits", 0)),
      kernel_cache_misses=int(tuning.get("kernel_cache_misses", 0)),
      kernels=dict(tuning.get("kernels", {})),
      losses=[float(v) for v in history.losses], step_times=list(history.step_times),
      first_call=tuning.get("first_call"))
  return result, trainer


def kernel_table(trainer: Trainer, batch: dict[str, np.ndarray]) -> list[autotune.BucketChoice]:
  """Each conv bucket of `trainer`'s training step, as the tuning cache has it."""
  step = trainer._programs.train_step.__wrapped__  # pylint: disable=protected-access
  placed = trainer.placement.put(batch)
  return autotune.explain(step, trainer.state, placed)


def out_dir(path: str | pathlib.Path) -> pathlib.Path:
  """Creates (if needed) and returns the report folder."""
  folder = pathlib.Path(path).expanduser()
  folder.mkdir(parents=True, exist_ok=True)
  return folder
