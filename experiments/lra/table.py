"""The Long Range Arena table of a ``zoo lra`` suite: rows mechanisms, columns tasks and their average.

Each task's cells come from that task's ``zoo compare`` runs, judged as ``zoo compare`` judges them
(:func:`experiments.compare.summary.summarize_mechanisms`): the mean ± 95% interval of validation accuracy over
seeds, the paired verdict against ``full`` by the rule of :mod:`experiments.stats`, and Δ / Δ control (the gap to
``full`` as a fraction of the no-attention control's gap: 0 = full attention, 1 = no better than no attention).

The average column is LRA's average over its five tasks (Path-X left out, as in LRA), taken seed by seed: for
each seed that every such task finished, the mean of the tasks' accuracies; the mean ± interval, the paired
verdict against full's averages and Δ / Δ control are then those of these per-seed averages (a mechanism missing
a task has no average).

Per task, a sanity line: full attention must be clearly above the control (the 95% interval of control - full
below -δ); otherwise the task does not test attention at this scale, and its verdicts say little. Beside the
table, the published tables of :mod:`experiments.lra.published`, marked with how their scale relates to this one.
Accuracies are shown in % (as LRA reports them); ``lra.csv`` keeps the metric's own units (fractions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments import stats
from experiments.compare.summary import (
    CONTROL,
    find_control,
    lower_is_better,
    summarize_mechanisms,
    write_csv,
)
from experiments.lra.published import TABLES, TASKS, ZOO_NAMES, scale_note

#: the metric every LRA task is judged by
METRIC = "val_acc"
AVERAGE = "average"


@dataclass(frozen=True)
class Cell:
    """One mechanism on one task (or the average): its interval over seeds, finished and listed seeds, verdict
    against full, the paired difference and Δ / Δ control."""

    interval: stats.Interval | None
    ok: int
    seeds: int
    verdict: str
    difference: stats.PairedDifference | None
    gap_fraction: float | None


@dataclass(frozen=True)
class LraTable:
    """``cells[(mechanism, task)]`` for every task and :data:`AVERAGE`; ``sanity[task]`` the full-vs-control line."""

    tasks: list[str]
    mechanisms: list[str]
    cells: dict[tuple[str, str], Cell]
    sanity: dict[str, str]
    margin: float | None


def build(task_rows: dict[str, list[dict[str, Any]]], *, margin: float | None = None) -> LraTable:
    """The table from each task's run rows (``zoo compare``'s ``runs.csv`` rows, or :func:`run_row`'s), in the
    order of ``task_rows``; ``margin`` None: accuracy's default δ (0.01)."""
    delta = margin if margin is not None else stats.default_margin(METRIC)
    tasks = list(task_rows)
    mechanisms = _mechanism_order([row for rows in task_rows.values() for row in rows])
    cells: dict[tuple[str, str], Cell] = {}
    sanity: dict[str, str] = {}
    per_seed: dict[str, dict[str, dict[int, float | None]]] = {}
    for task, rows in task_rows.items():
        summary = summarize_mechanisms(rows, METRIC, reference="full", margin=delta)
        for s in summary:
            cells[(s["mechanism"], task)] = Cell(
                s["intervals"].get(METRIC), s["ok"], s["seeds"], s["verdict"], s["difference"], s["gap_fraction"]
            )
            per_seed.setdefault(s["mechanism"], {})[task] = s["per_seed"]
        sanity[task] = sanity_line(summary, delta)
    averaged = [task for task in tasks if task in TASKS]  # LRA's average leaves Path-X out
    averages = {m: _average(per_seed.get(m, {}), averaged) for m in mechanisms}
    control = next((m for m in reversed(mechanisms) if _is_control(m, task_rows)), None)
    for mechanism in mechanisms:
        cells[(mechanism, AVERAGE)] = _average_cell(mechanism, averages, control, delta)
    return LraTable(tasks, mechanisms, cells, sanity, delta)


def _is_control(label: str, task_rows: dict[str, list[dict[str, Any]]]) -> bool:
    return any(r["attention"] == CONTROL for rows in task_rows.values() for r in rows if r["mechanism"] == label)


