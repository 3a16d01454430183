"""What every data module shares: the batch contract, padding, seeded sampling and the on-disk cache.

Batches are dicts (the contract with the task modules in ``tasks/``):

- ``"tokens"``: LongTensor ``(B, N)``, ``N <= max_seq_len``, padded with ``pad_id`` to the longest
  sequence of the batch (to ``max_seq_len`` when ``pad_to_max_len=True``);
- ``"mask"``: BoolTensor ``(B, N)``, True = real token (the project's one mask convention);
- ``"labels"``: LongTensor ``(B,)`` when ``target == "sequence"``; ``(B, N)`` with ``-100`` = ignore when
  ``target == "token"`` (padding is always ``-100``).

A packed batch of sequence classification (data option ``pack``, :class:`PackCollate`) holds the same B examples
in R <= B rows: ``"tokens"`` and ``"mask"`` ``(R, N)``, ``"segments"`` ``(R, S + 1)`` (each row's document
boundaries, :mod:`attention_zoo.packing`) and ``"labels"`` ``(B,)`` in document order: row by row, and within a
row from its first document to its last, the order in which the task pools the documents.

Right after ``__init__`` every module exposes ``vocab_size``, ``max_seq_len``, ``num_classes``, ``pad_id``
(ints) and ``target`` (str), which LightningCLI links into the model.

Samplers yield ``(epoch, index)`` keys so that per-epoch randomness drawn inside a dataset (MLM masking)
is a pure function of ``(seed, epoch, index)``: identical with any ``num_workers``, under DDP and after a
resume. The sampler subclasses ``DistributedSampler``, so Lightning calls its ``set_epoch`` and does not
replace it under DDP; it takes the replica count from the attached trainer.

Generated or tokenised splits are cached as ``<cache_dir>/<name>/<split>-<hash>.pt``, the hash covering
every parameter that defines the data. A file is written to a temporary name and renamed into place, so
a crash never leaves a partial file under the final name; a file that cannot be read back or whose
stored parameters differ is rebuilt with a warning, never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import numbers
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from einops import rearrange
from lightning import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from attention_zoo.packing import padding_mask
from tasks.data.packing import first_fit, pack_side

Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = ("train", "val", "test")
#: the label of a position that is not scored (padding, unmasked MLM tokens, recall keys): cross-entropy's default
IGNORE_INDEX = -100
CACHE_FORMAT = 2  # bump when the stored layout or any generator changes
log = logging.getLogger(__name__)


class DataError(ValueError):
    """Data that cannot be used as asked (a file that does not parse, an empty text, an unknown label, a
    text too long): the message names the file and line, or the example, and what to change. ``zoo fit``
    prints it as a one-line error."""


def default_cache_dir() -> Path:
    """``$ZOO_CACHE`` if set, else ``~/.cache/attention-zoo``."""
    return Path(os.environ.get("ZOO_CACHE") or Path.home() / ".cache" / "attention-zoo")


def derive_seed(seed: int, *names: str | int) -> int:
    """A 63-bit seed for one purpose (a split, an epoch, an example), independent of the others."""
    text = "/".join(str(part) for part in (seed, *names))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class Sequences:
    """Ragged sequences stored flat: sequence ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``.

    ``labels`` is ``(n,)`` for one label per sequence, ``(T,)`` aligned with ``tokens`` for one label per
    token, or None when labels are drawn later (MLM). ``truncated`` counts sequences that were cut.
    """

    tokens: Tensor  # (T,) any integer dtype (stored compactly); read back as int64
    offsets: Tensor  # (n + 1,) int64
    labels: Tensor | None = None  # any integer dtype; read back as int64
    truncated: int = 0

    @classmethod
    def from_tensors(cls, sequences: Sequence[Tensor], labels: Tensor | None = None, truncated: int = 0) -> Sequences:
        """Pack 1-d token tensors; ``labels`` is one per sequence or None."""
        lengths = torch.tensor([0, *(len(s) for s in sequences)], dtype=torch.int64)
        tokens = torch.cat([s.to(torch.int32) for s in sequences]) if sequences else torch.zeros(0, dtype=torch.int32)
        return cls(tokens, lengths.cumsum(0), labels, truncated)

    @classmethod
    def from_rows(cls, tokens: Tensor, labels: Tensor) -> Sequences:
        """Pack equal-length rows: ``tokens`` and per-token ``labels``, both ``(n, N)``."""
        length = tokens.shape[1]
        offsets = torch.arange(0, tokens.numel() + 1, length, dtype=torch.int64)
        flat_tokens, flat_labels = (rearrange(t, "b n -> (b n)").to(torch.int32) for t in (tokens, labels))
        return cls(flat_tokens, offsets, flat_labels)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def sequence(self, index: int) -> Tensor:
        return self.tokens[self.offsets[index] : self.offsets[index + 1]].long()

    def token_labels(self, index: int) -> Tensor:
        return self.labels[self.offsets[index] : self.offsets[index + 1]].long()

    def validate(self) -> None:
        """Raise ValueError unless the arrays describe consistent sequences."""
        n_tokens = len(self.tokens)
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or int(self.offsets[0]) != 0:
            raise ValueError("offsets must be a 1-d tensor starting at 0")
        if int(self.offsets[-1]) != n_tokens or bool((self.lengths() < 0).any()):
            raise ValueError(f"offsets end at {int(self.offsets[-1])} but there are {n_tokens} tokens")
        if self.labels is not None and len(self.labels) not in (len(self), n_tokens):
            raise ValueError(f"{len(self.labels)} labels for {len(self)} sequences of {n_tokens} tokens")


def _compact(values: Tensor) -> Tensor:
    """``values`` in the smallest of uint8 / int16 / int32 that holds them (ListOps: uint8; bytes: int16)."""
    low, high = (int(values.min()), int(values.max())) if values.numel() else (0, 0)
    for dtype in (torch.uint8, torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return values.to(dtype)
    raise ValueError(f"token ids up to {high} do not fit in int32")


def _canonical(params: dict) -> dict:
    return json.loads(json.dumps(params, sort_keys=True))


def cache_file(cache_dir: Path, name: str, split: str, params: dict) -> Path:
    """``<cache_dir>/<name>/<split>-<hash>.pt``, the hash covering ``params`` and the cache format."""
    key = json.dumps({"format": CACHE_FORMAT, "split": split, **_canonical(params)}, sort_keys=True)
    return cache_dir / name / f"{split}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def write_atomically(path: Path, write: Callable[[object], None]) -> None:
    """Call ``write(binary_file)`` on a temporary file next to ``path``, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_or_build(path: Path, params: dict, build: Callable[[], Sequences]) -> Sequences:
    """The sequences cached at ``path`` for ``params``; built and written atomically if absent or unusable."""
    params = _canonical(params)
    if path.exists():
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
            if payload.get("format") != CACHE_FORMAT or payload.get("params") != params:
                raise ValueError("stored format or parameters differ from the requested ones")
            data = Sequences(payload["tokens"], payload["offsets"], payload.get("labels"), payload["truncated"])
            data.validate()
            return data
        except Exception as error:  # any unreadable file is rebuilt, whatever broke it
            warnings.warn(f"ignoring unusable cache file {path} ({error}); rebuilding it", stacklevel=2)
    log.info("building %s (not cached yet)", path)
    built = build()
    built.validate()
    labels = None if built.labels is None else _compact(built.labels)
    data = Sequences(_compact(built.tokens), built.offsets, labels, built.truncated)
    payload = {"format": CACHE_FORMAT, "params": params, "tokens": data.tokens, "offsets": data.offsets}
    payload |= {"truncated": data.truncated} | ({} if data.labels is None else {"labels": data.labels})
    write_atomically(path, lambda file: torch.save(payload, file))
    return data


