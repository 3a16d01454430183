"""Speedups over full attention, and scalings from n = 2048 to 8192, measured interleaved in one process, round
after round, with each ratio's paired confidence interval and its verdict against the project's target.

    python -m experiments.bench.paired_ratio --seq-len 4096 --attentions linear,cosformer,performer:nb_features=256
    python -m experiments.bench.paired_ratio --causal --attentions moba:block_size=128,top_k=4 --rounds 20
    python -m experiments.bench.paired_ratio --scaling --attentions linear --causal --rounds 12 --out scalings.csv

``zoo targets`` times each case in its own worker, one case after another, so full attention is timed once at the
start of a sweep and a mechanism minutes later. On a machine whose speed drifts (a virtual machine whose CPU is
throttled from outside) that drift enters every ratio. Here each round times full and then every mechanism on
the same inputs (core, forward + backward, B = 1, ``--heads``, ``--dim-head``, float32, one thread); with
``--scaling``, each mechanism at n = 2048 and then at 8192. Each timed call follows an untimed one of the same
case, so that it finds the allocator holding blocks of its own sizes: without, a case of 4x the memory right
after a small one faults its pages in, and t(8192) comes out above what its own worker measures. A round is a
pair: its ratio (full / mechanism, or t(8192) / t(2048)) has the machine's speed of that minute in both terms. Reported
per row: min / min over the rounds (the protocol's ratio of minima), the geometric
mean of the rounds' ratios with its 95% confidence interval (Student's t, ``experiments.stats.summarize``, on the
means of the log ratios over ``--blocks`` runs of consecutive rounds: the machine's drift makes neighbouring
rounds alike, so single rounds are not independent), and, where the project has a target for the row
(``experiments/bench/targets.py``), the verdict: ``met`` when the whole interval is on the target's side,
``missed`` when it is wholly on the other, ``inconclusive`` otherwise. The interval covers the minutes of one
run: the machine moves between runs, so a verdict near the line wants runs apart to agree. Time only: memory
needs a process per case (``zoo targets``). ``--keep-freed``: glibc keeps the memory freed between calls
(:mod:`experiments.bench.allocator`), so that most calls find their pages resident.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from rich.console import Console
from rich.progress import Progress

import attention_zoo as az
from attention_zoo.spec import AttentionSpec, parse_list
from experiments.bench.allocator import keep_freed_memory
from experiments.bench.targets import SCALING_NS, SPEEDUP_N, TARGETS, Target
from experiments.stats import summarize

#: confidence of the paired intervals
CONFIDENCE = 0.95
#: what :func:`verdict` says of an interval against a target
VERDICTS = ("met", "missed", "inconclusive")


def paired_interval(
    numerators: list[float], denominators: list[float], blocks: int | None = None
) -> tuple[float, float, float]:
    """Geometric mean of the rounds' ratios numerator / denominator and its ``CONFIDENCE`` interval: Student's t
    on the means of the log ratios over ``blocks`` equal runs of consecutive rounds (batch means; default: every
    round its own block), since the machine's drift makes neighbouring rounds alike; NaN bounds from fewer than
    two blocks."""
    logs = [math.log(a / b) for a, b in zip(numerators, denominators, strict=True)]
    blocks = len(logs) if blocks is None else blocks
    if blocks < 1 or len(logs) % blocks:
        raise ValueError(f"blocks must be >= 1 and divide the {len(logs)} rounds, got {blocks}")
    size = len(logs) // blocks
    means = [statistics.fmean(logs[i : i + size]) for i in range(0, len(logs), size)]
    mean = statistics.fmean(logs)
    if len(means) < 2:  # one block says nothing about the spread
        return math.exp(mean), math.nan, math.nan
    interval = summarize(means, CONFIDENCE)
    return math.exp(mean), math.exp(interval.low), math.exp(interval.high)


def verdict(low: float, high: float, *, at_least: float | None = None, at_most: float | None = None) -> str:
    """``met`` / ``missed`` / ``inconclusive``: where the interval [low, high] lies against the target bound."""
    if math.isnan(low) or math.isnan(high):
        return "inconclusive"
    if at_least is not None:
        return "met" if low >= at_least else "missed" if high < at_least else "inconclusive"
    if at_most is not None:
        return "met" if high <= at_most else "missed" if low > at_most else "inconclusive"
    raise ValueError("verdict needs a bound: at_least or at_most")


def target_for(attention: str, options: dict, causal: bool) -> Target | None:
    """The project's target for this mechanism, options and causality, or None."""
    return next((t for t in TARGETS if (t.attention, t.options, t.causal) == (attention, options, causal)), None)


