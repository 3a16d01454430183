"""What ``zoo compare`` writes once runs are done: per-run rows, per-mechanism means with 95% intervals over
seeds, ranks that mark statistical ties, the printed table, CSV, Markdown and plots with error bars.

Ranking: mechanisms are ordered by the mean of the primary metric (``val_acc`` when the task logs it,
else ``val_ppl``, else ``val_loss``; higher is better for accuracy, F1, BLEU and chrF, lower for loss and
perplexity). Every mechanism whose 95% interval overlaps the best one's is marked tied with it (rank
``=1``), not ranked below it: with a few seeds, small differences are noise.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from experiments.stats import Interval, summarize

RUN_COLUMNS = (
    "mechanism", "attention", "options", "options_from", "seed", "status", "val_acc", "val_loss", "train_loss",
    "val_ppl", "tokens_per_s", "peak_mem_mb", "train_mem_mb", "parameters", "steps", "resumed_from_step", "fit_s",
    "wall_s", "reason", "run_dir",
)  # fmt: skip
#: aggregated over seeds in every summary, whether or not the task logs further metrics
CORE_METRICS = ("val_acc", "val_loss", "val_ppl", "tokens_per_s", "peak_mem_mb", "train_mem_mb", "fit_s")
LOWER_IS_BETTER = ("loss", "ppl", "mem_mb", "fit_s", "wall_s")


def lower_is_better(metric: str) -> bool:
    """Loss, perplexity, memory and durations; everything else (accuracy, BLEU, rates per second) is better
    higher."""
    return metric.endswith(LOWER_IS_BETTER)


def primary_metric(rows: list[dict[str, Any]]) -> str:
    """The metric mechanisms are ranked by: the first of val_acc, val_ppl, val_loss any run reports."""
    for metric in ("val_acc", "val_bleu", "val_ppl", "val_loss"):
        if any(_number(r.get(metric)) is not None for r in rows):
            return metric
    return "val_loss"


def metric_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every numeric metric column the runs report, the core ones first."""
    extra = sorted({k for r in rows for k in r if k.startswith(("val_", "test_", "decode_")) and k not in CORE_METRICS})
    return [*CORE_METRICS, *extra]


def summarize_mechanisms(rows: list[dict[str, Any]], metric: str | None = None) -> list[dict[str, Any]]:
    """One row per mechanism (in first-run order) with ``n``, ``ok``, per-metric intervals and the rank."""
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
            "problems": "; ".join(failures),
            "intervals": {c: summarize([_number(r.get(c)) for r in ok]) for c in columns},
        }
        summary.append(item)
    rank(summary, metric)
    return summary


def rank(summary: list[dict[str, Any]], metric: str) -> None:
    """Set ``rank`` (1 for the best mean, ``=1`` for a tie with it, else the position) and ``tied``."""
    scored = [s for s in summary if s["intervals"].get(metric) is not None]
    sign = 1 if lower_is_better(metric) else -1
    scored.sort(key=lambda s: sign * s["intervals"][metric].mean)
    for s in summary:
        s["rank"], s["tied"], s["order"] = "-", False, 10**6
    if not scored:
        return
    best = scored[0]["intervals"][metric]
    for position, s in enumerate(scored, start=1):
        tied = s["intervals"][metric].overlaps(best)
        s["tied"], s["order"] = tied, position
        s["rank"] = "1" if position == 1 else ("=1" if tied else str(position))


