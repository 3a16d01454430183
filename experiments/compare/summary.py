"""What ``zoo compare`` writes once runs are done: per-run rows, per-mechanism means with 95% intervals over
seeds, each mechanism's paired difference from a reference with its verdict, the printed table, CSV, Markdown
and plots with error bars.

The primary metric is ``val_acc`` when the task logs it, else ``val_bleu``, ``val_ppl``, ``val_loss`` (higher is
better for accuracy, F1, BLEU and chrF, lower for loss and perplexity). Rows are ordered best mean first. The
verdict of each mechanism against the reference (default ``full``) is the rule of :mod:`experiments.stats`:
``on par`` when the 90% interval of the paired difference lies inside ±δ, else ``better`` / ``worse`` when its
95% interval excludes 0, else ``inconclusive``. Beside each verdict: the smallest margin at which ``on par`` would
hold, and, when the no-attention control (:data:`CONTROL`, ``zoo compare --control``) ran, the mechanism's
difference as a fraction of the control's (0: the reference's metric, 1: no better than no attention at all).

A mechanism whose finished runs never validated (no ``val_*`` metric: fewer steps than the trainer's
``val_check_interval``) is judged on nothing else: with a ``val_*`` metric its verdict is ``not validated``,
and :func:`validation_warning` names those runs. When runs trained beside each other (``runs_at_once`` above 1,
``zoo compare --jobs``), the speed, memory and time columns say ``measured concurrently``.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from experiments.stats import (
    RULE,
    Interval,
    PairedDifference,
    default_margin,
    margin_text,
    metric_bounds,
    paired_difference,
    summarize,
)

RUN_COLUMNS = (
    "mechanism", "attention", "options", "options_from", "seed", "status", "validated", "val_acc", "val_loss",
    "train_loss", "val_ppl", "tokens_per_s", "peak_mem_mb", "train_mem_mb", "parameters", "steps",
    "resumed_from_step", "fit_s", "wall_s", "runs_at_once", "reason", "run_dir",
)  # fmt: skip
#: aggregated over seeds in every summary, whether or not the task logs further metrics
CORE_METRICS = ("val_acc", "val_loss", "val_ppl", "tokens_per_s", "peak_mem_mb", "train_mem_mb", "fit_s")
LOWER_IS_BETTER = ("loss", "ppl", "mem_mb", "fit_s", "wall_s")
#: the registered core of the no-attention control arm
CONTROL = "self_only"
#: the columns other runs on the same machine change: speed, memory and time
CONCURRENCY_AFFECTED = ("_per_s", "mem_mb", "fit_s", "wall_s")
#: how a column measured beside other runs is flagged
CONCURRENTLY = "measured concurrently"


def lower_is_better(metric: str) -> bool:
    """Loss, perplexity, memory and durations; everything else (accuracy, BLEU, rates per second) is better
    higher."""
    return metric.endswith(LOWER_IS_BETTER)


def primary_metric(rows: list[dict[str, Any]]) -> str:
    """The metric mechanisms are ordered and judged by: the first of val_acc, val_bleu, val_ppl, val_loss any run
    reports."""
    for metric in ("val_acc", "val_bleu", "val_ppl", "val_loss"):
        if any(_number(r.get(metric)) is not None for r in rows):
            return metric
    return "val_loss"


def validated(row: dict[str, Any]) -> bool:
    """Whether a run's row has a validation metric (``val_*``): a run too short for the trainer's
    ``val_check_interval`` has none."""
    return any(k.startswith("val_") and _number(v) is not None for k, v in row.items())


def validation_warning(rows: list[dict[str, Any]]) -> str | None:
    """One line naming the finished runs that never validated (None when every one did)."""
    finished = [r for r in rows if r.get("status") == "ok"]
    never = [f"{r['mechanism']}/seed-{r['seed']}" for r in finished if not validated(r)]
    if not never:
        return None
    named = ", ".join(never[:3]) + (f" and {len(never) - 3} more" if len(never) > 3 else "")
    return (
        f"validation never ran in {len(never)} of {len(finished)} finished runs ({named}): no val_* metric, so their "
        "verdict is 'not validated'; train more steps than --trainer.val_check_interval, or lower it"
    )


def metric_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every numeric metric column the runs report, the core ones first."""
    extra = sorted({k for r in rows for k in r if k.startswith(("val_", "test_", "decode_")) and k not in CORE_METRICS})
    return [*CORE_METRICS, *extra]


