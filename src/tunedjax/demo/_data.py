"""The demo's data: procedurally drawn images stored as encoded PNG bytes.

`shapes_dataset` draws labelled images (a shape or a texture per class, in
random colours, sizes, places and backgrounds) with Pillow and keeps each one
as PNG bytes, as a real image folder keeps its files: a `Loader` over it has to
decode and augment every record (`Decode`, `Augment`), in its worker processes
when it has them, so loading costs what it costs in real training. Nothing is
downloaded. `folder_dataset` reads a real folder (one subfolder per class)
into the same form.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from tunedjax._errors import TunedJaxError

CLASSES = ("circle", "square", "triangle", "cross", "ring", "stripes", "checker", "dots")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
# Per-channel mean and standard deviation of the generated images (0..1 scale).
MEAN = np.array([0.5, 0.5, 0.5], np.float32)
STD = np.array([0.25, 0.25, 0.25], np.float32)


class DemoDataError(TunedJaxError):
  """A demo data folder that cannot be used (missing, empty, unreadable)."""


def _pil() -> Any:
  try:
    from PIL import Image, ImageDraw  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover - pillow comes with matplotlib
    raise DemoDataError("The demo needs Pillow: pip install 'tunedjax[demo]'.") from e
  return Image, ImageDraw


@dataclasses.dataclass(frozen=True)
class EncodedImages:
  """Encoded images and their labels: a grain random-access source.

  Attributes:
    images: one encoded image (PNG, JPEG, ...) per record, as bytes.
    labels: the class index of each record.
    classes: the class names, indexed by label.

  Example:
    >>> data = shapes_dataset(16, image_size=16, seed=0)
    >>> len(data), data[0]["label"] in range(len(CLASSES))
    (16, True)
    >>> data.split(4)[1].labels.shape
    (4,)
  """

  images: tuple[bytes, ...]
  labels: np.ndarray
  classes: tuple[str, ...]

  def __len__(self) -> int:
    return len(self.images)

  def __getitem__(self, index: int) -> dict[str, Any]:
    return {"image": self.images[index], "label": self.labels[index]}

  @property
  def encoded_bytes(self) -> int:
    """The total size of the encoded images."""
    return sum(len(b) for b in self.images)

  def split(self, held_out: int) -> tuple[EncodedImages, EncodedImages]:
    """The first ``len - held_out`` records, and the last `held_out`."""
    if not 0 < held_out < len(self):
      raise DemoDataError(f"held_out must be between 1 and {len(self) - 1}, got {held_out}.")
    cut = len(self) - held_out
    return (EncodedImages(self.images[:cut], self.labels[:cut], self.classes),
            EncodedImages(self.images[cut:], self.labels[cut:], self.classes))


def _draw(label: int, size: int, rng: np.random.Generator) -> Any:
  """One image of class ``CLASSES[label]``, as a Pillow RGB image."""
  Image, ImageDraw = _pil()
  background = rng.integers(0, 256, 3)
  noise = rng.normal(0, 18, (size, size, 3))
  base = np.clip(background + noise, 0, 255).astype(np.uint8)
  img = Image.fromarray(base, "RGB")
  draw = ImageDraw.Draw(img)
  ink = tuple(int(c) for c in (background + 128 + rng.integers(-40, 40, 3)) % 256)
  name = CLASSES[label]
  r = rng.uniform(0.22, 0.4) * size
  cx, cy = rng.uniform(r, size - r, 2)
  box = (cx - r, cy - r, cx + r, cy + r)
  width = max(1, int(size / 10))
  if name == "circle":
    draw.ellipse(box, fill=ink)
  elif name == "square":
    draw.regular_polygon((cx, cy, r), 4, rotation=float(rng.uniform(0, 90)), fill=ink)
  elif name == "triangle":
    draw.regular_polygon((cx, cy, r), 3, rotation=float(rng.uniform(0, 120)), fill=ink)
  elif name == "cross":
    draw.line((cx - r, cy, cx + r, cy), fill=ink, width=width)
    draw.line((cx, cy - r, cx, cy + r), fill=ink, width=width)
  elif name == "ring":
    draw.ellipse(box, outline=ink, width=width)
  elif name == "stripes":
    period = int(rng.integers(3, 6))
    for k in range(-size, 2 * size, period):
      if rng.random() < 0.5:
        draw.line((k, 0, k, size), fill=ink, width=1)
      else:
        draw.line((0, k, size, k), fill=ink, width=1)
  elif name == "checker":
    cell = int(rng.integers(3, 6))
    for i in range(0, size, cell):
      for j in range(0, size, cell):
        if (i // cell + j // cell) % 2 == 0:
          draw.rectangle((i, j, i + cell - 1, j + cell - 1), fill=ink)
  else:  # dots
    step = int(rng.integers(4, 7))
    for i in range(step // 2, size, step):
      for j in range(step // 2, size, step):
        draw.ellipse((i - 1, j - 1, i + 1, j + 1), fill=ink)
  return img


def encode_png(image: Any) -> bytes:
  """A Pillow image (or HxWx3 uint8 array) as PNG bytes."""
  Image, _ = _pil()
  if isinstance(image, np.ndarray):
    image = Image.fromarray(image, "RGB")
  buf = io.BytesIO()
  image.save(buf, format="PNG")
  return buf.getvalue()


def shapes_dataset(n: int, *, image_size: int = 32, seed: int = 0) -> EncodedImages:
  """`n` generated images, classes in turn (balanced), each as PNG bytes.

  The same arguments give the same bytes. Eight classes (`CLASSES`): four
  filled or outlined shapes and four textures, each drawn in a random colour
  at a random size and place over a noisy background of another colour.

  Args:
    n: how many images.
    image_size: their height and width in pixels.
    seed: the generator's seed.

  Returns:
    The images as `EncodedImages`, in a random order of classes.
  """
  if n < 1 or image_size < 8:
    raise DemoDataError(f"shapes_dataset needs n >= 1 and image_size >= 8, got n={n}, "
                        f"image_size={image_size}.")
  rng = np.random.default_rng(seed)
  labels = rng.permutation(np.arange(n) % len(CLASSES)).astype(np.int32)
  images = tuple(encode_png(_draw(int(y), image_size, rng)) for y in labels)
  return EncodedImages(images, labels, CLASSES)


def folder_dataset(directory: str | pathlib.Path) -> EncodedImages:
  """The images of a folder with one subfolder per class, as `EncodedImages`.

  Files whose suffix is not one of `IMAGE_SUFFIXES` are ignored. Records are
  in a fixed order (class, then file name); the loader shuffles them.

  Raises:
    DemoDataError: the folder is missing, or has no class with an image.
  """
  root = pathlib.Path(directory).expanduser()
  if not root.is_dir():
    raise DemoDataError(f"--data {str(directory)!r} is not a directory; it should hold one "
                        "subfolder of images per class.")
  classes = sorted(p.name for p in root.iterdir() if p.is_dir())
  images: list[bytes] = []
  labels: list[int] = []
  for label, name in enumerate(classes):
    for path in sorted((root / name).iterdir()):
      if path.suffix.lower() in IMAGE_SUFFIXES:
        images.append(path.read_bytes())
        labels.append(label)
  if not images or len(classes) < 2:
    raise DemoDataError(
        f"--data {str(directory)!r} needs at least two subfolders (one per class) holding "
        f"images ({', '.join(IMAGE_SUFFIXES)}); found classes {classes} and "
        f"{len(images)} images.")
  return EncodedImages(tuple(images), np.asarray(labels, np.int32), tuple(classes))


class Decode(grain.transforms.Map):
  """Decodes a record's image bytes to an HxWx3 uint8 array of `size` pixels."""

  def __init__(self, size: int):
    self.size = size

  def map(self, record: dict[str, Any]) -> dict[str, Any]:
    Image, _ = _pil()
    with Image.open(io.BytesIO(record["image"])) as img:
      img = img.convert("RGB")
      if img.size != (self.size, self.size):
        img = img.resize((self.size, self.size), Image.BILINEAR)
      pixels = np.asarray(img, np.uint8)
    return {"image": pixels, "label": record["label"]}


