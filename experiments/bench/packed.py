"""``zoo bench --segments N``: each mechanism's core on rows of N packed documents, timed against the same
documents padded one per row, interleaved in one process.

    zoo bench --segments 8 --attentions full,linear,nystrom:num_landmarks=64 --seq-lens 4096 --repeats 10

The documents: each of the B rows of n positions is cut at N - 1 distinct points drawn uniformly from 1 .. n - 1
(``SEED``; the same documents for every mechanism at the same n and B), so every document holds at least one
position, the row is full (no padding in the packed arm) and the lengths follow the long tail of a broken stick
(the longest of 8 is about a third of the row). The arms, on the same q, k, v (and output gradient):

- packed: ``core(q, k, v, segments=...)`` on (B, H, n, D);
- padded: ``core(q, k, v, mask=...)`` on (B * N, H, L, D), one document per row from position 0, L the longest
  document of the batch (what a loader padding to the batch's longest feeds the core).

Before any timing, both arms' outputs (eval mode, so that random draws are fixed) are compared with the core applied
to each document alone, unpadded (the packed contract of :mod:`attention_zoo.packing`), at every real position:
``|out - alone| <= tol + tol * |alone|``, ``tol`` by dtype (:data:`TOLERANCE`). A packed arm that disagrees is not
timed: its row has status ``wrong``, the largest difference and where, and ``zoo bench`` ends with exit code 1. The
padded arm is timed either way and its row says whether it agreed (``padded_matches_alone``): where a core's padded
form differs from the document alone (a mask does not undo what a core draws over the padded length, such as
BigBird's random blocks or LSH's buckets), that is the core's padded behaviour, not a fault of the benchmark.

Timing (the mode of the sweep: ``fwd`` under ``torch.inference_mode()``, ``fwd+bwd`` one forward and one backward
in train mode): ``warmup`` untimed rounds of both arms, then ``repeats`` rounds, each timing the packed arm and then
the padded one, each timed call right after an untimed one of the same arm, so that it finds the allocator holding
blocks of its own sizes (:mod:`experiments.bench.paired_ratio` says why); CUDA calls are timed with events. A drift
of the machine's speed reaches both arms alike. Reported: each arm's median, min and max ms, ``padded_over_packed``
(median padded / median packed: > 1 means packing is faster) and real tokens per second (B * n over the arm's
median). Memory is not measured (it needs a process per case: ``zoo bench``).

Settings: the sweep's mechanisms (default: every registered one, as ``zoo bench`` picks them; ``full`` is not added,
each mechanism is its own baseline), ``seq_lens`` (the row length n), ``batch`` (B), ``heads``, ``dim_head``,
``modes`` (``fwd``, ``fwd+bwd``), ``dtypes``, ``threads``, ``device``, ``causal`` (aligned within each document),
``repeats`` and ``warmup``; ``levels`` only ``core``. Any other setting is refused. Rows go to ``packed.jsonl`` in
``--out`` (appended case by case; a rerun with the same ``--out`` skips the cases measured with the same code,
``--retry-failed`` redoes the failed ones), then ``packed.csv`` and ``packed.md`` are rebuilt from it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.markdown import Markdown
from torch import Tensor

import attention_zoo as az
from attention_zoo.packing import segments_from_lengths
from experiments.bench import tables
from experiments.bench.cases import BenchConfig, Case, SweepEntry, expand, invalid_entries, load_config
from experiments.bench.command import default_attentions, resolve_device
from experiments.bench.measure import classify, time_calls
from experiments.bench.report import machine_section
from experiments.bench.runner import describe, precheck
from experiments.bench.store import HalfWrittenLine, _flat, code_fingerprint, machine_info, now
from experiments.console import console
from experiments.records import checked_json_lines, lacking

PACKED_FILE = "packed.jsonl"
#: the seed of the document lengths and of q, k, v
SEED = 0
#: atol = rtol of the agreement with each document alone, by dtype
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
#: the sweep settings that apply to the packed comparison
SETTINGS = {"attentions", "seq_lens", "batch", "heads", "dim_head", "levels", "modes", "dtypes", "threads", "device",
            "causal", "repeats", "warmup"}  # fmt: skip
MODES = ("fwd", "fwd+bwd")
#: what every row of ``packed.jsonl`` holds
FIELDS = ("attention", "options", "mode", "dtype", "seq_len", "batch", "segments", "status", "code")


def document_lengths(n: int, batch: int, count: int, seed: int = SEED) -> list[list[int]]:
    """Per row, ``count`` lengths >= 1 that sum to ``n``: the row cut at ``count - 1`` distinct points drawn uniformly
    from 1 .. n - 1."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        cuts = sorted((torch.randperm(n - 1, generator=generator)[: count - 1] + 1).tolist())
        edges = [0, *cuts, n]
        rows.append([end - start for start, end in itertools.pairwise(edges)])
    return rows


