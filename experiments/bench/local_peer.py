"""The zoo's ``local`` core side by side with lucidrains' ``local-attention`` at equal keys per query.

The peer is block-local: ``LocalAttention(window_size=w, look_backward=1, look_forward=1)`` lets each query see
its own block of w keys and the two next to it, 3w keys (2w at the ends); the zoo's ``local`` with
``window=3w`` sees the 3w + 1 keys with |i - j| <= 3w / 2. Both run forward and backward on the same
q, k, v (B = 1, H = 8, D = 64, float32), one torch thread, minimum of ``--repeats`` after one warm-up call. The
zoo's useful FLOPs are those of :mod:`experiments.bench.flops` (4 n (3w + 1) D per head forward, 3x for
forward + backward), against the machine's matmul peak measured in the same process just before and just after
each case (the larger of the two). The zoo and the peer are called in turn, round after round, so that the
machine's drift in speed reaches both alike.

The peer is not a dependency of the project and none of its code is in it: install it apart, for the
measurement only, and put it on the path with ``--peer_path``::

    pip download --no-deps local-attention hyper-connections -d .peer/wheels
    pip install --no-deps --target .peer/site .peer/wheels/*.whl
    python -m experiments.bench.local_peer --peer_path .peer/site --out results/cpu_peers/band_kernel.jsonl

Each line of the output is one (n, w) case as JSON; the last line holds the matmul peak and the versions.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import attention_zoo as az
from experiments.bench.measure import measure_peak_tflops
from experiments.bench.paired_ratio import interleaved_seconds
from experiments.bench.store import write_json_lines


def forward_backward(attend: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        for x in (q, k, v):
            x.grad = None
        attend(q, k, v).sum().backward()

    return step


def self_attention(core: az.AttentionCore) -> Callable:
    return lambda q, k, v: core(q, k, v, mask=None, causal=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer_path", type=Path, required=True, help="the folder local-attention is installed in")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256], help="the peer's window_size w")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="also write the JSON lines here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.peer_path))
    from local_attention import LocalAttention  # the peer, from --peer_path only

    torch.set_num_threads(1)
    peaks = []
    lines = []
    for n in args.lengths:
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, n, 64, generator=generator).requires_grad_() for _ in range(3))
        for w in args.blocks:
            zoo = az.create_attention("local", dim_head=64, heads=8, window=3 * w)
            peer = LocalAttention(
                window_size=w, look_backward=1, look_forward=1, use_rotary_pos_emb=False, autopad=False
            )
            steps = [forward_backward(self_attention(zoo), q, k, v), forward_backward(peer, q, k, v)]
            # the peak measured just before and after the case, the larger of the two (the lower fraction)
            peak_gflops = measure_peak_tflops("cpu", "float32", 1) * 1e3
            zoo_ms, peer_ms = (min(times) * 1e3 for times in interleaved_seconds(steps, args.repeats))
            peak_gflops = max(peak_gflops, measure_peak_tflops("cpu", "float32", 1) * 1e3)
            peaks.append(peak_gflops)
            flops = 3 * 4 * n * (3 * w + 1) * 64 * 8
            gflops = flops / zoo_ms / 1e6
            case = {"n": n, "w": w, "zoo_window": 3 * w, "zoo_ms": zoo_ms, "peer_ms": peer_ms}
            case |= {"zoo_vs_peer": peer_ms / zoo_ms, "zoo_gflops": gflops, "peak_gflops": peak_gflops}
            case |= {"zoo_peak_fraction": gflops / peak_gflops}
            lines.append(json.dumps({key: round(x, 3) if isinstance(x, float) else x for key, x in case.items()}))
            print(lines[-1], flush=True)
    versions = {"local_attention": importlib.metadata.version("local-attention"), "torch": torch.__version__}
    lines.append(json.dumps({"matmul_peak_gflops_range": [round(min(peaks), 1), round(max(peaks), 1)]} | versions))
    print(lines[-1])
    write_json_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
