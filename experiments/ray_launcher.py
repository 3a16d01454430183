"""``--launcher ray``: ``zoo compare`` runs and ``zoo bench`` cases as Ray tasks, on this machine or a cluster.

Ray core tasks, not Ray Tune: a run is already a self-contained ``zoo fit`` subprocess with its own resume
(``run.json``, ``last.ckpt``) and the driver already writes the experiment folder; what is missing is only a
scheduler that puts each run where its CPUs or GPUs are free, on one laptop or many nodes with the same code.
Tune would add trial schedulers, search spaces and an experiment layout of its own for nothing here.

``zoo compare``: one task per (mechanism, options, seed) run (``num_cpus=--run_cpus``, ``num_gpus=--run_gpus``),
running exactly what the local launcher runs (:func:`experiments.compare.runs.attempt`), so a crash, an OOM or
a timeout stays that run's and is recorded with its reason. Tasks are never retried by Ray (``max_retries=0``):
a lost node or a killed worker is recorded as a failed run, and a rerun (resume) runs it again. Where the run
writes: with a local Ray (no ``--ray_address``) or ``--shared_dir`` (a folder every node mounts at the same
path), straight into the experiment directory; otherwise in a scratch folder on the worker, whose files
(``run.json``, logs, TensorBoard events, ``config.yaml``, ``hparams.yaml``, and checkpoints up to
``RETURNED_CHECKPOINT_MB``) come back to the driver as one archive; an unfinished run's folder goes out with
its task, so it continues from its checkpoint.

``zoo bench``: one task per case, each still measured in its own worker subprocess with its time and memory
limits (:meth:`experiments.bench.runner.Runner.case_row`); the driver appends each row to ``results.jsonl``
as it arrives. Never two timing cases on one device at once: a CUDA case asks for ``num_gpus=1`` (Ray gives
each GPU to one task at a time and sets ``CUDA_VISIBLE_DEVICES``); a CPU case asks for one unit of the custom
resource ``zoo_bench_slot``, of which each node has one (the local Ray started here has it; start cluster
nodes with ``ray start ... --resources='{"zoo_bench_slot": 1}'``), so at most one CPU case runs per node.

Ray is imported only here and only when ``--launcher ray`` asks for it; without it, the error names the
extra (``pip install -e ".[ray]"``).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import shutil
import signal
import socket
import tarfile
import tempfile
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

#: ``zoo compare`` settings of the launcher (they may change when an experiment is resumed)
LAUNCHER_SETTINGS = ("launcher", "ray_address", "run_cpus", "run_gpus", "shared_dir")
#: the custom resource a CPU bench case holds: one per node, so one CPU timing case per node at a time
BENCH_SLOT = "zoo_bench_slot"
#: checkpoints larger than this stay on the worker when a run's files are sent back (use --shared_dir)
RETURNED_CHECKPOINT_MB = 100
#: environment a local Ray's tasks take from the driver (the data cache)
FORWARDED_ENV = ("ZOO_CACHE",)


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
            raise RayLauncherError(f"cannot start or reach {where}: {_first_line(error)}") from None
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


# --- zoo compare ---------------------------------------------------------------------------------------


def run_compare(
    pending: list[Any],
    total: int,
    directory: Path,
    settings: Any,
    config: Any,
    *,
    stop: threading.Event,
    finish: Callable[..., dict[str, Any]],
    out: Any,
) -> dict[str, dict[str, Any]]:
    """Run ``pending`` (:class:`experiments.compare.runs.Run`) as Ray tasks, each with ``settings``
    (:class:`experiments.compare.runs.RunSettings`) and the launcher's settings of ``config``;
    ``finish(run, how, wall, ok, reason)`` makes each run's row as it ends. Returns the rows by run name;
    setting ``stop`` cancels what has not ended."""
    ray = connect(config.ray_address)
    shared = config.ray_address is None or config.shared_dir is not None
    experiment = directory.absolute()  # the workers do not share this process's working directory
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ} if config.ray_address is None else {}
    task = ray.remote(_compare_task).options(
        num_cpus=config.run_cpus or config.threads, num_gpus=config.run_gpus, max_retries=0
    )
    refs = {}
    for run in pending:
        earlier = None if shared else _pack_earlier(run.directory(experiment))
        refs[task.remote(run, str(experiment), settings, shared, earlier, env)] = run
    out.print(
        f"on Ray: {len(refs)} task(s), {config.run_cpus or config.threads:g} CPU and {config.run_gpus:g} GPU each; "
        + ("runs write into the experiment directory" if shared else "run files come back to this machine")
    )
    rows: dict[str, dict[str, Any]] = {}
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=out) as progress:
        bar = progress.add_task("[bold]runs (Ray)", total=total, completed=total - len(refs))
        waiting, cancelled = list(refs), False
        while waiting:
            if stop.is_set() and not cancelled:
                for ref in waiting:
                    ray.cancel(ref)  # a running task gets KeyboardInterrupt and stops its zoo fit cleanly
                cancelled = True
            ready, waiting = ray.wait(waiting, num_returns=len(waiting) if cancelled else 1, timeout=0.5)
            for ref in ready:
                run = refs[ref]
                try:
                    result = ray.get(ref)
                except Exception as error:  # noqa: BLE001  (a cancelled task, a dead worker, a lost node)
                    if isinstance(error, ray.exceptions.TaskCancelledError):
                        reason = "interrupted (rerun the same zoo compare command to resume)"
                    else:
                        reason = f"the Ray task failed: {_first_line(error)}"
                    rows[run.name] = finish(run, "on Ray", 0.0, False, reason)
                else:
                    if not shared:
                        _unpack(result["files"], run.directory(directory))
                    rows[run.name] = finish(run, result["how"], result["wall"], result["ok"], result["reason"])
                progress.advance(bar)
    return rows


def _compare_task(
    run: Any, experiment: str, settings: Any, shared: bool, earlier: bytes | None, env: dict[str, str]
) -> dict[str, Any]:
    """One run on a Ray worker: in the shared experiment directory, or in a scratch copy whose files return."""
    from experiments.compare.runs import attempt

    _cancellable()
    stop = threading.Event()  # a cancelled task stops by KeyboardInterrupt, which execute() passes on
    with _environment(env):
        if shared:
            how, wall, ok, reason = attempt(run, Path(experiment), settings, stop=stop)
            return {"how": how, "wall": wall, "ok": ok, "reason": reason}
        with tempfile.TemporaryDirectory(prefix="zoo-ray-") as scratch:
            local = Path(scratch) / Path(experiment).name
            run_dir = run.directory(local)
            if earlier is not None:
                _unpack(earlier, run_dir)
            how, wall, ok, reason = attempt(run, local, settings, stop=stop)
            return {"how": how, "wall": wall, "ok": ok, "reason": reason, "files": _pack(run_dir)}


def _cancellable() -> None:
    """Ray cancels a running task by raising KeyboardInterrupt through the worker's SIGINT handler; a Ray
    started by a process that ignores SIGINT (a background job of a script) has workers that ignore it too."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextmanager
