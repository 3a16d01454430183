"""``zoo report``: one answer to "which attention at my length?", joining a ``zoo compare`` experiment
(accuracy, tokens/s and memory, from training, over seeds) with a ``zoo bench`` result (time per length).

    zoo report --compare runs/mlm-1024 --bench results/cpu
    zoo compare --bench results/cpu        # compare, then this report in the same folder

Writes into the compare experiment's folder:
- ``pareto.png``: the primary metric (mean ± 95% interval over seeds) against the speedup over full
  attention in the same training runs (mean tokens/s of the mechanism / mean tokens/s of ``full``), marker
  area proportional to the memory training added; the Pareto front (no other mechanism is both faster
  and better; a mechanism whose verdict is ``worse`` or ``not validated`` is never on it) is drawn.
- ``report.md``: the same numbers as a table, then "which mechanism at which length": for every length
  the bench measured, the mechanisms that are faster than full attention there (bench speedup, the
  median time of full / the mechanism's, at the bench's mode and dtype) with what they gave up on the
  compared task: the paired difference from ``full`` over shared seeds, its 95% interval and the verdict of
  the rule in :mod:`experiments.stats` (the same as ``zoo compare``'s summary). The accuracy is the
  compared task's, at its one length; the speed column is the bench's, at each length.

Bench rows are matched to compare entries by mechanism and options; a mechanism the bench measured only
with other options is matched to those, and the table says so.

Both records are checked before anything is written: a ``runs.csv`` with a missing or unexpected column, a row
with more or fewer fields than its header (a truncated file), a value of the wrong kind, or a ``results.jsonl``
line that is not a JSON object (a truncated or corrupt file), or a timing without one of the fields the report
reads, is one ``zoo report: error:`` line naming the file (and line), exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from experiments.bench.tables import is_baseline
from experiments.compare.summary import (
    RUN_COLUMNS,
    format_difference,
    format_interval,
    format_on_par_margin,
    lower_is_better,
    primary_metric,
    summarize_mechanisms,
)
from experiments.records import csv_fields, read_text
from experiments.stats import RULE, PairedDifference, margin_text

#: the runs.csv columns the report reads (zoo compare writes RUN_COLUMNS, then one per further metric)
COMPARE_COLUMNS = ("mechanism", "attention", "options", "options_from", "seed", "status", "reason", "tokens_per_s")
#: the metric columns zoo compare adds beyond RUN_COLUMNS
METRIC_PREFIXES = ("val_", "test_", "decode_")
#: the text columns of runs.csv; every other column holds numbers (or nothing)
TEXT_COLUMNS = ("mechanism", "attention", "options", "options_from", "status", "validated", "reason", "run_dir")
#: the statuses zoo compare gives a run
RUN_STATUSES = ("ok", "failed", "interrupted", "not run")
#: the fields of a bench timing the report reads, with what each must be
#: verdicts that keep a mechanism off the Pareto front however fast it is: accuracy lost, or never validated
OFF_FRONT = ("worse", "not validated")
TIMING_FIELDS = {"attention": str, "options": dict, "seq_len": int, "mode": str, "dtype": str, "level": str,
                 "time_ms_median": float}  # fmt: skip


def load_compare(directory: Path) -> list[dict[str, Any]]:
    """The rows of a compare experiment's ``runs.csv``, checked: the columns the report reads and no others
    than zoo compare writes, each row as many fields as the header, numbers where numbers belong."""
    path = directory / "runs.csv"
    what = "a zoo compare experiment (or one that never finished)"
    header, records = csv_fields(path, what)
    missing = [c for c in COMPARE_COLUMNS if c not in header]
    unexpected = [c for c in header if c not in RUN_COLUMNS and not c.startswith(METRIC_PREFIXES)]
    twice = sorted({c for c in header if header.count(c) > 1})
    problems = []
    if missing:
        problems.append(f"missing column(s) {_names(missing)} (zoo report reads {', '.join(COMPARE_COLUMNS)})")
    if unexpected:
        written = f"{', '.join(RUN_COLUMNS)}, then {'*, '.join(METRIC_PREFIXES)}* metrics"
        problems.append(f"unexpected column(s) {_names(unexpected)} (zoo compare writes {written})")
    problems += [f"column(s) given twice: {_names(twice)}"] if twice else []
    if problems:
        raise ValueError(f"{path}: not a zoo compare runs.csv: {'; '.join(problems)}")
    rows = [
        _checked_run({k: _parse(v) for k, v in zip(header, fields, strict=True)}, where) for where, fields in records
    ]
    if not rows:
        raise ValueError(f"{path}: no runs, only a header")
    return rows


def _checked_run(row: dict[str, Any], where: str) -> dict[str, Any]:
    if row["status"] not in RUN_STATUSES:
        raise ValueError(f"{where}: status {row['status']!r}; a run's status is one of {', '.join(RUN_STATUSES)}")
    for column, value in row.items():
        if column not in TEXT_COLUMNS and value is not None and not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {column} {value!r} is not a number")
    if not isinstance(row["seed"], int):
        raise ValueError(f"{where}: seed {row['seed']!r} is not an int")
    try:
        options = json.loads(row["options"] or "")
    except json.JSONDecodeError:
        options = None
    if not isinstance(options, dict):
        raise ValueError(f"{where}: options {row['options']!r} is not a JSON object {{...}}")
    speed = row["tokens_per_s"]
    if row["status"] == "ok" and not (isinstance(speed, (int, float)) and speed > 0):
        raise ValueError(f"{where}: a finished run (status ok) with tokens_per_s {speed!r}; it must be a number > 0")
    row["mechanism"], row["attention"] = str(row["mechanism"]), str(row["attention"])  # a label may read as a number
    return row


def load_bench(
    directory: Path, *, mode: str = "fwd+bwd", dtype: str = "float32", level: str = "core", causal: bool = False
) -> list[dict[str, Any]]:
    """The timings of a bench ``results.jsonl`` at ``mode``, ``dtype``, ``level`` and causality (the latest row
    of each case), checked: every line a JSON object, every timing with the fields the report reads."""
    path = directory / "results.jsonl"
    rows = []
    for number, line in enumerate(read_text(path, "a zoo bench --out folder").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {number}: not JSON ({error.msg}): a truncated or corrupt file") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {number}: expected a JSON object {{...}}, got {type(row).__name__}")
        if row.get("kind") == "time" and row.get("status") == "ok":
            _check_timing(row, f"{path} line {number}")
        rows.append(row)
    chosen = [
        r for r in rows
        if r.get("kind") == "time" and r.get("status") == "ok" and r["mode"] == mode and r["dtype"] == dtype
        and r["level"] == level and bool(r.get("causal")) == causal
    ]  # fmt: skip
    if not chosen:
        found = sorted({f"{'causal' if r.get('causal') else 'non-causal'} {r.get('level')} {r.get('mode')} "
                        f"{r.get('dtype')}" for r in rows if r.get("kind") == "time"})  # fmt: skip
        kind = "causal" if causal else "non-causal"
        raise ValueError(f"{path} has no {kind} {level} {mode} {dtype} timings; it has {found}")
    latest: dict[tuple, dict[str, Any]] = {}
    for row in chosen:  # a rerun case replaces its earlier result
        latest[(row["attention"], json.dumps(row["options"], sort_keys=True), row["seq_len"])] = row
    return list(latest.values())


def _check_timing(row: dict[str, Any], where: str) -> None:
    missing = [name for name in TIMING_FIELDS if name not in row]
    if missing:
        raise ValueError(f"{where}: a timing (kind time, status ok) without {_names(missing)}")
    for name, kind in TIMING_FIELDS.items():
        value = row[name]
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{where}: {name} {value!r} is not a number > 0")
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name} {value!r} is not an int >= 1")
        elif not isinstance(value, kind):
            expected = "a JSON object {...}" if kind is dict else "a string"
            raise ValueError(f"{where}: {name} {value!r} is not {expected}")


def bench_speedups(bench: list[dict[str, Any]], attention: str, options: dict) -> tuple[dict[int, float], str]:
    """n -> speedup over full (median times) for the mechanism, and a note when other options were used."""
    base = {r["seq_len"]: r["time_ms_median"] for r in bench if is_baseline(r)}
    same = [r for r in bench if r["attention"] == attention and r["options"] == options]
    note = ""
    if not same:
        others = [r for r in bench if r["attention"] == attention]
        if others:
            chosen = json.dumps(others[0]["options"], sort_keys=True)
            same = [r for r in others if json.dumps(r["options"], sort_keys=True) == chosen]
            note = f"bench options {chosen}"
    return {r["seq_len"]: base[r["seq_len"]] / r["time_ms_median"] for r in same if r["seq_len"] in base}, note


def write_report(
    experiment: Path,
    bench_dir: Path,
    *,
    mode: str = "fwd+bwd",
    dtype: str = "float32",
    level: str = "core",
    margin: float | None = None,
    causal: bool = False,
) -> Path:
    rows = load_compare(experiment)
    bench = load_bench(bench_dir, mode=mode, dtype=dtype, level=level, causal=causal)
    metric = primary_metric(rows)
    summary = [s for s in summarize_mechanisms(rows, metric, reference="full", margin=margin) if s["ok"]]
    reference = next((s for s in summary if s["attention"] == "full"), None)
    if reference is None:
        raise ValueError(f"{experiment} has no finished 'full' run: speedups and accuracy changes are against full")
    full_speed = reference["intervals"]["tokens_per_s"].mean
    points = []
    for s in summary:
        speed = s["intervals"]["tokens_per_s"]
        points.append(
            {
                "summary": s,
                "speedup": speed.mean / full_speed,
                "speedup_half": speed.half_width / full_speed,
                "metric": s["intervals"][metric],
                "memory": s["intervals"]["train_mem_mb"].mean if s["intervals"].get("train_mem_mb") else 0.0,
                "change": s["difference"],
            }
        )
    front = pareto_front(points, lower_is_better(metric))
    plot_pareto(points, front, metric, experiment / "pareto.png", experiment.name)

    sign = "lower" if lower_is_better(metric) else "higher"
    lines = [
        f"# zoo report: {experiment.name}",
        "",
        f"- accuracy: `{experiment}` ({metric}, {sign} is better; mean ± 95% interval over seeds)",
        f"- speed by length: `{bench_dir}` ({level}, {mode}, {dtype}, {'causal' if causal else 'non-causal'}; "
        "speedup = full's median time /"
        " the mechanism's)",
        "",
        "## The compared task",
        "",
        "Change vs full: the paired difference over shared seeds with its 95% interval, and the verdict"
        f" ({margin_text(reference['margin'])}: {RULE}); on par from δ: the smallest margin at which it would be"
        " `on par`.",
        "",
        "| mechanism | options | seeds | " + metric + " | change vs full | verdict | on par from δ | speedup in"
        " training | train MB | Pareto |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(points, key=lambda p: -p["speedup"]):
        s = p["summary"]
        lines.append(
            f"| {s['mechanism']} | `{s['options']}` | {s['ok']} | {_interval(p['metric'])} | {_change(p['change'])} | "
            f"{s['verdict']} | {format_on_par_margin(p['change'], metric)} | "
            f"{p['speedup']:.2f}x ± {p['speedup_half']:.2f} | {p['memory']:,.0f} | "
            f"{'yes' if p in front else ''} |"
        )
    lengths = sorted({r["seq_len"] for r in bench})
    lines += [
        "",
        "## Which mechanism at which length",
        "",
        f"Faster than full attention at each length (bench speedup), with the {metric} change on the compared task"
        " (paired difference from full, 95% interval) and its verdict.",
        "",
        "| n | faster than full: speedup (change in " + metric + ") | not faster |",
        "|---|---|---|",
    ]
    notes = {}
    for n in lengths:
        faster, slower = [], []
        for p in points:
            s = p["summary"]
            if s["attention"] == "full":
                continue
            speedups, note = bench_speedups(bench, s["attention"], json.loads(s["options"]))
            if note:
                notes[s["mechanism"]] = note
            if n not in speedups:
                continue
            (faster if speedups[n] > 1 else slower).append((speedups[n], s["mechanism"], p["change"], s["verdict"]))
        cells = [
            f"{name} {speed:.1f}x ({_change(change)}, {verdict})"
            for speed, name, change, verdict in sorted(faster, reverse=True)
        ]
        behind = ", ".join(name for _, name, _, _ in sorted(slower, reverse=True))
        lines.append(f"| {n} | {', '.join(cells) or '-'} | {behind or '-'} |")
    if notes:
        lines += ["", "Bench rows measured with other options than the compared run:"]
        lines += [f"- {name}: {note}" for name, note in sorted(notes.items())]
    path = experiment / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def pareto_front(points: list[dict[str, Any]], lower_better: bool) -> list[dict[str, Any]]:
    """Points no other point beats on both speedup and metric (ties on one axis, better on the other), among those
    whose verdict is none of :data:`OFF_FRONT`: speed bought with accuracy the rule says is lost, or never checked,
    is no trade-off to offer (the no-attention control would otherwise sit on the front for being fast)."""
    value = (lambda p: -p["metric"].mean) if lower_better else (lambda p: p["metric"].mean)
    candidates = [p for p in points if p["summary"]["verdict"] not in OFF_FRONT]
    front = []
    for p in candidates:
        dominated = any(
            q is not p
            and q["speedup"] >= p["speedup"]
            and value(q) >= value(p)
            and (q["speedup"] > p["speedup"] or value(q) > value(p))
            for q in candidates
        )
        if not dominated:
            front.append(p)
    return front


def plot_pareto(points: list[dict[str, Any]], front: list[dict[str, Any]], metric: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5.5))
    biggest = max((p["memory"] for p in points), default=1.0) or 1.0
    for p in points:
        s = p["summary"]
        yerr = [[p["metric"].mean - p["metric"].low], [p["metric"].high - p["metric"].mean]]
        axes.errorbar(p["speedup"], p["metric"].mean, xerr=p["speedup_half"], yerr=yerr,
                      fmt="none", ecolor="gray", capsize=2, zorder=1)  # fmt: skip
        axes.scatter(p["speedup"], p["metric"].mean, s=40 + 400 * p["memory"] / biggest, alpha=0.6,
                     edgecolors="black", zorder=2)  # fmt: skip
        axes.annotate(s["mechanism"], (p["speedup"], p["metric"].mean), textcoords="offset points", xytext=(6, 4),
                      fontsize=8)  # fmt: skip
    ordered = sorted(front, key=lambda p: p["speedup"])
    axes.plot([p["speedup"] for p in ordered], [p["metric"].mean for p in ordered], "r--", lw=1, label="Pareto front")
    axes.axvline(1.0, color="black", lw=0.5)
    axes.set_xlabel("speedup over full attention in training (tokens/s ratio)")
    axes.set_ylabel(f"{metric} (mean ± 95% interval over seeds)")
    axes.set_title(f"{title}: {metric} vs speed; marker area = memory added by training", fontsize=10)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _interval(interval: Any) -> str:
    return format_interval(interval, "")


def _change(change: PairedDifference | None) -> str:
    return format_difference(change, "", interval=True)


def _names(names: list[str]) -> str:
    return ", ".join(map(repr, names))


def _parse(value: str) -> Any:
    if value == "":
        return None
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zoo report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", required=True, type=Path, help="a zoo compare experiment folder")
    parser.add_argument("--bench", required=True, type=Path, help="a zoo bench --out folder")
    parser.add_argument("--mode", default="fwd+bwd", choices=["fwd", "fwd+bwd"], help="bench mode (training: fwd+bwd)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--level", default="core", choices=["core", "mha", "layer", "encoder"])
    parser.add_argument("--margin", type=float, default=None, help="equivalence margin δ (default: the metric's)")
    args = parser.parse_args(argv)
    if args.margin is not None and not args.margin >= 0:
        parser.error(f"--margin must be >= 0, got {args.margin}")
    try:
        path = write_report(
            args.compare, args.bench, mode=args.mode, dtype=args.dtype, level=args.level, margin=args.margin
        )
    except ValueError as error:  # records that are missing, of another kind, truncated or corrupt: named
        print(f"zoo report: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the experiment folder is not writable
        print(f"zoo report: error: cannot write {error.filename}: {error.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {path.parent / 'pareto.png'}")
    return 0
