"""``zoo compare``'s runs started from the preloaded forkserver (experiments/preload.py): each is a process
of its own with its log, its exit code, its environment and its own session, as a subprocess was."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from experiments import preload

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_writes_its_log_and_returns_its_exit_code(tmp_path):
    helped = preload.start(["validate", "--help"], tmp_path / "help.log", dict(os.environ), threads=1)
    assert isinstance(helped, preload.ForkedRun)
    assert helped.wait(120) == 0 and helped.poll() == 0
    assert "--ckpt_path" in (tmp_path / "help.log").read_text()


def test_a_run_is_a_task_command(tmp_path):
    """Only what :mod:`tasks.cli` runs: the forked run never goes through the ``zoo`` command table."""
    for args in (["list"], []):
        with pytest.raises(ValueError, match=r"a run is zoo fit \| validate \| test <args>"):
            preload.start(args, tmp_path / "bad.log", dict(os.environ), threads=1)
    assert not (tmp_path / "bad.log").exists()


def test_a_run_sees_the_environment_it_was_given(tmp_path):
    """Not the forkserver's: ``ZOO_VERBOSE=1`` (read by the CLI at run time) changes what the run writes."""
    for verbose in ("0", "1"):
        run = preload.start(
            ["fit", "--no-such-flag"], tmp_path / f"{verbose}.log", os.environ | {"ZOO_VERBOSE": verbose}, 1
        )
        assert run.wait(120) == 2
    assert "ZOO_VERBOSE=1: the parser's full message" in (tmp_path / "0.log").read_text()
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "1.log").read_text()


def test_a_run_leads_its_own_session_and_is_stopped_by_a_signal(tmp_path):
    """Its own session: a Ctrl-C at the terminal reaches only the parent, which then stops the run itself."""
    env = os.environ | {"ZOO_CACHE": str(tmp_path / "cache")}
    args = ["fit", "-c", str(ROOT / "configs" / "recall.yaml"), "--trainer.max_steps", "100000"]
    run = preload.start(args, tmp_path / "f.log", env, 1)
    deadline = time.monotonic() + 60
    while os.getpgid(run.process.pid) != run.process.pid and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.getpgid(run.process.pid) == run.process.pid != os.getpgid(os.getpid())
    with pytest.raises(subprocess.TimeoutExpired):
        run.wait(1)
    run.kill()
    assert run.wait(30) == -signal.SIGKILL


def test_without_forkserver_a_run_is_a_plain_subprocess(tmp_path, monkeypatch):
    monkeypatch.setattr(preload.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    helped = preload.start(["validate", "--help"], tmp_path / "help.log", dict(os.environ), threads=1)
    assert isinstance(helped, subprocess.Popen)
    assert helped.wait(120) == 0
    assert "--ckpt_path" in (tmp_path / "help.log").read_text()
