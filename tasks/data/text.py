"""Text classification from local files.

Sources (exactly one):

- ``data_dir``: a folder in the aclImdb layout (Maas et al. 2011), ``<data_dir>/train/<label>/*.txt``,
  optional ``<data_dir>/val/<label>/*.txt``, ``<data_dir>/test/<label>/*.txt``; the labels are the
  sub-folders of ``train/`` (aclImdb's unlabelled ``train/unsup`` is skipped).
- ``train_file`` (and optional ``val_file``, ``test_file``): CSV, TSV (Python ``csv`` quoting) or JSON
  Lines, chosen by suffix, with ``text_column`` and ``label_column``.
- ``hf_dataset``: a Hugging Face ``datasets`` name, splits ``train``, ``validation``, ``test``; only when
  the package is installed, and it needs network access or a local HF cache.

A split without a source (val, test) is carved from train (``val_fraction``, ``test_fraction``), seeded.
Labels are mapped to ids in the order of ``labels`` if given, else sorted (numerically if all are
integers) as found in the training split; ``label_names`` exposes the mapping. Labels of files and
datasets are read as text with surrounding spaces dropped, numbers in one spelling (``" 1"``, ``"1.0"``,
``1`` and ``"1"`` are all label ``"1"``; merged spellings are reported in a warning); folder names are
taken as they are. The number of classes and the labels in id order are printed when the module is built,
before training.

Files are decoded with ``encoding`` (default UTF-8, a leading byte-order mark dropped). Every problem in
a file is a :class:`~tasks.data.base.DataError` naming the file and its line (a folder source: the file):
bytes that are not valid in ``encoding`` or a NUL character (binary data), a line that is not valid
JSON or not a JSON object, a CSV/TSV row with more or fewer fields than the header (an unquoted comma in a
text), a missing column, an empty label, a text that is not a string. A text that is
missing, JSON ``null`` or empty is an error too, unless ``empty_text="skip"`` drops such rows (their
count and places are reported in a warning).

Tokenizers (``byte``, ``bpe``, ``wordpiece``) live in :mod:`tasks.data.tokenize`.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from tasks.data.base import SPLITS, DataError, PackCollate, Sequences, Split, derive_seed
from tasks.data.tokenize import CLS_ID, PAD_ID, TokenizedDataModule, TokenizerKind, file_digest

Truncation = Literal["error", "keep_head", "keep_tail"]
EmptyText = Literal["error", "skip"]
TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl")
LABELS_SHOWN = 20  # label names printed before training; a larger set is summarised by its count
UNLABELLED_FOLDERS = {"unsup"}
Record = tuple[str, str]  # (text, label name)


def normalise_label(value: Any) -> str:
    """A label as text: surrounding spaces dropped, a number in one spelling (``" 1"``, ``"1.0"``, ``1``
    -> ``"1"``; ``"0.50"`` -> ``"0.5"``); anything else unchanged."""
    label = str(value).strip()
    for parse in (int, float):
        try:
            number = parse(label)
        except ValueError:
            continue
        if isinstance(number, float):
            if not math.isfinite(number):
                return label
            return str(int(number)) if number.is_integer() else repr(number)
        return str(number)
    return label


def decode_file(path: Path, encoding: str) -> str:
    """The text of ``path``; :class:`DataError` naming the file and line of the first byte that is not
    valid in ``encoding``, or of a NUL character (binary data)."""
    data = path.read_bytes()
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise DataError(
            f"{str(path)!r} line {line}: not valid {encoding} (byte {data[error.start]:#04x}: {error.reason}); "
            f"set the data module's encoding to the file's, e.g. encoding='latin-1'"
        ) from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise DataError(f"{str(path)!r} line {line}: a NUL character: binary data, not {encoding} text")
    return text.removeprefix("\ufeff")


class EmptyTexts:
    """Applies ``empty_text`` to the texts of one source: an empty one (missing, JSON null or '') raises
    :class:`DataError` naming its place, or is counted and skipped, then reported by :meth:`report`."""

    def __init__(self, policy: EmptyText, source: str) -> None:
        self.policy, self.source, self.skipped = policy, source, []

    def keep(self, text: Any, place: str) -> bool:
        if text is not None and text != "":
            if not isinstance(text, str):
                raise DataError(f"{self.source} {place}: the text must be a string, got {type(text).__name__} {text!r}")
            return True
        if self.policy == "error":
            raise DataError(
                f"{self.source} {place}: the text is empty (missing, null or ''); fix the row, or set "
                f"empty_text='skip' to drop such rows"
            )
        self.skipped.append(place)
        return False

    def report(self) -> None:
        if self.skipped:
            places = ", ".join(self.skipped[:5]) + (", ..." if len(self.skipped) > 5 else "")
            warnings.warn(
                f"skipped {len(self.skipped)} empty text(s) in {self.source} (empty_text='skip'): {places}",
                stacklevel=3,
            )


def _label_folders(split_dir: Path) -> dict[str, list[Path]]:
    """The ``*.txt`` files of each label folder of ``split_dir``, sorted; unlabelled folders skipped."""
    folders = sorted(d for d in split_dir.iterdir() if d.is_dir() and d.name not in UNLABELLED_FOLDERS)
    return {folder.name: sorted(folder.glob("*.txt")) for folder in folders}


def _read_folder(split_dir: Path, label_names: Sequence[str], encoding: str, empty_text: EmptyText) -> list[Record]:
    files = _label_folders(split_dir)
    unknown = sorted(set(files) - set(label_names))
    if unknown:
        raise DataError(f"unknown label folder(s) {unknown} in {split_dir}; known labels: {list(label_names)}")
    empty = EmptyTexts(empty_text, repr(str(split_dir)))
    records = []
    for label, paths in files.items():
        for path in paths:
            text = decode_file(path, encoding)
            if empty.keep(text, f"file {str(path.relative_to(split_dir))!r}"):
                records.append((text, label))
    empty.report()
    return records


def _table_rows(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    """``(line number, row)`` of a JSONL, CSV or TSV text; a row is what the line holds (a dict for
    CSV/TSV); a line that does not parse raises :class:`DataError` naming it."""
    if path.suffix == ".jsonl":
        for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON strings may hold U+2028
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{str(path)!r} line {number}: not valid JSON ({error.msg}, column {error.colno})"
                ) from None
        return
    delimiter = "\t" if path.suffix == ".tsv" else ","
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        for row in reader:
            # DictReader files surplus fields under None and fills missing ones with None: a text holding an
            # unquoted delimiter would otherwise be cut short and its remainder read as the label
            if None in row or None in row.values():
                header = reader.fieldnames or []
                fields = len(header) + len(row[None]) if None in row else sum(v is not None for v in row.values())
                raise DataError(
                    f"{str(path)!r} line {reader.line_num}: {fields} fields, the header has {len(header)} "
                    f"({', '.join(header)}); quote a field that holds the delimiter {delimiter!r} "
                    '(e.g. "bad, really bad")'
                )
            yield reader.line_num, row
    except csv.Error as error:
        raise DataError(f"{str(path)!r} line {reader.line_num}: {error}") from None


def _read_table(path: Path, text_column: str, label_column: str, encoding: str, empty_text: EmptyText) -> list[Record]:
    if path.suffix not in TABLE_SUFFIXES:
        raise ValueError(f"cannot read {str(path)!r}: the suffix must be one of {TABLE_SUFFIXES}")
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    empty = EmptyTexts(empty_text, repr(str(path)))
    records, spellings = [], {}
    for number, row in _table_rows(path, decode_file(path, encoding)):
        where = f"{str(path)!r} line {number}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object {{...}}, got {type(row).__name__}")
        missing = [c for c in (text_column, label_column) if c not in row]
        if missing:
            raise DataError(f"{where} has no column {missing}; it has {sorted(row, key=str)}")
        if not empty.keep(row[text_column], f"line {number}"):
            continue
        raw = row[label_column]
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            raise DataError(f"{where} has an empty {label_column!r}")
        if not isinstance(raw, (str, int, float)):
            raise DataError(f"{where}: {label_column!r} must be a string or a number, got {type(raw).__name__}")
        label = normalise_label(raw)
        spellings.setdefault(label, set()).add(repr(raw))
        records.append((row[text_column], label))
    empty.report()
    _report_merged_spellings(str(path), spellings)
    return records


def _report_merged_spellings(source: str, spellings: dict[str, set[str]]) -> None:
    merged = {label: sorted(seen) for label, seen in spellings.items() if len(seen) > 1}
    if merged:
        text = "; ".join(f"{', '.join(seen)} -> {label!r}" for label, seen in sorted(merged.items()))
        warnings.warn(f"{source!r}: differently spelled labels were read as one label: {text}", stacklevel=3)


def _sorted_labels(labels: set[str]) -> list[str]:
    def is_int(label: str) -> bool:
        return label.lstrip("-").isdigit()

    return sorted(labels, key=int) if all(is_int(label) for label in labels) else sorted(labels)


class TextClassificationDataModule(TokenizedDataModule):
    """Sequence classification of text from local files (or, optionally, Hugging Face ``datasets``).

    ``vocab_size`` is 260 for ``byte``, ``tokenizer_vocab_size`` for a tokenizer trained here (every id
    is below it), the file's vocabulary size for ``tokenizer_file``. Texts longer than ``max_seq_len``
    tokens are an error unless ``truncation`` says what to keep; truncation is reported with a warning.

    Long Range Arena's Text task (Tay et al. 2020, arXiv:2011.04006) is this module on the aclImdb folder with
    ``tokenizer="byte"``, ``truncation="keep_head"`` and ``max_seq_len=1000``: the length of LRA's released
    ``text_classification`` config and of the Nystromformer authors' LRA data (the paper says 4K), each review's
    first 1000 UTF-8 bytes as ``lra_benchmarks/text_classification/input_pipeline.py`` cuts them.

    Args:
        data_dir: folder in the aclImdb layout (``train/<label>/*.txt``, ``test/<label>/*.txt``, optional ``val/``).
        train_file: CSV, TSV or JSONL file of training examples.
        val_file: validation examples (same format); default: carved from train.
        test_file: test examples (same format); default: carved from train.
        hf_dataset: Hugging Face dataset name (needs the ``datasets`` package and network or its cache).
        hf_config: Hugging Face dataset configuration name.
        hf_data_files: ``{split: file}`` for a file builder (``hf_dataset="json"`` or ``"csv"``: local files read
            by the real ``datasets`` package, no network); Hugging Face split names ``train``, ``validation``,
            ``test``.
        text_column: column (or JSON key) holding the text.
        label_column: column (or JSON key) holding the label.
        labels: label names in id order; default: the training labels, sorted (numerically if integers).
            With files or a dataset, numbers may be given in any spelling (``1.0`` is ``"1"``).
        val_fraction: share of train carved out as validation when there is no validation source.
        test_fraction: share of train carved out as test when there is no test source.
        train_size: keep at most this many training examples (seeded subsample); None keeps all.
        val_size: keep at most this many validation examples; None keeps all.
        test_size: keep at most this many test examples; None keeps all.
        max_seq_len: maximum tokens per sequence, ``<cls>`` included.
        truncation: what to do with a longer text: ``"error"`` (default: raise, naming the example),
            ``"keep_head"`` (keep its first tokens) or ``"keep_tail"`` (keep its last tokens).
        tokenizer: ``"byte"`` (UTF-8 bytes), ``"bpe"`` or ``"wordpiece"`` (trained on the training split).
        tokenizer_vocab_size: vocabulary size of a trained tokenizer.
        tokenizer_file: use this saved tokenizer (``tokenizers`` JSON) instead of training one.
        prepend_cls: put ``<cls>`` (id 1) before each text, for models that pool the first token.
        encoding: text encoding of the files (any Python codec name, e.g. ``"latin-1"``); bytes that are
            not valid in it are an error naming the file and line.
        empty_text: a row whose text is missing, JSON ``null`` or empty: ``"error"`` (default: raise,
            naming the file and line) or ``"skip"`` (drop it; a warning counts and places the skipped rows).
        pack: pack each batch's examples into as few rows of ``max_seq_len`` tokens as they fit in (first-fit
            decreasing, :class:`tasks.data.base.PackCollate`), with their boundaries (``segments``), instead of one
            padded row each: the same examples and labels per step, less padding; the labels come in the rows'
            document order, the order the classifier pools them in. Attention stays inside each example.
        **loader: plus the loader options of :class:`tasks.data.base.ZooDataModule` (``seed``, ``shuffle_seed``,
            ``batch_size``, ``num_workers``, ``pad_to_max_len``, ``cache_dir``).
    """

    target = "sequence"
    cache_name = "text"

    def __init__(
        self,
        *,
        data_dir: str | None = None,
        train_file: str | None = None,
        val_file: str | None = None,
        test_file: str | None = None,
        hf_dataset: str | None = None,
        hf_config: str | None = None,
        hf_data_files: dict[str, str] | None = None,
        text_column: str = "text",
        label_column: str = "label",
        labels: list[str | int] | None = None,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        train_size: int | None = None,
        val_size: int | None = None,
        test_size: int | None = None,
        max_seq_len: int = 1024,
        truncation: Truncation = "error",
        tokenizer: TokenizerKind = "byte",
        tokenizer_vocab_size: int = 8192,
        tokenizer_file: str | None = None,
        prepend_cls: bool = False,
        encoding: str = "utf-8",
        empty_text: EmptyText = "error",
        pack: bool = False,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        given = {"data_dir": data_dir, "train_file": train_file, "hf_dataset": hf_dataset}
        if sum(v is not None for v in given.values()) != 1:
            raise ValueError(f"give exactly one source of data: data_dir, train_file or hf_dataset; got {given}")
        if (val_file or test_file) and train_file is None:
            raise ValueError("val_file and test_file need train_file")
        if truncation not in ("error", "keep_head", "keep_tail"):
            raise ValueError(f"truncation must be one of 'error', 'keep_head', 'keep_tail'; got {truncation!r}")
        self.use_tokenizer(tokenizer, tokenizer_vocab_size, tokenizer_file)
        if empty_text not in ("error", "skip"):
            raise ValueError(f"empty_text must be 'error' or 'skip'; got {empty_text!r}")
        try:
            codecs.lookup(encoding)
        except LookupError:
            raise ValueError(
                f"unknown encoding {encoding!r}; give a Python codec name such as 'utf-8' or 'latin-1'"
            ) from None
        if max_seq_len < 1 + prepend_cls:
            raise ValueError(f"max_seq_len must be >= {1 + prepend_cls}, got {max_seq_len}")
        if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"need 0 <= val_fraction, test_fraction and their sum < 1; got {val_fraction}, {test_fraction}"
            )
        self.data_dir = Path(data_dir) if data_dir is not None else None
        if self.data_dir is not None and not (self.data_dir / "train").is_dir():
            raise FileNotFoundError(
                f"data_dir {data_dir!r} has no train/ folder: put the reviews there in the aclImdb layout "
                f"(train/pos, train/neg, test/pos, test/neg: aclImdb_v1.tar.gz from "
                f"https://ai.stanford.edu/~amaas/data/sentiment/, extracted), or give train_file or hf_dataset"
            )
        self.files = {
            split: Path(f) for split, f in zip(SPLITS, (train_file, val_file, test_file), strict=True) if f is not None
        }
        self.hf_dataset, self.hf_config, self.hf_data_files = hf_dataset, hf_config, hf_data_files
        self.text_column, self.label_column = text_column, label_column
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        self.truncation = truncation
        self.prepend_cls = prepend_cls
        self.encoding, self.empty_text = encoding, empty_text
        self.pack = pack
        self._raw: dict[Split, list[Record] | None] = {}  # texts of each source, dropped after setup
        self._hf_data = None
        self._fingerprint: str | None = None

        if labels is None:
            self.label_names = self._infer_labels()
        else:  # folder names are labels as they are; labels read from files and datasets are normalised
            self.label_names = [str(v) if self.data_dir is not None else normalise_label(v) for v in labels]
        if len(self.label_names) < 2 or len(set(self.label_names)) != len(self.label_names):
            raise ValueError(f"need at least 2 distinct labels, got {self.label_names}")
        self.label_to_id = {name: i for i, name in enumerate(self.label_names)}
        self.expose(
            vocab_size=self.tokenizer_capacity(),
            max_seq_len=max_seq_len,
            num_classes=len(self.label_names),
            pad_id=PAD_ID,
        )
        # before training: a label set that a malformed file or a wrong column produced shows here at once
        source = self.data_dir or self.files.get("train") or self.hf_dataset
        shown = ", ".join(self.label_names[:LABELS_SHOWN])
        more = f" and {self.num_classes - LABELS_SHOWN} more" if self.num_classes > LABELS_SHOWN else ""
        rank_zero_info(
            f"text classification from {str(source)!r}: {self.num_classes} classes (ids in order: {shown}{more})"
        )
        self.cls_id = CLS_ID

    # ---- reading -------------------------------------------------------------------------------------
    def _infer_labels(self) -> list[str]:
        if self.data_dir is not None:
            return list(_label_folders(self.data_dir / "train"))
        if self.hf_dataset is not None:
            feature = self._hf()["train"].features.get(self.label_column)
            if hasattr(feature, "names"):
                return list(feature.names)
        return _sorted_labels({label for _, label in self._raw_split("train")})

    def _hf(self):
        if self._hf_data is not None:
            return self._hf_data
        try:
            import datasets
        except ImportError as error:
            raise ImportError(
                f"hf_dataset={self.hf_dataset!r} needs the Hugging Face `datasets` package: pip install datasets "
                f"(or use data_dir / train_file for local files)"
            ) from error
        try:
            dataset = datasets.load_dataset(self.hf_dataset, self.hf_config, data_files=self.hf_data_files)
        except Exception as error:  # network, name or cache errors all end here; the cause is chained
            raise RuntimeError(
                f"could not load Hugging Face dataset {self.hf_dataset!r} (config {self.hf_config!r}): {error}. "
                f"It needs network access the first time, or a local Hugging Face cache"
            ) from error
        if "train" not in dataset:
            raise ValueError(f"Hugging Face dataset {self.hf_dataset!r} has no 'train' split; it has {list(dataset)}")
        self._hf_data = dataset
        return dataset

    def _raw_split(self, split: Split) -> list[Record] | None:
        """Records of the split's own source, before carving; None when it has none."""
        if split not in self._raw:
            self._raw[split] = self._read_source(split)
        return self._raw[split]

    def _read_source(self, split: Split) -> list[Record] | None:
        if self.data_dir is not None:
            split_dir = self.data_dir / split
            if not split_dir.is_dir():
                return None
            return _read_folder(split_dir, self.label_names, self.encoding, self.empty_text)
        if self.files:
            if split not in self.files:
                return None
            return _read_table(self.files[split], self.text_column, self.label_column, self.encoding, self.empty_text)
        dataset = self._hf()
        name = {"train": "train", "val": "validation", "test": "test"}[split]
        if name not in dataset:
            return None
        part = dataset[name]
        for column in (self.text_column, self.label_column):
            if column not in part.column_names:
                raise ValueError(f"Hugging Face split {name!r} has no column {column!r}; it has {part.column_names}")
        feature = part.features.get(self.label_column)
        names = getattr(feature, "names", None)
        empty = EmptyTexts(self.empty_text, f"Hugging Face split {name!r}")
        records, spellings = [], {}
        for row, (text, value) in enumerate(zip(part[self.text_column], part[self.label_column], strict=True)):
            if empty.keep(text, f"row {row}"):
                label = names[value] if names is not None else normalise_label(value)
                spellings.setdefault(label, set()).add(repr(value))
                records.append((text, label))
        empty.report()
        if names is None:
            _report_merged_spellings(f"Hugging Face split {name}", spellings)
        return records

    def _source_fingerprint(self) -> str:
        if self._fingerprint is None:
            if self.data_dir is not None:
                split_dirs = [self.data_dir / split for split in SPLITS if (self.data_dir / split).is_dir()]
                files = [path for d in split_dirs for paths in _label_folders(d).values() for path in paths]
                self._fingerprint = file_digest(files, root=self.data_dir)
            elif self.files:
                self._fingerprint = file_digest([self.files[s] for s in SPLITS if s in self.files])
            else:
                import datasets

                files = sorted((self.hf_data_files or {}).values())
                local = f":{file_digest([Path(f) for f in files])}" if files else ""
                self._fingerprint = f"hf:{self.hf_dataset}:{self.hf_config}{local}:datasets-{datasets.__version__}"
        return self._fingerprint

    def _carved(self) -> dict[Split, list[Record]]:
        """The training source split into train and the val/test portions of splits without a source."""
        train = self._raw_split("train")
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(derive_seed(self.seed, "carve")))
        n_test = round(self.test_fraction * len(train)) if self._raw_split("test") is None else 0
        n_val = round(self.val_fraction * len(train)) if self._raw_split("val") is None else 0
        parts = {"test": order[:n_test], "val": order[n_test : n_test + n_val], "train": order[n_test + n_val :]}
        return {split: [train[i] for i in sorted(part.tolist())] for split, part in parts.items()}

    def records(self, split: Split) -> list[Record]:
        """The split's ``(text, label)`` pairs after carving val/test out of train and subsampling."""
        own = self._raw_split(split)
        chosen = own if split != "train" and own is not None else self._carved()[split]
        limit = self.sizes[split]
        if limit is not None and len(chosen) > limit:
            keep = torch.randperm(len(chosen), generator=torch.Generator().manual_seed(derive_seed(self.seed, split)))
            chosen = [chosen[i] for i in sorted(keep[:limit].tolist())]
        if not chosen:
            raise DataError(f"the {split} split is empty; give it a source or a larger {split}_fraction")
        return chosen

    # ---- tokenising ----------------------------------------------------------------------------------
    def source_params(self) -> dict:
        return {
            "source": self._source_fingerprint(),
            "text_column": self.text_column,
            "label_column": self.label_column,
            "encoding": self.encoding,
            "empty_text": self.empty_text,
            "fractions": [self.val_fraction, self.test_fraction],
            "sizes": self.sizes,
            "seed": self.seed,
        }

    def training_texts(self) -> list[str]:
        return [text for text, _ in self.records("train")]

    def cache_params(self) -> dict:
        own = {"labels": self.label_names, "truncation": self.truncation, "prepend_cls": self.prepend_cls}
        return super().cache_params() | own

    def build_split(self, split: Split) -> Sequences:
        records = self.records(split)
        tokenizer = self.text_tokenizer()
        labels = []
        for text, label in records:
            if label not in self.label_to_id:
                raise DataError(
                    f"unknown label {label!r} in the {split} split (text {text[:40]!r}); known labels: "
                    f"{self.label_names} (set `labels` to choose them)"
                )
            labels.append(self.label_to_id[label])
        room = self.max_seq_len - self.prepend_cls
        sequences, truncated = [], 0
        for number, ids in enumerate(tokenizer.encode([text for text, _ in records])):
            example = f"example {number} of {split} ({records[number][0][:40]!r})"
            if len(ids) == 0:
                raise DataError(f"{example} is empty after tokenisation")
            if len(ids) > room:
                if self.truncation == "error":
                    raise DataError(
                        f"{example} has {len(ids)} tokens, more than max_seq_len={self.max_seq_len}"
                        f"{' minus 1 for <cls>' if self.prepend_cls else ''}; set truncation='keep_head' or "
                        f"'keep_tail', or raise max_seq_len"
                    )
                ids = ids[:room] if self.truncation == "keep_head" else ids[-room:]
                truncated += 1
            sequences.append(torch.cat([torch.tensor([CLS_ID]), ids]) if self.prepend_cls else ids)
        return Sequences.from_tensors(sequences, torch.tensor(labels, dtype=torch.int64), truncated)

    def collate(self) -> Callable[[list], dict[str, Tensor]]:
        if self.pack:
            return PackCollate(self.pad_id, self.max_seq_len, pad_to=self.pad_to_max_len)
        return super().collate()

    def truncation_warning(self, split: Split, data: Sequences) -> str:
        return (
            f"{data.truncated} of {len(data)} {split} texts are longer than max_seq_len={self.max_seq_len} "
            f"tokens and were truncated (truncation={self.truncation!r})"
        )

    def release_sources(self) -> None:
        self._raw, self._hf_data = {}, None