def _inputs(seq_len: int, heads: int, dim_head: int) -> list[torch.Tensor]:
    """q, k, v (leaves) and the output's gradient, shared by every core timed at this length."""
    torch.manual_seed(0)
    return [torch.randn(1, heads, seq_len, dim_head, requires_grad=i < 3) for i in range(4)]


def _step(core: az.AttentionCore, inputs: list[torch.Tensor], causal: bool) -> Callable[[], None]:
    q, k, v, grad = inputs
    if core.needs_shared_qk:  # one projection for queries and keys (LSH): the same tensor
        k = q

    def call() -> None:
        core(q, k, v, causal=causal).backward(grad)
        q.grad = k.grad = v.grad = None

    return call


def _with_interval(row: dict, numerators: list[float], denominators: list[float], blocks: int | None,
                   target: float | None, bound: Literal["at_least", "at_most"]) -> dict:  # fmt: skip
    mean, low, high = paired_interval(numerators, denominators, blocks)
    row.update(blocks=len(numerators) if blocks is None else blocks, paired=mean, paired_low=low, paired_high=high,
               target=target)  # fmt: skip
    row["verdict"] = "" if target is None else verdict(low, high, **{bound: target})
    return row


@dataclass(frozen=True)
class PairedRounds:
    """How the paired timings run: ``rounds`` interleaved rounds (their intervals over ``blocks``, as
    :func:`paired_interval`) of cores with ``heads`` heads of width ``dim_head``; ``on_round`` after each round."""

    causal: bool
    rounds: int
    blocks: int | None = None
    heads: int = 8
    dim_head: int = 64
    on_round: Callable[[], None] | None = None


def measure(entries: list[tuple[str, dict]], seq_len: int, plan: PairedRounds) -> list[dict]:
    """One row per entry (full first): min and max ms over the rounds, the speedup min(full) / min(it), and the
    rounds' paired speedups full / it: their geometric mean, its interval (over ``blocks``, as
    :func:`paired_interval`), and the verdict on the target."""
    torch.set_num_threads(1)
    causal, rounds, blocks, heads, dim_head = plan.causal, plan.rounds, plan.blocks, plan.heads, plan.dim_head
    entries = [("full", {}), *entries]
    cores = [az.create_attention(name, dim_head=dim_head, heads=heads, max_seq_len=seq_len, **options)
             for name, options in entries]  # fmt: skip
    inputs = _inputs(seq_len, heads, dim_head)
    steps = [_step(core, inputs, causal) for core in cores]
    seconds = interleaved_seconds(steps, rounds, rewarm=True, on_round=plan.on_round)
    rows = []
    for (name, options), times in zip(entries, seconds, strict=True):
        target = target_for(name, options, causal)
        row = {"attention": name, "options": options, "seq_len": seq_len, "causal": causal, "rounds": rounds,
               "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3,
               "speedup": min(seconds[0]) / min(times)}  # fmt: skip
        minimum = None if target is None or seq_len != SPEEDUP_N else target.min_speedup
        rows.append(_with_interval(row, seconds[0], times, blocks, minimum, "at_least"))
    return rows


def measure_scaling(entries: list[tuple[str, dict]], plan: PairedRounds) -> list[dict]:
    """One row per entry: each mechanism at n = 2048 and 8192 (``SCALING_NS``), one after the other in every round;
    min(t(8192)) / min(t(2048)), and the rounds' paired ratios: their geometric mean, interval and verdict."""
    torch.set_num_threads(1)
    causal, rounds, blocks, heads, dim_head = plan.causal, plan.rounds, plan.blocks, plan.heads, plan.dim_head
    short, long = SCALING_NS
    inputs = {n: _inputs(n, heads, dim_head) for n in (short, long)}
    steps = []
    for name, options in entries:
        for n in (short, long):
            core = az.create_attention(name, dim_head=dim_head, heads=heads, max_seq_len=n, **options)
            steps.append(_step(core, inputs[n], causal))
    seconds = interleaved_seconds(steps, rounds, rewarm=True, on_round=plan.on_round)
    rows = []
    for index, (name, options) in enumerate(entries):
        at_short, at_long = seconds[2 * index], seconds[2 * index + 1]
        target = target_for(name, options, causal)
        row = {"attention": name, "options": options, "seq_lens": f"{short}/{long}", "causal": causal,
               "rounds": rounds, "ms_min_short": min(at_short) * 1e3, "ms_min_long": min(at_long) * 1e3,
               "scaling": min(at_long) / min(at_short)}  # fmt: skip
        maximum = None if target is None else target.max_scaling
        rows.append(_with_interval(row, at_long, at_short, blocks, maximum, "at_most"))
    return rows


