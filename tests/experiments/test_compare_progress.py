"""``zoo compare``'s progress: the ETA of its bar from the runs that finished, and each running run's line with its
step. The bar is tested with a stand-in for a run's process that reports its steps and its wall time."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import Progress

import attention_zoo as az
from experiments.compare import command as compare
from experiments.compare.runs import Entry, Run, RunSettings, eta_text
from tests.experiments.tiny_recall import RECALL

SETTINGS = RunSettings(RECALL, (), 1, None, False, False, shown_experiment="runs/exp")


@pytest.mark.parametrize(
    ("finished_s", "remaining", "jobs", "expected"),
    [
        ([30.0, 50.0], 4, 2, "ETA 1 min 20 s"),  # mean 40 s x 4 runs / 2 at once = 80 s
        ([30.0, 50.0], 4, 1, "ETA 2 min 40 s"),
        ([10.0], 1, 4, "ETA 10 s"),  # one run left goes no faster with four jobs
        ([20.0, 40.0, 60.0], 3, 8, "ETA 40 s"),  # three left, three at once: one mean run's time
        ([1800.0], 5, 2, "ETA 1 h 15 min"),  # 1800 x 5 / 2 = 4500 s
        ([7.4], 2, 1, "ETA 15 s"),
        ([], 6, 2, "ETA after the first run"),
        ([12.0], 0, 2, ""),
    ],
)
def test_eta_is_the_mean_finished_run_times_the_remaining_runs_over_the_runs_at_once(
    finished_s, remaining, jobs, expected
):
    assert eta_text(finished_s, remaining, jobs) == expected


class Recording(Progress):
    """A progress display that keeps every description each of its tasks had."""

    def __init__(self, *columns, **options) -> None:
        super().__init__(*columns, **options)
        self.descriptions: dict[int, list[str]] = {}

    def add_task(self, description: str, *args, **options):
        task = super().add_task(description, *args, **options)
        self.descriptions[task] = [description]
        return task

    def update(self, task, *args, description: str | None = None, **options) -> None:
        if description is not None:
            self.descriptions[task].append(description)
        super().update(task, *args, description=description, **options)


class StandIn:
    """In place of :func:`experiments.compare.runs.attempt`: reports steps 5 and 10 of 10, writes a finished
    run.json and says it took ``wall`` seconds."""

    def __init__(self, wall: float) -> None:
        self.wall = wall

    def __call__(self, run: Run, directory: Path, settings: RunSettings, *, stop: threading.Event, on_progress=None):
        on_progress(5, 10)
        on_progress(10, 10)
        run_dir = run.directory(directory)
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {"status": "finished", "tokens_per_s": 100.0, "peak_mem_mb": 2.0, "fit_start_mem_mb": 1.0,
                  "metrics": {"val/acc": 0.5}}  # fmt: skip
        (run_dir / "run.json").write_text(json.dumps(record))
        return "new", self.wall, True, ""


def test_the_bar_shows_the_eta_and_each_run_its_steps(tmp_path, monkeypatch):
    entries = [Entry(az.AttentionSpec(name), "defaults", name) for name in ("full", "local")]
    runs = [Run(entry, seed) for seed in range(2) for entry in entries]
    displays: list[Recording] = []
    monkeypatch.setattr(compare, "Progress", lambda *a, **k: displays.append(Recording(*a, **k)) or displays[-1])
    monkeypatch.setattr(compare, "attempt", StandIn(wall=60.0))
    out = Console(file=io.StringIO(), width=120)
    rows = compare.run_locally(
        runs, [], tmp_path, SETTINGS, 1, stop=threading.Event(), check=compare.MetricCheck(None), out=out
    )
    assert [row["status"] for row in rows] == ["ok"] * 4
    (display,) = displays
    overall, *per_run = display.descriptions.values()
    # one at a time, 60 s each: 3 runs left after the first, then 2, 1, none
    assert overall == ["[bold]runs", "[bold]runs[/] ETA after the first run", "[bold]runs[/] ETA 3 min 00 s",
                       "[bold]runs[/] ETA 2 min 00 s", "[bold]runs[/] ETA 1 min 00 s", "[bold]runs[/] "]  # fmt: skip
    assert [d[0] for d in per_run] == [f"{run.name} [dim]starting[/]" for run in runs]
    assert all(d[1:] == [run.name, run.name] for d, run in zip(per_run, runs, strict=True))  # its steps shown


def test_runs_finished_earlier_do_not_count_in_the_eta(tmp_path, monkeypatch):
    """A run resumed as already fitted took no time now: the ETA waits for a run trained now."""
    entries = [Entry(az.AttentionSpec(name), "defaults", name) for name in ("full", "local")]
    runs = [Run(entry, 0) for entry in entries]
    displays: list[Recording] = []
    monkeypatch.setattr(compare, "Progress", lambda *a, **k: displays.append(Recording(*a, **k)) or displays[-1])
    monkeypatch.setattr(compare, "attempt", lambda run, *a, **k: ("already fitted", 0.0, True, ""))
    for run in runs:
        run.directory(tmp_path).mkdir(parents=True)
        record = {"status": "finished", "peak_mem_mb": 2.0, "fit_start_mem_mb": 1.0, "metrics": {}}
        (run.directory(tmp_path) / "run.json").write_text(json.dumps(record))
    out = Console(file=io.StringIO(), width=120)
    compare.run_locally(runs, [], tmp_path, SETTINGS, 1, stop=threading.Event(), check=compare.MetricCheck(None),
                        out=out)  # fmt: skip
    overall = next(iter(displays[0].descriptions.values()))
    assert overall[1:] == ["[bold]runs[/] ETA after the first run"] * 2 + ["[bold]runs[/] "]
