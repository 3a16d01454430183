"""The GPU suite's ``report.md`` and grid plots, from the rows it recorded (``results.jsonl``)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.gpu.measure import RAW_SDPA, RAW_SDPA_FLASH
from experiments.records import checked_json_lines

ENV_FIELDS = ("name", "capability", "sm_count", "l2_mb", "memory_gib", "driver", "cuda", "torch", "triton",
              "xformers", "python", "gemm_dtype", "gemm_size", "peak_tflops", "copy_gbs")  # fmt: skip


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]


#: the fields the report reads from each kind of row the suite records
ROW_FIELDS: dict[str, tuple[str, ...]] = {
    "step": ("step", "status", "seconds", "detail"),
    "target": ("target", "attention", "met"),
    "speed": ("target", "attention", "seq_len", "met"),
    "sdpa_kernel": ("seq_len", "operators"),
    "measure": ("grid", "label", "mode", "seq_len", "status"),
    "compare": ("summary_md",),
    "lra": ("task", "run", "ok", "reason"),
}
FLASH, FULL = RAW_SDPA_FLASH.label, "full"


def crossovers(rows: list[dict[str, Any]], grid: str, baseline: str = FLASH) -> list[list[Any]]:
    """Per (mechanism, mode): the shortest measured n from which it beats ``baseline`` (a label: SDPA-flash,
    or ``full``, SDPA's own choice of kernel) at every longer n."""
    times: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for row in rows:
        if row.get("kind") == "measure" and row.get("grid") == grid and row.get("status") == "ok":
            times[(row["label"], row["mode"])][row["seq_len"]] = row["time_ms"]
    out = []
    for (label, mode), by_n in sorted(times.items()):
        flash = times.get((baseline, mode), {})
        if label.startswith(RAW_SDPA) or label == baseline:
            continue
        ns = sorted(n for n in by_n if n in flash)
        faster = [by_n[n] < flash[n] for n in ns]
        crossing = next((n for i, n in enumerate(ns) if all(faster[i:])), None)
        longest = ns[-1] if ns else None
        speedup = flash[longest] / by_n[longest] if longest else None
        out.append([label, mode, crossing if crossing is not None else f"none up to {longest}", longest, speedup])
    return out


def _speed_section(rows: list[dict[str, Any]]) -> list[str]:
    """The ``speed`` step's verdicts (:mod:`experiments.gpu.speed`) and the SDPA kernel ``full`` (auto) ran."""
    verdicts = [r for r in rows if r.get("kind") == "speed"]
    kernels = [r for r in rows if r.get("kind") == "sdpa_kernel"]
    if not verdicts and not kernels:
        return []
    lines = ["", "## Each mechanism at the speed of its mechanism (against full (auto) in the same process)", ""]
    for kernel in kernels:
        operators = ", ".join(kernel["operators"]) or "none found"
        lines += [f"full (auto) at n = {kernel['seq_len']} runs: {operators}", ""]
    lines += _table(
        ["mechanism", "options", "n", "ms", "full ms", "speedup", "x floor (I/O)", "host syncs", "target", "met"],
        [
            [
                v["attention"],
                v.get("options"),
                v["seq_len"],
                v.get("time_ms"),
                v.get("full_ms"),
                v.get("speedup"),
                v.get("of_floor"),
                v.get("host_syncs"),
                v["target"],
                {True: "yes", False: "NO", None: v.get("detail")}[v["met"]],
            ]
            for v in verdicts
        ],  # fmt: skip
    )
    return lines


def write(out: Path, env: dict[str, Any], rows: list[dict[str, Any]], smoke: bool) -> None:
    lines = ["# zoo gpu-suite" + (" (smoke: tiny sizes, not a measurement of the targets)" if smoke else ""), ""]
    lines += ["## Environment", ""]
    lines += _table(["field", "value"], [[k, env.get(k)] for k in ENV_FIELDS if k in env])
    steps = [r for r in rows if r.get("kind") == "step"]
    lines += ["", "## Steps", ""] + _table(
        ["step", "status", "seconds", "detail"], [[r["step"], r["status"], r["seconds"], r["detail"]] for r in steps]
    )
    verdicts = [r for r in rows if r.get("kind") == "target"]
    if verdicts:
        first = verdicts[0]
        setting = f"{first.get('dtype')}, {first.get('mode')}, B={first.get('batch')} H={first.get('heads')} " + (
            f"d={first.get('dim_head')}"
        )
        lines += ["", f"## Targets ({setting}, against SDPA-flash in the same process)", ""]
        lines += _table(
            ["mechanism", "options", "n", "ms", "SDPA-flash ms", "speedup", "target", "met"],
            [
                [
                    v["attention"],
                    v.get("options"),
                    v.get("seq_len"),
                    v.get("time_ms"),
                    v.get("sdpa_flash_ms"),
                    v.get("speedup"),
                    v["target"],
                    {True: "yes", False: "NO", None: v.get("detail")}[v["met"]],
                ]
                for v in verdicts
            ],  # fmt: skip
        )
    lines += _speed_section(rows)
    for compare in (r for r in rows if r.get("kind") == "compare"):
        lines += ["", "## Compare (zoo compare, default task, one seed)", "", compare["summary_md"]]
    measured = [r for r in rows if r.get("kind") == "measure" and r.get("grid") not in ("targets", "speed")]
    by_grid: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in measured:
        by_grid[row["grid"]].append(row)
    for grid, grid_rows in by_grid.items():
        lines += ["", f"## Grid: {grid}", ""]
        lines += _table(
            ["mechanism", "mode", "n", "status", "ms", "TFLOP/s", "peak MB", "x floor", "bound"],
            [
                [
                    r["label"],
                    r["mode"],
                    r["seq_len"],
                    r["status"] if r["status"] == "ok" else r.get("detail"),
                    r.get("time_ms"),
                    r.get("tflops"),
                    r.get("peak_mb"),
                    r.get("of_floor"),
                    r.get("bound"),
                ]
                for r in grid_rows
            ],  # fmt: skip
        )
        if grid != "registry":
            headers = ["mechanism", "mode", "faster from n", "longest n", "speedup there"]
            for baseline, text in ((FLASH, "SDPA-flash"), (FULL, "full (auto: SDPA's own kernel choice)")):
                lines += ["", f"Crossovers against {text} ({grid}):", ""]
                lines += _table(headers, crossovers(rows, grid, baseline))
    (out / "report.md").write_text("\n".join(lines) + "\n")


def plot_grids(rows: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Time against n, log-log, one figure per (grid, mode) of the length grids."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str], dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row.get("kind") == "measure" and row.get("status") == "ok" and row["grid"] not in ("targets", "registry"):
            series[(row["grid"], row["mode"])][row["label"]].append((row["seq_len"], row["time_ms"]))
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for (grid, mode), lines in sorted(series.items()):
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for label, points in sorted(lines.items()):
            ns, ms = zip(*sorted(points), strict=True)
            axes.plot(ns, ms, marker="o", label=label, linestyle="--" if label.startswith(RAW_SDPA) else "-")
        axes.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="ms per call (median)",
                 title=f"{grid}: {mode}")  # fmt: skip
        axes.legend(fontsize=7)
        figure.tight_layout()
        path = folder / f"{grid}_{mode.replace('+', '_')}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


def read_rows(path: Path, *, repair: bool = False, note: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The rows of a suite's ``results.jsonl``, each checked for the fields the report reads (a ``ValueError`` naming
    the file and line). A half-written last line (a run killed mid-line) is reported through ``note`` and skipped;
    with ``repair`` it is cut off (:func:`experiments.records.checked_json_lines`), so that a rerun appends whole
    lines."""
    rows, fragment = checked_json_lines(path, _row_problem, repair=repair)
    if fragment:
        note(f"{path}: {'cutting off' if repair else 'skipping'} a half-written last line ({len(fragment)} bytes)")
    return rows


def _row_problem(row: dict[str, Any]) -> str | None:
    """What makes ``row`` no row of the suite's ``results.jsonl`` (:data:`ROW_FIELDS`), or None."""
    kind = row.get("kind")
    if kind not in ROW_FIELDS:
        return f"kind {kind!r}; a row of zoo gpu-suite is one of {', '.join(ROW_FIELDS)}"
    needed = ROW_FIELDS[kind] + (("time_ms",) if kind == "measure" and row.get("status") == "ok" else ())
    missing = [name for name in needed if name not in row]
    return f"a {kind} row without {', '.join(missing)}" if missing else None


def rebuild(out: Path, note: Callable[[str], None] = print) -> None:
    """Rewrite ``report.md`` from the ``results.jsonl`` and ``env.json`` of a finished run (:func:`read_rows`)."""
    rows = read_rows(out / "results.jsonl", note=note)
    env_path = out / "env.json"
    env: Any = {}
    if env_path.exists():
        try:
            env = json.loads(env_path.read_bytes())
        except ValueError as error:  # JSONDecodeError, or UnicodeDecodeError of a binary file
            raise ValueError(
                f"{env_path}: not JSON ({getattr(error, 'msg', 'not UTF-8')}): a truncated or corrupt file"
            ) from None
        if not isinstance(env, dict):
            raise ValueError(f"{env_path}: expected a JSON object {{...}}, got {type(env).__name__}")
    smoke = any(r.get("smoke") for r in rows if r.get("kind") in ("target", "speed"))
    write(out, env, rows, smoke)
