"""The demo's data: generated PNG images, a folder of images, decode and augment."""

from __future__ import annotations

import numpy as np
import pytest

from tunedjax import demo
from tunedjax.demo import _data

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_generated_images_are_png_bytes_balanced_and_deterministic():
  a = demo.shapes_dataset(32, image_size=16, seed=3)
  b = demo.shapes_dataset(32, image_size=16, seed=3)
  c = demo.shapes_dataset(32, image_size=16, seed=4)
  assert a.images == b.images and a.images != c.images
  assert all(img.startswith(PNG_MAGIC) for img in a.images)
  assert np.bincount(a.labels, minlength=len(demo.CLASSES)).tolist() == [4] * 8
  assert a.encoded_bytes == sum(map(len, a.images))


def test_decode_then_augment_give_normalised_float_images():
  data = demo.shapes_dataset(4, image_size=16, seed=0)
  decoded = _data.Decode(16).map(data[0])
  assert decoded["image"].shape == (16, 16, 3) and decoded["image"].dtype == np.uint8
  assert decoded["image"].std() > 0  # drawn, never blank
  out = _data.Augment().random_map(decoded, np.random.default_rng(0))
  assert out["image"].shape == (16, 16, 3) and out["image"].dtype == np.float32
  assert -3 < out["image"].mean() < 3 and out["label"] == data[0]["label"]
  again = _data.Augment().random_map(decoded, np.random.default_rng(0))
  np.testing.assert_array_equal(out["image"], again["image"])  # seeded per record
  resized = _data.Decode(8).map(data[0])["image"]
  assert resized.shape == (8, 8, 3)


def test_a_folder_of_images_is_read_one_class_per_subfolder(tmp_path):
  generated = demo.shapes_dataset(6, image_size=12, seed=0)
  for name in ("cats", "dogs"):
    (tmp_path / name).mkdir()
  for i, img in enumerate(generated.images):
    (tmp_path / ("cats" if i % 2 else "dogs") / f"{i}.png").write_bytes(img)
  (tmp_path / "dogs" / "notes.txt").write_text("not an image")
  data = demo.folder_dataset(tmp_path)
  assert data.classes == ("cats", "dogs") and len(data) == 6
  assert sorted(data.labels.tolist()) == [0, 0, 0, 1, 1, 1]
  assert _data.Decode(12).map(data[0])["image"].shape == (12, 12, 3)


@pytest.mark.parametrize("make", ["missing", "empty", "one_class"])
def test_an_unusable_folder_is_a_clear_error(tmp_path, make):
  root = tmp_path / "images"
  if make != "missing":
    root.mkdir()
  if make == "one_class":
    (root / "only").mkdir()
    (root / "only" / "a.png").write_bytes(demo.shapes_dataset(1, image_size=8).images[0])
  with pytest.raises(demo.DemoDataError, match="one subfolder|two subfolders"):
    demo.folder_dataset(root)


def test_split_keeps_the_last_records_for_evaluation():
  data = demo.shapes_dataset(10, image_size=8)
  train, held = data.split(3)
  assert len(train) == 7 and len(held) == 3 and held.images == data.images[7:]
  with pytest.raises(demo.DemoDataError, match="held_out"):
    data.split(10)
