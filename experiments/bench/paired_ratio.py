"""Speedups over full attention measured interleaved in one process: full, then each mechanism, round after round.

    python -m experiments.bench.paired_ratio --seq-len 4096 --attentions linear,cosformer,performer:nb_features=256
    python -m experiments.bench.paired_ratio --seq-len 4096 --causal --attentions linear --rounds 8 --out ratios.csv

``zoo targets`` times each case in its own worker, one case after another, so full attention is timed once at the
start of a sweep and a mechanism minutes later. On a machine whose speed drifts (a virtual machine whose CPU is
throttled from outside) that drift enters every ratio. Here each round times full and then every mechanism on
the same inputs (core, forward + backward, B = 1, ``--heads``, ``--dim-head``, float32, one thread), and the
ratio is min(full) / min(mechanism) over the rounds, with each one's spread (max / min) to show how much the
machine moved. Time only: memory needs a process per case (``zoo targets``).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import attention_zoo as az
from experiments.compare.command import parse_attentions


def measure(
    entries: list[tuple[str, dict]], *, seq_len: int, causal: bool, rounds: int, heads: int = 8, dim_head: int = 64
) -> list[dict]:
    """One row per entry (full first): min and max ms over the rounds, and the speedup min(full) / min(it)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq_len, dim_head, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, seq_len, dim_head)
    entries = [("full", {}), *entries]
    cores = [az.create_attention(name, dim_head=dim_head, heads=heads, max_seq_len=seq_len, **options)
             for name, options in entries]  # fmt: skip

    def step(core: az.AttentionCore) -> Callable[[], None]:
        def call() -> None:
            core(q, k, v, causal=causal).backward(grad)
            q.grad = k.grad = v.grad = None

        return call

    seconds = interleaved_seconds([step(core) for core in cores], rounds)
    full = min(seconds[0])
    return [
        {"attention": name, "options": options, "seq_len": seq_len, "causal": causal, "rounds": rounds,
         "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3, "speedup": full / min(times)}
        for (name, options), times in zip(entries, seconds, strict=True)
    ]  # fmt: skip


def interleaved_seconds(steps: list[Callable[[], None]], rounds: int) -> list[list[float]]:
    """Each step's call times, in seconds, over ``rounds`` rounds that call every step once in turn, after one
    warm-up round: a drift of the machine's speed then reaches every step alike."""
    for call in steps:
        call()
    seconds: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for call, times in zip(steps, seconds, strict=True):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attentions", required=True, help="comma-separated entries, as zoo compare's")
    parser.add_argument("--seq-len", type=int, default=4096, help="sequence length n (default 4096)")
    parser.add_argument("--causal", action="store_true", help="causal attention, against causal full")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds after one warm-up round (default 6)")
    parser.add_argument("--heads", type=int, default=8, help="heads H (default 8)")
    parser.add_argument("--dim-head", type=int, default=64, help="head dimension D (default 64)")
    parser.add_argument("--out", type=Path, default=None, help="a CSV to append the rows to (default: none)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.seq_len < 1:
        print(f"error: --rounds and --seq-len must be >= 1, got {args.rounds} and {args.seq_len}", file=sys.stderr)
        return 2
    try:  # an unknown mechanism or a bad option is refused when its core is built, before any timing
        entries = [(name, options or {}) for name, options in parse_attentions(args.attentions)]
        shape = dict(seq_len=args.seq_len, causal=args.causal, heads=args.heads, dim_head=args.dim_head)
        rows = measure(entries, rounds=args.rounds, **shape)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for row in rows:
        spread = row["ms_max"] / row["ms_min"]
        label = row["attention"] + (f" {row['options']}" if row["options"] else "") + (" causal" * row["causal"])
        print(f"{label:48s} {row['ms_min']:9.1f} ms  {row['speedup']:6.2f}x  spread {spread:.2f}")
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