def summarize_mechanisms(
    rows: list[dict[str, Any]],
    metric: str | None = None,
    *,
    reference: str = "full",
    margin: float | None = None,
) -> list[dict[str, Any]]:
    """One row per mechanism (best mean of ``metric`` first, unscored last) with ``n``, ``ok``, per-metric
    intervals and ``difference``: the :class:`~experiments.stats.PairedDifference` from the ``reference``
    mechanism (its label, or its attention name when one label has it) on ``metric``, None for the reference
    itself and when no reference ran. ``margin`` None: the metric's default (:func:`experiments.stats.default_margin`).
    """
    metric = metric or primary_metric(rows)
    columns = metric_columns(rows)
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["mechanism"], []).append(row)
    summary = []
    for label, runs in groups.items():
        ok = [r for r in runs if r["status"] == "ok"]
        failures = sorted({f"{r['status']}: {r['reason']}" for r in runs if r["status"] != "ok"})
        item: dict[str, Any] = {
            "mechanism": label,
            "attention": runs[0]["attention"],
            "options": runs[0]["options"],
            "options_from": runs[0]["options_from"],
            "seeds": len(runs),
            "ok": len(ok),
            "status": "ok" if len(ok) == len(runs) else ("partial" if ok else "failed"),
            "validated": sum(map(validated, ok)),
            "problems": "; ".join(failures),
            "intervals": {c: summarize([_number(r.get(c)) for r in ok], bounds=metric_bounds(c)) for c in columns},
            "per_seed": {int(r["seed"]): _number(r.get(metric)) for r in ok if r.get("seed") is not None},
        }
        summary.append(item)
    compare_with_reference(summary, metric, reference, margin)
    order(summary, metric)
    return summary


def find_reference(summary: list[dict[str, Any]], reference: str) -> dict[str, Any] | None:
    """The summary row labelled ``reference``, or the one row whose attention it names."""
    by_label = [s for s in summary if s["mechanism"] == reference]
    by_attention = [s for s in summary if s["attention"] == reference]
    return (by_label or (by_attention if len(by_attention) == 1 else [None]))[0]


def compare_with_reference(summary: list[dict[str, Any]], metric: str, reference: str, margin: float | None) -> None:
    """Set ``difference``, ``verdict``, ``reference``, ``margin`` and ``gap_fraction`` on every row (module
    docstring)."""
    base = find_reference(summary, reference)
    reference_mean = base["intervals"][metric].mean if base and base["intervals"].get(metric) else None
    delta = margin if margin is not None else default_margin(metric, reference_mean)
    never = lambda s: metric.startswith("val_") and s["ok"] > 0 and not s["validated"]
    for s in summary:
        s["reference"], s["margin"], s["difference"] = reference, delta, None
        if never(s):
            s["verdict"] = "not validated"
        elif base is None or never(base):
            s["verdict"] = "-"
        elif s is base:
            s["verdict"] = "reference"
        else:
            difference = paired_difference(
                s["per_seed"], base["per_seed"], margin=delta, higher_is_better=not lower_is_better(metric),
                bounds=metric_bounds(metric),
            )  # fmt: skip
            s["difference"], s["verdict"] = difference, difference.verdict
    control = find_control(summary)
    scale = None if control is None or control["difference"] is None else control["difference"].mean
    for s in summary:
        shown = s["difference"] is not None and scale is not None and math.isfinite(scale) and scale != 0
        s["gap_fraction"] = s["difference"].mean / scale if shown else None