@dataclasses.dataclass
class Arms:
    """The inputs of both arms: packed (B, H, n, D) with ``segments``; padded (B * N, H, L, D) with ``mask``; each
    arm's output gradient holding the same values at the same documents' positions."""

    packed: list[Tensor]
    segments: Tensor
    padded: list[Tensor]
    mask: Tensor
    lengths: list[list[int]]


def build_arms(case: Case, lengths: list[list[int]], shared_qk: bool) -> Arms:
    # b: batch, h: heads, n: positions, d: head dim; packed q, k, v and the output gradient
    generator = torch.Generator().manual_seed(SEED)
    b, h, n, d = case.batch, case.heads, case.seq_len, case.dim_head
    packed = [torch.randn(b, h, n, d, generator=generator) for _ in range(4)]
    if shared_qk:  # one projection for queries and keys (LSH): the same tensor
        packed[1] = packed[0]
    longest = max(max(row) for row in lengths)
    rows = [(row, start, length) for row, sizes in enumerate(lengths) for start, length in _starts(sizes)]
    padded = [t.new_zeros(len(rows), h, longest, d) for t in packed]
    mask = torch.zeros(len(rows), longest, dtype=torch.bool)
    for index, (row, start, length) in enumerate(rows):
        for source, target in zip(packed, padded, strict=True):
            target[index, :, :length] = source[row, :, start : start + length]
        mask[index, :length] = True
    device, dtype = torch.device(case.device), getattr(torch, case.dtype)
    move = lambda ts: [t.to(device=device, dtype=dtype) for t in ts]  # noqa: E731
    packed, padded = move(packed), move(padded)
    if shared_qk:
        packed[1], padded[1] = packed[0], padded[0]
    return Arms(packed, segments_from_lengths(lengths, n, device=device), padded, mask.to(device), lengths)


