"""The experiment lock of ``zoo compare`` (``experiments/compare/lock.py``): one command per experiment
folder, stale locks of dead processes taken over, locks of other hosts only with ``--force-unlock``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.compare import command as compare
from experiments.compare.lock import LOCK_NAME, ExperimentLocked, acquire, experiment_lock, release

ROOT = Path(__file__).resolve().parents[2]


def write_lock(directory: Path, **holder) -> None:
    fields = {"pid": os.getpid(), "host": socket.gethostname(), "started": "then", "command": "zoo compare"}
    (directory / LOCK_NAME).write_text(json.dumps(fields | {"token": "theirs"} | holder))


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_the_lock_names_its_holder_and_goes_when_the_command_ends(tmp_path):
    with experiment_lock(tmp_path, say=pytest.fail):
        holder = json.loads((tmp_path / LOCK_NAME).read_text())
        assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no private file left behind
    assert not (tmp_path / LOCK_NAME).exists()
    with pytest.raises(KeyboardInterrupt), experiment_lock(tmp_path):
        raise KeyboardInterrupt  # Ctrl-C releases it too
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_second_command_is_refused_in_one_line_naming_the_holder(tmp_path):
    token = acquire(tmp_path)
    with pytest.raises(ExperimentLocked) as refused:
        acquire(tmp_path, say=pytest.fail)
    message = str(refused.value)
    assert "\n" not in message and f"in use by another zoo compare, pid {os.getpid()} on host" in message
    release(tmp_path, token)
    release(tmp_path, acquire(tmp_path))


@pytest.mark.parametrize("holder", ["dead", "reused pid"])
def test_a_lock_left_by_a_process_that_no_longer_runs_is_taken_over_with_a_message(tmp_path, holder):
    if holder == "dead":
        write_lock(tmp_path, pid=dead_pid())
    else:  # the pid runs, but it is another process than the one that took the lock
        write_lock(tmp_path, process_start="1")
    messages = []
    token = acquire(tmp_path, say=messages.append)
    assert len(messages) == 1 and "no longer runs" in messages[0]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == token


def test_a_lock_of_another_host_is_taken_over_only_with_force_unlock(tmp_path):
    write_lock(tmp_path, host="elsewhere", pid=dead_pid())
    with pytest.raises(ExperimentLocked, match="locked by pid .* on host elsewhere .*rerun with --force-unlock"):
        acquire(tmp_path, say=pytest.fail)
    messages = []
    token = acquire(tmp_path, force_unlock=True, say=messages.append)
    assert len(messages) == 1 and "--force-unlock: taking over" in messages[0] and "elsewhere" in messages[0]
    release(tmp_path, token)
    (tmp_path / LOCK_NAME).write_text("garbage")
    with pytest.raises(ExperimentLocked, match="unreadable"):
        acquire(tmp_path)
    release(tmp_path, acquire(tmp_path, force_unlock=True, say=lambda _: None))


def test_release_leaves_a_lock_it_no_longer_owns(tmp_path):
    token = acquire(tmp_path)
    write_lock(tmp_path, host="elsewhere")  # forced away by a command on another host
    release(tmp_path, token)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "theirs"


@pytest.mark.slow
def test_two_zoo_compare_commands_into_one_experiment(tmp_path, capsys):
    """The second command stops with one error line and touches nothing; --force_unlock is a compare flag."""
    args = [
        "--task-config", str(ROOT / "configs" / "recall.yaml"), "--attentions", "full",
        "--runs-dir", str(tmp_path / "runs"), "--experiment", "shared",
        "--fit-args", json.dumps(["--data.seq_len=32", "--data.num_kv_pairs=4", "--data.vocab_size=32",
                                  "--data.train_size=256", "--data.batch_size=8", "--model.dim=16", "--model.depth=1",
                                  "--trainer.max_steps=2000", "--trainer.val_check_interval=1000"]),
    ]  # fmt: skip
    env = os.environ | {"ZOO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", "compare", *args], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    experiment = tmp_path / "runs" / "shared"
    try:
        deadline = time.monotonic() + 120
        while not (experiment / "compare.yaml").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (experiment / LOCK_NAME).exists(), "the first command took no lock"
        saved = (experiment / "compare.yaml").read_text()
        assert compare.main([*args, "--force-unlock", "false"]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith("zoo compare: error: ") and "\n" not in error
        assert f"in use by another zoo compare, pid {first.pid} on host" in error
        assert (experiment / "compare.yaml").read_text() == saved
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(timeout=120)
    assert not (experiment / LOCK_NAME).exists()
