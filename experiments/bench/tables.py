"""Markdown tables of a sweep's results, in the papers' layouts, every ratio against full attention.

The baseline is ``full`` with the SDPA backend (options ``{}``, ``backend=auto`` or ``backend=sdpa``)
measured in the same group: same level, mode, dtype, device, threads, heads, head width, model sizes,
causal flag and batch. Ratios are baseline / mechanism, so > 1 means faster or smaller. Times are
medians; a failed case shows its status (``oom``, ``timeout``, ...), one not measured shows "-".

- :func:`nystromformer_table`: memory (MB) and time (ms) by mechanism x n, ratios in parentheses
  (Xiong et al. 2021, the efficiency table).
- :func:`linformer_table`: for a mechanism swept over one option (Linformer's k), speedup and memory
  saving by n x option value (Wang et al. 2020, Table 3). Where the sweep searched the largest batch
  that fits (the paper's method), memory saving is the ratio of those batches and speedup the ratio of
  time per sequence, each at its own largest batch; otherwise the ratios of peak memory and of time at
  the sweep's batch.
- :func:`crossover_table`: the shortest n from which a mechanism is faster than full attention at every
  longer n measured.
- :func:`decoding_table`: greedy decoding of n tokens with the decoding cache against recomputing the
  decoder over the prefix at every step, per mechanism (the translation issue's target: >= 5x for full).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from attention_zoo.spec import AttentionSpec

GROUP_FIELDS = ("level", "mode", "dtype", "device", "threads", "heads", "dim_head", "dim", "depth", "ff_mult")
GROUP_FIELDS += ("vocab_size", "causal", "batch")

Row = dict[str, Any]


def spec(row: Row) -> AttentionSpec:
    """The mechanism a row measured."""
    return AttentionSpec(row["attention"], row["options"])


def label(row: Row) -> str:
    """``linformer:k=128``: the name people read in tables and plots (the flag syntax)."""
    return spec(row).label


def is_baseline(row: Row) -> bool:
    options = row["options"]
    return row["attention"] == "full" and set(options) <= {"backend"} and options.get("backend", "auto") != "math"


def group_title(key: tuple) -> str:
    values = dict(zip(GROUP_FIELDS, key, strict=True))
    parts = [values["level"], values["mode"], values["dtype"], values["device"]]
    if values["batch"] is not None:
        parts.append(f"B={values['batch']}")
    parts += [f"H={values['heads']}", f"D={values['dim_head']}"]
    parts += [f"{name}={values[name]}" for name in ("dim", "depth", "ff_mult") if values[name] is not None]
    parts.append(f"{values['threads']} thread" + ("s" if values["threads"] > 1 else ""))
    return " · ".join(parts + (["causal"] if values["causal"] else []))


def group_rows(rows: Iterable[Row], kind: str = "time") -> dict[tuple, list[Row]]:
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for row in rows:
        if row["kind"] == kind:
            groups[tuple(row[f] for f in GROUP_FIELDS)].append(row)
    return dict(groups)


def by_config(rows: list[Row]) -> dict[str, dict[int, Row]]:
    """label -> n -> row; the baseline's label first (the plain ``full`` row wins over an equivalent one)."""
    table: dict[str, dict[int, Row]] = defaultdict(dict)
    for row in sorted(rows, key=lambda r: (not is_baseline(r), r["attention"], label(r))):
        table[label(row)][row["seq_len"]] = row
    return dict(table)


def baseline_by_n(rows: list[Row]) -> dict[int, Row]:
    out: dict[int, Row] = {}
    for row in sorted((r for r in rows if is_baseline(r)), key=lambda r: len(r["options"]), reverse=True):
        out[row["seq_len"]] = row  # the shortest options ({}) are written last and win
    return out