class Augment(grain.transforms.RandomMap):
  """Random crop (after reflection padding), flip and brightness; normalises.

  Seeded per record by the loader, so the same seed gives the same batches.
  """

  def __init__(self, pad: int = 2, brightness: float = 0.1):
    self.pad = pad
    self.brightness = brightness

  def random_map(self, record: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    x = record["image"].astype(np.float32) / 255.0
    h, w, _ = x.shape
    if self.pad:
      x = np.pad(x, ((self.pad, self.pad), (self.pad, self.pad), (0, 0)), mode="reflect")
      i, j = rng.integers(0, 2 * self.pad + 1, 2)
      x = x[i:i + h, j:j + w]
    if rng.random() < 0.5:
      x = x[:, ::-1]
    x = x * (1.0 + rng.uniform(-self.brightness, self.brightness))
    return {"image": normalize(x), "label": record["label"]}


class Normalize(grain.transforms.Map):
  """Scales to 0..1 and normalises, without augmentation (evaluation)."""

  def map(self, record: dict[str, Any]) -> dict[str, Any]:
    return {"image": normalize(record["image"].astype(np.float32) / 255.0),
            "label": record["label"]}


def normalize(x: np.ndarray) -> np.ndarray:
  """Pixels in 0..1 to zero mean and unit scale, as float32."""
  return ((x - MEAN) / STD).astype(np.float32)


def decoded(data: EncodedImages, size: int) -> dict[str, np.ndarray]:
  """Every image decoded and normalised, as arrays (for evaluation)."""
  dec, norm = Decode(size), Normalize()
  records = [norm.map(dec.map(data[i])) for i in range(len(data))]
  return {"image": np.stack([r["image"] for r in records]),
          "label": np.asarray([r["label"] for r in records], np.int32)}


def train_transforms(size: int) -> Sequence[Any]:
  """Decode, then augment: what the training loader's workers run."""
  return (Decode(size), Augment())