def _mechanism_order(rows: list[dict[str, Any]]) -> list[str]:
    """full first, the control last, the others in the order the runs list them."""
    labels = list(dict.fromkeys(row["mechanism"] for row in rows))
    controls = [label for label in labels if any(r["attention"] == CONTROL for r in rows if r["mechanism"] == label)]
    first = [label for label in labels if label == "full"]
    return first + [label for label in labels if label not in first and label not in controls] + controls


def _average(by_task: dict[str, dict[int, float | None]], tasks: list[str]) -> dict[int, float]:
    """seed -> mean accuracy over ``tasks``, for the seeds that every task finished."""
    if not tasks or any(task not in by_task for task in tasks):
        return {}
    averages = {}
    for seed in sorted(set.intersection(*(set(by_task[t]) for t in tasks))):
        values = [by_task[t][seed] for t in tasks]
        if all(v is not None and math.isfinite(v) for v in values):
            averages[seed] = sum(values) / len(values)  # type: ignore[arg-type]
    return averages


def _average_cell(
    mechanism: str, averages: dict[str, dict[int, float]], control: str | None, margin: float | None
) -> Cell:
    """The average column's cell: the per-seed averages' interval, their paired verdict against full's and
    Δ / Δ control from the control's paired difference of averages."""
    values, reference = averages[mechanism], averages.get("full", {})
    interval = stats.summarize(list(values.values()), bounds=stats.metric_bounds(METRIC))
    if mechanism == "full" or not values or not reference:
        verdict = "reference" if mechanism == "full" and values else "-"
        return Cell(interval, len(values), len(values), verdict, None, None)
    difference = _paired(values, reference, margin)
    gap = None
    if control is not None and averages[control]:
        scale = _paired(averages[control], reference, margin).mean
        gap = difference.mean / scale if math.isfinite(scale) and scale != 0 else None
    return Cell(interval, len(values), len(values), difference.verdict, difference, gap)


def _paired(values: dict[int, float], reference: dict[int, float], margin: float | None) -> stats.PairedDifference:
    bounds, higher = stats.metric_bounds(METRIC), not lower_is_better(METRIC)
    return stats.paired_difference(values, reference, margin=margin, higher_is_better=higher, bounds=bounds)


def sanity_line(summary: list[dict[str, Any]], margin: float | None) -> str:
    """Whether full attention is clearly above the control on one task: the 95% interval of control - full lies
    below -δ. One line, with the numbers."""
    full = next((s for s in summary if s["verdict"] == "reference"), None)
    control = find_control(summary)
    if full is None or control is None or control["difference"] is None:
        missing = "full" if full is None else "the control"
        return f"not judged: no finished {missing} run"
    difference: stats.PairedDifference = control["difference"]
    means = (
        f"full {percent(full['intervals'][METRIC])} vs control {percent(control['intervals'][METRIC])}, "
        f"control - full {100 * difference.mean:+.1f} points"
    )
    if difference.n < 2 or not math.isfinite(difference.high):
        return f"not judged: {means} over {difference.n} paired seed(s), no interval (run 2 or more seeds)"
    interval = f"[{100 * difference.low:+.1f}, {100 * difference.high:+.1f}]"
    bar = -(margin or 0.0)
    if difference.high < bar:
        return f"full clearly above the control: {means} {interval}"
    return f"this scale does not test attention: {means} {interval} does not lie below -δ = {100 * bar:+.1f}"


def percent(interval: stats.Interval | None) -> str:
    """``61.2 ± 1.3`` (%), ``61.2 (1 seed)``, or ``-``."""
    if interval is None:
        return "-"
    if interval.n < 2:
        return f"{100 * interval.mean:.1f} (1 seed)"
    below, above = interval.mean - interval.low, interval.high - interval.mean
    if math.isclose(below, above, rel_tol=1e-9, abs_tol=1e-12):
        return f"{100 * interval.mean:.1f} ± {100 * interval.half_width:.1f}"
    return f"{100 * interval.mean:.1f} [{100 * interval.low:.1f}, {100 * interval.high:.1f}]"


def cell_text(cell: Cell | None) -> str:
    """``55.0 ± 2.0 · worse · 0.42``: accuracy, verdict against full, Δ / Δ control."""
    if cell is None:
        return "not run"
    parts = [percent(cell.interval)]
    if cell.ok < cell.seeds:
        parts[0] += f" ({cell.ok}/{cell.seeds} seeds)"
    if cell.verdict not in ("-", "reference"):
        parts.append(cell.verdict)
    if cell.gap_fraction is not None and cell.verdict != "reference":
        parts.append(f"{cell.gap_fraction:.2f}")
    return " · ".join(parts)


