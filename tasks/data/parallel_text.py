"""Sentence pairs from local files (``files`` source) or Hugging Face ``datasets`` (``hf`` source).

File formats, chosen by the path:

- ``<prefix>`` (no ``.tsv``/``.jsonl`` suffix): two line-aligned UTF-8 text files ``<prefix>.<source_lang>``
  and ``<prefix>.<target_lang>``, one sentence per line; the layout of WMT's training corpora and of
  newstest once unwrapped from SGML (``train.en`` + ``train.de``). Only ``\\n`` ends a line (a stray
  ``\\r`` or ``\\u2028`` inside a sentence does not shift the alignment); both files must have the same
  number of lines.
- ``*.tsv``: ``source<TAB>target`` per line, exactly two fields, no quoting (sentences contain quotes).
- ``*.jsonl``: one JSON object per line; ``source_field`` and ``target_field`` name the fields, a dotted
  name reaching into nested objects (``translation.en`` reads Hugging Face's layout).

A blank line (empty or whitespace only) means the same in every format: an empty pair in TSV and JSONL, an
empty side in line-aligned files (where it keeps its place, so the lines after it stay aligned). It is not an
error: the corpus drops the pair and counts it with the other empty pairs (``corpus_summary()["dropped"]["empty"]``).

A UTF-8 byte order mark at the start of a file is dropped. Errors name the file and its real (1-based) line
number. The Hugging Face reader takes the splits ``train``, ``validation`` and ``test``; rows with a
``translation`` column are read as ``translation[source_lang]`` / ``translation[target_lang]`` (the layout of
``wmt14``, ``de-en``), other datasets by ``source_field`` / ``target_field``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.data.base import DataError

Pair = tuple[str, str]
HF_SPLITS = {"train": "train", "val": "validation", "test": "test"}


def data_files(path: str, source_lang: str, target_lang: str) -> list[Path]:
    """The file(s) that ``path`` names: itself (TSV, JSONL) or the two line-aligned files of a prefix."""
    if path.endswith((".tsv", ".jsonl")):
        return [Path(path)]
    return [Path(f"{path}.{source_lang}"), Path(f"{path}.{target_lang}")]


def _lines(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    data = path.read_bytes()
    try:
        # utf-8-sig: a byte order mark opening the file is dropped, as the text classification reader drops it
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise DataError(
            f"{str(path)!r} line {line}: not valid utf-8 (byte {data[error.start]:#04x}: {error.reason})"
        ) from None
    lines = text.split("\n")  # only \n ends a line
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _field(record: object, name: str, path: Path, number: int) -> str:
    value = record
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            keys = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise DataError(f"{path}:{number}: no field {name!r} (at {part!r}: found {keys})")
        value = value[part]
    if not isinstance(value, str):
        raise DataError(f"{path}:{number}: field {name!r} is a {type(value).__name__}, not a string")
    return value


def read_pairs(path: str, *, source_lang: str, target_lang: str, source_field: str, target_field: str) -> list[Pair]:
    """Every pair of one split's file(s), in file order (empty ones included; the caller filters)."""
    files = data_files(path, source_lang, target_lang)
    if len(files) == 2:
        sources, targets = _lines(files[0]), _lines(files[1])
        if len(sources) != len(targets):
            longer, shorter = files if len(sources) > len(targets) else files[::-1]
            raise DataError(
                f"{str(longer)!r} line {min(len(sources), len(targets)) + 1} has no counterpart in {str(shorter)!r}: "
                f"line-aligned files differ in length ({files[0].name} has {len(sources)} lines, {files[1].name} "
                f"has {len(targets)})"
            )
        return list(zip(sources, targets, strict=True))
    pairs = []
    for number, line in enumerate(_lines(files[0]), start=1):
        if not line.strip():
            pairs.append(("", ""))
        elif path.endswith(".tsv"):
            fields = line.split("\t")
            if len(fields) != 2:
                raise DataError(
                    f"{files[0]}:{number}: expected 2 tab-separated fields (source, target), got {len(fields)}"
                )
            pairs.append((fields[0], fields[1]))
        else:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{files[0]}:{number}: not valid JSON ({error})") from None
            pairs.append(
                (_field(record, source_field, files[0], number), _field(record, target_field, files[0], number))
            )
    return pairs


def read_hf_pairs(
    name: str,
    config: str | None,
    hf_data_files: dict[str, str] | None,
    *,
    source_lang: str,
    target_lang: str,
    source_field: str,
    target_field: str,
) -> dict[str, list[Pair] | None]:
    """The pairs of each split of a Hugging Face dataset; None for a split the dataset does not have."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, data_files=hf_data_files)
    except Exception as error:  # network, name, config or cache errors all end here; the cause is chained
        raise RuntimeError(
            f"could not load Hugging Face dataset {name!r} (config {config!r}): {error}. A hub dataset needs "
            f"network access the first time or a local Hugging Face cache; local files load with "
            f"hf_dataset='json' and hf_data_files"
        ) from error
    if "train" not in dataset:
        raise DataError(f"Hugging Face dataset {name!r} has no 'train' split; it has {list(dataset)}")
    splits: dict[str, list[Pair] | None] = {}
    for split, hf_split in HF_SPLITS.items():
        if hf_split not in dataset:
            splits[split] = None
            continue
        part = dataset[hf_split]
        where = Path(f"{name}[{hf_split}]")
        if "translation" in part.column_names:
            fields = f"translation.{source_lang}", f"translation.{target_lang}"
        else:
            fields = source_field, target_field
        splits[split] = [
            (_field(row, fields[0], where, number), _field(row, fields[1], where, number))
            for number, row in enumerate(part, start=1)
        ]
    return splits
