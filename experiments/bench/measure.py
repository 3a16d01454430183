"""Measuring one :class:`~experiments.bench.cases.Case`: build the workload, time it, read its peak memory.

Also the worker: ``python -m experiments.bench.measure`` reads one job (JSON) on stdin and prints one
result line, so that the runner can give every case a fresh process (memory isolation; an OOM or a
crash ends that case only).

Time: ``warmup`` untimed calls, then ``repeats`` timed ones (median, min, max). CPU: ``perf_counter``
around each call. CUDA: a pair of CUDA events around each call, read after ``end.synchronize()``.

Memory (``memory_method`` in every result) is that of one more call after the timed ones, so lazy
initialisation (kernel caches, code pages of the shared libraries) is not counted:
- ``cuda-max-allocated``: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; what
  PyTorch's caching allocator handed out, not what it reserved from the driver.
- ``rss-hwm`` (Linux): glibc's ``malloc_trim(0)`` first returns malloc's free pages to the system (else
  the call could reuse them unseen), then the resident set's high-water mark ``VmHWM`` is reset through
  ``/proc/self/clear_refs``; the result is ``VmHWM`` after the call minus ``VmRSS`` before it. Caveats:
  it counts whole pages and every allocation of the process (oneDNN scratch, Python objects), not only
  tensors; a block freed during the call and reused by a later allocation is counted once, which is the
  true peak of live memory but not the sum of the allocations.

``peak_mb`` is that growth above the workload's inputs and parameters (and what persists between
calls); ``total_mb`` counts them as well (growth above the process after imports, or above the warm
baseline where the resident set shrank by a few pages in between): the max-batch search checks ``total_mb``
against the memory budget.

``allocated_peak_mb`` is what the CUDA figure is on both devices: the peak of the bytes torch's allocator has
handed out during one warm call, above those live before it. On CUDA it is ``peak_mb``; on the CPU one more call
runs under ``torch.profiler`` (``profile_memory``), whose allocation and free events, summed in time order, give
it. It leaves out what the resident set adds (pages malloc keeps for freed blocks, which vary with the
allocator's history; buffers that libraries allocate outside torch) and frees of blocks allocated before the call
(so it errs high).
"""

from __future__ import annotations

import ctypes
import json
import math
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import attention_zoo as az
from attention_zoo.decoding.search import greedy_search
from attention_zoo.seq2seq import Seq2SeqTransformer
from attention_zoo.transformer import EncoderLayer
from experiments.bench.cases import DECODE_MODES, Case

RESULT_MARKER = "BENCH_RESULT "
STATUS_FILE = Path("/proc/self/status")  # Linux
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if STATUS_FILE.exists() else None
MIB = 2**20


def _status_kib(field: str) -> int:
    for line in STATUS_FILE.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def model_config(case: Case, n: int) -> az.ModelConfig:
    """The model of a layer, encoder or seq2seq case over ``n`` positions, without dropout; a size the case
    leaves out (a layer's vocabulary and depth) keeps the config's default."""
    sizes = {name: value for name, value in (("vocab_size", case.vocab_size), ("depth", case.depth)) if value}
    return az.ModelConfig(
        max_seq_len=n,
        dim=case.dim,
        heads=case.heads,
        dim_head=case.dim_head,
        ff_mult=case.ff_mult,
        attention=case.spec,
        **sizes,
    )


