"""Pathfinder: the snakes2-style generator against its own geometry (markers on path ends, paths apart, bends
bounded), determinism, the difficulty options, the data module's contract, and the LRA release reader on a tiny
folder in the release's layout. Tiny sizes; every test uses its own cache folder."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch
from PIL import Image

from tasks.data.base import DataError
from tasks.data.pathfinder import (
    PAD_ID,
    PathfinderDataModule,
    generate_pathfinder,
    lra_settings,
    read_lra_folder,
)

LRA32 = lra_settings(32)
SMALL = dict(resolution=16, contour_length=4, seed_distance=3.0, distractors=4)


def segment_distance(p: np.ndarray, q: np.ndarray) -> float:
    """Smallest distance between segments ``p`` and ``q`` (each ``(2, 2)``), by dense sampling."""
    t = np.linspace(0, 1, 41)[:, None]
    a, b = p[0] + t * (p[1] - p[0]), q[0] + t * (q[1] - q[0])
    return float(np.sqrt(((a[:, None] - b[None]) ** 2).sum(-1)).min())


@pytest.fixture(scope="module")
def images():
    return generate_pathfinder(LRA32, 8, seed=3)


def test_labels_are_balanced(images):
    assert [image.label for image in images].count(1) == 4
    odd = generate_pathfinder(replace(LRA32, contour_length=4, distractors=4), 7, seed=0)
    assert [image.label for image in odd].count(1) == 3


def test_markers_are_the_ends_of_one_path_for_label_1_and_of_two_for_label_0(images):
    for image in images:
        first, other = image.paths[image.first], image.paths[1 - image.first]
        start, end = image.markers
        np.testing.assert_allclose(start, first[0, 0])
        np.testing.assert_allclose(end, (first if image.label == 1 else other)[-1, 1])
        # the two target paths never touch, so a label-0 pair is on two separate paths
        gap = min(segment_distance(p, q) for p in first for q in other)
        assert gap > LRA32.paddle_thickness
        for centre in image.markers:  # the markers are drawn where the metadata says
            row, col = np.rint(centre).astype(int)
            assert image.pixels[row, col] >= 128


def test_paths_are_chains_of_paddles_with_bounded_bends(images):
    length, margin = LRA32.paddle_length, LRA32.paddle_margins[0]
    for image in images:
        for path in image.paths:
            assert path.shape == (LRA32.contour_length, 2, 2)
            np.testing.assert_allclose(np.linalg.norm(path[:, 1] - path[:, 0], axis=-1), length)
            steps = path[1:, 0] - path[:-1, 1]  # end of one paddle to the start of the next
            gaps = np.linalg.norm(steps, axis=-1)
            assert (gaps > margin).all() and (gaps <= 2 * margin + 1e-9).all()
            directions = path[:, 1] - path[:, 0]
            angles = np.arctan2(directions[:, 0], directions[:, 1])
            turns = np.abs((np.diff(angles) + math.pi) % (2 * math.pi) - math.pi)
            assert (turns < math.pi / 2 / LRA32.continuity + 1e-9).all()
            for paddle in path:  # every paddle is drawn at full contrast (the image's maximum) next to it
                low, high = (
                    np.floor(paddle.min(axis=0)).astype(int).clip(1) - 1,
                    np.ceil(paddle.max(axis=0)).astype(int) + 2,
                )
                assert image.pixels[low[0] : high[0], low[1] : high[1]].max() == 255


def test_the_same_seed_gives_the_same_images(images):
    again = generate_pathfinder(LRA32, 8, seed=3)
    assert all((a.pixels == b.pixels).all() and a.label == b.label for a, b in zip(images, again, strict=True))
    other = generate_pathfinder(LRA32, 8, seed=4)
    assert not all((a.pixels == b.pixels).all() for a, b in zip(images, other, strict=True))


def test_parallel_generation_gives_the_same_images(monkeypatch):
    from tasks.data import pathfinder

    monkeypatch.setattr(pathfinder, "CHUNK", 3)
    settings = replace(LRA32, resolution=16, contour_length=4, seed_distance=3.0, distractors=4)
    serial = generate_pathfinder(settings, 7, seed=1)
    parallel = generate_pathfinder(settings, 7, seed=1, workers=2)
    assert all((a.pixels == b.pixels).all() for a, b in zip(serial, parallel, strict=True))


def test_difficulty_parameters_change_the_images(images):
    longer = generate_pathfinder(replace(LRA32, contour_length=9), 8, seed=3)
    assert all(len(image.paths[0]) == 9 for image in longer)
    assert not all((a.pixels == b.pixels).all() for a, b in zip(images, longer, strict=True))
    clean = generate_pathfinder(replace(LRA32, distractors=0), 8, seed=3)
    assert all(not image.distractors for image in clean)
    assert sum(len(image.distractors) for image in images) > 0
    lit = lambda batch: np.mean([(image.pixels > 0).sum() for image in batch])
    assert lit(clean) < lit(images)


def test_lra_defaults_and_path_x():
    assert (LRA32.contour_length, LRA32.paddle_length, LRA32.paddle_margins) == (14, 2, (1,))
    assert (LRA32.distractors, LRA32.marker_radius, LRA32.antialias) == (20, 1.5, 2)
    assert (LRA32.distractor_length, LRA32.num_distractor_paths) == (4, 5)
    path_x = lra_settings(128)
    assert (path_x.paddle_margins, path_x.seed_distance, path_x.marker_radius) == ((2, 3), 20.0, 3.0)
    assert lra_settings(16).seed_distance == 3.5  # another resolution: the nearest LRA one's, scaled


def test_impossible_settings_fail_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="seed_distance=7.0 leaves no room"):
        PathfinderDataModule(resolution=16, seed_distance=7.0, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="paddle_margin must be an int >= 1"):
        PathfinderDataModule(paddle_margin=0, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="train_size must be an int >= 1"):
        PathfinderDataModule(train_size=0, cache_dir=str(tmp_path))


def test_data_module_contract_and_fixed_evaluation_sets(tmp_path):
    dm = PathfinderDataModule(**SMALL, train_size=12, val_size=6, test_size=6, batch_size=4, cache_dir=str(tmp_path))
    assert (dm.vocab_size, dm.max_seq_len, dm.num_classes, dm.pad_id, dm.target) == (257, 256, 2, PAD_ID, "sequence")
    dm.prepare_data()
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch["tokens"].shape == (4, 256) and batch["mask"].all() and batch["labels"].shape == (4,)
    assert int(batch["tokens"].max()) <= 255
    for split, size in (("train", 12), ("val", 6), ("test", 6)):
        assert int(dm.load_split(split).labels.sum()) == size // 2
    bigger = PathfinderDataModule(**SMALL, train_size=20, val_size=6, test_size=6, cache_dir=str(tmp_path))
    assert torch.equal(bigger.load_split("val").tokens, dm.load_split("val").tokens)
    harder = PathfinderDataModule(
        **SMALL | {"distractors": 8}, train_size=12, val_size=6, test_size=6, cache_dir=str(tmp_path)
    )
    assert harder.cache_path("val") != dm.cache_path("val")  # every generator parameter is in the cache key


def write_lra_folder(root: Path, pixels: list[np.ndarray], labels: list[int]) -> Path:
    """A difficulty folder in the LRA release's layout: grayscale PNGs under imgs/0 and metadata/0.npy, a text
    file of lines ``imgs/0 sample_<i>.png <i> <label> <snakes2's other fields>``."""
    folder = root / "curv_contour_length_14"
    (folder / "imgs" / "0").mkdir(parents=True)
    (folder / "metadata").mkdir()
    lines = []
    for index, (image, label) in enumerate(zip(pixels, labels, strict=True)):
        Image.fromarray(image, mode="L").save(folder / "imgs" / "0" / f"sample_{index}.png")
        lines.append(f"imgs/0 sample_{index}.png {index} {label} 1.0 14 4 2 0.5 1 1")
    (folder / "metadata" / "0.npy").write_text("\n".join(lines) + "\n")
    return folder