def _starts(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each document of a row."""
    out, start = [], 0
    for size in sizes:
        out.append((start, size))
        start += size
    return out


def agreement(core: az.AttentionCore, arms: Arms, case: Case) -> dict[str, Any]:
    """Both arms' outputs against the core on each document alone (eval mode, no gradient): the largest difference
    of each, whether it is within :data:`TOLERANCE`, and where the packed arm is furthest out."""
    q, k, v, _ = arms.packed
    tol = TOLERANCE[case.dtype]
    core.eval()
    with torch.no_grad():
        packed = core(q, k, v, segments=arms.segments, causal=case.causal)
        padded = core(*arms.padded[:3], mask=arms.mask, causal=case.causal)
        worst = {"packed": (False, 0.0, ""), "padded": (False, 0.0, "")}  # (out of bounds, largest difference, where)
        index = 0
        for row, sizes in enumerate(arms.lengths):
            for document, (start, length) in enumerate(_starts(sizes)):
                alone = core(*(t[row : row + 1, :, start : start + length] for t in (q, k, v)), causal=case.causal)
                outs = {"packed": packed[row : row + 1, :, start : start + length],
                        "padded": padded[index : index + 1, :, :length]}  # fmt: skip
                for arm, out in outs.items():
                    error = (out.float() - alone.float()).abs()
                    diff = error.max().item()
                    out_of_bounds = bool((error > tol + tol * alone.float().abs()).any() or not error.isfinite().all())
                    where = f"row {row}, document {document} (positions {start} .. {start + length - 1})"
                    if (out_of_bounds, diff) > worst[arm][:2]:  # out of bounds first, then the larger difference
                        worst[arm] = (out_of_bounds, diff, where)
                index += 1
    return {
        "tolerance": tol,
        "packed_max_abs_diff": worst["packed"][1],
        "packed_matches_alone": not worst["packed"][0],
        "packed_worst_at": worst["packed"][2],
        "padded_max_abs_diff": worst["padded"][1],
        "padded_matches_alone": not worst["padded"][0],
    }


def _step(core: az.AttentionCore, inputs: list[Tensor], train: bool, **call: Any) -> Callable[[], None]:
    q, k, v, grad = inputs
    leaves = [q, v] if k is q else [q, k, v]

    if not train:

        def step() -> None:
            with torch.inference_mode():
                core(q, k, v, **call)

        return step

    def step() -> None:
        core(q, k, v, **call).backward(grad)
        core.zero_grad(set_to_none=True)
        for t in leaves:
            t.grad = None

    return step


def paired_seconds(steps: list[Callable[[], None]], warmup: int, repeats: int, device: str) -> list[list[float]]:
    """Each step's call times, in seconds: ``warmup`` untimed rounds, then ``repeats`` rounds calling every step in
    turn, each timed call right after an untimed one of the same step."""
    for _ in range(warmup):
        for step in steps:
            step()
    seconds: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for step, times in zip(steps, seconds, strict=True):
            step()
            times.extend(time_calls(step, 0, 1, device))
    return seconds


def measure_packed(case: Case, count: int, *, repeats: int, warmup: int) -> dict[str, Any]:
    """One case: its documents, the agreement check and, when the packed arm agrees, both arms' times (never raises:
    a failure is a status, as in ``zoo bench``)."""
    lengths = document_lengths(case.seq_len, case.batch, count)
    longest = max(max(row) for row in lengths)
    result: dict[str, Any] = {"segments": count, "seed": SEED, "lengths": lengths, "longest": longest,
                              "padded_positions": case.batch * count * longest}  # fmt: skip
    if (refused := precheck(case)) is not None:
        return result | refused
    try:
        if case.device == "cuda" and not torch.cuda.is_available():
            return result | {"status": "unsupported", "detail": "CUDA is not available on this machine"}
        torch.set_num_threads(case.threads)
        torch.manual_seed(SEED)
        core = az.create_attention(
            case.attention, dim_head=case.dim_head, heads=case.heads, max_seq_len=case.seq_len, **case.options
        ).to(device=case.device, dtype=getattr(torch, case.dtype))
        arms = build_arms(case, lengths, core.needs_shared_qk)
        result |= agreement(core, arms, case)
        if not result["packed_matches_alone"]:
            detail = (f"packed output differs from the document alone by up to {result['packed_max_abs_diff']:.3g} "
                      f"at {result['packed_worst_at']} (tolerance {result['tolerance']:g}): not timed")  # fmt: skip
            return result | {"status": "wrong", "detail": detail}
        train = case.mode == "fwd+bwd"
        core.train(train)
        for t in {id(t): t for t in arms.packed[:3] + arms.padded[:3]}.values():
            t.requires_grad_(train)
        steps = [_step(core, arms.packed, train, segments=arms.segments, causal=case.causal),
                 _step(core, arms.padded, train, mask=arms.mask, causal=case.causal)]  # fmt: skip
        packed, padded = paired_seconds(steps, warmup, repeats, case.device)
    except Exception as exc:  # the sweep records why a case failed and goes on
        status = classify(exc)
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        return result | {"status": status, "detail": f"{type(exc).__name__}: {first}"}
    tokens = case.batch * case.seq_len
    times = {}
    for arm, seconds in (("packed", packed), ("padded", padded)):
        median = statistics.median(seconds)
        times |= {f"{arm}_ms_median": median * 1e3, f"{arm}_ms_min": min(seconds) * 1e3,
                  f"{arm}_ms_max": max(seconds) * 1e3, f"{arm}_tokens_per_s": tokens / median}  # fmt: skip
    ratio = times["padded_ms_median"] / times["packed_ms_median"]
    detail = "" if result["padded_matches_alone"] else "padded differs from the documents alone (the core's padding)"
    return result | times | {"status": "ok", "detail": detail, "padded_over_packed": ratio}


def key(row: dict[str, Any]) -> str:
    """The resume key of a row or result: the case and the documents."""
    fields = {f.name: row[f.name] for f in dataclasses.fields(Case)} | {"segments": row["segments"]}
    return json.dumps(fields, sort_keys=True)


def read_rows(path: Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """The rows of a ``packed.jsonl`` (none when it does not exist), each checked; a half-written last line is
    skipped with a warning (cut off with ``repair``), as ``zoo bench``'s store does."""
    if not path.exists():
        return []
    rows, fragment = checked_json_lines(path, lacking(FIELDS, "not a zoo bench --segments row"), repair=repair)
    if fragment:
        warnings.warn(f"{path}: dropping a half-written last line ({len(fragment)} bytes)", HalfWrittenLine,
                      stacklevel=2)  # fmt: skip
    return rows


