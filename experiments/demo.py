"""zoo demo: build every registered attention (each of its example configs) on one small random input and
print its forward time and its distance from full attention. Untrained, so the error column shows how far each
approximation is from softmax attention before learning, not its task accuracy."""

from __future__ import annotations

import time

from experiments.subcommands import ZooArgumentParser

#: torch, attention_zoo and rich are imported only once the arguments are read: zoo demo --help stays fast
EXAMPLES = ("zoo demo", "zoo demo --seq-len 2048 --threads 2")


def measure(name: str, options: dict, n: int, heads: int, dim_head: int, repeats: int) -> tuple[float, float]:
    """(best forward time in ms, relative Frobenius error vs full attention) on a fixed random input; a causal-only
    core runs causally, against causal full attention."""
    import torch

    import attention_zoo as az

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, dim_head, generator=generator) for _ in range(3))
    torch.manual_seed(0)
    core = az.create_attention(name, dim_head=dim_head, heads=heads, max_seq_len=n, **options).eval()
    if core.needs_shared_qk:
        k = q
    causal = core.causal_only
    reference = az.create_attention("full", dim_head=dim_head, heads=heads)(q, k, v, causal=causal)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            out = core(q, k, v, causal=causal)
            best = min(best, time.perf_counter() - start)
    error = (torch.linalg.vector_norm(out - reference) / torch.linalg.vector_norm(reference)).item()
    return best * 1e3, error


def main(argv: list[str]) -> int:
    parser = ZooArgumentParser("zoo demo", __doc__, EXAMPLES)
    parser.add_argument("--seq-len", type=int, default=512, help="sequence length n of the input (default 512)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads H (default 4)")
    parser.add_argument("--dim-head", type=int, default=32, help="head width D (default 32)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed forwards per config; the fastest is shown (default 5)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable timings)")
    args = parser.parse_args(argv)
    import torch
    from rich.markup import escape
    from rich.table import Table

    import attention_zoo as az
    from experiments.console import console

    torch.set_num_threads(args.threads)
    table = Table(
        title=f"every attention on B=1, H={args.heads}, N={args.seq_len}, D={args.dim_head}, "
        f"{args.threads} thread(s), untrained"
    )
    for header in ("name", "options", "forward ms (min)", "rel. error vs full"):
        table.add_column(header)
    for name in az.list_attentions():
        for options in az.get_attention_class(name).example_configs:
            try:
                ms, error = measure(name, options, args.seq_len, args.heads, args.dim_head, args.repeats)
                table.add_row(name, escape(str(options)), f"{ms:.2f}", f"{error:.3g}")
            except ValueError as exc:  # an example config that does not fit this input size
                table.add_row(name, escape(str(options)), "-", escape(f"skipped: {exc}"))
    console().print(table)
    if causal_only := az.list_attentions(causal_only=True):
        console().print(f"causal only ({', '.join(causal_only)}): causal, against causal full attention")
    return 0
