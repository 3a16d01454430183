"""The machine a GPU-suite run measured on: device, driver and library versions, and its two ceilings
measured in the run (a bf16 matrix product's rate and a device-to-device copy's bandwidth), against which
every mechanism's time is read as a multiple of its floor max(FLOPs / peak, bytes / bandwidth).

What the suite writes names no folder of the machine it ran on (:func:`relative_paths`): a result names its
hardware and versions, and paths a reader's checkout resolves."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from experiments.bench.measure import time_calls
from experiments.machine_paths import machine_folders, portable_text


def relative_paths(text: str, work: Path | None = None) -> str:
    """``text`` with this machine's folders written as what they are
    (:func:`experiments.machine_paths.portable_text`), the suite's scratch folder ``work`` as ``<work>`` and the
    temporary folder as ``<tmp>``."""
    extra = {tempfile.gettempdir(): "<tmp>"} | ({} if work is None else {work: "<work>"})
    return portable_text(text, machine_folders(extra))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        return subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.strip() or None
    except (subprocess.SubprocessError, OSError):
        return None


def describe(device: str) -> dict[str, Any]:
    """Names and versions; on CUDA also the SM count, L2 and memory of device 0."""
    info: dict[str, Any] = {
        "device": device,
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "xformers": _version("xformers"),
        "lightning": _version("lightning"),
        "jsonargparse": _version("jsonargparse"),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "executable": Path(sys.executable).name,  # the interpreter's name: its folder is this machine's
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info |= {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "l2_mb": getattr(props, "L2_cache_size", 0) / 2**20,
            "memory_gib": props.total_memory / 2**30,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "driver": _driver(),
        }
    else:
        info |= {"name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    return info


def gemm_peak_tflops(device: str, dtype: torch.dtype, size: int, repeats: int = 10) -> float:
    """Median rate of a square ``size`` matrix product on random data (zeros run faster than real data)."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    seconds = time_calls(lambda: a @ b, 3, repeats, device)
    return 2 * size**3 / sorted(seconds)[len(seconds) // 2] / 1e12


def copy_bandwidth_gbs(device: str, nbytes: int, repeats: int = 10) -> float:
    """Median device-to-device copy bandwidth, counting the bytes read and the bytes written."""
    source = torch.randn(nbytes // 4, device=device)
    target = torch.empty_like(source)
    seconds = time_calls(lambda: target.copy_(source), 3, repeats, device)
    return 2 * source.numel() * 4 / sorted(seconds)[len(seconds) // 2] / 1e9
