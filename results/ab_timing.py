"""What the A/B and profile scripts under ``results/`` share: the seeded inputs of a core, one forward + backward
step, variants timed interleaved round by round with each call's minor page faults, and a library module loaded
as it was at an earlier commit.

The scripts import it as ``results.ab_timing``, so they run from the repository root as modules, for example

    python -m results.cpu_targets.moba_flash.moba_ab 4096 causal
"""

from __future__ import annotations

import importlib
import importlib.util
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

#: library modules that the code of the commits these scripts load imports under names that have moved since
MOVED_MODULES = {
    "attention_zoo.decoding_cache": "attention_zoo.decoding.cache",
    "attention_zoo.moba_layout": "attention_zoo.moba.layout",
}


def inputs(n: int, heads: int = 8, dim_head: int = 64) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v leaves of shape (1, heads, n, dim_head) that require grad, then an output gradient of that shape,
    drawn in that order from one generator seeded 0, so that every variant and every script times the same data."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, dim_head, generator=generator).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(1, heads, n, dim_head, generator=generator)


def fwd_bwd(forward: Callable[[], Tensor], grad: Tensor, *leaves: Tensor) -> Callable[[], list[Tensor]]:
    """A step: ``forward()``, then its backward with ``grad``; returns the output and the leaves' gradients and
    clears those, so that each call starts as the first did."""

    def call() -> list[Tensor]:
        out = forward()
        out.backward(grad)
        result = [out.detach(), *(leaf.grad for leaf in leaves)]
        for leaf in leaves:
            leaf.grad = None
        return result

    return call


def largest_difference(first: list[Tensor], second: list[Tensor]) -> float:
    """The largest absolute elementwise difference between two steps' results (output and gradients)."""
    return max((a - b).abs().max().item() for a, b in zip(first, second, strict=True))


def minor_faults() -> int:
    """The process's minor page faults so far (first touches of freshly mapped memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclass
class Timing:
    """One variant's timed calls: the seconds and the minor page faults of each."""

    seconds: list[float] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)

    def text(self, faults: bool = True) -> str:
        """``min X median Y ms``, with ``, faults median Z`` unless ``faults`` is False; the median of an even
        count is its upper middle value."""
        ms = sorted(self.seconds)
        text = f"min {ms[0] * 1e3:.1f} median {ms[len(ms) // 2] * 1e3:.1f} ms"
        return text + (f", faults median {sorted(self.faults)[len(self.faults) // 2]}" if faults else "")


def interleaved(variants: Mapping[str, Callable[[], object]], rounds: int) -> dict[str, Timing]:
    """Each variant called once per round, in turn, after one untimed warm-up round, so that a drift of the
    machine's speed reaches every variant alike; the seconds and minor page faults of each timed call."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    timings = {label: Timing() for label in variants}
    for round_ in range(rounds + 1):
        for label, call in variants.items():
            faults, start = minor_faults(), time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
            if round_:
                timings[label].seconds.append(elapsed)
                timings[label].faults.append(minor_faults() - faults)
    return timings


def best_ms(call: Callable[[], object], calls: int) -> float:
    """The fastest of ``calls`` calls, in milliseconds."""
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return min(seconds) * 1e3


def at_commit(commit: str, path: str, name: str) -> ModuleType:
    """The module at ``path`` (relative to the repository) as it was at ``commit``, imported as ``name``; its
    imports of library modules that have moved since resolve to their new places (``MOVED_MODULES``)."""
    for old, new in MOVED_MODULES.items():
        sys.modules.setdefault(old, importlib.import_module(new))
    source = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True).stdout
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
