"""One ``zoo compare`` run: a (mechanism, options, seed) trained by one ``zoo fit`` process.

The run's directory is ``<experiment>/<label>/seed-<seed>/`` (the TensorBoard logger's version, so
``tensorboard --logdir <experiment>`` shows ``<label>/seed-<seed>`` runs side by side); the run's process keeps
``run.json`` there up to date (``tasks/callbacks.py``), which is all the parent reads: progress while it
runs, then metrics, throughput and memory. A run whose ``run.json`` says ``finished`` is done for good; a
rerun of the experiment skips it (resume), continues an unfinished one from its ``last.ckpt``, and starts
over one that left no checkpoint. A run whose checkpoint cannot be read (a truncated ``last.ckpt``) is not
started: its row says so and names the way out, ``zoo compare --restart <label>/seed-<s>``, which trains it anew.

The files a run writes name no path of the machine: once its process ends, its logs, ``run.json``,
``config.yaml`` and ``hparams.yaml`` are rewritten (:func:`portable_files`) so that the experiment is named as
:func:`shown_path` names it (relative to the working directory, or to the checkout, when below it), code of the
checkout by its path in the checkout, and the interpreter's packages and standard library as
``<site-packages>`` and ``<python>``. A run on a Ray worker's scratch folder is named where its files end up.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import attention_zoo as az
from experiments import preload
from experiments.compare.summary import validated
from experiments.machine_paths import machine_folders, portable_text, shown_path
from tasks.callbacks import RUN_RECORD, read_json_record

#: the files of a run that name paths (``portable_files``)
PATH_FILES = ("fit.log", "test.log", RUN_RECORD, "config.yaml", "hparams.yaml")
#: one run started at a time, whatever the number of runs at once: multiprocessing's bookkeeping of its children
#: and its forkserver connection were not written for threads that start processes together
_STARTING = threading.Lock()


@dataclass(frozen=True)
class Entry:
    """One mechanism with its options (``spec``), where the options came from (``command line``, ``config`` or
    ``defaults``), and ``label``, which names its directory and its summary row: the mechanism's name when it is
    listed once, else ``spec.folder`` (``name-defaults`` for its twin without options)."""

    spec: az.AttentionSpec
    options_from: str
    label: str


def attention_arguments(spec: az.AttentionSpec) -> list[str]:
    """The ``zoo fit`` arguments that give the task ``spec`` (its ``hparams()``): the name, and the options as one
    JSON object, which the task's parser reads back with their types (JSON is YAML's flow syntax; a string option
    is quoted, so ``8:10`` or ``yes`` stay strings)."""
    hparams = spec.hparams()
    # ensure_ascii=False: an option beyond the Basic Multilingual Plane (🐍) would be written as a surrogate
    # pair (\ud83d\udc0d), which the YAML reader of jsonargparse reads as two broken characters
    return [
        "--model.attention", hparams["attention"],
        "--model.attention_options", json.dumps(hparams["attention_options"], ensure_ascii=False),
    ]  # fmt: skip


@dataclass(frozen=True)
class Run:
    entry: Entry
    seed: int

    @property
    def name(self) -> str:
        return f"{self.entry.label}/seed-{self.seed}"

    def directory(self, experiment: Path) -> Path:
        return experiment / self.entry.label / f"seed-{self.seed}"


def read_record(run_dir: Path) -> dict[str, Any]:
    return read_json_record(run_dir / RUN_RECORD)


def is_finished(run_dir: Path) -> bool:
    return read_record(run_dir).get("status") == "finished"


def is_tested(run_dir: Path) -> bool:
    """``zoo test`` has added the run's test metrics to its run.json (``tasks.callbacks.RunRecord``)."""
    return bool(read_record(run_dir).get("tested_checkpoint"))


