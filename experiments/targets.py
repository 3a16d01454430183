"""``zoo targets``: the project's CPU performance targets, measured against full attention.

Protocol (the issues' wording): CPU, one thread (these machines throttle a second busy thread), the
attention core alone, B=1, H=8, D=64, float32, forward+backward, minimum of repeats, speedup over
``full`` with the SDPA backend measured in the same process; linear scaling as
time(n=8192) / time(n=2048) <= 5.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
from rich.table import Table

import attention_zoo as az
from experiments.console import console


@dataclass(frozen=True)
class Target:
    attention: str
    options: dict = field(default_factory=dict)
    min_speedup: float | None = None  # at n = 4096, over full (sdpa)
    max_scaling: float | None = None  # time(8192) / time(2048)


TARGETS: tuple[Target, ...] = (
    Target("linformer", {"k": 256}, min_speedup=4.5, max_scaling=5.0),
    Target("nystrom", {"num_landmarks": 64}, min_speedup=14.0, max_scaling=5.0),
    Target("local", {"window": 256}, min_speedup=4.0, max_scaling=5.0),
    Target("lsh", {"n_hashes": 4, "bucket_size": 64}, min_speedup=2.0),
)


def fwd_bwd_seconds(
    attention: str,
    options: dict,
    n: int,
    *,
    batch: int = 1,
    heads: int = 8,
    dim_head: int = 64,
    repeats: int = 5,
    causal: bool = False,
) -> float:
    """Minimum over ``repeats`` of one forward+backward of the core alone (after one warm-up)."""
    torch.manual_seed(0)
    core = az.create_attention(attention, dim_head=dim_head, heads=heads, max_seq_len=n, **options)
    q, k, v = (torch.randn(batch, heads, n, dim_head, requires_grad=True) for _ in range(3))
    if core.needs_shared_qk:
        k = q
    grad = torch.randn(batch, heads, n, dim_head)
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        core(q, k, v, causal=causal).backward(grad)
        elapsed = time.perf_counter() - start
        if i:  # the first call warms up allocator and caches
            best = min(best, elapsed)
        q.grad = k.grad = v.grad = None
    return best


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zoo targets", description=__doc__)
    parser.add_argument("--attentions", default="", help="comma-separated subset (default: every target)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    wanted = {a for a in args.attentions.split(",") if a}
    known = set(az.list_attentions())
    table = Table(title=f"performance targets (CPU, {args.threads} thread(s), fwd+bwd, B=1 H=8 D=64 fp32)")
    for header in ("attention", "options", "full ms", "ms", "speedup", "target", "t(8192)/t(2048)", "target", "met"):
        table.add_column(header)
    full_ms = fwd_bwd_seconds("full", {"backend": "sdpa"}, 4096, repeats=args.repeats) * 1e3
    for target in TARGETS:
        if (wanted and target.attention not in wanted) or target.attention not in known:
            continue
        ms = fwd_bwd_seconds(target.attention, target.options, 4096, repeats=args.repeats) * 1e3
        speedup = full_ms / ms
        met = target.min_speedup is None or speedup >= target.min_speedup
        scaling = "-"
        if target.max_scaling is not None:
            ratio = fwd_bwd_seconds(target.attention, target.options, 8192, repeats=args.repeats) / (
                fwd_bwd_seconds(target.attention, target.options, 2048, repeats=args.repeats)
            )
            scaling = f"{ratio:.2f}"
            met = met and ratio <= target.max_scaling
        table.add_row(
            target.attention,
            str(target.options),
            f"{full_ms:.1f}",
            f"{ms:.1f}",
            f"{speedup:.2f}x",
            f">= {target.min_speedup}x",
            scaling,
            f"<= {target.max_scaling}" if target.max_scaling else "-",
            "yes" if met else "NO",
        )
    console().print(table)
    return 0
