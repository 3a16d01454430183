"""``zoo compare --jobs N``: up to N runs at once with the local launcher. The scheduler is tested with a stand-in
for a run's process (quick and exact about what runs when); one tiny end-to-end comparison checks that the
accuracies do not depend on the number of runs at once."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

import attention_zoo as az
from experiments.compare import command as compare
from experiments.compare.runs import Entry, Run, RunSettings
from tests.experiments.tiny_recall import RECALL, ROOT, compare_command, fit_args, runs_of

SETTINGS = RunSettings(RECALL, (), 1, None, False, False, shown_experiment="runs/exp")


def plan(labels: str, seeds: int) -> list[Run]:
    entries = [Entry(az.AttentionSpec(label), "defaults", label) for label in labels.split(",")]
    return [Run(entry, seed) for seed in range(seeds) for entry in entries]


class StandIn:
    """In place of :func:`experiments.compare.runs.attempt`: each run writes a finished run.json after
    ``seconds[run.name]`` (or, with ``until_stopped``, once the comparison is stopped); records the order of the
    starts and the most runs under way at once."""

    def __init__(self, seconds: dict[str, float] | None = None, until_stopped: bool = False) -> None:
        self.seconds, self.until_stopped = seconds or {}, until_stopped
        self.lock, self.under_way, self.most, self.started = threading.Lock(), 0, 0, []

    def __call__(self, run: Run, directory: Path, settings: RunSettings, *, stop: threading.Event, on_progress=None):
        with self.lock:
            self.started.append(run.name)
            self.under_way += 1
            self.most = max(self.most, self.under_way)
        if self.until_stopped:
            stop.wait(30)
        else:
            time.sleep(self.seconds.get(run.name, 0.05))
        with self.lock:
            self.under_way -= 1
        if stop.is_set():
            return "new", 0.1, False, "interrupted (rerun the same zoo compare command to resume)"
        run_dir = run.directory(directory)
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {"status": "finished", "tokens_per_s": 100.0, "peak_mem_mb": 2.0, "fit_start_mem_mb": 1.0,
                  "metrics": {"val/acc": 0.5}}  # fmt: skip
        (run_dir / "run.json").write_text(json.dumps(record))
        return "new", 0.1, True, ""


def run_locally(runs: list[Run], directory: Path, jobs: int, stop: threading.Event | None = None, done=()):
    out = Console(file=io.StringIO(), width=120)
    stop = stop or threading.Event()
    check = compare.MetricCheck(None)
    rows = compare.run_locally(runs, list(done), directory, SETTINGS, jobs, stop=stop, check=check, out=out)
    return rows, out.file.getvalue()


@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_jobs_below_one_is_refused_in_one_line_before_anything_runs(jobs, tmp_path, capsys):
    assert compare.main(["--jobs", jobs, "--runs-dir", str(tmp_path / "runs")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("zoo compare: error: --jobs must be >= 1 (runs at once; ") and line.endswith(f"got {jobs}")
    assert not (tmp_path / "runs").exists()


def test_jobs_defaults_to_the_usable_cores():
    assert compare.build_parser().get_defaults().jobs == len(os.sched_getaffinity(0))
    assert compare.build_parser(default_experiment=True).get_defaults().jobs == len(os.sched_getaffinity(0))


def test_runs_start_in_order_at_most_jobs_at_once_and_each_records_how_many_ran_beside_it(tmp_path, monkeypatch):
    runs = plan("full,local,nystrom", seeds=2)  # seed-major: full/seed-0, local/seed-0, nystrom/seed-0, full/seed-1..
    # full/seed-0 outlasts the five after it: runs finish out of order, and the next starts as soon as one ends
    stand_in = StandIn({"full/seed-0": 1.5})
    monkeypatch.setattr(compare, "attempt", stand_in)
    rows, printed = run_locally(runs, tmp_path, jobs=2)
    assert stand_in.started == [run.name for run in runs] and stand_in.most == 2
    assert [(r["mechanism"], r["seed"], r["status"]) for r in rows] == [
        (run.entry.label, run.seed, "ok") for run in runs
    ]
    assert [r["runs_at_once"] for r in rows] == [2] * 6
    assert all(json.loads((run.directory(tmp_path) / "run.json").read_text())["runs_at_once"] == 2 for run in runs)
    lines = [line.strip() for line in printed.splitlines() if "/seed-" in line and ": ok" in line]
    assert lines[0].startswith("local/seed-0: ok") and len(lines) == 6  # one line per run, as each ends


def test_one_job_runs_one_after_another(tmp_path, monkeypatch):
    stand_in = StandIn()
    monkeypatch.setattr(compare, "attempt", stand_in)
    rows, _ = run_locally(plan("full,local", seeds=2), tmp_path, jobs=1)
    assert stand_in.most == 1 and [r["runs_at_once"] for r in rows] == [1] * 4
    assert compare.at_once_text(rows, 1) == "runs one after another (--jobs 1)"
    assert not compare.measured_concurrently(rows)


def test_more_jobs_than_runs_start_every_run_and_no_run_finished_earlier(tmp_path, monkeypatch):
    runs = plan("full,local,nystrom", seeds=1)
    earlier = StandIn()
    monkeypatch.setattr(compare, "attempt", earlier)
    run_locally(runs[:1], tmp_path, jobs=1)
    stand_in = StandIn()
    monkeypatch.setattr(compare, "attempt", stand_in)
    rows, _ = run_locally(runs, tmp_path, jobs=8, done=runs[:1])
    assert stand_in.started == ["local/seed-0", "nystrom/seed-0"] and [r["status"] for r in rows] == ["ok"] * 3
    assert [r["runs_at_once"] for r in rows] == [1, 2, 2]
    assert compare.at_once_text(rows, 8).startswith("up to 2 runs at once (--jobs 8; ")
    assert compare.measured_concurrently(rows)


def test_stopping_interrupts_the_runs_under_way_and_starts_no_other(tmp_path, monkeypatch):
    stand_in = StandIn(until_stopped=True)
    monkeypatch.setattr(compare, "attempt", stand_in)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()  # what Ctrl-C does: the SIGINT handler sets the event
    rows, _ = run_locally(plan("full,local", seeds=2), tmp_path, jobs=2, stop=stop)
    assert stand_in.started == ["full/seed-0", "local/seed-0"]
    assert [r["status"] for r in rows] == ["interrupted", "interrupted", "not run", "not run"]


@pytest.mark.slow
def test_accuracies_do_not_depend_on_the_number_of_runs_at_once(tmp_path):
    """Two runs one after another, then the same two side by side: the same accuracies, bit for bit."""
    args = ["--task-config", RECALL, "--attentions", "full,local:window=8", "--runs-dir", str(tmp_path / "runs"),
            "--fit-args", json.dumps(fit_args(max_steps=2))]  # fmt: skip
    zoo = compare_command(tmp_path / "cache", ROOT, *args)
    alone = runs_of(zoo("--experiment", "alone", "--jobs", "1"), tmp_path / "runs" / "alone")
    together = runs_of(zoo("--experiment", "together", "--jobs", "2"), tmp_path / "runs" / "together")
    assert [(r["mechanism"], r["val_acc"], r["val_loss"]) for r in alone] == [
        (r["mechanism"], r["val_acc"], r["val_loss"]) for r in together
    ]
    assert [r["runs_at_once"] for r in alone] == ["1", "1"] and [r["runs_at_once"] for r in together] == ["2", "2"]
    summary = (tmp_path / "runs" / "together" / "summary.md").read_text()
    assert "up to 2 runs at once (--jobs 2" in summary and "tokens_per_s (measured concurrently)" in summary
    assert "measured concurrently" not in (tmp_path / "runs" / "alone" / "summary.md").read_text()