def find_control(summary: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The no-attention control's summary row (the one labelled :data:`CONTROL`, else the first whose attention
    it is), None when it did not run."""
    controls = [s for s in summary if s["attention"] == CONTROL]
    return next((s for s in controls if s["mechanism"] == CONTROL), controls[0] if controls else None)


def order(summary: list[dict[str, Any]], metric: str) -> None:
    """Set ``order``: 1 for the best mean of ``metric``, then by mean; mechanisms without it last."""
    scored = [s for s in summary if s["intervals"].get(metric) is not None]
    sign = 1 if lower_is_better(metric) else -1
    scored.sort(key=lambda s: sign * s["intervals"][metric].mean)
    for s in summary:
        s["order"] = 10**6
    for position, s in enumerate(scored, start=1):
        s["order"] = position


def summary_table_rows(summary: list[dict[str, Any]], metric: str, columns: list[str]) -> list[dict[str, Any]]:
    """Flat rows for ``summary.csv``: the paired difference from the reference on ``metric`` (``delta``,
    ``delta_lo``, ``delta_hi``: its 95% interval; ``p_value``, ``verdict``, ``margin``, ``on_par_margin``: the
    smallest margin for ``on par``; ``gap_fraction``: delta over the control's delta), then ``<metric>_mean``,
    ``_std``, ``_ci_low``, ``_ci_high`` per metric."""
    flat = []
    for s in summary:
        row = {k: s[k] for k in ("mechanism", "attention", "options", "options_from", "seeds", "ok", "status")}
        row["validated"] = s["validated"]
        difference: PairedDifference | None = s["difference"]
        row |= {
            "metric": metric,
            "reference": s["reference"],
            "margin": s["margin"],
            "verdict": s["verdict"],
            "paired_seeds": None if difference is None else difference.n,
            "delta": None if difference is None else _finite_or_none(difference.mean),
            "delta_lo": None if difference is None else _finite_or_none(difference.low),
            "delta_hi": None if difference is None else _finite_or_none(difference.high),
            "delta_lo90": None if difference is None else _finite_or_none(difference.low90),
            "delta_hi90": None if difference is None else _finite_or_none(difference.high90),
            "p_value": None if difference is None else _finite_or_none(difference.p_value),
            "on_par_margin": None if difference is None else _finite_or_none(difference.on_par_margin),
            "gap_fraction": s.get("gap_fraction"),
            "verdict_reason": "" if difference is None else difference.reason,
            "problems": s["problems"],
        }
        for column in columns:
            interval: Interval | None = s["intervals"].get(column)
            for part in ("mean", "std", "low", "high"):
                name = f"{column}_{ {'low': 'ci_low', 'high': 'ci_high'}.get(part, part) }"
                row[name] = None if interval is None else getattr(interval, part)
        flat.append(row)
    return flat


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_runs(directory: Path, rows: list[dict[str, Any]]) -> None:
    """``runs.csv``: one row per run, the run columns first, then every metric a run has."""
    columns = metric_columns(rows)
    write_csv(directory / "runs.csv", rows, [*RUN_COLUMNS, *(c for c in columns if c not in RUN_COLUMNS)])


def write_summary(
    directory: Path,
    rows: list[dict[str, Any]],
    header: list[str],
    *,
    metric: str | None = None,
    reference: str = "full",
    margin: float | None = None,
    concurrent: bool | None = None,
) -> list[dict[str, Any]]:
    """``summary.csv`` and ``summary.md`` (opening with ``header``) from the runs' rows; returns the summary.
    ``concurrent``: whether the runs trained beside each other (their speed, memory and time columns are then
    flagged :data:`CONCURRENTLY`); None: whether any finished run's ``runs_at_once`` is above 1."""
    metric = metric or primary_metric(rows)
    columns = metric_columns(rows)
    summary = summarize_mechanisms(rows, metric, reference=reference, margin=margin)
    flat = summary_table_rows(summary, metric, columns)
    write_csv(directory / "summary.csv", flat, list(flat[0]) if flat else ["mechanism"])
    if concurrent is None:
        concurrent = any((_number(r.get("runs_at_once")) or 1) > 1 for r in rows if r.get("status") == "ok")
    shown = [c for c in columns if any(s["intervals"].get(c) is not None for s in summary)]
    titles = [f"{c} ({CONCURRENTLY})" if concurrent and c.endswith(CONCURRENCY_AFFECTED) else c for c in shown]
    warning = validation_warning(rows)
    lines = [*header, "", *([f"**Warning**: {_md(warning)}.", ""] if warning else [])]
    lines += [*verdict_lines(summary, metric), ""]
    control = find_control(summary) is not None
    judged = ["verdict", "on par from δ", *(["Δ / Δ control"] if control else []), f"Δ {metric} [95% CI]", "p"]
    counts = ["ok/seeds", *(["validated"] if warning else [])]
    lines += [
        "| mechanism | options | " + " | ".join([*counts, *judged, *titles]) + " |",
        "|---" * (len(counts) + len(judged) + len(titles) + 2) + "|",
    ]
    for s in sorted(summary, key=_best_first):
        cells = [_md(s["mechanism"]), _md(short_options(s["options"], 60)), f"{s['ok']}/{s['seeds']}"]
        cells += [f"{s['validated']}/{s['ok']}"] if warning else []
        cells.append(s["verdict"])
        cells.append(format_on_par_margin(s["difference"], metric))
        if control:
            cells.append("-" if s.get("gap_fraction") is None else f"{s['gap_fraction']:.2f}")
        cells += [format_difference(s["difference"], metric, interval=True), format_p(s["difference"])]
        cells += [format_interval(s["intervals"].get(c), c) for c in shown]
        lines.append("| " + " | ".join(cells) + " |")
    problems = [f"- {s['mechanism']}: {_md(s['problems'])}" for s in summary if s["problems"]]
    if problems:
        lines += ["", "Runs that did not finish:", *problems]
    lines += ["", "Per run: `runs.csv`; per mechanism with std, intervals and the paired test: `summary.csv`."]
    (directory / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


def verdict_lines(summary: list[dict[str, Any]], metric: str) -> list[str]:
    """The sentences ``summary.md`` opens its table with: the metric, the reference, the margin and the rule."""
    reference = summary[0]["reference"] if summary else "full"
    margin = summary[0]["margin"] if summary else None
    if not any(s["verdict"] == "reference" for s in summary):
        base = find_reference(summary, reference)
        why = "never validated" if base is not None and base["verdict"] == "not validated" else "has no finished run"
        return [f"Mean ± 95% interval over seeds, best {metric} first. `{reference}` {why}: no verdicts."]
    lines = [
        f"Mean ± 95% interval over seeds, best {metric} first. Verdict: the paired difference from `{reference}` on "
        f"{metric} over shared seeds (Δ = mechanism - {reference}; paired t-test), {margin_text(margin)}: {RULE}. "
        "On par from δ: the smallest margin at which the verdict would be `on par` (the largest absolute end of the "
        "90% interval), to read against your own δ."
    ]
    control = find_control(summary)
    if control is not None:
        lines.append(
            f"Δ / Δ control: the mechanism's Δ over the Δ of `{control['mechanism']}`, the no-attention control (each "
            f"position sees only itself): 0 = {reference}'s {metric}, 1 = no better than no attention."
        )
    return lines


def _best_first(s: dict[str, Any]) -> tuple[int, str]:
    """Best mean first, unscored last."""
    return (s.get("order", 10**6), s["mechanism"])


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def short_options(options_json: str, width: int = 22) -> str:
    """``{"k": 64, "sharing": "kv"}`` -> ``k=64 sharing=kv``, cut to ``width`` characters (the CSV keeps
    the full text)."""
    options = json.loads(options_json) if options_json else {}
    text = " ".join(f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in options.items()) or "-"
    return text if len(text) <= width else text[: width - 1] + "…"


def format_interval(interval: Interval | None, column: str) -> str:
    if interval is None:
        return "-"
    value = _format_value(interval.mean, column)
    if interval.n < 2:
        return value
    below, above = interval.mean - interval.low, interval.high - interval.mean
    if math.isclose(below, above, rel_tol=1e-9, abs_tol=1e-12):
        return f"{value} ± {_format_value(interval.half_width, column)}"
    return f"{value} [{_format_value(interval.low, column)}, {_format_value(interval.high, column)}]"  # clipped


def format_difference(difference: PairedDifference | None, metric: str, *, interval: bool) -> str:
    """``+0.012 [-0.004, +0.028]`` (``interval``) or ``+0.012``; ``-`` for the reference."""
    if difference is None or not math.isfinite(difference.mean):
        return "-"
    text = f"{difference.mean:+.3f}" if not metric.endswith("_per_s") else f"{difference.mean:+,.0f}"
    if interval and math.isfinite(difference.low):
        text += f" [{difference.low:+.3f}, {difference.high:+.3f}]"
    return text


def format_on_par_margin(difference: PairedDifference | None, metric: str) -> str:
    """The smallest δ for ``on par``, in the difference's format; ``-`` for the reference or one seed."""
    if difference is None or math.isnan(difference.on_par_margin):
        return "-"
    if math.isinf(difference.on_par_margin):
        return "∞"
    return f"{difference.on_par_margin:.3f}" if not metric.endswith("_per_s") else f"{difference.on_par_margin:,.0f}"


def format_p(difference: PairedDifference | None) -> str:
    if difference is None or not math.isfinite(difference.p_value):
        return "-"
    return f"{difference.p_value:.2g}"


def _format_value(value: float, column: str) -> str:
    if column == "tokens_per_s" or column.endswith("_per_s"):
        return f"{value / 1000:,.1f}k" if abs(value) >= 1000 else f"{value:,.0f}"
    if column.endswith(("mem_mb", "_s")):
        return f"{value:,.0f}"
    return f"{value:.3f}"


def print_table(summary: list[dict[str, Any]], metric: str, out: Any, *, concurrent: bool = False) -> None:
    """The summary, best first, in the console's width up to 120 columns: mechanism, the primary metric (mean ±
    95% interval), the paired difference Δ from the reference and its verdict always, whole; then, while they
    fit, the runs finished of the seeds, the smallest margin for ``on par``, the options (cut to 22 characters,
    else 12), tokens/s and the memory training added (dropped in the reverse order: memory and tokens/s first).
    ``concurrent``: tokens/s and memory were measured with runs beside each other, which their titles and a
    caption say. The difference's interval and p-value are in ``summary.csv`` / ``summary.md``."""
    width = min(120, out.width)
    optional = ("ok", "on par δ", "options", "tokens/s", "train MB")
    layouts = [(optional[:kept], cut) for kept in range(len(optional), -1, -1) for cut in (22, 12)]
    for kept, cut in layouts:
        table = _summary_table(summary, metric, kept, options_width=cut, concurrent=concurrent)
        if out.measure(table, options=out.options.update_width(10 * width)).maximum <= width:  # its natural width
            break
    out.print(table, width=width)
    for s in summary:
        if s["problems"]:
            out.print(f"[red]{escape(s['mechanism'])}[/]: {escape(s['problems'][:300])}")


def _summary_table(
    summary: list[dict[str, Any]], metric: str, optional: tuple[str, ...], *, options_width: int, concurrent: bool
) -> Table:
    """:func:`print_table`'s table with the ``optional`` columns named (``ok``, ``on par δ``, ``options``,
    ``tokens/s``, ``train MB``), the options cut to ``options_width`` characters."""
    reference = summary[0]["reference"] if summary else "full"
    margin = summary[0]["margin"] if summary else None
    delta = f"δ = {margin:g}" if margin is not None else "no margin"
    measured = [c for c, title in (("tokens_per_s", "tokens/s"), ("train_mem_mb", "train MB")) if title in optional]
    flagged = concurrent and bool(measured)
    table = Table(
        title=f"zoo compare: mean ± 95% interval over seeds; verdict vs {reference} on {metric}, {delta}",
        caption=f"*: {CONCURRENTLY}, runs side by side (--jobs 1: each run alone)" if flagged else None,
    )
    table.add_column("mechanism", max_width=18, overflow="fold")
    if "options" in optional:
        table.add_column("options", max_width=options_width, overflow="ellipsis", no_wrap=True)
    table.add_column(metric, justify="right", no_wrap=True)
    table.add_column(f"Δ vs {reference}"[:16], justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    if "on par δ" in optional:
        table.add_column("on par δ", justify="right")
    for column in measured:
        title = {"tokens_per_s": "tokens/s", "train_mem_mb": "train MB"}[column]
        table.add_column(f"{title}*" if flagged else title, justify="right")
    if "ok" in optional:
        table.add_column("ok", justify="right")
    colours = {"better": "green", "worse": "red", "on par": "cyan", "not validated": "yellow"}
    for s in sorted(summary, key=_best_first):
        verdict = s["verdict"]
        cells = [escape(s["mechanism"])]
        cells += [escape(short_options(s["options"], options_width))] if "options" in optional else []
        cells += [format_interval(s["intervals"].get(metric), metric)]
        cells += [format_difference(s["difference"], metric, interval=False)]
        cells += [f"[{colours[verdict]}]{verdict}[/]" if verdict in colours else verdict]
        cells += [format_on_par_margin(s["difference"], metric)] if "on par δ" in optional else []
        cells += [format_interval(s["intervals"].get(c), c) for c in measured]
        if "ok" in optional:
            cells.append(f"{s['ok']}/{s['seeds']}" if s["ok"] == s["seeds"] else f"[red]{s['ok']}/{s['seeds']}[/]")
        table.add_row(*cells)
    return table


def plot(summary: list[dict[str, Any]], metric: str, directory: Path, title: str) -> None:
    """``accuracy_vs_throughput.png`` (the primary metric against tokens/s, 95% error bars on both axes)
    and ``peak_memory.png`` (memory added by training, with error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [s for s in summary if s["intervals"].get("tokens_per_s") and s["intervals"].get(metric)]
    failed = [s["mechanism"] for s in summary if s["ok"] == 0]
    note = f"\nfailed: {', '.join(failed)}" if failed else ""
    markers = "osD^vP*Xh<>"

    figure, axes = plt.subplots(figsize=(8, 5))
    for index, s in enumerate(done):  # a legend, not annotations: close points would overprint their labels
        x, y = s["intervals"]["tokens_per_s"], s["intervals"][metric]
        axes.errorbar(x.mean, y.mean, xerr=_error_bar(x), yerr=_error_bar(y), fmt=markers[index % len(markers)],
                      capsize=3, markersize=6, label=f"{s['mechanism']} ({s['ok']} seeds)")  # fmt: skip
    if done:  # an empty legend is a matplotlib warning (no run validated, or none finished)
        axes.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    axes.set_xlabel("training throughput (real tokens / s)")
    axes.set_ylabel(f"{metric} (final; mean ± 95% interval)")
    axes.set_title(f"{title}: {metric} vs throughput{note}", fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(directory / "accuracy_vs_throughput.png", dpi=120)
    plt.close(figure)

    with_memory = [s for s in summary if s["intervals"].get("train_mem_mb")]
    names = [s["mechanism"] for s in with_memory]
    added = [s["intervals"]["train_mem_mb"] for s in with_memory]
    start = [s["intervals"]["peak_mem_mb"].mean - a.mean for s, a in zip(with_memory, added, strict=True)]
    figure, axes = plt.subplots(figsize=(7, 0.4 * max(len(names), 3) + 1.5))
    axes.barh(names, start, color="lightgray", label="in use when training started")
    axes.barh(names, [a.mean for a in added], left=start, xerr=[[a.mean - a.low for a in added],
              [a.high - a.mean for a in added]], capsize=3,
              label="added by training (to the peak), ± 95% interval")  # fmt: skip
    axes.invert_yaxis()
    axes.set_xlabel("peak memory (MB): CUDA allocated, or CPU resident set size")
    axes.set_title(f"{title}: peak memory{note}", fontsize=10)
    axes.legend(fontsize=8, loc="lower right")
    axes.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(directory / "peak_memory.png", dpi=120)
    plt.close(figure)


def _error_bar(interval: Interval) -> list[list[float]]:
    """Matplotlib's asymmetric error: [[below], [above]] (a clipped interval is not symmetric)."""
    return [[interval.mean - interval.low], [interval.high - interval.mean]]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
