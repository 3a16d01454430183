"""The ``speed`` step of ``zoo gpu-suite``: each mechanism at the speed of its mechanism on the GPU.

bf16, fwd+bwd, B = 8, H = 8, d = 64, each core of :data:`SPEED_CORES` (the registry grid's defaults) against
``full`` (``auto``: SDPA's own kernel choice) measured right before it, in the same process:

| target | value |
|---|---|
| every core of :data:`SPEED_CORES`, n = 16384 | at least 2x faster than ``full`` (``auto``) |
| every core, n = 8192 | no slower than ``full`` (``auto``) |
| MoBA, LSH, Nystrom, Performer, n = 8192 | within 4x of the floor |
| MoBA | no host synchronisation in forward or backward |

The paths these replaced as CUDA defaults (:data:`EARLIER_PATHS`) are timed last, at n = 8192, for comparison.
The floor here is max(FLOPs / peak, bytes / bandwidth) with the bytes of the inputs and outputs only
(:meth:`~experiments.gpu.measure.Workload.io_bytes`, fixed per shape), the peak and bandwidth measured by the
``environment`` step; every row reports its multiple of it (BigBird and the strided pattern through their pair
counts, :mod:`experiments.bench.flops`). Host synchronisation: one forward+backward under
``torch.cuda.set_sync_debug_mode("error")``, which raises at the first synchronising CUDA call. The step also
records which SDPA kernel ``full`` (``auto``) runs on the device (the ATen operator of one profiled call).

Before the timings the step runs every ``cuda``-marked test, those of the GPU paths first (:data:`PATH_TESTS`: at
the sizes where the paths engage, d >= 16 and n >= 1024, which the device conformance suite's tiny shapes do not
reach), for at most a set share of the step's time (the suite's ``SPEED_TESTS_SHARE``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from attention_zoo import AttentionSpec
from experiments.bench import flops
from experiments.bench.measure import build_step
from experiments.gpu.measure import Workload

#: the reference of every row: SDPA's own kernel choice
FULL_AUTO = AttentionSpec("full")
#: n -> the least speedup over ``full`` (auto) each core must reach there
MIN_SPEEDUP = {8192: 1.0, 16384: 2.0}
#: the cores held to a multiple of their floor at n = 8192, and that multiple
FLOOR_CORES, FLOOR_MULTIPLE, FLOOR_SEQ_LEN = ("moba", "lsh", "nystrom", "performer"), 4.0, 8192
#: the cores whose forward and backward must not synchronise with the host
SYNC_FREE = ("moba",)
#: the CUDA tests of the GPU paths (forward and backward against float64 or the eager path, host syncs), run first
PATH_TESTS = (
    "tests/attention_zoo/test_moba_flex.py",
    "tests/attention_zoo/test_lsh_flex.py",
    "tests/attention_zoo/test_compiled.py",
    "tests/attention_zoo/test_sparse_flex.py",
)


def cuda_test_order(files: list[str]) -> list[str]:
    """``files`` (each with ``cuda``-marked tests) with :data:`PATH_TESTS` first, so a run cut by its budget has
    checked the new paths."""
    return [f for f in PATH_TESTS if f in files] + [f for f in files if f not in PATH_TESTS]


@dataclass(frozen=True)
class SpeedCore:
    """A core of the targets at the grid's defaults, and its options at smoke sizes."""

    spec: AttentionSpec
    smoke_options: dict[str, Any] = field(default_factory=dict)

    def at(self, smoke: bool) -> AttentionSpec:
        return AttentionSpec(self.spec.name, self.smoke_options) if smoke else self.spec


