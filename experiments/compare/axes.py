"""Accuracy, time and memory in one table: ``zoo compare``'s short benchmark at long n, joined with the task.

After the runs, :func:`long_n_axes` times the compared mechanisms with ``zoo bench`` (the attention core,
forward+backward, causal when the task's model is (``--model.causal true``), float32, one thread, :data:`REPEATS`
timed calls after one warm-up, each case in its own process bounded by :data:`CASE_TIMEOUT_S`) at each ``long_n``,
into ``<experiment>/bench/`` (a rerun resumes it), then:

- appends to ``summary.md`` and ``report.md`` one table, a row per mechanism: the task's metric (mean ± 95%
  interval over seeds) and its verdict, the median time at each long n and the peak memory at the largest, with a
  line saying which n each column comes from (accuracy at the task's length, time and memory at the bench's);
- draws ``accuracy_vs_time.png``: the metric against the time at the largest n, the Pareto front drawn by
  :func:`experiments.compare.report.pareto_front` (so a mechanism judged ``worse`` or ``not validated`` is never
  on it);
- writes ``zoo report``'s ``report.md`` and ``pareto.png`` (:func:`experiments.compare.report.write_report`).

Each entry is timed with its options but ``impl``: the mechanism's own default kernel runs, since an ``impl`` picks
among kernels of one function (a dense masked path chosen for speed at short n would be quadratic at long n). A
benchmark that fails (a bad entry, no case timed) costs only its table: :func:`long_n_axes` says why in one line
and the comparison's files stand.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from attention_zoo.spec import AttentionSpec

#: the folder of the experiment the benchmark writes to
BENCH_FOLDER = "bench"
#: timed calls per case (the median is reported)
REPEATS = 3
#: the bound of one case, start-up included: a mechanism slow at long n cannot hold the comparison up for long
CASE_TIMEOUT_S = 30.0
#: the plot this module draws
PLOT = "accuracy_vs_time.png"


def bench_spec(spec: AttentionSpec) -> AttentionSpec:
    """The entry's mechanism as the benchmark times it: at its default budget for long sequences, the one ``zoo
    bench`` times by default (:func:`experiments.bench.command.default_attentions`), with its default kernel, and
    the entry's switches (boolean options such as ``sink_logit``: a variant of the mechanism, not a size). The
    entry's sizes are chosen for the task's length (MoBA's blocks of 2 at n = 64), which at long n would time a
    setting nobody runs there."""
    from experiments.bench.command import default_attentions

    defaults = {default.name: default for default in default_attentions()}
    base = defaults.get(spec.name, AttentionSpec(spec.name))
    switches = {name: value for name, value in spec.options.items() if isinstance(value, bool)}
    return AttentionSpec(base.name, {**base.options, **switches}) if switches else base


def run_bench(out: Path, specs: Sequence[AttentionSpec], long_n: Sequence[int], *, causal: bool = False) -> Path:
    """``zoo bench`` of ``specs`` (as :func:`bench_spec` times them) at ``long_n`` into ``out``, causal when the task
    is; ValueError, one line, when an entry cannot be built at these lengths. Returns ``out``."""
    from experiments.bench.cases import BenchConfig, expand, invalid_entries
    from experiments.bench.command import resolve_device, with_baseline
    from experiments.bench.report import write_outputs
    from experiments.bench.runner import Runner
    from experiments.bench.store import ResultStore

    config = BenchConfig(
        attentions=list(dict.fromkeys(bench_spec(s) for s in specs)), seq_lens=list(long_n), levels=["core"],
        modes=["fwd+bwd"], dtypes=["float32"], threads=[1], repeats=REPEATS, warmup=1, case_timeout_s=CASE_TIMEOUT_S,
        causal=causal,
    )  # fmt: skip
    config = with_baseline(config)
    if problems := invalid_entries(config):
        raise ValueError("; ".join(problems))
    device = resolve_device(config.device)
    store = ResultStore(out)
    Runner(config, store, device).run(expand(config, device))
    write_outputs(store)
    return out


def task_length(experiment: Path) -> int | None:
    """The task's sequence length, as the first run's ``config.yaml`` (Lightning's) records it; None if unknown."""
    value = _first_recorded(experiment, "data", "seq_len")
    return value if isinstance(value, int) else None


def task_causal(experiment: Path) -> bool:
    """Whether the task's model attends causally (``--model.causal true``), as the first run's ``config.yaml``
    records it; False if unrecorded."""
    return _first_recorded(experiment, "model", "causal") is True


def _first_recorded(experiment: Path, section: str, key: str) -> Any:
    for path in sorted(experiment.glob("*/seed-*/config.yaml")):
        part = (yaml.safe_load(path.read_text()) or {}).get(section) or {}
        value = (part.get("init_args") or part).get(key)
        if value is not None:
            return value
    return None


def joined_lines(
    summary: list[dict[str, Any]], bench: list[dict[str, Any]], metric: str, task_n: int | None, *,
    causal: bool = False,
) -> tuple[list[str], list[dict[str, Any]]]:  # fmt: skip
    """The Markdown section of the joined table, and its plot's points (mechanisms timed at the largest n).
    ``summary``: :func:`experiments.compare.summary.summarize_mechanisms`'s rows; ``bench``: the timings of
    :func:`experiments.compare.report.load_bench`."""
    from experiments.compare.report import pareto_front
    from experiments.compare.summary import format_interval, lower_is_better

    lengths = sorted({r["seq_len"] for r in bench})
    largest = lengths[-1]
    points = []
    for s in summary:
        options = bench_spec(AttentionSpec(s["attention"], json.loads(s["options"]))).options
        timed = {r["seq_len"]: r for r in bench if r["attention"] == s["attention"] and r["options"] == options}
        interval = s["intervals"].get(metric)
        if largest in timed and interval is not None and not math.isnan(interval.mean):
            # pareto_front ranks by speed: the inverse time at the largest n
            points.append({"summary": s, "metric": interval, "speedup": 1 / timed[largest]["time_ms_median"]})
        s["timed"] = timed
    front = pareto_front(points, lower_is_better(metric))
    on_front = {p["summary"]["mechanism"] for p in front}
    task = f"n = {task_n}" if task_n else "the task's length"
    lines = [
        "",
        "## Accuracy, time and memory",
        "",
        f"{metric} and verdict: the task's runs ({task}, mean ± 95% interval over seeds, at the comparison's budgets); "
        f"time: median ms of the attention core at its default budget for long sequences (zoo bench's), "
        f"forward+backward{', causal' if causal else ''}, float32, one thread, at n = {', '.join(map(str, lengths))} "
        "(zoo bench, "
        f"`{BENCH_FOLDER}/`); memory: the peak a call added at n = {largest}. Pareto: {metric} against the time at "
        f"n = {largest}, without mechanisms judged worse or not validated.",
        "",
        f"| mechanism | {metric} ({task}) | verdict | "
        + " | ".join(f"ms (n = {n})" for n in lengths)
        + f" | peak MB (n = {largest}) | Pareto |",
        "|---" * (len(lengths) + 5) + "|",
    ]
    for s in summary:
        timed = s.pop("timed")
        times = [_figure(timed[n]["time_ms_median"]) if n in timed else "-" for n in lengths]
        memory = timed[largest].get("peak_mb") if largest in timed else None
        cells = [
            s["mechanism"], format_interval(s["intervals"].get(metric), metric), s["verdict"], *times,
            _figure(memory) if isinstance(memory, (int, float)) else "-", "yes" if s["mechanism"] in on_front else "",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines, [p | {"front": p["summary"]["mechanism"] in on_front} for p in points]


def _figure(value: float) -> str:
    """Three significant figures, without an exponent (``8,192``, ``927``, ``2.5``, ``0.75``)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def plot_axes(points: list[dict[str, Any]], metric: str, largest: int, path: Path, title: str) -> None:
    """``metric`` (mean ± 95% interval) against the time at the largest n, log scale; the front dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5.5))
    for p in points:
        ms, interval = 1 / p["speedup"], p["metric"]
        yerr = [[interval.mean - interval.low], [interval.high - interval.mean]]
        axes.errorbar(ms, interval.mean, yerr=yerr, fmt="o", capsize=2, color="tab:red" if p["front"] else "gray")
        axes.annotate(p["summary"]["mechanism"], (ms, interval.mean), textcoords="offset points", xytext=(6, 4),
                      fontsize=8)  # fmt: skip
    front = sorted((1 / p["speedup"], p["metric"].mean) for p in points if p["front"])
    if front:
        axes.plot(*zip(*front, strict=True), "r--", lw=1, label="Pareto front (none judged worse or not validated)")
        axes.legend(fontsize=8)
    axes.set_xscale("log")
    axes.set_xlabel(f"ms per call at n = {largest} (attention core, fwd+bwd, one thread)")
    axes.set_ylabel(f"{metric} on the task (mean ± 95% interval over seeds)")
    axes.set_title(f"{title}: {metric} vs time at n = {largest}", fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_axes(
    experiment: Path, bench_dir: Path, *, metric: str | None = None, reference: str = "full",
    margin: float | None = None, causal: bool = False,
) -> list[str]:  # fmt: skip
    """Join ``experiment``'s runs with the timings in ``bench_dir``: ``zoo report``'s files, then the joined table
    appended to ``summary.md`` and ``report.md``, and :data:`PLOT`. Returns the names of the files written;
    ValueError (one line) when a record cannot be read or ``full`` has no finished run."""
    from experiments.compare.report import load_bench, load_compare, write_report
    from experiments.compare.summary import primary_metric, summarize_mechanisms

    rows, bench = load_compare(experiment), load_bench(bench_dir, causal=causal)
    metric = metric or primary_metric(rows)
    summary = [s for s in summarize_mechanisms(rows, metric, reference=reference, margin=margin) if s["ok"]]
    lines, points = joined_lines(summary, bench, metric, task_length(experiment), causal=causal)
    report = write_report(experiment, bench_dir, margin=margin, causal=causal)
    for path in (experiment / "summary.md", report):
        path.write_text(path.read_text() + "\n".join(lines) + "\n")
    plot_axes(points, metric, max(r["seq_len"] for r in bench), experiment / PLOT, experiment.name)
    return [report.name, "pareto.png", PLOT]


def long_n_axes(
    experiment: Path, specs: Sequence[AttentionSpec], long_n: Sequence[int], *, metric: str | None = None,
    reference: str = "full", margin: float | None = None, say: Any = print,
) -> list[str]:  # fmt: skip
    """:func:`run_bench` into ``<experiment>/bench/``, then :func:`write_axes`. Any failure is one ``say``d
    warning line and no file more (the comparison's own files stand): returns the names of the files written."""
    try:
        causal = task_causal(experiment)
        bench_dir = run_bench(experiment / BENCH_FOLDER, specs, long_n, causal=causal)
        return write_axes(experiment, bench_dir, metric=metric, reference=reference, margin=margin, causal=causal)
    except Exception as error:  # noqa: BLE001  (the accuracy summary must survive any failure of the benchmark)
        say(f"zoo compare: warning: no benchmark at long n ({type(error).__name__}: {error}); the summary stands")
        return []