def is_count(value: object) -> bool:
    """Whether ``value`` is an integer and not a bool (``True`` is an int to Python, never a count to a user)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def split_sizes(train_size: int, val_size: int, test_size: int) -> dict[Split, int]:
    """``{"train": train_size, "val": val_size, "test": test_size}``; ValueError naming a size that is not an
    int >= 1."""
    sizes: dict[Split, int] = {"train": train_size, "val": val_size, "test": test_size}
    for split, size in sizes.items():
        if not is_count(size) or size < 1:
            raise ValueError(f"{split}_size must be an int >= 1, got {size!r}")
    return sizes


def epoch_and_index(key: int | tuple[int, int]) -> tuple[int, int]:
    """``(epoch, index)`` from an :class:`EpochSampler` key, or epoch 0 for a plain index."""
    return (0, key) if isinstance(key, int) else key


class SequenceDataset(Dataset):
    """Items ``(tokens (N,), label ())`` or ``(tokens (N,), labels (N,))`` from stored sequences."""

    def __init__(self, data: Sequences, target: Literal["sequence", "token"]):
        self.data = data
        self.target = target

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, Tensor]:
        _, index = epoch_and_index(key)
        if self.target == "token":
            return self.data.sequence(index), self.data.token_labels(index)
        return self.data.sequence(index), self.data.labels[index].long()


class EpochSampler(DistributedSampler):
    """A ``DistributedSampler`` yielding ``(epoch, index)``; with ``redraw_per_epoch=False`` the epoch
    part is always 0, so evaluation splits see the same per-example randomness every epoch."""

    def __init__(
        self, dataset: Dataset, *, shuffle: bool, seed: int, num_replicas: int, rank: int, redraw_per_epoch: bool
    ):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.redraw_per_epoch = redraw_per_epoch

    def __iter__(self):
        epoch = self.epoch if self.redraw_per_epoch else 0
        return ((epoch, index) for index in super().__iter__())


class PadCollate:
    """Stack ``(tokens, labels)`` items into a batch dict, padding to the longest item or to ``pad_to``."""

    def __init__(self, pad_id: int, pad_to: int | None = None):
        self.pad_id = pad_id
        self.pad_to = pad_to

    def __call__(self, items: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        lengths = torch.tensor([len(tokens) for tokens, _ in items])
        width = self.pad_to or int(lengths.max())
        tokens = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.arange(width)[None, :] < lengths[:, None]
        per_token = items[0][1].ndim == 1
        labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long) if per_token else None
        for row, (item_tokens, item_labels) in enumerate(items):
            tokens[row, : len(item_tokens)] = item_tokens
            if per_token:
                labels[row, : len(item_labels)] = item_labels
        if not per_token:
            labels = torch.stack([item_labels for _, item_labels in items]).long()
        return {"tokens": tokens, "mask": mask, "labels": labels}


class PackCollate:
    """Pack ``(tokens, label)`` items of sequence classification into rows of at most ``length`` tokens, several
    examples a row, with their boundaries (the batch contract's packed form, module docstring).

    The rows are :func:`tasks.data.packing.first_fit`'s (first-fit decreasing, each row's examples in batch order);
    the labels follow the documents row by row. Rows are as wide as the fullest row, or ``length`` with ``pad_to``.
    An item longer than ``length`` is refused (the data modules truncate or refuse such examples when they build a
    split), and so is an empty one: it would have no token to pool.
    """

    def __init__(self, pad_id: int, length: int, *, pad_to: bool = False):
        self.pad_id = pad_id
        self.length = length
        self.pad_to = pad_to

    def __call__(self, items: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        sequences = [tokens for tokens, _ in items]
        empty = next((i for i, tokens in enumerate(sequences) if tokens.numel() == 0), None)
        if empty is not None:
            raise ValueError(f"cannot pack example {empty} of the batch: it has no tokens (no document to pool)")
        rows = first_fit([[tokens.numel()] for tokens in sequences], [self.length])
        width = self.length if self.pad_to else max(sum(sequences[i].numel() for i in row) for row in rows)
        tokens, segments = pack_side(sequences, rows, width, self.pad_id)
        labels = torch.stack([items[i][1] for row in rows for i in row]).long()
        return {"tokens": tokens, "mask": padding_mask(segments, width), "segments": segments, "labels": labels}


class ZooDataModule(LightningDataModule):
    """Base of every data module: shared dataloaders, padding collate, seeded splits, disk cache.

    A subclass sets ``vocab_size``, ``max_seq_len``, ``num_classes``, ``pad_id`` in ``__init__`` (:meth:`expose`),
    the class attributes ``target`` and ``cache_name``, and either ``cache_fields`` or :meth:`cache_params`
    (everything that defines the data), and implements :meth:`build_split`. :meth:`make_dataset` (MLM
    masking, translation pairs), :meth:`collate` (translation batches) and :meth:`truncation_warning` may be
    overridden.

    The arguments below are the loader options of every data module: a subclass declares its own options
    only and passes ``**loader`` on to this ``__init__``, which takes no others (a misspelt option is
    refused). The CLI follows ``**loader`` here, so ``--data.batch_size`` and the rest are options of every
    module.

    Args:
        seed: seed of the data: whatever the module draws (generation, file samples, splits, subsamples,
            masking) and, unless ``shuffle_seed`` is given, the training order.
        shuffle_seed: seed of the training order alone (None: derived from ``seed``); ``zoo compare --seeds``
            varies it, keeping the data themselves fixed.
        batch_size: examples (sequences, or translation pairs) per batch, per device under DDP.
        num_workers: DataLoader worker processes; 0 loads in the main process.
        pad_to_max_len: pad every batch to the module's longest allowed length instead of to its longest
            example: ``max_seq_len``, or for translation ``max_source_len`` and ``max_target_len``.
        cache_dir: where generated/tokenised splits are cached; default ``$ZOO_CACHE`` or
            ``~/.cache/attention-zoo``.
    """

    target: ClassVar[Literal["sequence", "token"]]
    cache_name: ClassVar[str]
    #: the attributes that, with ``seed``, define the data: the default :meth:`cache_params`
    cache_fields: ClassVar[tuple[str, ...]] = ()

    vocab_size: int
    max_seq_len: int
    num_classes: int
    pad_id: int

    def __init__(
        self,
        *,
        seed: int = 0,
        shuffle_seed: int | None = None,
        batch_size: int = 32,
        num_workers: int = 0,
        pad_to_max_len: bool = False,
        cache_dir: str | None = None,
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.seed = seed
        self.shuffle_seed = shuffle_seed
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pad_to_max_len = pad_to_max_len
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.splits: dict[Split, Sequences] = {}

    def expose(self, *, vocab_size: int, max_seq_len: int, num_classes: int, pad_id: int) -> None:
        """Set the sizes the model is built with (LightningCLI links them) and the padding id."""
        self.vocab_size, self.max_seq_len, self.num_classes, self.pad_id = vocab_size, max_seq_len, num_classes, pad_id

    def cache_params(self) -> dict:
        """JSON-serialisable parameters that fully define the data of every split (the cache key); by
        default the attributes named in ``cache_fields`` and ``seed``."""
        if not self.cache_fields:
            raise NotImplementedError(f"{type(self).__name__} defines neither cache_fields nor cache_params")
        return {name: getattr(self, name) for name in self.cache_fields} | {"seed": self.seed}

    def build_split(self, split: Split) -> Sequences:
        """Generate or read and tokenise one split."""
        raise NotImplementedError

    def make_dataset(self, split: Split, data: Sequences) -> Dataset:
        return SequenceDataset(data, self.target)

    def collate(self) -> Callable[[list], dict[str, Tensor]]:
        """Turns a list of :meth:`make_dataset` items into a batch dict."""
        return PadCollate(self.pad_id, self.max_seq_len if self.pad_to_max_len else None)

    def cache_path(self, split: Split) -> Path:
        return cache_file(self.cache_dir, self.cache_name, split, self.cache_params())

    def load_split(self, split: Split) -> Sequences:
        """The split, from memory, from the cache, or built (and cached); when it is first loaded, a split
        with truncated (or dropped) examples is warned about in the words of :meth:`truncation_warning`."""
        if split not in self.splits:
            params = self.cache_params()
            path = cache_file(self.cache_dir, self.cache_name, split, params)
            self.splits[split] = load_or_build(path, params, lambda: self.build_split(split))
            if self.splits[split].truncated:
                warnings.warn(self.truncation_warning(split, self.splits[split]), stacklevel=2)
        return self.splits[split]

    def truncation_warning(self, split: Split, data: Sequences) -> str:
        """What :meth:`load_split` says about a split in which ``data.truncated`` examples were cut."""
        return f"{data.truncated} of {len(data)} {split} sequences were truncated"

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node before setup: every split is built and cached once.
        for split in SPLITS:
            self.load_split(split)

    def setup(self, stage: str | None = None) -> None:
        needed = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}
        for split in needed.get(stage, SPLITS):
            self.load_split(split)

    def order_seed(self) -> int:
        """The seed of the training order: from ``shuffle_seed`` when given, else from ``seed``."""
        if self.shuffle_seed is None:
            return derive_seed(self.seed, "shuffle")
        return derive_seed(self.shuffle_seed, "order")

    def _replicas(self) -> tuple[int, int]:
        kwargs = getattr(self.trainer, "distributed_sampler_kwargs", None) if self.trainer is not None else None
        return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)

    def _loader(self, split: Split) -> DataLoader:
        dataset = self.make_dataset(split, self.load_split(split))
        num_replicas, rank = self._replicas()
        train = split == "train"
        sampler = EpochSampler(
            dataset,
            shuffle=train,
            seed=self.order_seed(),
            num_replicas=num_replicas,
            rank=rank,
            redraw_per_epoch=train,
        )
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=self.collate(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")
