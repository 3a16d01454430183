"""``zoo fit`` / ``zoo test`` runs started from a process that has already imported torch and Lightning.

A ``zoo fit`` process spends seconds importing torch, Lightning and torchmetrics before it reads its config, and
a comparison starts one per run. Here each run is forked from a multiprocessing forkserver that imported those
modules once (:data:`PRELOADED`). The forkserver is a fresh single-threaded interpreter started by exec, not a
fork of this threaded process, and it runs no torch operation, so no thread pool is forked. Each run is still a
process of its own in its own session (SIGINT from the terminal reaches only this parent, which stops the run),
with its output appended to its log and ``threads`` torch threads; a crash, an out-of-memory kill or an
interrupt stays in that run, as with a subprocess. Without the ``forkserver`` start method (Windows) a run is a
plain ``python -m experiments.cli`` subprocess. Only the task commands (:data:`TASK_COMMANDS`) start here: the
forked run calls :func:`tasks.cli.run`, so this package never imports the ``zoo`` command table above it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

#: imported once by the forkserver: ``tasks.cli`` pulls in torch, Lightning, torchmetrics and every task (and with
#: them the zoo, which a benchmark's worker started by :func:`start_function` then imports in no time). Not
#: ``experiments.cli``: a child started from ``python -m experiments.cli`` re-runs its main module, which runpy
#: warns about when that module is already imported
PRELOADED = ["tasks.cli"]
#: the ``zoo`` commands a run may be: those of :mod:`tasks.cli`
TASK_COMMANDS = ("fit", "validate", "test")

_context: multiprocessing.context.BaseContext | None = None


class RunProcess(Protocol):
    """What :func:`experiments.compare.runs.execute` needs of a started run (``subprocess.Popen`` has it)."""

    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


def start(args: list[str], log: Path, env: dict[str, str], threads: int) -> RunProcess:
    """Start ``zoo <args>`` (``args[0]`` one of :data:`TASK_COMMANDS`) with ``env`` as its environment, stdout
    and stderr appended to ``log``."""
    if not args or args[0] not in TASK_COMMANDS:
        raise ValueError(f"a run is zoo {' | '.join(TASK_COMMANDS)} <args>, got zoo {' '.join(args)!r}")
    if "forkserver" not in multiprocessing.get_all_start_methods():
        with open(log, "a") as out:
            command = [sys.executable, "-m", "experiments.cli", *args]
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    process = _forkserver().Process(target=_zoo, args=(args, str(log), env, threads), daemon=False)
    process.start()
    return ForkedRun(process)


def available() -> bool:
    """Whether runs and workers can be forked from the preloaded forkserver (not on Windows)."""
    return "forkserver" in multiprocessing.get_all_start_methods()


def start_function(target: Callable[..., None], args: tuple[Any, ...]) -> multiprocessing.process.BaseProcess:
    """``target(*args)`` in a process forked from the preloaded forkserver (see :func:`available`), started."""
    process = _forkserver().Process(target=target, args=args, daemon=False)
    process.start()
    return process


def warm_up() -> None:
    """Start the forkserver now: its imports then overlap whatever this process does before the first run."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        _forkserver()
        multiprocessing.forkserver.ensure_running()


def _forkserver() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOADED)
    return _context


def output_to(log: str) -> None:
    """This forked process's stdout and stderr appended to the file ``log`` (created if need be), line-buffered."""
    descriptor = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (fd 1 outlives the process's code)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _zoo(args: list[str], log: str, env: dict[str, str], threads: int) -> None:
    """The run's process: its own session, its environment, its log as stdout and stderr, then ``zoo``."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning stops cleanly on KeyboardInterrupt
    os.environ.clear()
    os.environ.update(env)
    output_to(log)
    sys.argv = ["zoo", *args]

    import torch

    from tasks.cli import run

    torch.set_num_threads(threads)  # the forkserver imported torch before OMP_NUM_THREADS of this run was set
    sys.exit(run(args[0], args[1:]))


class ForkedRun:
    """A forked run seen through the ``subprocess.Popen`` methods :func:`execute` uses; signals go to its
    session (the run and anything it started)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self.process.is_alive():
            self.returncode = self.process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"zoo run {self.process.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:  # not yet in its own session (or exited in between)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
