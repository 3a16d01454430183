"""Long Range Arena's Retrieval task: byte-level document matching on the ACL Anthology Network (AAN).

Tay et al. 2020, "Long Range Arena: A Benchmark for Efficient Transformers", arXiv:2011.04006, Sec. 3.3: two
papers of the AAN corpus (Radev et al. 2013), label 1 when one cites the other. Each document is a sequence of
bytes cut to its first ``max_length`` (LRA: 4000) and encoded on its own by a shared encoder
(:class:`tasks.retrieval.DocumentMatching`), so the task tests how well a long text is compressed into one vector.

Format: the LRA release's ``lra_release/tsv_data/new_aan_pairs.train.tsv``, ``.eval.tsv`` (the validation split)
and ``.test.tsv``, read as ``lra_benchmarks/matching/input_pipeline.py`` reads them: no header, tab-separated,
no quoting, five fields ``label, id1, id2, text1, text2``, the label a number 0 or 1 (``1``, ``0.0``). The texts
are taken byte for byte as they stand in the file: the release writes them as Python bytes literals (``b'...'``)
and LRA's byte encoder reads that text as it is, so the ids here are LRA's bytes, shifted past the special tokens
of :mod:`tasks.data.tokenize` (``<pad>`` 0, bytes 4-259, vocabulary 260).

Batch contract (the pair form of :mod:`tasks.data.base`'s, ``target = "pair"``):

- ``"tokens"``: LongTensor ``(B, 2, N)``, the two documents of each pair, both padded with ``pad_id`` to the longest
  document of the batch (``N <= max_seq_len``; to ``max_seq_len`` with ``pad_to_max_len``);
- ``"mask"``: BoolTensor ``(B, 2, N)``, True = real byte;
- ``"labels"``: LongTensor ``(B,)``, 1 = the papers are linked by a citation.

Stored as :class:`~tasks.data.base.Sequences` with the documents of pair ``i`` at ``2i`` and ``2i + 1`` and the pair's
label on both.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from einops import rearrange
from torch import Tensor
from torch.utils.data import Dataset

from tasks.data.base import (
    DataError,
    PadCollate,
    Sequences,
    Split,
    ZooDataModule,
    derive_seed,
    epoch_and_index,
    is_count,
)
from tasks.data.tokenize import BYTE_VOCAB_SIZE, PAD_ID, SPECIAL_TOKENS, file_digest

#: the release's file of each split in ``data_dir``
RELEASE_FILES: dict[Split, str] = {
    "train": "new_aan_pairs.train.tsv",
    "val": "new_aan_pairs.eval.tsv",
    "test": "new_aan_pairs.test.tsv",
}
FIELDS = ("label", "id1", "id2", "text1", "text2")


def read_aan_tsv(path: Path, max_length: int) -> tuple[list[bytes], list[int], list[bool]]:
    """``(documents, labels, cut)`` of one release file: the two documents of each pair in turn, each cut to its
    first ``max_length`` bytes, one label per pair, and whether each document was cut; :class:`DataError`
    naming the file and line of a row that is not ``label, id1, id2, text1, text2`` with a 0/1 label and two
    non-empty texts."""
    documents, labels, cut = [], [], []
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            where = f"{str(path)!r} line {number}"
            fields = line.rstrip(b"\r\n").split(b"\t")
            if len(fields) != len(FIELDS):
                raise DataError(
                    f"{where}: {len(fields)} tab-separated fields, expected {len(FIELDS)} ({', '.join(FIELDS)})"
                )
            try:
                label = float(fields[0])
            except ValueError:
                label = math.nan
            if label not in (0.0, 1.0):
                raise DataError(f"{where}: the label must be 0 or 1, got {fields[0].decode(errors='replace')!r}")
            for text, name in ((fields[3], "text1"), (fields[4], "text2")):
                if not text:
                    raise DataError(f"{where}: {name} is empty")
                cut.append(len(text) > max_length)
                documents.append(text[:max_length])
            labels.append(int(label))
    if not labels:
        raise DataError(f"{str(path)!r} holds no pair")
    return documents, labels, cut


class PairDataset(Dataset):
    """Items ``(first (N1,), second (N2,), label ())`` from pairs stored as consecutive sequences."""

    def __init__(self, data: Sequences):
        self.data = data

    def __len__(self) -> int:
        return len(self.data) // 2

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
        _, index = epoch_and_index(key)
        return self.data.sequence(2 * index), self.data.sequence(2 * index + 1), self.data.labels[2 * index].long()


class PairCollate:
    """Stack pair items into the batch dict of this module: both documents padded to one width."""

    def __init__(self, pad_id: int, pad_to: int | None = None):
        self.pad = PadCollate(pad_id, pad_to)

    def __call__(self, items: list[tuple[Tensor, Tensor, Tensor]]) -> dict[str, Tensor]:
        flat = self.pad([(document, label) for first, second, label in items for document in (first, second)])
        return {
            "tokens": rearrange(flat["tokens"], "(b two) n -> b two n", two=2),
            "mask": rearrange(flat["mask"], "(b two) n -> b two n", two=2),
            "labels": flat["labels"][::2],
        }


class RetrievalDataModule(ZooDataModule):
    """LRA Retrieval (AAN document matching): is one paper cited by the other? Two classes, byte-level.

    Read from the LRA release's TSV files and cached (keyed by the files' names, sizes and times); nothing is
    generated, and without the files the module refuses, naming the missing one and where it comes from.
    ``max_seq_len = max_length``, the length of one document.

    Args:
        data_dir: the folder of ``new_aan_pairs.{train,eval,test}.tsv`` (``lra_release/tsv_data/`` of LRA's
            ``lra_release.gz``).
        max_length: bytes kept from the start of each document (LRA: 4000); also ``max_seq_len``.
        train_size: keep at most this many training pairs (a seeded subsample); None keeps all (LRA: 147,086).
        val_size: keep at most this many validation pairs; None keeps all (LRA: 18,090).
        test_size: keep at most this many test pairs; None keeps all (LRA: 17,437).
        **loader: plus the loader options of :class:`tasks.data.base.ZooDataModule` (``seed``, ``shuffle_seed``,
            ``batch_size`` in pairs, ``num_workers``, ``pad_to_max_len``, ``cache_dir``).
    """

    target = "pair"
    cache_name = "retrieval"

    def __init__(
        self,
        *,
        data_dir: str = "data/lra_release/tsv_data",
        max_length: int = 4000,
        train_size: int | None = None,
        val_size: int | None = None,
        test_size: int | None = None,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        if not is_count(max_length) or max_length < 1:
            raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        for split, size in self.sizes.items():
            if size is not None and (not is_count(size) or size < 1):
                raise ValueError(f"{split}_size must be None or an int >= 1, got {size!r}")
        self.data_dir = Path(data_dir)
        for name in RELEASE_FILES.values():
            if not (self.data_dir / name).is_file():
                raise FileNotFoundError(
                    f"Retrieval data_dir {data_dir!r} has no {name}: the LRA release lra_release.gz "
                    "(github.com/google-research/long-range-arena) has it in lra_release/tsv_data/"
                )
        self.max_length = max_length
        self.expose(vocab_size=BYTE_VOCAB_SIZE, max_seq_len=max_length, num_classes=2, pad_id=PAD_ID)

    def cache_params(self) -> dict:
        files = [self.data_dir / name for name in RELEASE_FILES.values()]
        source = file_digest(files, root=self.data_dir)
        return {"release": source, "max_length": self.max_length, "sizes": self.sizes, "seed": self.seed}

    def build_split(self, split: Split) -> Sequences:
        documents, labels, cut = read_aan_tsv(self.data_dir / RELEASE_FILES[split], self.max_length)
        limit = self.sizes[split]
        if limit is not None and len(labels) > limit:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "retrieval", split))
            keep = sorted(torch.randperm(len(labels), generator=generator)[:limit].tolist())
            documents, cut = ([values[2 * i + j] for i in keep for j in (0, 1)] for values in (documents, cut))
            labels = [labels[i] for i in keep]
        lengths = torch.tensor([0, *(len(document) for document in documents)], dtype=torch.int64)
        flat = bytearray(b"".join(documents))
        # bytes 0-255 become ids 4-259; int16 holds them without the int32 copy of a 4 GB training split
        tokens = torch.frombuffer(flat, dtype=torch.uint8).to(torch.int16) + len(SPECIAL_TOKENS)
        per_document = torch.tensor(labels, dtype=torch.int64).repeat_interleave(2)
        return Sequences(tokens, lengths.cumsum(0), per_document, sum(cut))

    def make_dataset(self, split: Split, data: Sequences) -> Dataset:
        return PairDataset(data)

    def collate(self) -> PairCollate:
        return PairCollate(self.pad_id, self.max_seq_len if self.pad_to_max_len else None)

    def truncation_warning(self, split: Split, data: Sequences) -> str:
        return (
            f"{data.truncated} of {len(data)} {split} documents are longer than max_length={self.max_length} bytes "
            "and were cut to their first max_length bytes (as LRA does)"
        )
