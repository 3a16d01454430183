"""One timed workload of the GPU suite, in the suite's own process: an attention core of the registry
(:func:`experiments.bench.measure.build_step`, the workload ``zoo bench`` times) or the raw
``F.scaled_dot_product_attention`` under one SDPA backend, the baseline of every GPU target.

Time: CUDA events around each call after warm-up, the median of the repeats (CPU: ``perf_counter``).
Memory: ``torch.cuda.max_memory_allocated`` during one more call, above what was allocated before it.

The floor of a call is max(FLOPs / peak, bytes / bandwidth), with the peak and bandwidth measured in the
same run (:mod:`experiments.gpu.environment`). FLOPs are the formulas of :mod:`experiments.bench.flops` (matrix
products only; fwd+bwd = 3 x fwd). Bytes are an estimate: the inputs and outputs of the pass, each moved
once (fwd: q, k, v read, the output written: 4 B H n d elements; fwd+bwd adds the output gradient and the
saved tensors read back, and dq, dk, dv written: 12 B H n d), plus every intermediate the core
materialises, written once and read once: 2 x the call's peak allocation above its inputs. A fused kernel
(flash) materialises almost nothing, so its floor is its inputs and outputs.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention_zoo as az
from experiments.bench import flops
from experiments.bench.cases import Case
from experiments.bench.measure import build_step, classify, time_calls

#: the name of the raw ``F.scaled_dot_product_attention`` baseline in results, and the baseline itself
RAW_SDPA = "sdpa"
RAW_SDPA_FLASH = az.AttentionSpec(RAW_SDPA, {"backend": "flash"})
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "math": SDPBackend.MATH}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """A core of the registry (``spec``) or the raw SDPA baseline (``spec.name == "sdpa"``, option ``backend``),
    B x H heads of n positions and width d."""

    spec: az.AttentionSpec
    seq_len: int
    mode: Literal["fwd", "fwd+bwd"] = "fwd+bwd"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    device: str = "cuda"
    batch: int = 8
    heads: int = 8
    dim_head: int = 64
    causal: bool = False

    @property
    def label(self) -> str:
        return self.spec.label

    def row(self) -> dict[str, Any]:
        """The workload as a results row names it: ``label``, ``attention``, ``options`` and the sizes."""
        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "spec"}
        return {"label": self.label, "attention": self.spec.name, "options": dict(self.spec.options)} | sizes

    def case(self) -> Case:
        attention = "full" if self.spec.name == RAW_SDPA else self.spec.name
        options = {} if self.spec.name == RAW_SDPA else dict(self.spec.options)
        return Case(attention, options, "core", self.mode, self.dtype, self.device, self.seq_len, self.batch,
                    self.heads, self.dim_head, threads=torch.get_num_threads(), causal=self.causal)  # fmt: skip

    def io_bytes(self) -> int:
        elements = self.batch * self.heads * self.seq_len * self.dim_head
        return (12 if self.mode == "fwd+bwd" else 4) * elements * getattr(torch, self.dtype).itemsize


def raw_sdpa_step(workload: Workload) -> Callable[[], None]:
    """One call of ``F.scaled_dot_product_attention`` restricted to the workload's ``backend`` option."""
    backend = SDPA_BACKENDS[workload.spec.options.get("backend", "flash")]
    train = workload.mode == "fwd+bwd"
    shape = (workload.batch, workload.heads, workload.seq_len, workload.dim_head)
    dtype = getattr(torch, workload.dtype)
    q, k, v = (torch.randn(shape, device=workload.device, dtype=dtype, requires_grad=train) for _ in range(3))
    grad = torch.randn(shape, device=workload.device, dtype=dtype)

    def step() -> None:
        with sdpa_kernel(backend), torch.set_grad_enabled(train):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=workload.causal)
        if train:
            out.backward(grad)
            q.grad = k.grad = v.grad = None

    return step


def _time_and_peak(workload: Workload, warmup: int, repeats: int) -> tuple[list[float], int | None]:
    torch.manual_seed(0)
    step = raw_sdpa_step(workload) if workload.spec.name == RAW_SDPA else build_step(workload.case())
    seconds = time_calls(step, warmup, repeats, workload.device)
    if workload.device != "cuda":
        return seconds, None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return seconds, torch.cuda.max_memory_allocated() - before


def measure(workload: Workload, *, warmup: int, repeats: int, peak_tflops: float | None = None,
            bandwidth_gbs: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The workload's time, memory and floor, or the status that stopped it (never raises)."""
    row = workload.row()
    try:
        seconds, peak_bytes = _time_and_peak(workload, warmup, repeats)
    except Exception as exc:  # one failing workload never stops the suite
        return row | {"status": classify(exc), "detail": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
    finally:
        if workload.device == "cuda":
            torch.cuda.empty_cache()
    median = statistics.median(seconds)
    row |= {"status": "ok", "time_ms": median * 1e3, "time_ms_min": min(seconds) * 1e3, "repeats": len(seconds)}
    work = flops.case_flops(workload.case())
    if work is not None:
        row["tflops"] = work / median / 1e12
    if peak_bytes is None:
        return row
    row["peak_mb"] = peak_bytes / 2**20
    if work is not None and peak_tflops and bandwidth_gbs:
        # the pass's outputs (out; dq, dk, dv) are in io_bytes already: the rest of the peak is intermediates
        outputs = workload.io_bytes() // (3 if workload.mode == "fwd+bwd" else 4)
        moved = workload.io_bytes() + 2 * max(0, peak_bytes - outputs)
        compute_s, memory_s = work / (peak_tflops * 1e12), moved / (bandwidth_gbs * 1e9)
        floor = max(compute_s, memory_s)
        row |= {"floor_ms": floor * 1e3, "of_floor": median / floor,
                "bound": "compute" if compute_s >= memory_s else "memory"}  # fmt: skip
    return row