def interleaved_seconds(
    steps: list[Callable[[], None]],
    rounds: int,
    *,
    rewarm: bool = False,
    on_round: Callable[[], None] | None = None,
) -> list[list[float]]:
    """Each step's call times, in seconds, over ``rounds`` rounds that call every step once in turn, after one
    warm-up round: a drift of the machine's speed then reaches every step alike. ``rewarm``: each timed call
    right after an untimed one of the same step, so that it finds the allocator holding blocks of its own sizes
    rather than the previous step's (without, a step of 4x the memory after a small one faults its pages in).
    ``on_round``: called after each timed round (a progress bar)."""
    for call in steps:
        call()
    seconds: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for call, times in zip(steps, seconds, strict=True):
            if rewarm:
                call()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        if on_round is not None:
            on_round()
    return seconds


def _interval_text(row: dict) -> str:
    text = f"paired {row['paired']:.3g} [{row['paired_low']:.3g}, {row['paired_high']:.3g}]"
    return text + (f"  target {row['target']}: {row['verdict']}" if row["verdict"] else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attentions", required=True, help="mechanisms in the flag syntax of attention_zoo.spec")
    parser.add_argument("--seq-len", type=int, default=4096, help="sequence length n (default 4096)")
    parser.add_argument("--causal", action="store_true", help="causal attention, against causal full")
    parser.add_argument("--scaling", action="store_true", help="t(8192) / t(2048) of each mechanism, not speedups")
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds after one warm-up round (default 12)")
    parser.add_argument("--blocks", type=int, default=4, help="runs of rounds the interval is over (default 4)")
    parser.add_argument("--heads", type=int, default=8, help="heads H (default 8)")
    parser.add_argument("--dim-head", type=int, default=64, help="head dimension D (default 64)")
    parser.add_argument(
        "--keep-freed",
        action="store_true",
        help="glibc keeps freed memory first (experiments/bench/allocator.py): fewer calls fault pages in",
    )
    parser.add_argument("--out", type=Path, default=None, help="a CSV to append the rows to (default: none)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.seq_len < 1:
        print(f"error: --rounds and --seq-len must be >= 1, got {args.rounds} and {args.seq_len}", file=sys.stderr)
        return 2
    if args.blocks < 1 or args.rounds % args.blocks:
        print(f"error: --blocks must be >= 1 and divide --rounds {args.rounds}, got {args.blocks}", file=sys.stderr)
        return 2
    if args.keep_freed:
        try:
            keep_freed_memory()
        except RuntimeError as error:  # not glibc's malloc
            print(f"error: {error}", file=sys.stderr)
            return 2
    try:  # an unknown mechanism or option is refused here, a value its core rejects when built: before any timing
        entries = [(spec.name, spec.options) for spec in (s.checked() for s in parse_list(args.attentions))]
        # on stderr and gone when done, so that the table on stdout stays what `tee` keeps
        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task("paired rounds", total=args.rounds)
            plan = PairedRounds(args.causal, args.rounds, args.blocks, args.heads, args.dim_head,
                                lambda: progress.advance(task))  # fmt: skip
            rows = measure_scaling(entries, plan) if args.scaling else measure(entries, args.seq_len, plan)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for row in rows:
        row["allocator"] = "keep-freed" if args.keep_freed else "default"
        label = AttentionSpec(row["attention"], row["options"]).label + (" causal" * row["causal"])
        if args.scaling:
            print(f"{label:48s} {row['ms_min_short']:8.1f} -> {row['ms_min_long']:8.1f} ms  {row['scaling']:5.2f}  "
                  + _interval_text(row))  # fmt: skip
        else:
            spread = row["ms_max"] / row["ms_min"]
            print(f"{label:48s} {row['ms_min']:9.1f} ms  {row['speedup']:6.2f}x  spread {spread:.2f}  "
                  + _interval_text(row))  # fmt: skip
    if args.out is not None:
        new = not args.out.exists()
        with args.out.open("a", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
