"""Reading back the record files the zoo writes (``runs.csv``, a study's CSVs, JSON records), checked, so that a
truncated or corrupt file is refused in one line naming it (and its line), never read as fewer rows."""

from __future__ import annotations

import csv
import io
from pathlib import Path


def read_text(path: Path, what: str) -> str:
    """The text of a record file; ValueError naming it when it is missing, unreadable or not UTF-8 text."""
    if not path.is_file():
        raise ValueError(f"{path.parent} has no {path.name}: not {what}")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"{path}: cannot read it ({error.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}): a binary or corrupt file, not {what}") from None
    if "\0" in text:
        raise ValueError(f"{path}: a NUL character: a binary or corrupt file, not {what}")
    return text


def csv_fields(path: Path, what: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The header of a CSV record and its rows as ``(where, fields)`` (``where``: the file and line, for messages),
    blank lines skipped; ValueError naming the file and line when the file is missing or not text
    (:func:`read_text`), empty, not CSV, has a row with another field count than its header, or does not end in a
    line end (a file cut anywhere fails one of these)."""
    text = read_text(path, what)
    reader = csv.reader(io.StringIO(text, newline=""))
    rows = []
    try:
        header = next(reader, None)
        if not header:
            raise ValueError(f"{path}: empty: not {what}")
        for fields in reader:
            if not fields:
                continue
            where = f"{path} line {reader.line_num}"
            if len(fields) != len(header):
                raise ValueError(
                    f"{where}: {len(fields)} fields, the header has {len(header)}: a truncated or corrupt file"
                )
            rows.append((where, fields))
    except csv.Error as error:
        raise ValueError(f"{path} line {reader.line_num}: not CSV ({error})") from None
    if not text.endswith(("\n", "\r")):
        raise ValueError(f"{path} line {reader.line_num}: no line end: a truncated file")
    return header, rows
