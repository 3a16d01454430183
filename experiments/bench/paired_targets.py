"""Paired intervals and verdicts for every speedup and scaling target: ``zoo targets --paired-rounds R``.

The sweep of ``zoo targets`` times each case in its own worker, minutes apart from its baseline, and judges a row
by a ratio of minima: a point, with no statement of how sure it is. After the sweep, this step measures the same
rows interleaved in one process (:mod:`experiments.bench.paired_ratio`): the speedups at n = 4096 against full
attention, non-causal and causal, and the scalings t(8192) / t(2048), each mechanism timed beside its baseline in
every round, and gives each row its 95% interval and a verdict (``met`` / ``missed`` only when the whole interval
is on one side of the target, else ``inconclusive``). Time only, one thread (memory needs a worker per case: the
sweep's). The rows go to ``paired.jsonl`` in the sweep's folder; a rerun with the same rounds and blocks reuses
the groups already there (each of the four groups, speed or scaling, causal or not, is one interleaved run).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from experiments.bench import paired_ratio
from experiments.bench.targets import SPEEDUP_N, Target

PAIRED_FILE = "paired.jsonl"
Kind = Literal["speed", "scaling"]
GROUPS: tuple[tuple[Kind, bool], ...] = (("speed", False), ("speed", True), ("scaling", False), ("scaling", True))


def entries(targets: list[Target], kind: Kind, causal: bool) -> list[tuple[str, dict]]:
    """The (mechanism, options) of the targets with a bound of this kind, non-causal or causal, in target order."""
    bound = "min_speedup" if kind == "speed" else "max_scaling"
    return [(t.attention, dict(t.options)) for t in targets if t.causal == causal and getattr(t, bound) is not None]


def _key(row: dict) -> tuple:
    return row["kind"], row["causal"], row["attention"], json.dumps(row["options"], sort_keys=True)


def read_rows(path: Path) -> list[dict]:
    """The rows of a ``paired.jsonl`` (none when it does not exist); the last row of a key wins."""
    if not path.exists():
        return []
    latest = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            latest[_key(row)] = row
    return list(latest.values())


def run(
    targets: list[Target],
    path: Path,
    *,
    rounds: int,
    blocks: int,
    heads: int = 8,
    dim_head: int = 64,
    console: Console | None = None,
) -> list[dict]:
    """Measure each group that ``path`` does not already hold at these rounds and blocks, append its rows, and
    return every row of the targets (the speed groups' ``full`` rows left out)."""
    if blocks < 1 or rounds < 1 or rounds % blocks:
        raise ValueError(f"paired rounds must be >= 1 and a multiple of the blocks (>= 1), got {rounds} and {blocks}")
    done = {_key(row): row for row in read_rows(path) if (row["rounds"], row["blocks"]) == (rounds, blocks)}
    todo = []
    for kind, causal in GROUPS:
        group = entries(targets, kind, causal)
        if group and any(_key({"kind": kind, "causal": causal, "attention": a, "options": o}) not in done
                         for a, o in group):  # fmt: skip
            todo.append((kind, causal, group))
    shape = dict(rounds=rounds, blocks=blocks, heads=heads, dim_head=dim_head)
    with Progress(console=console or Console(stderr=True), transient=True) as progress:
        for kind, causal, group in todo:
            label = f"paired {kind}{' (causal)' if causal else ''}"
            task = progress.add_task(label, total=rounds)
            on_round: Callable[[], None] = lambda task=task: progress.advance(task)
            if kind == "speed":
                rows = paired_ratio.measure(group, seq_len=SPEEDUP_N, causal=causal, on_round=on_round,
                                            **shape)  # fmt: skip
            else:
                rows = paired_ratio.measure_scaling(group, causal=causal, on_round=on_round, **shape)
            rows = [{"kind": kind, **row} for row in rows if row["attention"] != "full"]  # the baseline's own row
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as file:  # a group at a time: an interruption keeps the groups measured
                file.writelines(json.dumps(row) + "\n" for row in rows)
            done.update((_key(row), row) for row in rows)
    wanted = {_key({"kind": k, "causal": c, "attention": a, "options": o})
              for k, c in GROUPS for a, o in entries(targets, k, c)}  # fmt: skip
    return [row for key, row in done.items() if key in wanted]


def table(rows: list[dict], targets: list[Target]) -> Table:
    """One line per target: its paired speedup and scaling, each with its interval and verdict."""
    by_key = {_key(row): row for row in rows}
    rounds = sorted({(row["rounds"], row["blocks"]) for row in rows})
    title = "paired intervals (95%, one process, interleaved"
    title += "".join(f"; {r} rounds in {b} blocks" for r, b in rounds) + ")"
    result = Table(title=title)
    for header in ("attention", "options", "speedup [95%]", "target", "verdict", "t(8192)/t(2048) [95%]", "target",
                   "verdict"):  # fmt: skip
        result.add_column(header)

    def cells(kind: Kind, target: Target, bound: float | None, sign: str) -> list[str]:
        row = by_key.get(_key({"kind": kind, "causal": target.causal, "attention": target.attention,
                               "options": target.options}))  # fmt: skip
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