def markdown(table: LraTable, *, scale: str, header: list[str], not_run: dict[str, str]) -> str:
    """``lra.md``: ``header``, the table, the sanity lines, the tasks ``not_run`` (task -> why) and the published
    tables marked with :func:`experiments.lra.published.scale_note`."""
    columns = [*table.tasks, AVERAGE]
    lines = [
        *header,
        "",
        f"Validation accuracy (%), mean ± 95% interval over seeds. Each cell: accuracy · verdict against `full` "
        f"(paired by seed, {stats.margin_text(table.margin)} in accuracy, {100 * (table.margin or 0):g} point(s) here: "
        f"{stats.RULE}) · Δ / Δ control (the gap to full over the no-attention control's gap: 0 = full, 1 = no better "
        "than no attention). Average: LRA's mean over its five tasks (Path-X left out), seed by seed.",
        "",
        "| mechanism | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for mechanism in table.mechanisms:
        cells = [cell_text(table.cells.get((mechanism, column))) for column in columns]
        lines.append(f"| {mechanism} | " + " | ".join(cells) + " |")
    lines += ["", "Does each task test attention at this scale (full clearly above the control)?", ""]
    lines += [f"- {task}: {line}" for task, line in table.sanity.items()]
    if not_run:
        lines += ["", "Not run:", ""] + [f"- {task}: {why}" for task, why in not_run.items()]
    for published in TABLES:
        lines += ["", f"## {published.title}, quoted ({scale_note(published, scale)})", ""]
        lines += [f"{published.citation}; numbers checked in {published.checked_in}. Accuracy (%).", ""]
        lines += ["| model | zoo mechanism | " + " | ".join([*TASKS, AVERAGE]) + " |", "|---" * (len(TASKS) + 3) + "|"]
        for model, values in published.rows.items():
            numbers = " | ".join(f"{v:.2f}" for v in values)
            lines.append(f"| {model} | {ZOO_NAMES.get(model, '-')} | {numbers} |")
    return "\n".join(lines) + "\n"


def csv_rows(table: LraTable) -> tuple[list[dict[str, Any]], list[str]]:
    """``lra.csv``'s rows and columns: per mechanism, for each task and the average, ``<column>_mean``,
    ``_ci_low``, ``_ci_high``, ``_seeds_ok``, ``_verdict``, ``_delta`` (mechanism - full, in accuracy),
    ``_gap_fraction`` (Δ / Δ control)."""
    columns = ["mechanism"]
    parts = ("mean", "ci_low", "ci_high", "seeds_ok", "verdict", "delta", "gap_fraction")
    for column in [*table.tasks, AVERAGE]:
        columns += [f"{column}_{part}" for part in parts]
    rows = []
    for mechanism in table.mechanisms:
        row: dict[str, Any] = {"mechanism": mechanism}
        for column in [*table.tasks, AVERAGE]:
            cell = table.cells.get((mechanism, column))
            interval = cell.interval if cell else None
            row |= {
                f"{column}_mean": None if interval is None else interval.mean,
                f"{column}_ci_low": None if interval is None else interval.low,
                f"{column}_ci_high": None if interval is None else interval.high,
                f"{column}_seeds_ok": None if cell is None else cell.ok,
                f"{column}_verdict": None if cell is None else cell.verdict,
                f"{column}_delta": None if cell is None or cell.difference is None else cell.difference.mean,
                f"{column}_gap_fraction": None if cell is None else cell.gap_fraction,
            }
        rows.append(row)
    return rows, columns


def write(
    directory: Path, table: LraTable, *, scale: str, header: list[str], not_run: dict[str, str]
) -> tuple[Path, Path]:
    """Write ``lra.md`` and ``lra.csv`` into ``directory``; return their paths."""
    md, csv_path = directory / "lra.md", directory / "lra.csv"
    md.write_text(markdown(table, scale=scale, header=header, not_run=not_run), encoding="utf-8")
    rows, columns = csv_rows(table)
    write_csv(csv_path, rows, columns)
    return md, csv_path