def _environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _pack(run_dir: Path) -> bytes:
    """The run's files as a gzipped tar; checkpoints only while they are small."""
    checkpoints = [p for p in run_dir.rglob("*.ckpt") if p.is_file()]
    keep = sum(p.stat().st_size for p in checkpoints) <= RETURNED_CHECKPOINT_MB * 2**20
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in sorted(run_dir.rglob("*")):
            if path.is_file() and (keep or path.suffix != ".ckpt"):
                archive.add(path, arcname=str(path.relative_to(run_dir)))
    return buffer.getvalue()


def _pack_earlier(run_dir: Path) -> bytes | None:
    """An unfinished (or untested) earlier attempt goes out with the task, so it continues where it stopped."""
    return _pack(run_dir) if run_dir.is_dir() else None


def _unpack(data: bytes, run_dir: Path) -> None:
    """Replace ``run_dir`` by the archive's files."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(run_dir, filter="data")
        else:  # Python < 3.10.12 / 3.11.4: our own archive, relative paths only
            archive.extractall(run_dir)  # noqa: S202


# --- zoo bench -----------------------------------------------------------------------------------------


def run_bench(config: Any, store: Any, device: str, cases: list[Any], *, retry_failed: bool, run_cpus: float) -> int:
    """Measure every case the store lacks as a Ray task (Ray already connected, :func:`connect`); each row is
    appended to the store the moment it comes back. Returns how many ran."""
    import ray

    from experiments.bench.runner import describe, pending_cases, summary
    from experiments.bench.store import now
    from experiments.console import console

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
                            "detail": f"the Ray task failed: {_first_line(error)}",
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
_RUNNERS: dict[tuple[str, str], Any] = {}


def _bench_task(config: Any, case: Any, device: str) -> dict[str, Any]:
    from experiments.bench.runner import Runner
    from experiments.bench.store import code_fingerprint

    _cancellable()
    key = (repr(config), device)
    if key not in _RUNNERS:
        _RUNNERS[key] = Runner(config, None, device)
    return _RUNNERS[key].case_row(case, code_fingerprint())


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else text}"[:300]