SPEED_CORES: tuple[SpeedCore, ...] = (
    SpeedCore(AttentionSpec("linformer", {"k": 256}), {"k": 32}),
    SpeedCore(AttentionSpec("local", {"window": 256}), {"window": 16}),
    SpeedCore(AttentionSpec("linear")),
    SpeedCore(AttentionSpec("cosformer")),
    SpeedCore(AttentionSpec("longformer"), {"window": 16, "global_tokens": 2}),
    SpeedCore(AttentionSpec("nystrom", {"num_landmarks": 64}), {"num_landmarks": 16}),
    SpeedCore(AttentionSpec("performer", {"nb_features": 256}), {"nb_features": 32}),
    SpeedCore(AttentionSpec("bigbird"), {"block_size": 8, "random_blocks": 1}),
    SpeedCore(AttentionSpec("sparse"), {"pattern": "strided", "stride": 8}),
    SpeedCore(AttentionSpec("lsh", {"n_hashes": 4, "bucket_size": 64}), {"n_hashes": 2, "bucket_size": 16}),
    SpeedCore(AttentionSpec("moba", {"block_size": 128, "top_k": 4}), {"block_size": 16, "top_k": 2}),
)


#: the paths the GPU paths replaced as CUDA defaults, timed last at the shorter length for comparison (no target)
EARLIER_PATHS: tuple[SpeedCore, ...] = (
    SpeedCore(AttentionSpec("moba", {"block_size": 128, "top_k": 4, "impl": "tiled"}),
              {"block_size": 16, "top_k": 2, "impl": "tiled"}),
    SpeedCore(AttentionSpec("lsh", {"n_hashes": 4, "bucket_size": 64, "impl": "chunked"}),
              {"n_hashes": 2, "bucket_size": 16, "impl": "chunked"}),
    SpeedCore(AttentionSpec("nystrom", {"num_landmarks": 64, "impl": "eager"}), {"num_landmarks": 16, "impl": "eager"}),
    SpeedCore(AttentionSpec("performer", {"nb_features": 256, "impl": "eager"}), {"nb_features": 32, "impl": "eager"}),
)  # fmt: skip


def pairs(base: Workload, smoke: bool) -> Iterator[tuple[Workload, Workload, float | None]]:
    """(full (auto), core, the least speedup) per core and length, the shorter length first (so a run cut by
    its budget still has every core at n = 8192), then :data:`EARLIER_PATHS` at the shorter length (least None:
    no target). Smoke: the base workload's length and twice it."""
    lengths = (base.seq_len, 2 * base.seq_len) if smoke else tuple(MIN_SPEEDUP)
    for n, least in zip(lengths, MIN_SPEEDUP.values(), strict=True):
        reference = dataclasses.replace(base, spec=FULL_AUTO, seq_len=n, mode="fwd+bwd")
        for core in SPEED_CORES:
            yield reference, dataclasses.replace(reference, spec=core.at(smoke)), least
    reference = dataclasses.replace(base, spec=FULL_AUTO, seq_len=lengths[0], mode="fwd+bwd")
    for core in EARLIER_PATHS:
        yield reference, dataclasses.replace(reference, spec=core.at(smoke)), None


def io_floor_ms(workload: Workload, peak_tflops: float | None, bandwidth_gbs: float | None) -> float | None:
    """max(FLOPs / peak, bytes of the inputs and outputs / bandwidth), in ms; None without a FLOP formula or
    the measured ceilings."""
    work = flops.case_flops(workload.case())
    if work is None or not peak_tflops or not bandwidth_gbs:
        return None
    return max(work / (peak_tflops * 1e12), workload.io_bytes() / (bandwidth_gbs * 1e9)) * 1e3


