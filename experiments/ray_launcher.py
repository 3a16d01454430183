"""``--launcher ray``, the part ``zoo compare`` and ``zoo bench`` share: Ray found, started or reached, and the
helpers their Ray tasks use. What each command runs as a task lives in its own package:
``experiments/compare/ray_runs.py`` (one task per training run) and ``experiments/bench/ray_runs.py`` (one task
per bench case); this module imports neither.

Ray core tasks, not Ray Tune: a run is already a self-contained ``zoo fit`` subprocess with its own resume
(``run.json``, ``last.ckpt``) and the driver already writes the experiment folder; what is missing is only a
scheduler that puts each run where its CPUs or GPUs are free, on one laptop or many nodes with the same code.
Tune would add trial schedulers, search spaces and an experiment layout of its own for nothing here.

Never two bench timing cases on one device at once: a CPU case holds one unit of the custom resource
``zoo_bench_slot`` (:data:`BENCH_SLOT`), of which each node has one: the local Ray started here has it; start
cluster nodes with ``ray start ... --resources='{"zoo_bench_slot": 1}'``.

Ray is imported only when ``--launcher ray`` asks for it; without it, the error names the extra
(``pip install -e ".[ray]"``).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from typing import Any

#: the custom resource a CPU bench case holds: one per node, so one CPU timing case per node at a time
BENCH_SLOT = "zoo_bench_slot"


class RayLauncherError(RuntimeError):
    """Ray is missing, unreachable, or lacks what the sweep asks for: one line for the user."""


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayLauncherError(
            '--launcher ray needs Ray, which is not installed: pip install -e ".[ray]" (or pip install "ray[default]")'
        ) from None
    return ray


def connect(address: str | None, *, bench_device: str | None = None) -> Any:
    """Ray, initialised: an already initialised Ray (a test, a notebook) as it is, else the cluster at
    ``address``, else a new local Ray on this machine (every CPU, one bench slot). With ``bench_device``,
    checks that the cluster can hold a bench case on that device."""
    ray = require_ray()
    if address is not None:
        _check_reachable(address)
    if not ray.is_initialized():
        quiet = dict(logging_level=logging.WARNING, log_to_driver=False)
        try:
            if address is None:
                ray.init(address="local", include_dashboard=False, resources={BENCH_SLOT: 1}, **quiet)
            else:
                ray.init(address=address, **quiet)
        except Exception as error:  # noqa: BLE001  (ConnectionError, ValueError, ...: all one line for the user)
            where = f"the Ray cluster at {address!r}" if address else "a local Ray"
            raise RayLauncherError(f"cannot start or reach {where}: {first_line(error)}") from None
    if bench_device is not None:
        resources = ray.cluster_resources()
        if bench_device == "cuda" and resources.get("GPU", 0) < 1:
            raise RayLauncherError("--device cuda, but the Ray cluster has no GPU")
        if bench_device == "cpu" and resources.get(BENCH_SLOT, 0) < 1:
            raise RayLauncherError(
                f"the Ray cluster has no {BENCH_SLOT} resource, which keeps CPU timing cases one per node: start "
                f"each node with ray start ... --resources='{{\"{BENCH_SLOT}\": 1}}'"
            )
    return ray


def _check_reachable(address: str) -> None:
    """A ``host:port`` or ``ray://host:port`` where nothing listens fails here in seconds (Ray itself retries
    for minutes); ``auto`` and other forms are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as error:
        raise RayLauncherError(
            f"nothing answers at --ray-address {address} ({error.strerror or error}): start the cluster "
            "(ray start --head on that machine) or correct the address"
        ) from None


def cancellable() -> None:
    """Called first in a Ray task. Ray cancels a running task by raising KeyboardInterrupt through the worker's
    SIGINT handler; a Ray started by a process that ignores SIGINT (a background job of a script) has workers
    that ignore it too."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def first_line(error: BaseException) -> str:
    """``error`` in one line for a table cell or a result row: its type and its first non-blank line."""
    text = str(error).strip() or type(error).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else text}"[:300]