def summary_table_rows(summary: list[dict[str, Any]], metric: str, columns: list[str]) -> list[dict[str, Any]]:
    """Flat rows for ``summary.csv``: ``<metric>_mean``, ``_std``, ``_ci_low``, ``_ci_high`` per metric."""
    flat = []
    for s in summary:
        row = {k: s[k] for k in ("mechanism", "attention", "options", "options_from", "seeds", "ok", "status")}
        row |= {"rank_by": metric, "rank": s["rank"], "tied_with_best": s["tied"], "problems": s["problems"]}
        for column in columns:
            interval: Interval | None = s["intervals"].get(column)
            for part in ("mean", "std", "low", "high"):
                name = f"{column}_{ {'low': 'ci_low', 'high': 'ci_high'}.get(part, part) }"
                row[name] = None if interval is None else getattr(interval, part)
        flat.append(row)
    return flat


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_outputs(directory: Path, rows: list[dict[str, Any]], header: list[str]) -> list[dict[str, Any]]:
    """``runs.csv`` (one row per run), ``summary.csv`` (one per mechanism), ``summary.md``, the plots."""
    metric = primary_metric(rows)
    columns = metric_columns(rows)
    run_columns = [*RUN_COLUMNS, *(c for c in columns if c not in RUN_COLUMNS)]
    write_csv(directory / "runs.csv", rows, run_columns)
    summary = summarize_mechanisms(rows, metric)
    flat = summary_table_rows(summary, metric, columns)
    write_csv(directory / "summary.csv", flat, list(flat[0]) if flat else ["mechanism"])
    shown = [c for c in columns if any(s["intervals"].get(c) is not None for s in summary)]
    lines = [*header, "", f"Mean ± 95% interval over seeds; ranked by {metric} (`=1`: interval overlaps the best).", ""]
    lines += ["| rank | mechanism | options | ok/seeds | " + " | ".join(shown) + " |", "|---" * (len(shown) + 4) + "|"]
    for s in sorted(summary, key=_rank_order):
        cells = [s["rank"], s["mechanism"], _md(short_options(s["options"], 60)), f"{s['ok']}/{s['seeds']}"]
        cells += [format_interval(s["intervals"].get(c), c) for c in shown]
        lines.append("| " + " | ".join(cells) + " |")
    problems = [f"- {s['mechanism']}: {_md(s['problems'])}" for s in summary if s["problems"]]
    if problems:
        lines += ["", "Runs that did not finish:", *problems]
    lines += ["", "Per run: `runs.csv`; per mechanism with std and intervals: `summary.csv`."]
    (directory / "summary.md").write_text("\n".join(lines) + "\n")
    plot(summary, metric, directory, directory.name)
    return summary


def _rank_order(s: dict[str, Any]) -> tuple[int, str]:
    """Best first, then by mean (ties with the best keep their place by mean), unscored last."""
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
    return f"{value} ± {_format_value(interval.half_width, column)}"


def _format_value(value: float, column: str) -> str:
    if column == "tokens_per_s" or column.endswith("_per_s"):
        return f"{value / 1000:,.1f}k" if abs(value) >= 1000 else f"{value:,.0f}"
    if column.endswith(("mem_mb", "_s")):
        return f"{value:,.0f}"
    return f"{value:.3f}"


def print_table(summary: list[dict[str, Any]], metric: str, out: Any) -> None:
    """The summary in at most 120 columns: mechanism, short options, the primary metric, val loss,
    tokens/s and the memory training added, each mean ± 95% interval half-width, then the rank."""
    shown = [metric, "val_loss" if metric != "val_loss" else "val_ppl", "tokens_per_s", "train_mem_mb"]
    titles = {"tokens_per_s": "tokens/s", "train_mem_mb": "train MB"}
    table = Table(title=f"zoo compare (mean ± 95% interval over seeds; rank by {metric}, =1: tied with the best)")
    table.add_column("rank", justify="right")
    table.add_column("mechanism", max_width=18, overflow="fold")
    table.add_column("options", max_width=22, overflow="ellipsis", no_wrap=True)
    for column in shown:
        table.add_column(titles.get(column, column), justify="right")
    table.add_column("ok", justify="right")
    for s in sorted(summary, key=_rank_order):
        cells = [format_interval(s["intervals"].get(c), c) for c in shown]
        ok = f"{s['ok']}/{s['seeds']}" if s["ok"] == s["seeds"] else f"[red]{s['ok']}/{s['seeds']}[/]"
        table.add_row(s["rank"], escape(s["mechanism"]), escape(short_options(s["options"])), *cells, ok)
    out.print(table, width=min(120, out.width))
    for s in summary:
        if s["problems"]:
            out.print(f"[red]{escape(s['mechanism'])}[/]: {escape(s['problems'][:300])}")


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
        axes.errorbar(x.mean, y.mean, xerr=x.half_width, yerr=y.half_width, fmt=markers[index % len(markers)],
                      capsize=3, markersize=6, label=f"{s['mechanism']} ({s['ok']} seeds)")  # fmt: skip
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
    axes.barh(names, [a.mean for a in added], left=start, xerr=[a.half_width for a in added], capsize=3,
              label="added by training (to the peak), ± 95% interval")  # fmt: skip
    axes.invert_yaxis()
    axes.set_xlabel("peak memory (MB): CUDA allocated, or CPU resident set size")
    axes.set_title(f"{title}: peak memory{note}", fontsize=10)
    axes.legend(fontsize=8, loc="lower right")
    axes.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(directory / "peak_memory.png", dpi=120)
    plt.close(figure)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