def build_step(case: Case) -> Callable[[], None]:
    """One call of the workload in the case's mode (inputs and parameters are built here, untimed)."""
    # b: batch, h: heads, n: positions, d: head dim
    torch.manual_seed(0)
    device, dtype = torch.device(case.device), getattr(torch, case.dtype)
    train = case.mode == "fwd+bwd"
    b, n = case.batch, case.seq_len
    attention = dict(attention=case.attention, attention_options=case.options, dim_head=case.dim_head)
    model: nn.Module
    if case.level == "core" and case.mode == "decode-step":
        return decode_step(case, device, dtype)
    if case.level == "core":
        model = az.create_attention(
            case.attention, dim_head=case.dim_head, heads=case.heads, max_seq_len=n, **case.options
        )
        q, k, v = (torch.randn(b, case.heads, n, case.dim_head, device=device, dtype=dtype) for _ in range(3))
        inputs = [t.requires_grad_(train) for t in (q, k, v)]
        if model.needs_shared_qk:
            inputs[1] = inputs[0]
        forward = lambda: model(*inputs, causal=case.causal)
        out_shape = (b, case.heads, n, case.dim_head)
    elif case.level in ("mha", "layer"):
        if case.level == "mha":
            model = az.MultiHeadAttention(case.dim, case.heads, max_seq_len=n, causal=case.causal, **attention)
        else:
            model = EncoderLayer(model_config(case, n), causal=case.causal)
        inputs = [torch.randn(b, n, case.dim, device=device, dtype=dtype, requires_grad=train)]
        forward = lambda: model(inputs[0])
        out_shape = (b, n, case.dim)
    elif case.level == "encoder":
        model = az.TransformerEncoder(model_config(case, n), causal=case.causal)
        inputs = []
        tokens = torch.randint(0, case.vocab_size, (b, n), device=device)
        forward = lambda: model(tokens)
        out_shape = (b, n, case.dim)
    else:  # seq2seq: n source tokens; teacher forcing over n target tokens, or greedy decoding of n tokens
        model = Seq2SeqTransformer(model_config(case, n))  # n source positions, n target positions
        inputs = []
        source, target = (torch.randint(3, case.vocab_size, (b, n), device=device) for _ in range(2))
        if case.mode in DECODE_MODES:
            model.to(device=device, dtype=dtype).eval()
            use_cache = case.mode == "decode"
            # eos_id = vocab_size is never generated: every sequence decodes exactly n tokens (max_len)
            ids = dict(bos_id=1, eos_id=case.vocab_size, pad_id=0)
            return lambda: greedy_search(model, source, None, max_len=n, use_cache=use_cache, **ids)
        forward = lambda: model(source, None, target)
        out_shape = (b, n, case.vocab_size)
    model.to(device=device, dtype=dtype).train(train)
    if not train:

        def step() -> None:
            with torch.inference_mode():
                forward()

        return step
    grad = torch.randn(out_shape, device=device, dtype=dtype)

    def step() -> None:
        forward().backward(grad)
        model.zero_grad(set_to_none=True)
        for t in inputs:
            t.grad = None

    return step


#: positions a decode-step case may add after its prefill (warm-up and repeats); bounds max_seq_len
DECODE_STEP_ROOM = 4096
#: decoding steps per timed call of a decode-step case, its time reported per step: one step of an O(1)-state
#: core takes a fraction of a millisecond, about the size of the timer's and the machine's jitter
DECODE_STEPS_PER_CALL = 16


def decode_step(case: Case, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    """``DECODE_STEPS_PER_CALL`` decoding steps (one new position per sequence each) of a causal core whose
    state already holds n positions; every call advances the state by that many positions."""
    # b: batch, h: heads, n: positions, d: head dim
    b, n, shape = case.batch, case.seq_len, (case.batch, case.heads, 1, case.dim_head)
    core = (
        az.create_attention(
            case.attention, dim_head=case.dim_head, heads=case.heads, max_seq_len=n + DECODE_STEP_ROOM, **case.options
        )
        .to(device=device, dtype=dtype)
        .eval()
    )
    state = core.start_decoding()
    with torch.inference_mode():
        prefix = [torch.randn(b, case.heads, n, case.dim_head, device=device, dtype=dtype) for _ in range(3)]
        if core.needs_shared_qk:
            prefix[1] = prefix[0]
        core.decode(*prefix, state)
    step_inputs = [torch.randn(shape, device=device, dtype=dtype) for _ in range(3)]
    if core.needs_shared_qk:
        step_inputs[1] = step_inputs[0]

    def step() -> None:
        with torch.inference_mode():
            for _ in range(DECODE_STEPS_PER_CALL):
                core.decode(*step_inputs, state)

    return step


def time_calls(step: Callable[[], None], warmup: int, repeats: int, device: str) -> list[float]:
    """Seconds per timed call."""
    for _ in range(warmup):
        step()
    seconds = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - begin)
    return seconds


