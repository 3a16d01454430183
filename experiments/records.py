"""Reading back the record files the zoo writes (``runs.csv``, a study's CSVs, JSON records, JSON-lines results),
checked, so that a truncated or corrupt file is refused in one line naming it (and its line), never read as fewer
rows; only the half-written last line of a killed JSON-lines writer is handed back, for its caller to report."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def read_json_lines(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], bytes]:
    """(line number, row) of each line of a JSON-lines record, and the fragment after its last line end that
    does not parse (``b""`` when there is none): the half-written line of a writer killed mid-line, for the
    caller to report and skip. A last line without its line end that parses is a row. Any other line that is
    not a JSON object is a ``ValueError`` naming the file, the line and what is wrong."""
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    lines, tail = data[:cut].splitlines(), data[cut:]
    fragment = b""
    if tail.strip():
        try:
            json.loads(tail)
            lines.append(tail)
        except ValueError:  # JSONDecodeError, or UnicodeDecodeError of a line cut inside a character
            fragment = tail
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            reason = f"{error.msg}, column {error.colno}" if isinstance(error, json.JSONDecodeError) else "not UTF-8"
            raise ValueError(f"{path} line {number}: not JSON ({reason}): a corrupt line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {number}: expected a JSON object {{...}}, got {type(row).__name__}")
        rows.append((number, row))
    return rows, fragment


def end_with_whole_line(path: Path, fragment: bytes) -> None:
    """Cut the half-written ``fragment`` that :func:`read_json_lines` found off the end of ``path``, and end a last
    line that lacks its line end, so that what is appended next starts a line of its own."""
    size = path.stat().st_size - len(fragment)
    with open(path, "r+b") as handle:
        handle.truncate(size)
        if size:
            handle.seek(size - 1)
            if handle.read(1) != b"\n":
                handle.write(b"\n")
        os.fsync(handle.fileno())


def checked_json_lines(
    path: Path, problem: Callable[[dict[str, Any]], str | None], *, repair: bool
) -> tuple[list[dict[str, Any]], bytes]:
    """The rows of a JSON-lines record (:func:`read_json_lines`), each checked by ``problem`` (what is wrong with
    a row, None when nothing is: a ``ValueError`` naming the file and line), and the half-written fragment after
    its last line end, for the caller to report. With ``repair`` that fragment is cut off once every row has passed
    (:func:`end_with_whole_line`), so that what is appended next starts a line of its own."""
    numbered, fragment = read_json_lines(path)
    for number, row in numbered:
        if (why := problem(row)) is not None:
            raise ValueError(f"{path} line {number}: {why}")
    if repair:
        end_with_whole_line(path, fragment)
    return [row for _, row in numbered], fragment


def lacking(fields: tuple[str, ...], what: str) -> Callable[[dict[str, Any]], str | None]:
    """A ``problem`` for :func:`checked_json_lines`: a row without one of ``fields`` is not ``what``."""

    def problem(row: dict[str, Any]) -> str | None:
        missing = [name for name in fields if name not in row]
        return f"{what}: no {', '.join(missing)}" if missing else None

    return problem