def cases_of(config: BenchConfig, count: int) -> list[Case]:
    """The cases of the sweep (mechanisms x settings x n); ValueError naming what the packed comparison cannot
    run."""
    if config.levels != ["core"]:
        raise ValueError(f"--segments times cores: levels must be core, got {', '.join(config.levels)}")
    bad = [mode for mode in config.modes if mode not in MODES]
    if bad:
        raise ValueError(f"--segments times {' and '.join(MODES)}: modes {', '.join(bad)} do not apply")
    if count < 1 or count > min(config.seq_lens):
        raise ValueError(
            f"--segments {count}: documents per row must be in [1, {min(config.seq_lens)}] (the shortest row length "
            "of --seq-lens: every document holds at least one position)"
        )
    if not config.attentions:
        config = dataclasses.replace(config, attentions=[SweepEntry(spec) for spec in default_attentions()])
    problems = invalid_entries(config)
    if problems:
        raise ValueError(f"{len(problems)} invalid attention entries, nothing was run: " + "; ".join(problems))
    cases = expand(config, resolve_device(config.device))
    if not cases:
        raise ValueError(f"the sweep has no case: no attention applies to seq_lens {config.seq_lens}")
    return cases


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per setting, each mechanism's packed and padded times, their ratio, real tokens per second and the
    agreement with the documents alone."""
    sections = []
    for group, members in tables.group_rows(rows).items():
        headers = ["mechanism", "n", "documents", "longest", "packed ms", "padded ms", "padded / packed",
                   "packed tokens/s", "padded tokens/s", "agrees with alone (packed, padded)"]  # fmt: skip
        body = []
        for row in sorted(members, key=lambda r: (r["seq_len"], tables.label(r))):
            head = [tables.label(row), str(row["seq_len"]), str(row["segments"]), str(row["longest"])]
            if row["status"] != "ok":
                body.append(head + [row["status"], "", "", "", "", row.get("detail", "").replace("|", "/")])
                continue
            agree = ", ".join("yes" if row[f"{arm}_matches_alone"] else "no" for arm in ("packed", "padded"))
            body.append(head + [tables.number(row["packed_ms_median"]), tables.number(row["padded_ms_median"]),
                                f"{row['padded_over_packed']:.2f}x", f"{row['packed_tokens_per_s']:.0f}",
                                f"{row['padded_tokens_per_s']:.0f}", agree])  # fmt: skip
        title = tables.group_title(group) + f" · {members[0]['repeats']} paired rounds"
        sections.append(f"#### {title}\n\n" + tables.markdown_table(headers, body))
    return "\n\n".join(sections)


def write_outputs(out: Path, rows: list[dict[str, Any]]) -> tuple[Path, Path]:
    """``packed.csv`` and ``packed.md`` from the latest row of each case, each written whole then renamed."""
    latest = list({key(row): row for row in rows}.values())
    csv_path, markdown = out / "packed.csv", out / "packed.md"
    flat = [_flat(row) for row in latest]
    columns = list(dict.fromkeys(name for row in flat for name in row))
    temporary = csv_path.with_suffix(".csv.tmp")
    with open(temporary, "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(flat)
    os.replace(temporary, csv_path)
    text = ("# attention-zoo benchmark: packed rows against padded ones\n\n## Machine\n\n" + machine_section(latest)
            + "\n\nMethod: `experiments/bench/packed.py` (its docstring).\n\n" + table(latest) + "\n")  # fmt: skip
    temporary = markdown.with_suffix(".md.tmp")
    temporary.write_text(text)
    os.replace(temporary, markdown)
    return csv_path, markdown


def main(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """``zoo bench --segments N`` (``args`` parsed by :func:`experiments.bench.command.build_parser`); exit code 2
    for a bad setting, 1 when a packed arm disagreed with the documents alone."""
    prog, count = args.prog, args.segments
    others = [flag for flag, on in (("--check-targets", args.check_targets), ("--launcher ray", args.launcher == "ray"),
                                    ("--paired-rounds", args.paired_rounds > 0)) if on]  # fmt: skip
    try:
        if others:
            raise ValueError(f"--segments does not go with {', '.join(others)}: it times in one local process")
        given = set(overrides) | (set(yaml.safe_load(Path(args.config).read_text()) or {}) if args.config else set())
        fixed = sorted(given - SETTINGS)
        if fixed:
            raise ValueError(
                f"{', '.join('--' + name.replace('_', '-') for name in fixed)}: not settings of --segments, which "
                "times both arms interleaved in one process; it takes "
                + ", ".join("--" + name.replace("_", "-") for name in sorted(SETTINGS))
            )
        config = load_config(args.config, overrides)
        cases = cases_of(config, count)
        if args.out.exists() and not args.out.is_dir():
            raise ValueError(f"--out {args.out} is a file, not a folder")
        path = args.out / PACKED_FILE
        rows = read_rows(path, repair=not args.report_only)
        if args.report_only and not rows:
            raise ValueError(f"--out {args.out} holds no {PACKED_FILE}: nothing to report")
    except (ValueError, OSError, yaml.YAMLError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    out = console()
    if not args.report_only:
        args.out.mkdir(parents=True, exist_ok=True)
        rows = run(cases, count, config, path, rows, retry_failed=args.retry_failed)
    wanted = {key(dataclasses.asdict(case) | {"segments": count}) for case in cases}
    swept = [row for row in {key(row): row for row in rows}.values() if key(row) in wanted]
    csv_path, markdown = write_outputs(args.out, rows)
    out.print(Markdown(table(swept)))
    out.print(f"wrote {path}, {csv_path}, {markdown}")
    wrong = [tables.label(row) for row in swept if row["status"] == "wrong"]
    if wrong:
        print(f"{prog}: error: the packed output of {', '.join(wrong)} disagrees with the documents alone "
              f"(see {markdown})", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def run(cases: list[Case], count: int, config: BenchConfig, path: Path, rows: list[dict[str, Any]], *,
        retry_failed: bool) -> list[dict[str, Any]]:  # fmt: skip
    """Measure each case that ``rows`` lacks (measured with this code; a failed one again with ``retry_failed``),
    appending its row to ``path`` as soon as it is known; every row."""
    code = code_fingerprint()
    latest = {key(row): row for row in rows if row["code"] == code}
    machine = machine_info(resolve_device(config.device))
    out = console()
    for case in cases:
        done = latest.get(key(dataclasses.asdict(case) | {"segments": count}))
        if done is not None and (done["status"] == "ok" or not retry_failed):
            continue
        started = time.monotonic()
        result = measure_packed(case, count, repeats=config.repeats, warmup=config.warmup)
        row = dataclasses.asdict(case) | {"repeats": config.repeats, "warmup": config.warmup} | result
        row |= {"machine": machine, "code": code, "finished_at": now(), "wall_s": round(time.monotonic() - started, 2),
                "load_avg_1m": os.getloadavg()[0]}  # fmt: skip
        with path.open("a") as file:
            file.write(json.dumps(row, sort_keys=True) + "\n")
        rows.append(row)
        out.print(f"{describe(case)} {count} documents: {summary(row)}")
    return rows


def summary(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']} {row['detail']}".strip()
    return (f"packed {row['packed_ms_median']:.2f} ms, padded {row['padded_ms_median']:.2f} ms "
            f"({row['padded_over_packed']:.2f}x)")  # fmt: skip