def measure_case(case: Case, *, repeats: int, warmup: int) -> dict[str, Any]:
    """Time and peak memory of ``case``, or the status that stopped it (never raises)."""
    cuda = case.device == "cuda"
    method = "cuda-max-allocated" if cuda else ("rss-hwm" if STATUS_FILE.exists() else "unavailable")
    try:
        if cuda and not torch.cuda.is_available():
            return {"status": "unsupported", "detail": "CUDA is not available on this machine"}
        torch.set_num_threads(case.threads)
        if method == "rss-hwm" and _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)  # both baselines are taken after a trim
        start_bytes = _allocated_bytes(method)
        step = build_step(case)
        seconds = time_calls(step, warmup, repeats, case.device)
        if case.mode == "decode-step":
            seconds = [s / DECODE_STEPS_PER_CALL for s in seconds]
        # memory of one more, warm call: lazy initialisation and code pages are behind us
        if method == "rss-hwm" and _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)  # hand malloc's free pages back, so the call cannot reuse them unseen
        base_bytes = _allocated_bytes(method)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        elif method == "rss-hwm":
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS to the current RSS
        step()
        if cuda:
            torch.cuda.synchronize()
            peak_bytes = torch.cuda.max_memory_allocated()
            allocated_peak_bytes = peak_bytes - base_bytes
        else:
            peak_bytes = _status_kib("VmHWM") * 1024 if method == "rss-hwm" else math.nan
            allocated_peak_bytes = allocated_peak(step)
    except Exception as exc:  # the sweep records why a case failed and goes on
        status = classify(exc)
        return {"status": status, "detail": _detail(exc, status)}
    return {
        "status": "ok",
        "detail": "",
        "time_ms_median": statistics.median(seconds) * 1e3,
        "time_ms_min": min(seconds) * 1e3,
        "time_ms_max": max(seconds) * 1e3,
        "peak_mb": (peak_bytes - base_bytes) / MIB,
        # the resident set can also shrink by a page or two between the baselines (pages the kernel takes back):
        # total counts from the lower one, so that total_mb >= peak_mb and the budget check errs on the safe side
        "total_mb": (peak_bytes - min(start_bytes, base_bytes)) / MIB,
        "memory_method": method,
        "allocated_peak_mb": allocated_peak_bytes / MIB,
    }


def allocated_peak(step: Callable[[], None]) -> int:
    """Peak, during one call of ``step``, of the bytes torch's CPU allocator has handed out, above those live
    before the call (frees of blocks allocated before it are not reported by the profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    events = [e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def _allocated_bytes(method: str) -> float:
    if method == "cuda-max-allocated":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return _status_kib("VmRSS") * 1024 if method == "rss-hwm" else math.nan


def classify(exc: BaseException) -> str:
    """``oom``, ``unsupported`` (the mechanism or dtype refuses this case) or ``error``."""
    text = str(exc)
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or any(
        s in text for s in ("can't allocate memory", "out of memory", "Cannot allocate memory")
    ):
        return "oom"
    if isinstance(exc, ValueError) or (
        isinstance(exc, (RuntimeError, NotImplementedError)) and "not implemented" in text
    ):
        return "unsupported"
    return "error"


def _detail(exc: BaseException, status: str) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    if status == "error":
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return f"{type(exc).__name__}: {first} ({Path(frame.filename).name}:{frame.lineno})"
    return f"{type(exc).__name__}: {first}"


def measure_peak_tflops(device: str, dtype: str, threads: int) -> float:
    """Best of a few large square matmuls: the device's practical peak for this dtype, TFLOP/s."""
    torch.set_num_threads(threads)
    size = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(size, size, device=device, dtype=getattr(torch, dtype)) for _ in range(2))
    seconds = time_calls(lambda: a @ b, 2, 5, device)
    return 2 * size**3 / min(seconds) / 1e12


def apply_memory_budget(device: str, budget_bytes: int | None) -> None:
    """Make allocations beyond the budget fail here instead of inviting the kernel's OOM killer.

    CPU: ``RLIMIT_AS`` = the address space after imports + budget. Address space exceeds resident
    memory (reserved but untouched pages count), so the limit is conservative. CUDA: the caching
    allocator's per-process fraction of the device."""
    if budget_bytes is None:
        return
    if device == "cuda":
        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total))
        return
    limit = _status_kib("VmSize") * 1024 + budget_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """A worker's job: ``{"case": {...}, "repeats", "warmup", "memory_budget_bytes"}`` or
    ``{"peak": {"device", "dtype", "threads"}}``; its result."""
    if "peak" in job:
        return {"peak_tflops": measure_peak_tflops(**job["peak"])}
    case = Case(**job["case"])
    apply_memory_budget(case.device, job.get("memory_budget_bytes"))
    return measure_case(case, repeats=job["repeats"], warmup=job["warmup"])


def worker_main() -> int:
    """The job (:func:`run_job`) on stdin; one ``BENCH_RESULT {...}`` line on stdout."""
    result = run_job(json.loads(sys.stdin.read()))
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
