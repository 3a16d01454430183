"""``zoo compare --launcher ray``: one Ray task per (mechanism, options, seed) run, on this machine or a cluster.

Each task asks for ``num_cpus=--run-cpus`` and ``num_gpus=--run-gpus`` and runs exactly what the local launcher
runs (:func:`experiments.compare.runs.attempt`), so a crash, an OOM or a timeout stays that run's and is recorded
with its reason. Tasks are never retried by Ray (``max_retries=0``): a lost node or a killed worker is recorded
as a failed run, and a rerun (resume) runs it again. Where the run writes: with a local Ray (no
``--ray-address``) or ``--shared-dir`` (a folder every node mounts at the same path), straight into the
experiment directory; otherwise in a scratch folder on the worker, whose files (``run.json``, logs, TensorBoard
events, ``config.yaml``, ``hparams.yaml``, and checkpoints up to :data:`RETURNED_CHECKPOINT_MB`) come back to the
driver as one archive; an unfinished run's folder goes out with its task, so it continues from its checkpoint.
What both commands share (Ray found or started, the bench slot) is ``experiments/ray_launcher.py``.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from experiments.compare.runs import Run, RunSettings, attempt
from experiments.ray_launcher import cancellable, connect, first_line

#: ``zoo compare`` settings of the launcher (they may change when an experiment is resumed)
LAUNCHER_SETTINGS = ("launcher", "ray_address", "run_cpus", "run_gpus", "shared_dir")
#: checkpoints larger than this stay on the worker when a run's files are sent back (use --shared-dir)
RETURNED_CHECKPOINT_MB = 100
#: environment a local Ray's tasks take from the driver (the data cache)
FORWARDED_ENV = ("ZOO_CACHE",)


def run_compare(
    pending: list[Run],
    total: int,
    directory: Path,
    settings: RunSettings,
    config: Any,
    *,
    stop: threading.Event,
    finish: Callable[..., dict[str, Any]],
    out: Any,
) -> dict[str, dict[str, Any]]:
    """Run ``pending`` (:class:`~experiments.compare.runs.Run`) as Ray tasks, each with ``settings``
    (:class:`~experiments.compare.runs.RunSettings`) and the launcher's settings of ``config``;
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
                        reason = f"the Ray task failed: {first_line(error)}"
                    rows[run.name] = finish(run, "on Ray", 0.0, False, reason)
                else:
                    if not shared:
                        _unpack(result["files"], run.directory(directory))
                    rows[run.name] = finish(run, result["how"], result["wall"], result["ok"], result["reason"])
                progress.advance(bar)
    return rows


def _compare_task(
    run: Run, experiment: str, settings: RunSettings, shared: bool, earlier: bytes | None, env: dict[str, str]
) -> dict[str, Any]:
    """One run on a Ray worker: in the shared experiment directory, or in a scratch copy whose files return."""
    cancellable()
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


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
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
