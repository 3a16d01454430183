"""What bounds the band kernel (:mod:`attention_zoo.sparse.band`): its tile sizes, its products timed alone, and
where a forward + backward spends its time.

    python -m experiments.bench.band_profile --lengths 2048 4096 --windows 192 384 768 \
        --out results/cpu_peers/band_profile.jsonl

For each (n, window) case, at B = 1, H = 8, D = 64, float32, one torch thread, non-causal:

- ``tiles``: the kernel's forward + backward at each query tile T of ``--tiles`` (ms, minimum over ``--rounds``
  interleaved rounds), and the tile the ``local`` core picks;
- ``products``: at the picked tile, the six batched products of one forward + backward (Q K^T and E V; E^T dO',
  dO' V^T, dS K and dS^T Q), each on the kernel's own strided key windows over every tile of the case, timed alone
  (minimum over ``--rounds``) with its rate in GFLOP/s; their sum is the time the products alone take;
- ``profile``: the share of a forward + backward's self time in each operator (``torch.profiler``), the largest
  first;
- the useful FLOP/s (12 n (w + 1) D per head, :mod:`experiments.bench.flops`) and the matmul peak of the same
  process (1024^3 products), measured before and after the case, the larger of the two.

So a case's ceiling is the useful FLOPs over the products' own time: what the kernel would reach with no
elementwise pass at all. Each line of the output is one case as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from attention_zoo.sparse.band import Band, BandRows, band_attention
from attention_zoo.sparse.patterns import LocalPattern
from experiments.bench.measure import measure_peak_tflops
from experiments.bench.paired_ratio import interleaved_seconds
from experiments.bench.store import write_json_lines

HEADS, DIM_HEAD = 8, 64


def forward_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band) -> Callable[[], None]:
    grad = torch.ones_like(q)

    def step() -> None:
        band_attention(q, k, v, band, None, DIM_HEAD**-0.5).backward(grad)
        q.grad = k.grad = v.grad = None

    return step


def product_operands(n: int, band: Band) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The (left, right) operands of the kernel's six products over every tile, with the kernel's layout: keys and
    values as overlapping strided windows of one row buffer, scores (tiles, T, L), tiles (tiles, T, D)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, n, DIM_HEAD, generator=generator)
    rows = BandRows(band, q)
    queries = rows.queries(q)
    keys = rows.windows(rows.keys(q))
    scores = torch.randn(len(queries), band.tile, band.width, generator=generator)
    return {
        "Q K^T": (queries, keys.mT),
        "E V": (scores, keys),
        "E^T dO'": (scores.mT, queries),
        "dO' V^T": (queries, keys.mT),
        "dS K": (scores, keys),
        "dS^T Q": (scores.mT, queries),
    }


def time_products(n: int, band: Band, rounds: int) -> dict[str, dict[str, float]]:
    timed = {}
    for name, (left, right) in product_operands(n, band).items():
        out = torch.bmm(left, right)
        seconds = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            torch.bmm(left, right, out=out)
            seconds.append(time.perf_counter() - start)
        flops = 2 * left.shape[0] * left.shape[1] * left.shape[2] * right.shape[2]
        best = min(seconds[1:])
        timed[name] = {"shape": [*left.shape, right.shape[2]], "ms": best * 1e3, "gflops": flops / best / 1e9}
    return timed


def operator_shares(step: Callable[[], None], top: int = 12) -> dict[str, float]:
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    ranked = sorted(events, key=lambda event: event.self_cpu_time_total, reverse=True)[:top]
    return {event.key: round(event.self_cpu_time_total / total, 4) for event in ranked}


def measure_case(n: int, window: int, tiles: list[int], rounds: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, DIM_HEAD, generator=generator).requires_grad_() for _ in range(3))
    picked = LocalPattern(window=window).band(causal=False)
    half = window // 2
    candidates = sorted({*tiles, picked.tile})
    bands = [Band(half, half, tile) for tile in candidates]
    peak = measure_peak_tflops("cpu", "float32", 1) * 1e3
    seconds = interleaved_seconds([forward_backward(q, k, v, band) for band in bands], rounds)
    tile_ms = {str(band.tile): min(times) * 1e3 for band, times in zip(bands, seconds, strict=True)}
    products = time_products(n, picked, rounds)
    shares = operator_shares(forward_backward(q, k, v, picked))
    peak = max(peak, measure_peak_tflops("cpu", "float32", 1) * 1e3)
    useful = 12 * n * (window + 1) * DIM_HEAD * HEADS
    kernel_ms = tile_ms[str(picked.tile)]
    products_ms = sum(product["ms"] for product in products.values())
    return {
        "n": n, "window": window, "tile": picked.tile, "key_slots": picked.width,
        "executed_over_useful": picked.width / (window + 1),
        "tile_ms": tile_ms, "kernel_ms": kernel_ms,
        "useful_gflops": useful / kernel_ms / 1e6, "peak_gflops": peak,
        "peak_fraction": useful / kernel_ms / 1e6 / peak,
        "products": products, "products_ms": products_ms, "products_share": products_ms / kernel_ms,
        "ceiling_peak_fraction": useful / products_ms / 1e6 / peak,
        "profile": shares,
    }  # fmt: skip


def _rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--windows", type=int, nargs="+", default=[192, 384, 768], help="the local window w")
    parser.add_argument("--tiles", type=int, nargs="+", default=[16, 32, 64], help="query tiles T to compare")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="also write the JSON lines here")
    args = parser.parse_args(argv)
    for value, name in [
        (min(args.lengths), "--lengths"),
        (min(args.windows), "--windows"),
        (min(args.tiles), "--tiles"),
    ]:
        if value < 1:
            raise SystemExit(f"{name} must be positive, got {value}")
    torch.set_num_threads(1)
    lines = []
    for n in args.lengths:
        for window in args.windows:
            lines.append(json.dumps(_rounded(measure_case(n, window, args.tiles, args.rounds))))
            print(lines[-1], flush=True)
            write_json_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
