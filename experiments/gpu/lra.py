"""The ``lra`` step of ``zoo gpu-suite``: one batch of the reference-scale Long Range Arena suite (``zoo lra
--scale reference``, :mod:`experiments.lra.command`) on one GPU, within the step's time.

    zoo gpu-suite --out OUT --steps lra --budget-min 9

The reference suite is hundreds of runs, some tens of thousands of steps long (Pathfinder: 62,400); a GPU
window is minutes. Each window therefore runs a batch: the runs that the committed results
(``results/lra-gpu/lra-reference/``, the unpacked ``lra.tar.gz`` and ``lra-resume.tar.gz`` of earlier batches)
do not hold finished, in the suite's order: task by task as the suite config lists them (tasks whose data are
absent are left out), within a task seed by seed, within a seed the mechanisms as listed, the control last
(``zoo compare``'s order, so whole seeds finish first). ``concurrency`` runs go at once, each its own ``zoo fit``
process (:func:`experiments.compare.runs.attempt`: an unfinished run continues from its ``last.ckpt``), since
the 2-layer, 64-wide models leave a GPU mostly idle. At the deadline (the step's time less a margin for
packing) no new run starts and the running ones are stopped (SIGINT: they keep the checkpoint of their last
``every_n_train_steps``), so the step ends cleanly before its time.

What comes back, flat in ``--out``: ``lra.tar.gz`` (every run's small files, earlier batches' and this one's, no
checkpoints, plus ``lra-reference/lra.md`` and ``lra.csv`` over all of them, headed by the device) and
``lra-resume.tar.gz`` (the ``last.ckpt`` of each unfinished run). Commit a batch by unpacking both into
``results/lra-gpu/``; the next batch continues from there.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from experiments import preload
from experiments.compare.command import check_entries, plan
from experiments.compare.runs import Run, RunSettings, attempt, is_finished, resume_checkpoint, run_row
from experiments.lra import table
from experiments.lra.command import SUITES, Suite, read_suite, skip_reason
from experiments.machine_paths import shown_path

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "results" / "lra-gpu"
#: seconds kept back at the end of the step: stopping the runs (up to 15 s each) and packing
PACK_MARGIN = 45.0
#: the smoke batch's runs: ListOps at a few symbols, two steps
SMOKE_FIT = [
    "--data.min_length=8", "--data.max_length=24", "--data.max_depth=3", "--data.train_size=32",
    "--data.val_size=16", "--data.test_size=16", "--data.batch_size=8", "--model.dim=16", "--model.depth=1",
    "--model.warmup_steps=1", "--trainer.max_steps=2", "--trainer.val_check_interval=2",
    "--trainer.log_every_n_steps=1",
]  # fmt: skip


def smoke_suite(work: Path) -> Path:
    """A tiny suite (ListOps, full and the control, one seed) for ``zoo gpu-suite --smoke --steps lra``."""
    config = {
        "scale": "reference", "attentions": "full", "seeds": 1, "threads": 1, "control": True,
        "fit_args": SMOKE_FIT, "tasks": {"listops": {"task_config": str(ROOT / "configs" / "listops.yaml")}},
    }  # fmt: skip
    path = work / "lra-smoke.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def planned(suite: Suite) -> list[tuple[str, Run]]:
    """(task, run) in the batch order of the module docstring, for the tasks that can run here."""
    order = []
    for name, task in suite.tasks.items():
        if skip_reason(task, {}) is None:
            entries = plan(suite.attentions, task.options, control=suite.control)
            order += [(name, Run(entry, seed)) for seed in range(suite.seeds) for entry in entries]
    return order


def run_batch(
    out: Path,
    work: Path,
    *,
    seconds: float,
    suite_path: Path = SUITES / "reference.yaml",
    committed: Path = COMMITTED,
    concurrency: int = 4,
    device: str = "cpu",
    record: Callable[[dict[str, Any]], None] | None = None,
) -> str:
    """Run the next runs of the suite at ``suite_path`` for ``seconds`` (at most), ``concurrency`` at once, in
    ``work``, starting from ``committed``; pack into ``out``; return the step's one-line outcome."""
    deadline = time.monotonic() + seconds - min(PACK_MARGIN, seconds / 4)
    suite = read_suite(suite_path)
    root = work / f"lra-{suite.scale}"
    if (committed / root.name).is_dir():
        shutil.copytree(committed / root.name, root, dirs_exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    order = planned(suite)
    earlier = [(t, r) for t, r in order if is_finished(r.directory(root / t))]
    pending = [(t, r) for t, r in order if (t, r) not in earlier]
    threads = max(1, (os.cpu_count() or 1) // concurrency)
    settings = {}
    for name in dict.fromkeys(t for t, _ in pending):  # whether the data module takes shuffle_seed, as compare asks
        task = suite.tasks[name]
        _, shuffle = check_entries(plan(suite.attentions, task.options)[:1], str(task.task_config), [])
        settings[name] = RunSettings(
            str(task.task_config), task.fit_args, threads, None, False, vary_data_order=shuffle,
            shown_experiment=shown_path(root / name),
        )  # fmt: skip
    stop = threading.Event()
    if time.monotonic() >= deadline:  # no time left: no run starts
        stop.set()
    timer = threading.Timer(max(0.0, deadline - time.monotonic()), stop.set)
    timer.start()
    preload.warm_up()  # started here, not by the first worker threads at once
    queue, lock, outcomes = list(pending), threading.Lock(), []

    def worker() -> None:
        while True:
            with lock:
                if stop.is_set() or not queue:
                    return
                name, run = queue.pop(0)
            print(f"[gpu-suite] lra: {name} {run.name}", flush=True)
            outcome = attempt(run, root / name, settings[name], stop=stop)
            outcomes.append((name, run, *outcome))
            print(f"[gpu-suite] lra: {name} {run.name}: {'ok' if outcome[2] else outcome[3]}", flush=True)

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            for future in [pool.submit(worker) for _ in range(concurrency)]:
                future.result()
    finally:
        timer.cancel()
    finished = [o for o in outcomes if o[4]]
    cut = [o for o in outcomes if not o[4] and stop.is_set()]
    for name, run, _, _, ok, reason in outcomes:
        if record is not None:
            record({"kind": "lra", "task": name, "run": run.name, "ok": ok, "reason": reason})
    pack(out, root, suite, order, device)
    done = sum(is_finished(r.directory(root / t)) for t, r in order)
    return (
        f"{len(finished)} run(s) finished in this batch ({concurrency} at once), {len(cut)} stopped by the budget "
        f"(they continue from lra-resume.tar.gz), {len(earlier)} committed earlier; {done} of {len(order)} done"
    )


def pack(out: Path, root: Path, suite: Suite, order: list[tuple[str, Run]], device: str) -> None:
    """``lra.md`` and ``lra.csv`` over every run under ``root``, then ``lra.tar.gz`` and ``lra-resume.tar.gz``."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for name, run in order:
        run_dir = run.directory(root / name)
        if run_dir.is_dir():
            status = "ok" if is_finished(run_dir) else "not run"
            reason = "" if status == "ok" else "unfinished: continues in a later batch"
            rows.setdefault(name, []).append(run_row(run, run_dir, status=status, wall_s=None, reason=reason))
    if rows:
        header = [
            f"# Long Range Arena, {suite.scale} scale, on the GPU batch by batch (zoo gpu-suite --steps lra)",
            "",
            f"- latest batch on {device}; suite config `{shown_path(suite.path)}`; tasks with runs: {', '.join(rows)}",
        ]
        table.write(root, table.build(rows), scale=suite.scale, header=header, not_run={})
    with tarfile.open(out / "lra.tar.gz", "w:gz") as archive:
        archive.add(root, arcname=root.name, filter=lambda info: None if info.name.endswith(".ckpt") else info)
    with tarfile.open(out / "lra-resume.tar.gz", "w:gz") as archive:
        for name, run in order:
            checkpoint = resume_checkpoint(run.directory(root / name))
            if checkpoint is not None and not is_finished(run.directory(root / name)):
                archive.add(checkpoint, arcname=str(checkpoint.relative_to(root.parent)))