def test_lra_release_reader(tmp_path):
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, (32, 32), dtype=np.uint8) for _ in range(10)]
    folder = write_lra_folder(tmp_path, pixels, [index % 2 for index in range(10)])
    # a gray image saved by matplotlib (RGBA) reads the same, and an empty file is skipped as LRA does
    rgba = np.dstack([pixels[1]] * 3 + [np.full((32, 32), 255, dtype=np.uint8)])
    matplotlib.image.imsave(folder / "imgs" / "0" / "sample_1.png", rgba)
    (folder / "imgs" / "0" / "sample_10.png").write_bytes(b"")
    with (folder / "metadata" / "0.npy").open("a") as file:
        file.write("imgs/0 sample_10.png 10 1 1.0 14 4 2 0.5 1 1\n")
    images, labels, empty = read_lra_folder(folder, 32)
    assert empty == 1
    np.testing.assert_array_equal(images, np.stack([p.reshape(-1) for p in pixels]))
    np.testing.assert_array_equal(labels, [index % 2 for index in range(10)])

    with pytest.warns(UserWarning, match="skipped 1 empty image"):
        dm = PathfinderDataModule(data_dir=str(folder), cache_dir=str(tmp_path / "cache"))
        splits = {split: dm.load_split(split) for split in ("train", "val", "test")}
    assert [len(splits[split]) for split in ("train", "val", "test")] == [8, 1, 1]
    seen = sorted(bytes(splits[s].sequence(i).to(torch.uint8).tolist()) for s in splits for i in range(len(splits[s])))
    assert seen == sorted(bytes(p.reshape(-1).tolist()) for p in pixels)


def test_lra_reader_errors_name_the_file_and_line(tmp_path):
    pixels = [np.zeros((32, 32), dtype=np.uint8)] * 2
    folder = write_lra_folder(tmp_path, pixels, [0, 1])
    with pytest.raises(DataError, match=r"no metadata/\*\.npy in .*these sub-folders have one: \['curv_contour"):
        read_lra_folder(tmp_path, 32)
    with pytest.raises(DataError, match=r"is 32x32, not 16x16"):
        read_lra_folder(folder, 16)
    (folder / "imgs" / "0" / "sample_1.png").unlink()
    with pytest.raises(DataError, match=r"0\.npy' line 2: image .*sample_1\.png' does not exist"):
        read_lra_folder(folder, 32)
    (folder / "metadata" / "0.npy").write_text("imgs/0 sample_0.png 0 yes\n")
    with pytest.raises(DataError, match=r"0\.npy' line 1: expected '<folder> <file> <index> <label 0 or 1>"):
        read_lra_folder(folder, 32)
