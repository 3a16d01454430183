"""Paired intervals and verdicts for every speedup and scaling target: ``zoo targets --paired-rounds R``.

The sweep of ``zoo targets`` times each case in its own worker, minutes apart from its baseline, and judges a row
by a ratio of minima: a point, with no statement of how sure it is. After the sweep, this step measures the same
rows interleaved in one process (:mod:`experiments.bench.paired_ratio`): the speedups at n = 4096 against full
attention, non-causal and causal, and the scalings t(8192) / t(2048), each mechanism timed beside its baseline in
every round, and gives each row its 95% interval and a verdict (``met`` / ``missed`` only when the whole interval
is on one side of the target, else ``inconclusive``). Time only, one thread (memory needs a worker per case: the
sweep's). The rows go to ``paired.jsonl`` in the sweep's folder; a rerun with the same rounds and blocks reuses
the groups already there (each of the four groups, speed or scaling, causal or not, is one interleaved run).
``--paired-keep-freed`` measures them with glibc keeping freed memory (:mod:`experiments.bench.allocator`), rows
kept apart from the default allocator's: without it, calls of tens of MiB fault a varying number of pages in,
which widens the intervals of the rows whose time at n = 8192 is short.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from experiments.bench import paired_ratio
from experiments.bench.allocator import keep_freed_memory
from experiments.bench.store import HalfWrittenLine
from experiments.bench.targets import SPEEDUP_N, Target
from experiments.records import checked_json_lines, lacking

PAIRED_FILE = "paired.jsonl"
Kind = Literal["speed", "scaling"]
Allocator = Literal["default", "keep-freed"]
#: what every row of the file holds (the speed groups' ``full`` rows too)
PAIRED_FIELDS = ("kind", "causal", "attention", "options", "rounds", "blocks", "paired", "paired_low", "paired_high",
                 "verdict")  # fmt: skip
GROUPS: tuple[tuple[Kind, bool], ...] = (("speed", False), ("speed", True), ("scaling", False), ("scaling", True))


def entries(targets: list[Target], kind: Kind, causal: bool) -> list[tuple[str, dict]]:
    """The (mechanism, options) of the targets with a bound of this kind, non-causal or causal, in target order."""
    bound = "min_speedup" if kind == "speed" else "max_scaling"
    return [(t.attention, dict(t.options)) for t in targets if t.causal == causal and getattr(t, bound) is not None]


def _key(allocator: str, kind: str, causal: bool, attention: str, options: dict) -> tuple:
    return allocator, kind, causal, attention, json.dumps(options, sort_keys=True)


def _row_key(row: dict) -> tuple:
    return _key(row.get("allocator", "default"), row["kind"], row["causal"], row["attention"], row["options"])


def _latest(rows: list[dict]) -> dict[tuple, dict]:
    """The rows by key, the last of a key winning."""
    return {_row_key(row): row for row in rows}


def _lines(path: Path, *, repair: bool = False) -> list[dict]:
    """The rows of ``path`` (none when it does not exist), each checked (a ``ValueError`` naming the file and line).
    A half-written last line (a run killed while writing a group) is skipped with a ``UserWarning``, as the bench's
    store does; with ``repair`` it is also cut off (:func:`experiments.records.checked_json_lines`), so that the
    next group is appended after whole lines."""
    if not path.exists():
        return []
    rows, fragment = checked_json_lines(path, lacking(PAIRED_FIELDS, "not a paired target row"), repair=repair)
    if fragment:
        message = f"{path}: skipping a half-written last line ({len(fragment)} bytes)"
        warnings.warn(message, HalfWrittenLine, stacklevel=3)
    return rows


def read_rows(path: Path, *, repair: bool = False) -> list[dict]:
    """The rows of a ``paired.jsonl`` (none when it does not exist; ``repair``: as :func:`_lines`); the last row of a
    key wins."""
    return list(_latest(_lines(path, repair=repair)).values())


def run(
    targets: list[Target],
    path: Path,
    *,
    rounds: int,
    blocks: int,
    keep_freed: bool = False,
    heads: int = 8,
    dim_head: int = 64,
    console: Console | None = None,
) -> list[dict]:
    """Measure each group that ``path`` does not already hold at these rounds, blocks and allocator setting, append
    its rows (the speed groups' ``full`` too: the baseline's times), and return the targets' rows. ``keep_freed``: glibc
    keeps freed memory first (:func:`experiments.bench.allocator.keep_freed_memory`, for the rest of the process);
    rows say which (``allocator``: ``default`` or ``keep-freed``)."""
    if blocks < 1 or rounds < 1 or rounds % blocks:
        raise ValueError(f"paired rounds must be >= 1 and a multiple of the blocks (>= 1), got {rounds} and {blocks}")
    allocator: Allocator = "keep-freed" if keep_freed else "default"
    # filtered before the last row of a key is taken: rows of other rounds written later do not hide these
    done = _latest([row for row in _lines(path, repair=True) if (row["rounds"], row["blocks"]) == (rounds, blocks)])
    todo = []
    for kind, causal in GROUPS:
        group = entries(targets, kind, causal)
        if group and any(_key(allocator, kind, causal, a, o) not in done for a, o in group):
            todo.append((kind, causal, group))
    if todo and keep_freed:
        keep_freed_memory()
    with Progress(console=console or Console(stderr=True), transient=True) as progress:
        for kind, causal, group in todo:
            label = f"paired {kind}{' (causal)' if causal else ''}"
            task = progress.add_task(label, total=rounds)
            on_round: Callable[[], None] = lambda task=task: progress.advance(task)
            plan = paired_ratio.PairedRounds(causal, rounds, blocks, heads, dim_head, on_round)
            if kind == "speed":
                rows = paired_ratio.measure(group, SPEEDUP_N, plan)
            else:
                rows = paired_ratio.measure_scaling(group, plan)
            rows = [{"allocator": allocator, "kind": kind, **row} for row in rows]  # the speed groups' full kept too
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as file:  # a group at a time: an interruption keeps the groups measured
                file.writelines(json.dumps(row) + "\n" for row in rows)
            done.update(_latest(rows))
    wanted = {_key(allocator, k, c, a, o) for k, c in GROUPS for a, o in entries(targets, k, c)}
    return [row for row_key, row in done.items() if row_key in wanted]


def table(rows: list[dict], targets: list[Target], allocator: Allocator = "default") -> Table:
    """One line per target: its paired speedup and scaling measured with this ``allocator`` setting, each with its
    interval and verdict."""
    rows = [row for row in rows if row.get("allocator", "default") == allocator]
    by_key = _latest(rows)
    rounds = sorted({(row["rounds"], row["blocks"]) for row in rows})
    title = "paired intervals (95%, one process, interleaved"
    title += "".join(f"; {r} rounds in {b} blocks" for r, b in rounds)
    title += "; glibc keeping freed memory)" if allocator == "keep-freed" else ")"
    result = Table(title=title)
    for header in ("attention", "options", "speedup [95%]", "target", "verdict", "t(8192)/t(2048) [95%]", "target",
                   "verdict"):  # fmt: skip
        result.add_column(header)

    def cells(kind: Kind, target: Target, bound: float | None, sign: str) -> list[str]:
        row = by_key.get(_key(allocator, kind, target.causal, target.attention, target.options))
        if bound is None:
            return ["-", "-", "-"]
        if row is None:
            return ["not measured", f"{sign} {bound}", "-"]
        value = f"{row['paired']:.2f} [{row['paired_low']:.2f}, {row['paired_high']:.2f}]"
        return [value, f"{sign} {bound}", row["verdict"]]

    for target in targets:
        if target.min_speedup is None and target.max_scaling is None:
            continue
        label = target.attention + (" (causal)" if target.causal else "")
        result.add_row(label, str(target.options), *cells("speed", target, target.min_speedup, ">="),
                       *cells("scaling", target, target.max_scaling, "<="))  # fmt: skip
    return result
