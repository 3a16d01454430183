"""A sweep's results on disk, safe against a kill at any moment, and the machine they came from.

``results.jsonl`` is the source of truth: one JSON object per finished case (its parameters, what was
measured, ``machine``). Each line goes out in one ``os.write`` on an ``O_APPEND`` descriptor, then
``fsync``. A kill mid-write can at worst leave a last line without its newline: opening the store cuts
that fragment off (and says so, as a ``UserWarning``) before anything is appended; that is the only damage a
resume repairs. Any other line that is not a result row (not JSON, not an object, without a case's fields or
status) is a ``ValueError`` naming the file and line: a row is never dropped unseen. ``results.csv`` is rebuilt
from it into a temporary file renamed over the old one.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import platform
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import attention_zoo
from experiments.bench.cases import BenchConfig, Case
from experiments.bench.tables import is_baseline
from experiments.records import checked_json_lines, lacking

CASE_FIELDS = tuple(f.name for f in dataclasses.fields(Case))
#: the case field each sweep setting sets, by which a setting named with ``--report-only`` selects stored rows
SELECTING_SETTINGS = {"seq_lens": "seq_len", "batch": "batch", "heads": "heads", "dim_head": "dim_head",
                      "levels": "level", "modes": "mode", "dtypes": "dtype", "threads": "threads", "device": "device",
                      "causal": "causal", "dim": "dim", "depth": "depth", "ff_mult": "ff_mult",
                      "vocab_size": "vocab_size"}  # fmt: skip


class HalfWrittenLine(UserWarning):
    """A record's last line that a killed writer left without its end: reported, then skipped."""


def case_of(row: dict[str, Any]) -> Case:
    return Case(**{name: row[name] for name in CASE_FIELDS})


class ResultStore:
    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "results.jsonl"
        self.rows: list[dict[str, Any]] = self._load()

    def _load(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        result = lacking((*CASE_FIELDS, "status"), "not a zoo bench result")
        rows, fragment = checked_json_lines(self.path, result, repair=True)  # checked before the file is touched
        if fragment:
            message = f"{self.path}: dropping a half-written last line ({len(fragment)} bytes)"
            warnings.warn(message, HalfWrittenLine, stacklevel=3)
        return rows

    def append(self, row: dict[str, Any]) -> None:
        line = (json.dumps(row, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.rows.append(row)

    def latest(self) -> dict[str, dict[str, Any]]:
        """The last row recorded for each case key (a retried case replaces its earlier result)."""
        return {case_of(row).key(): row for row in self.rows}

    def best(self) -> dict[str, dict[str, Any]]:
        """Each case key's result: of the rows measured with the code of its last row, the ok one with the
        smallest ``time_ms_min`` (a sweep of several rounds reports each case's fastest), with ``rounds``, how
        many ok rows it was chosen from; the last row where none is ok or the rows carry no time (max batch)."""
        latest = self.latest()
        chosen: dict[str, dict[str, Any]] = {}
        counts: dict[str, int] = {}
        for row in self.rows:
            key = case_of(row).key()
            if row.get("code") != latest[key].get("code") or row["status"] != "ok" or "time_ms_min" not in row:
                continue
            counts[key] = counts.get(key, 0) + 1
            if key not in chosen or row["time_ms_min"] < chosen[key]["time_ms_min"]:
                chosen[key] = row
        return {key: chosen[key] | {"rounds": counts[key]} if key in chosen else row for key, row in latest.items()}

    def write_csv(self) -> Path:
        rows = [_flat(row) for row in self.best().values()]
        columns = list(dict.fromkeys(key for row in rows for key in row))
        path = self.out_dir / "results.csv"
        temporary = path.with_suffix(".csv.tmp")
        with open(temporary, "w", newline="") as handle:
            writer = csv.DictWriter(handle, columns)
            writer.writeheader()
            writer.writerows(rows)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        return path


def selected_rows(rows: list[dict[str, Any]], config: BenchConfig, named: set[str]) -> list[dict[str, Any]]:
    """The stored ``rows`` that the sweep settings in ``named`` (those set on the command line or in the
    ``--config`` file) select; all of them when none is named.

    ``attentions`` selects each mechanism named with at least the options given (``linformer``: every Linformer
    stored; ``linformer:k=64``: those with k = 64) and keeps full attention, the baseline of every ratio. Each
    setting of a case (:data:`SELECTING_SETTINGS`) selects the rows with one of its values (``seq_lens`` by n;
    ``device: auto`` names no device). Settings of how to measure (repeats, rounds, ...) select nothing.
    """
    wanted = {}
    for setting in sorted(named & set(SELECTING_SETTINGS)):
        value = getattr(config, setting)
        if setting != "device" or value != "auto":
            wanted[SELECTING_SETTINGS[setting]] = value if isinstance(value, list) else [value]
    # the options as a row stores them (JSON: a tuple comes back a list)
    specs = [(e.spec.name, json.loads(json.dumps(e.spec.options))) for e in config.attentions]

    def mechanism_named(row: dict[str, Any]) -> bool:
        return is_baseline(row) or any(
            row["attention"] == name and all(row["options"].get(k, object()) == v for k, v in options.items())
            for name, options in specs
        )

    return [
        row
        for row in rows
        if all(row[field] in values for field, values in wanted.items())
        and ("attentions" not in named or mechanism_named(row))
    ]


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in row.items():
        if key == "machine":
            out.update({f"machine.{k}": v for k, v in value.items()})
        elif isinstance(value, (dict, list)):
            out[key] = json.dumps(value, sort_keys=True)
        else:
            out[key] = value
    return out


def machine_info(device: str) -> dict[str, Any]:
    """What a reader needs to judge the numbers: device, CPU, memory, versions."""
    info: dict[str, Any] = {
        "device": device,
        "device_name": _cpu_model() if device == "cpu" else torch.cuda.get_device_name(0),
        "cpu_model": _cpu_model(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            cuda=torch.version.cuda,
            gpu_memory_gb=round(props.total_memory / 2**30, 1),
            compute_capability=f"{props.major}.{props.minor}",
        )
    return info


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def code_fingerprint() -> str:
    """A short hash of the attention library's source: a stored result counts as finished for a resume
    only when it was measured with the same code, so an edited mechanism is never reported with old times."""
    digest = hashlib.sha256()
    for path in sorted(Path(attention_zoo.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json_lines(path: Path | None, lines: list[str]) -> None:
    """The JSON lines so far, to ``path`` (its folder made if missing); nothing without a path. A bench that writes
    after every case loses no finished case when it is interrupted."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
