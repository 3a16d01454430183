"""glibc's malloc told to keep the memory a process frees, for timings of warm steady state.

torch's CPU tensors come from malloc. By default glibc maps a block above its mmap threshold fresh from the kernel
(the threshold adapts up to 32 MiB) and hands the heap's free top back once it exceeds the trim threshold (twice
the mmap threshold), so a call whose tensors are tens of MiB may find its memory returned since the last call and
fault every page in again: about 0.4 ms per MiB on this project's machines, and how many MiB differs from call to
call with the heap's layout (0-96 MiB a call for linear attention at n = 8192,
``results/cpu_targets/page_faults/``). :func:`keep_freed_memory` sets both thresholds (``mallopt``):
no block below 1 GiB (32 MiB where glibc caps the setting) is mapped apart, and the heap is never trimmed. A freed
block is then reused resident; in a torch process, whose small allocations land between its tensors', a block
sometimes still extends the heap instead, so most warm calls fault nothing and a few still fault some MiB in (the
measurements above). It changes the whole process, every mechanism and baseline alike, for its lifetime; tcmalloc
and jemalloc, which PyTorch's CPU tuning guides recommend, keep freed memory in a similar way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

#: mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: blocks below this size come from the heap; glibc releases that cap it at 32 MiB (HEAP_MAX_SIZE / 2) get that
KEPT_MMAP_THRESHOLDS = (2**30, 32 * 2**20)
#: a heap top larger than this is trimmed: never, in practice
KEPT_TRIM_THRESHOLD = 2**31 - 1


def keep_freed_memory() -> None:
    """Set glibc's trim and mmap thresholds so that freed memory stays with the process; raises ``RuntimeError``
    where the C library is not glibc or refuses a setting."""
    if platform.libc_ver()[0] != "glibc":
        raise RuntimeError(f"keeping freed memory needs glibc's malloc; this process runs on {platform.libc_ver()}")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if libc.mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD) != 1:
        raise RuntimeError(f"glibc's mallopt refused a trim threshold of {KEPT_TRIM_THRESHOLD} bytes")
    if not any(libc.mallopt(M_MMAP_THRESHOLD, value) == 1 for value in KEPT_MMAP_THRESHOLDS):
        raise RuntimeError(f"glibc's mallopt refused every mmap threshold of {KEPT_MMAP_THRESHOLDS} bytes")
