"""``zoo bench --launcher ray``: one Ray task per bench case, on this machine or a cluster.

Each case is still measured in its own worker subprocess with its time and memory limits
(:meth:`experiments.bench.runner.Runner.case_row`); the driver appends each row to ``results.jsonl`` as it
arrives. Never two timing cases on one device at once: a CUDA case asks for ``num_gpus=1`` (Ray gives each GPU
to one task at a time and sets ``CUDA_VISIBLE_DEVICES``); a CPU case asks for one unit of
:data:`experiments.ray_launcher.BENCH_SLOT`, of which each node has one, so at most one CPU case runs per node.
What both commands share (Ray found or started, the bench slot) is ``experiments/ray_launcher.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from experiments.bench.cases import BenchConfig, Case
from experiments.bench.runner import Runner, describe, pending_cases, summary
from experiments.bench.store import ResultStore, code_fingerprint, now
from experiments.console import console
from experiments.ray_launcher import BENCH_SLOT, cancellable, first_line, require_ray


def run_bench(
    config: BenchConfig, store: ResultStore, device: str, cases: list[Case], *, retry_failed: bool, run_cpus: float
) -> int:
    """Measure every case the store lacks as a Ray task (Ray already connected:
    :func:`experiments.ray_launcher.connect`); each row is
    appended to the store the moment it comes back. Returns how many ran."""
    ray = require_ray()
    pending, code = pending_cases(store, cases, retry_failed=retry_failed, rounds=config.rounds)
    options: dict[str, Any] = {"num_cpus": run_cpus, "max_retries": 0}
    if device == "cuda":
        options["num_gpus"] = 1
    else:
        options["resources"] = {BENCH_SLOT: 1}
    task = ray.remote(_bench_task).options(**options)
    refs = {task.remote(config, case, device): case for case in pending}
    out = console()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=out) as progress:
        bar = progress.add_task("bench (Ray)", total=len(refs))
        waiting = list(refs)
        try:
            while waiting:
                ready, waiting = ray.wait(waiting, num_returns=1, timeout=0.5)
                for ref in ready:
                    case = refs[ref]
                    try:
                        row = ray.get(ref)
                    except Exception as error:  # noqa: BLE001  (the task itself failed: dead worker, lost node)
                        row = dataclasses.asdict(case) | {
                            "status": "error",
                            "detail": f"the Ray task failed: {first_line(error)}",
                            "code": code,
                            "finished_at": now(),
                        }
                    store.append(row)
                    progress.console.print(f"{describe(case)}: {summary(row)}")
                    progress.advance(bar)
        finally:  # Ctrl-C: cancelled cases stop their worker subprocess; measured rows are already stored
            for ref in waiting:
                ray.cancel(ref)
    return len(refs)


#: per Ray worker process, one Runner per sweep and device: the device's peak FLOP/s is measured once
_RUNNERS: dict[tuple[str, str], Runner] = {}


def _bench_task(config: BenchConfig, case: Case, device: str) -> dict[str, Any]:
    cancellable()
    key = (repr(config), device)
    if key not in _RUNNERS:
        _RUNNERS[key] = Runner(config, None, device)
    return _RUNNERS[key].case_row(case, code_fingerprint())
