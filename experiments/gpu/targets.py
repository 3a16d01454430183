"""The project's GPU performance targets: bf16, fwd+bwd, B = 8, H = 8, d = 64, each mechanism against the raw
``F.scaled_dot_product_attention`` with the flash backend at the same length, in the same process.

| target | value |
|---|---|
| full (``auto``) vs raw SDPA (flash) at n = 8192 | within 5% (time ratio <= 1.05) |
| Linformer k = 256 at n = 8192 | >= 6x |
| Nystrom m = 64 at n = 8192 | >= 5x |
| sliding window w = 1024 at n = 16384 | >= 0.75 n / (w + 128) |
| LSH (4 hashes, bucket 64) at n = 16384 | faster than SDPA-flash (> 1x) |

The smoke run (``zoo gpu-suite --smoke``) evaluates the same rows at tiny sizes on whatever device is there;
its numbers test the harness, not the targets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from attention_zoo import AttentionSpec
from experiments.gpu.measure import RAW_SDPA_FLASH, Workload

FULL_WITHIN = 0.05
#: the sliding window's target speedup: the keys a query must read (w + 1) plus a 128-key tile of slack
WINDOW_SLACK = 128


@dataclass(frozen=True)
class GpuTarget:
    """``min_speedup``: SDPA-flash time / mechanism time at least this; ``max_ratio``: mechanism time /
    SDPA-flash time at most this (the ``full`` row)."""

    spec: AttentionSpec
    seq_len: int
    text: str
    min_speedup: float | None = None
    max_ratio: float | None = None
    smoke_options: dict[str, Any] = field(default_factory=dict)

    def workload(self, base: Workload, smoke: bool) -> Workload:
        spec = AttentionSpec(self.spec.name, self.smoke_options) if smoke else self.spec
        return dataclasses.replace(base, spec=spec, seq_len=base.seq_len if smoke else self.seq_len)

    def met(self, ratio: float) -> bool:
        """``ratio``: mechanism time / SDPA-flash time."""
        if self.max_ratio is not None:
            return ratio <= self.max_ratio
        return 1 / ratio >= self.min_speedup if self.min_speedup is not None else True


def window_target(n: int, window: int) -> float:
    return 0.75 * n / (window + WINDOW_SLACK)


TARGETS: tuple[GpuTarget, ...] = (
    GpuTarget(AttentionSpec("full"), 8192, "within 5% of raw SDPA", max_ratio=1 + FULL_WITHIN),
    GpuTarget(AttentionSpec("linformer", {"k": 256}), 8192, ">= 6x", min_speedup=6.0, smoke_options={"k": 32}),
    GpuTarget(
        AttentionSpec("nystrom", {"num_landmarks": 64}),
        8192,
        ">= 5x",
        min_speedup=5.0,
        smoke_options={"num_landmarks": 16},
    ),
    GpuTarget(
        AttentionSpec("local", {"window": 1024}),
        16384,
        f">= 0.75 n / (w + 128) = {window_target(16384, 1024):.2f}x",
        min_speedup=window_target(16384, 1024),
        smoke_options={"window": 32},
    ),
    GpuTarget(
        AttentionSpec("lsh", {"n_hashes": 4, "bucket_size": 64}),
        16384,
        "> 1x (faster than SDPA-flash)",
        min_speedup=1.0,
        smoke_options={"n_hashes": 2, "bucket_size": 16},
    ),
)


def baseline(target: GpuTarget, base: Workload, smoke: bool) -> Workload:
    workload = target.workload(base, smoke)
    return dataclasses.replace(workload, spec=RAW_SDPA_FLASH)


def evaluate(target: GpuTarget, row: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """The target's verdict on a measured row against its SDPA-flash row."""
    verdict: dict[str, Any] = {"target": target.text, "attention": target.spec.name, "options": row.get("options")}
    verdict |= {key: row.get(key) for key in ("dtype", "mode", "batch", "heads", "dim_head")}
    if row.get("status") != "ok" or reference.get("status") != "ok":
        failed = row if row.get("status") != "ok" else reference
        detail = f"{failed.get('label')}: {failed.get('status')} {failed.get('detail')}"
        return verdict | {"met": None, "detail": detail}
    ratio = row["time_ms"] / reference["time_ms"]
    return verdict | {
        "seq_len": row["seq_len"],
        "time_ms": row["time_ms"],
        "sdpa_flash_ms": reference["time_ms"],
        "speedup": 1 / ratio,
        "met": target.met(ratio),
    }