def verdict(
    row: dict[str, Any], reference: dict[str, Any], least: float | None, floor_ms: float | None
) -> dict[str, Any]:
    """The speed row of a measured core: its speedup over ``full`` (auto) against ``least``, and for the
    :data:`FLOOR_CORES` at :data:`FLOOR_SEQ_LEN` its multiple of the floor against :data:`FLOOR_MULTIPLE`;
    ``met`` is None when either run failed or there is no target (``least`` None: an earlier path)."""
    out: dict[str, Any] = {"attention": row["attention"], "options": row.get("options"), "seq_len": row["seq_len"]}
    out |= {key: row.get(key) for key in ("dtype", "mode", "batch", "heads", "dim_head")}
    if least is None:
        out["target"] = "earlier path, for comparison"
    else:
        out["target"] = f">= {least:g}x full (auto)" if least > 1 else "no slower than full (auto)"
    if row.get("status") != "ok" or reference.get("status") != "ok":
        failed = row if row.get("status") != "ok" else reference
        return out | {"met": None, "detail": f"{failed.get('label')}: {failed.get('status')} {failed.get('detail')}"}
    speedup = reference["time_ms"] / row["time_ms"]
    out |= {"time_ms": row["time_ms"], "full_ms": reference["time_ms"], "speedup": speedup, "floor_ms": floor_ms}
    if floor_ms is not None:
        out["of_floor"] = row["time_ms"] / floor_ms
    if least is None:
        return out | {"met": None, "detail": "no target"}
    met = speedup >= least
    if floor_ms is not None and row["attention"] in FLOOR_CORES and row["seq_len"] == FLOOR_SEQ_LEN:
        out["target"] += f"; <= {FLOOR_MULTIPLE:g}x its floor"
        met = met and out["of_floor"] <= FLOOR_MULTIPLE
    return out | {"met": met}


def host_synchronisations(workload: Workload) -> str | None:
    """``"none"``, or the first synchronising call of one forward+backward of the workload (after a warm-up call);
    None off CUDA, where there is nothing to synchronise with."""
    if workload.device != "cuda":
        return None
    step = build_step(workload.case())
    step()  # compilation and first-call set-up may synchronise; the steady state is the claim
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as error:
        return str(error).strip().splitlines()[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return "none"


def sdpa_operators(workload: Workload) -> list[str]:
    """The ATen SDPA operators one fwd+bwd call of ``workload`` (``full`` (auto)) dispatches to, e.g.
    ``aten::_scaled_dot_product_flash_attention`` or ``..._cudnn_attention``."""
    step = build_step(workload.case())
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    names = {event.name for event in profile.events()}
    return sorted(name for name in names if _is_sdpa_kernel(name))


def _is_sdpa_kernel(name: str) -> bool:
    kernels = ("_flash_attention", "_efficient_attention", "_cudnn_attention", "_scaled_dot_product_attention_math")
    return name.startswith("aten::") and any(kernel in name for kernel in kernels) and "backward" not in name


def run(
    measure: Callable[[Workload], dict[str, Any]],
    record: Callable[[dict[str, Any]], None],
    base: Workload,
    smoke: bool,
    env: dict[str, Any],
    remaining: Callable[[], float],
) -> tuple[int, int]:
    """Measure every pair of :func:`pairs` while ``remaining()`` > 0, record each verdict (kind ``speed``), the
    host-synchronisation check of :data:`SYNC_FREE` and the SDPA kernel; (targets met, targets measured)."""
    reference = dataclasses.replace(base, spec=FULL_AUTO, seq_len=base.seq_len if smoke else FLOOR_SEQ_LEN)
    record({"kind": "sdpa_kernel", "seq_len": reference.seq_len, "operators": sdpa_operators(reference)})
    met = measured = 0
    for full_workload, workload, least in pairs(base, smoke):
        if remaining() <= 0:
            break
        full_row, row = measure(full_workload), measure(workload)
        floor = io_floor_ms(workload, env.get("peak_tflops"), env.get("copy_gbs"))
        speed = verdict(row, full_row, least, floor)
        if least is not None and workload.spec.name in SYNC_FREE and row.get("status") == "ok":
            speed["host_syncs"] = host_synchronisations(workload)
            if speed["host_syncs"] not in (None, "none"):
                speed["met"] = False
        record({"kind": "speed", "smoke": smoke} | speed)
        measured += least is not None
        met += speed["met"] is True
    return met, measured