def markdown_table(headers: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def number(value: float) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def ratio(base: float | None, value: float | None) -> str:
    if not base or not value:
        return "n/a"
    x = base / value
    return f"{x:.2g}x" if x < 1 else f"{x:.1f}x" if x < 10 else f"{x:.0f}x"


def cell(row: Row | None, field: str, base: Row | None) -> str:
    """``value (ratio)`` or the case's status."""
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"]
    value = row[field]
    if base is None or base["status"] != "ok":
        return number(value)
    return f"{number(value)} ({ratio(base[field], value)})"


def nystromformer_table(rows: list[Row]) -> str:
    sections = []
    for key, members in group_rows(rows).items():
        configs, base, ns = by_config(members), baseline_by_n(members), sorted({r["seq_len"] for r in members})
        headers = ["self-attention"] + [f"n={n} {what}" for n in ns for what in ("memory (MB)", "time (ms)")]
        body = [
            [name] + [cell(per_n.get(n), f, base.get(n)) for n in ns for f in ("peak_mb", "time_ms_median")]
            for name, per_n in configs.items()
        ]
        sections.append(f"#### {group_title(key)}\n\n" + markdown_table(headers, body))
    return "\n\n".join(sections)


def swept_option(members: list[Row]) -> dict[str, tuple[str, dict[Any, list[Row]]]]:
    """mechanism -> (option name, option value -> rows) for mechanisms whose configs differ in one option."""
    out = {}
    for attention in sorted({r["attention"] for r in members} - {"full"}):
        rows = [r for r in members if r["attention"] == attention]
        keys = {k for r in rows for k in r["options"]}
        varying = [k for k in sorted(keys) if len({repr(r["options"].get(k)) for r in rows}) > 1]
        if len(varying) == 1:
            values: dict[Any, list[Row]] = defaultdict(list)
            for row in rows:
                values[row["options"].get(varying[0])].append(row)
            out[attention] = (varying[0], _sorted_by_key(values))
    return out


def _sorted_by_key(values: dict[Any, list[Row]]) -> dict[Any, list[Row]]:
    try:
        return dict(sorted(values.items()))
    except TypeError:  # option values of mixed types (e.g. None and ints) keep the sweep's order
        return values


#: (kind of rows, time field, memory field, memory saved when larger, how the two ratios were measured)
TABLE3_METHODS = (
    (
        "max_batch",
        "ms_per_sequence_at_max_batch",
        "max_batch",
        True,
        "each at its largest batch: time per sequence; largest batch",
    ),
    ("time", "time_ms_median", "peak_mb", False, "at the sweep's batch: median time; peak memory"),
)


BOUND_NOTE = "\n\n\\* a search stopped at the cap or the time limit, not at memory: a bound, not a measurement"


def linformer_table(rows: list[Row]) -> str:
    sections = []
    for kind, time_field, memory_field, larger_saves, method in TABLE3_METHODS:
        for key, members in group_rows(rows, kind).items():
            base = baseline_by_n(members)
            for attention, (option, values) in swept_option(members).items():
                ns = sorted({r["seq_len"] for rs in values.values() for r in rs})
                speed, memory = [], []
                for n in ns:
                    at_n = [next((r for r in rs if r["seq_len"] == n), None) for rs in values.values()]
                    speed.append([str(n)] + [saving(r, base.get(n), time_field) for r in at_n])
                    memory.append([str(n)] + [saving(r, base.get(n), memory_field, larger_saves) for r in at_n])
                headers = ["length n"] + [f"{option}={v}" for v in values]
                sections.append(
                    f"#### {attention} vs full: {group_title(key)} ({method})\n\nTime saved:\n\n"
                    + markdown_table(headers, speed)
                    + "\n\nMemory saved:\n\n"
                    + markdown_table(headers, memory)
                    + (BOUND_NOTE if any("*" in c for cells in memory for c in cells) else "")
                )
    return "\n\n".join(sections)


def saving(row: Row | None, base: Row | None, field: str, larger_saves: bool = False) -> str:
    """How many times less of ``field`` (more, if ``larger_saves``) ``row`` needs than full attention."""
    if row is None or base is None:
        return "-"
    if row["status"] != "ok":
        return row["status"]
    if base["status"] != "ok":
        return f"full: {base['status']}"
    if larger_saves:
        bound = row.get("limited_by") != "memory" or base.get("limited_by") != "memory"
        return ratio(row[field], base[field]) + ("*" if bound else "")
    return ratio(base[field], row[field])


def crossover(per_n: dict[int, Row], base: dict[int, Row]) -> str:
    """The shortest n from which ``per_n`` is faster than ``base`` at every longer n measured."""
    ns = sorted(n for n, r in per_n.items() if r["status"] == "ok" and base.get(n, {}).get("status") == "ok")
    if not ns:
        return "n/a"
    faster = [per_n[n]["time_ms_median"] < base[n]["time_ms_median"] for n in ns]
    if not faster[-1]:
        return f"> {ns[-1]}"
    first = next(i for i in range(len(ns)) if all(faster[i:]))
    return f"<= {ns[0]}" if first == 0 else str(ns[first])


def crossover_table(rows: list[Row]) -> str:
    body = []
    for key, members in group_rows(rows).items():
        base = baseline_by_n(members)
        for name, per_n in by_config(members).items():
            if all(is_baseline(r) for r in per_n.values()):
                continue
            longest = max(per_n)
            body.append(
                [
                    name,
                    group_title(key),
                    crossover(per_n, base),
                    str(longest),
                    saving(per_n[longest], base.get(longest), "time_ms_median"),
                ]
            )
    headers = ["mechanism", "setting", "faster than full from n", "longest n", "speedup at longest n"]
    return markdown_table(headers, body) if body else "(no mechanism besides full was measured)"


def max_batch_table(rows: list[Row]) -> str:
    sections = []
    for key, members in group_rows(rows, "max_batch").items():
        base, ns = baseline_by_n(members), sorted({r["seq_len"] for r in members})
        body = []
        for name, per_n in by_config(members).items():
            cells = []
            for n in ns:
                row, full = per_n.get(n), base.get(n)
                if row is None or row["status"] != "ok":
                    cells.append(row["status"] if row else "-")
                    continue
                bound = "" if row["limited_by"] == "memory" else f" ({row['limited_by']}-bound)"
                saving = f" ({ratio(row['max_batch'], full['max_batch'])})" if full and full.get("max_batch") else ""
                cells.append(f"{row['max_batch']}{saving}{bound}")
            body.append([name] + cells)
        title = group_title(key).replace(" · ", " · max batch · ", 1)
        sections.append(f"#### {title}\n\n" + markdown_table(["mechanism"] + [f"n={n}" for n in ns], body))
    return "\n\n".join(sections)


def throughput_table(rows: list[Row]) -> str:
    sections = []
    for key, members in group_rows(rows).items():
        ns = sorted({r["seq_len"] for r in members})
        body = [[name] + [_throughput(per_n.get(n)) for n in ns] for name, per_n in by_config(members).items()]
        sections.append(f"#### {group_title(key)}\n\n" + markdown_table(["mechanism"] + [f"n={n}" for n in ns], body))
    return "\n\n".join(sections)


def _throughput(row: Row | None) -> str:
    if row is None or row["status"] != "ok":
        return row["status"] if row else "-"
    if row.get("gflops_per_s") is None:
        return "n/a"
    peak = row.get("peak_fraction")
    return f"{number(row['gflops_per_s'])}" + (f" ({peak:.0%})" if peak is not None else "")


def all_cases_table(rows: list[Row]) -> str:
    headers = ["mechanism", "setting", "n", "status", "median ms", "min ms", "max ms", "peak MB", "GFLOP", "detail"]
    body = []
    for row in rows:
        if row["kind"] != "time":
            continue
        key = tuple(row[f] for f in GROUP_FIELDS)
        ok = row["status"] == "ok"
        fields = ("time_ms_median", "time_ms_min", "time_ms_max", "peak_mb")
        measured = [number(row.get(f)) if ok else "" for f in fields]
        flops = number(row["flops"] / 1e9) if ok and row.get("flops") else ("n/a" if ok else "")
        detail = row.get("detail", "").replace("|", "/")
        body.append([label(row), group_title(key), str(row["seq_len"]), row["status"], *measured, flops, detail])
    return markdown_table(headers, body)


def decoding_table(rows: list[Row]) -> str:
    """Per setting and mechanism: greedy decoding time with the cache, recomputed, and their ratio."""
    groups: dict[tuple, dict[str, dict[int, dict[str, Row]]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        if row["kind"] == "time" and row["mode"] in ("decode", "decode-recompute"):
            key = tuple("greedy decoding" if f == "mode" else row[f] for f in GROUP_FIELDS)
            groups[key][label(row)].setdefault(row["seq_len"], {})[row["mode"]] = row
    sections = []
    for key, configs in groups.items():
        body = []
        for name, per_n in configs.items():
            for n, modes in sorted(per_n.items()):
                cached, recomputed = modes.get("decode"), modes.get("decode-recompute")
                times = [cell(r, "time_ms_median", None) for r in (cached, recomputed)]
                body.append([name, str(n), *times, _cache_speedup(cached, recomputed)])
        headers = ["mechanism", "tokens decoded", "cached (ms)", "recomputed (ms)", "cache speedup"]
        sections.append(f"#### {group_title(key)}\n\n" + markdown_table(headers, body))
    return "\n\n".join(sections)


def _cache_speedup(cached: Row | None, recomputed: Row | None) -> str:
    if cached is None or recomputed is None:
        return "-"
    failed = next((r["status"] for r in (cached, recomputed) if r["status"] != "ok"), None)
    return failed or ratio(recomputed["time_ms_median"], cached["time_ms_median"])