def resume_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint an unfinished run continues from, if it saved one."""
    last = run_dir / "checkpoints" / "last.ckpt"
    return last if last.is_file() else None


def readable_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a whole ``torch.save`` archive (a zip file whose directory, at its end, is intact);
    a truncated or overwritten checkpoint is not. Reads the archive's directory only, not its tensors."""
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def path_rewrites(experiment: Path, shown_experiment: str) -> list[tuple[str, str]]:
    """(absolute folder, what a run's files say instead), longest first: the folder holding ``experiment`` (here,
    or a Ray worker's scratch copy) as the folder of ``shown_experiment``, then the machine's folders
    (:func:`experiments.machine_paths.machine_folders`)."""
    return machine_folders({experiment.parent: os.path.dirname(shown_experiment)})


def portable_files(run_dir: Path, experiment: Path, shown_experiment: str) -> None:
    """Rewrite the machine's paths in the text files of ``run_dir`` (:data:`PATH_FILES`) with
    :func:`path_rewrites`; each file is replaced whole, so a reader never sees half of one."""
    rewrites = path_rewrites(experiment, shown_experiment)
    for name in PATH_FILES:
        path = run_dir / name
        try:
            text = path.read_text(encoding="utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            continue
        portable = portable_text(text, rewrites)
        if portable != text:
            temporary = path.with_name(f".{name}.portable")
            temporary.write_text(portable, encoding="utf-8")
            os.replace(temporary, path)


def fit_command(
    run: Run,
    task_config: str,
    experiment: Path,
    fit_args: list[str],
    *,
    vary_data_order: bool,
    subcommand: Literal["fit", "test"] = "fit",
) -> list[str]:
    """The ``zoo fit`` arguments of ``run`` (continuing from its ``last.ckpt`` when there is one), or with
    ``subcommand="test"`` the ``zoo test`` of its ``last.ckpt``, logging into the same run directory."""
    logger = {
        "class_path": "tasks.logger.ZooTensorBoardLogger",
        "init_args": {
            "save_dir": str(experiment.parent),
            "name": experiment.name,
            "version": run.name,
            "default_hp_metric": False,
        },
    }
    # ensure_ascii=False: an experiment named beyond the Basic Multilingual Plane (snake🐍) would be written as a
    # surrogate pair (\ud83d\udc0d), which the YAML reader of jsonargparse reads as two broken characters
    command = [
        subcommand, "-c", task_config,
        "--seed_everything", str(run.seed),
        *attention_arguments(run.entry.spec),
        "--trainer.logger", json.dumps(logger, ensure_ascii=False),
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    if vary_data_order:
        command += ["--data.shuffle_seed", str(run.seed)]
    if subcommand == "test":
        return [*command, "--ckpt_path", str(run.directory(experiment) / "checkpoints" / "last.ckpt"), *fit_args]
    checkpoint = resume_checkpoint(run.directory(experiment))
    if checkpoint is not None:
        command += ["--ckpt_path", str(checkpoint)]
    return [*command, *fit_args]


def prepare_directory(run_dir: Path) -> str:
    """Make ``run_dir`` ready for a (re)start; say what was done with an earlier attempt."""
    if not run_dir.exists():
        run_dir.mkdir(parents=True)
        return "new"
    if resume_checkpoint(run_dir) is not None:
        return "continued from its last checkpoint"
    shutil.rmtree(run_dir)  # an attempt that saved no checkpoint: nothing to continue from
    run_dir.mkdir(parents=True)
    return "restarted (the earlier attempt left no checkpoint)"


def execute(
    args: list[str],
    run_dir: Path,
    *,
    threads: int,
    timeout: float | None,
    stop: threading.Event,
    on_progress: Any = None,
    log_name: str = "fit.log",
) -> tuple[int, float, str]:
    """Run ``zoo <args>`` (started by :mod:`experiments.preload`) with its output in
    ``run_dir/<log_name>``; return (exit code, wall seconds, how it ended: ``"exited"``, ``"timed out"`` or
    ``"interrupted"``). ``on_progress(step, max_steps)`` is called
    while it runs; setting ``stop`` ends it early (SIGINT, then SIGKILL after 15 s)."""
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    ended = "exited"
    with _STARTING, _signals_unblocked():  # a Ray worker blocks SIGINT; a child inherits the mask: _terminate needs it
        process = preload.start(args, run_dir / log_name, env, threads)
    try:
        while process.poll() is None:
            record = read_record(run_dir)
            if on_progress is not None and record.get("max_steps"):
                on_progress(record.get("step", 0), record["max_steps"])
            if timeout is not None and time.perf_counter() - started > timeout:
                ended = "timed out"
            elif stop.is_set():
                ended = "interrupted"
            if ended != "exited":
                _terminate(process)
                break
            stop.wait(0.25)
    except BaseException:  # e.g. a cancelled Ray task: the run (in its own session) must not outlive it
        _terminate(process)
        raise
    process.wait()
    return process.returncode, time.perf_counter() - started, ended


@dataclass(frozen=True)
class RunSettings:
    """What every run of one comparison shares, here or on a Ray worker: the ``zoo fit`` config and extra
    arguments, torch threads, the time limit, whether each fitted run is then tested, whether the seed
    also sets the data order (the data module takes ``shuffle_seed``), and how the run's files name the
    experiment (:func:`shown_path` of it on the machine that started the comparison)."""

    task_config: str
    fit_args: tuple[str, ...]
    threads: int
    timeout: float | None
    test: bool
    vary_data_order: bool
    shown_experiment: str


def attempt(
    run: Run, experiment: Path, settings: RunSettings, *, stop: threading.Event, on_progress: Any = None
) -> tuple[str, float, bool, str]:
    """Fit ``run`` in ``experiment`` unless it is finished (continuing an unfinished attempt), then with
    ``settings.test`` ``zoo test`` it; return (what was done with an earlier attempt, wall seconds, ok, why not)."""
    run_dir = run.directory(experiment)
    limits = dict(threads=settings.threads, timeout=settings.timeout, stop=stop)
    config, fit_args, timeout = settings.task_config, list(settings.fit_args), settings.timeout
    how, wall, ok, reason = "already fitted", 0.0, True, ""
    if not is_finished(run_dir):
        checkpoint = resume_checkpoint(run_dir)
        if checkpoint is not None and not readable_checkpoint(checkpoint):
            return "not continued", 0.0, False, unreadable_checkpoint(run, checkpoint)
        how = prepare_directory(run_dir)
        command = fit_command(run, config, experiment, fit_args, vary_data_order=settings.vary_data_order)
        returncode, wall, ended = execute(command, run_dir, **limits, on_progress=on_progress)
        portable_files(run_dir, experiment, settings.shown_experiment)
        record = read_record(run_dir)
        ok = returncode == 0 and record.get("status") == "finished" and ended == "exited"
        reason = "" if ok else failure_reason(returncode, record, run_dir / "fit.log", ended, timeout)
    if ok and settings.test:
        checkpoint = run_dir / "checkpoints" / "last.ckpt"
        if not readable_checkpoint(checkpoint):
            return how, wall, False, unreadable_checkpoint(run, checkpoint)
        command = fit_command(run, config, experiment, fit_args, vary_data_order=False, subcommand="test")
        returncode, tested_wall, ended = execute(command, run_dir, **limits, log_name="test.log")
        portable_files(run_dir, experiment, settings.shown_experiment)
        wall += tested_wall
        ok = returncode == 0 and is_tested(run_dir) and ended == "exited"
        reason = "" if ok else "zoo test: " + failure_reason(returncode, {}, run_dir / "test.log", ended, timeout)
    return how, wall, ok, reason


def unreadable_checkpoint(run: Run, checkpoint: Path) -> str:
    """The reason of a run whose ``last.ckpt`` cannot be read: it can neither continue nor be tested."""
    state = "is unreadable (truncated or corrupt)" if checkpoint.exists() else "is missing"
    return (
        f"its checkpoints/last.ckpt {state}, so the run can neither continue nor be tested; rerun with --restart "
        f"{run.name} to train it anew"
    )


@contextlib.contextmanager
def _signals_unblocked():
    """SIGINT and SIGTERM unblocked in this thread while a child is started (it inherits this thread's mask)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _terminate(process: preload.RunProcess) -> None:
    """SIGINT first (Lightning stops cleanly and the run records why), SIGKILL if it does not exit."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()


def failure_reason(returncode: int, record: dict, log: Path, ended: str, timeout: float | None) -> str:
    if ended == "timed out":
        return f"timed out after {timeout:g} s"
    if ended == "interrupted":
        return "interrupted (rerun the same zoo compare command to resume)"
    if record.get("status") == "failed" and record.get("error"):
        return record["error"]
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (" (out of memory?)" if -returncode == signal.SIGKILL else "")
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):  # a clean CLI error, else the exception line closing a traceback
        if line.startswith("zoo fit: error:") or line.startswith("error:"):
            return line
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return line
    return f"exit code {returncode}; see the run's {log.name}"


def eta_text(finished_s: list[float], remaining: int, jobs: int) -> str:
    """The comparison's time left, for its progress bar: the mean wall time of the runs that finished now
    (``finished_s``; runs finished earlier took no time now and are left out) times the ``remaining`` runs
    (under way or waiting), over the runs that can go at once (``jobs``, but no more than remain). Runs under
    way count whole, so the estimate errs long by at most a run's time; ``"ETA after the first run"`` before
    any finished, ``""`` when none remain."""
    if remaining <= 0:
        return ""
    if not finished_s:
        return "ETA after the first run"
    seconds = round(sum(finished_s) / len(finished_s) * remaining / min(jobs, remaining))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    left = f"{hours} h {minutes:02d} min" if hours else (f"{minutes} min {secs:02d} s" if minutes else f"{secs} s")
    return f"ETA {left}"


def record_runs_at_once(run_dir: Path, at_once: int) -> None:
    """Add ``runs_at_once`` to the ``run.json`` of a run that has just trained: the most runs of the comparison
    that trained at the same time as it (itself included), under which its speed and memory were measured.
    The file is replaced whole, so a reader never sees half of one."""
    record = read_record(run_dir)
    if not record:
        return
    path = run_dir / RUN_RECORD
    temporary = path.with_name(f".{RUN_RECORD}.at-once")
    temporary.write_text(json.dumps(record | {"runs_at_once": at_once}, indent=2))
    os.replace(temporary, path)


def run_row(run: Run, run_dir: Path, *, status: str, wall_s: float | None, reason: str = "") -> dict[str, Any]:
    """The summary row of one run, from its ``run.json``; ``validated`` (``yes`` / ``no``, empty for a run that did
    not finish) says whether it logged a ``val_*`` metric."""
    record = read_record(run_dir)
    ok = status == "ok"
    metrics = {k: v for k, v in record.get("metrics", {}).items() if isinstance(v, (int, float))}
    row = {
        "mechanism": run.entry.label,
        "attention": run.entry.spec.name,
        "options": json.dumps(run.entry.spec.options),
        "options_from": run.entry.options_from,
        "seed": run.seed,
        "status": status,
        "tokens_per_s": record.get("tokens_per_s") if ok else None,
        "peak_mem_mb": record.get("peak_mem_mb") if ok else None,
        "train_mem_mb": record["peak_mem_mb"] - record["fit_start_mem_mb"] if ok else None,
        "parameters": record.get("parameters"),
        "steps": record.get("step"),
        "fit_s": record.get("fit_seconds"),
        "wall_s": wall_s if wall_s is not None else record.get("fit_seconds"),
        "runs_at_once": record.get("runs_at_once") if ok else None,
        "resumed_from_step": record.get("start_step") or None,
        "reason": reason,
        "run_dir": shown_path(run_dir),
        "train_loss": metrics.get("train/loss"),
    }
    # every scalar metric of the run: val/acc -> val_acc, test/bleu -> test_bleu, ...
    row |= {name.replace("/", "_"): value for name, value in metrics.items() if name.split("/")[0] in METRIC_STAGES}
    row["validated"] = ("yes" if validated(row) else "no") if ok else ""
    return row


METRIC_STAGES = ("val", "test", "decode")
