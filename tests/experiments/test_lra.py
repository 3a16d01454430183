"""``zoo lra``: the suite configs name task configs whose every mechanism builds; the LRA table from synthetic
runs (verdicts, the seed-by-seed average, Δ / Δ control, the sanity line, "other scale"); a tiny suite on ListOps
that writes lra.md and resumes without rerunning; the one-line skip of a task without its data."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import yaml

from experiments.compare.command import check_entries, plan
from experiments.compare.summary import CONTROL
from experiments.lra import command, table
from experiments.lra.published import NYSTROMFORMER_TABLE_3, TABLES, TASKS

ROOT = Path(__file__).resolve().parents[2]
SUITES = {scale: command.read_suite(ROOT / "configs" / "lra" / f"{scale}.yaml") for scale in ("lite", "reference")}
TINY_FIT = [
    "--data.min_length=8", "--data.max_length=24", "--data.max_depth=3", "--data.train_size=32",
    "--data.val_size=16", "--data.test_size=16", "--data.batch_size=8", "--model.dim=16", "--model.depth=1",
    "--model.warmup_steps=1", "--trainer.max_steps=2", "--trainer.val_check_interval=2",
    "--trainer.log_every_n_steps=1", "--trainer.accelerator=cpu",
]  # fmt: skip


@pytest.mark.parametrize("scale", ["lite", "reference"])
def test_suite_config_names_its_tasks_configs_and_every_budget_is_a_registered_option(scale):
    suite = SUITES[scale]
    assert suite.scale == scale and {"listops", "text", "retrieval", "image", "pathfinder"} <= set(suite.tasks)
    entries = [e.spec.name for e in plan(suite.attentions, {}, control=suite.control)]
    assert entries[0] == "full" and entries[-1] == CONTROL
    assert {"linformer", "nystrom", "local", "bigbird", "lsh", "performer"} <= set(entries)
    for task in suite.tasks.values():
        assert task.task_config == (ROOT / "configs" / "lra" / scale / f"{task.name}.yaml").resolve()
        plan(suite.attentions, task.options)  # every budget is an option the registry knows
        assert set(task.options) <= set(entries)


@pytest.mark.parametrize(("scale", "name"), [(s, t) for s in SUITES for t in SUITES[s].tasks])
def test_every_mechanism_builds_on_each_written_task_config(scale, name):
    task = SUITES[scale].tasks[name]
    if not task.task_config.is_file():
        pytest.skip(f"{task.task_config.relative_to(ROOT)} is not written yet")
    if command.skip_reason(task, {}):
        pytest.skip(f"{scale}/{name}: {command.skip_reason(task, {})}")
    entries = plan(SUITES[scale].attentions, task.options, control=True)
    problems, _ = check_entries(entries, str(task.task_config), list(task.fit_args))
    assert problems == []


def rows(task: str, values: dict[str, list[float]]) -> list[dict]:
    """Run rows as zoo compare's runs.csv holds them, one per mechanism and seed."""
    return [
        {"mechanism": label, "attention": label, "options": "{}", "options_from": "defaults", "seed": seed,
         "status": "ok", "val_acc": value, "reason": "", "task": task}
        for label, accuracies in values.items() for seed, value in enumerate(accuracies)
    ]  # fmt: skip


SYNTHETIC = {
    "listops": rows(
        "listops", {"full": [0.60, 0.62, 0.61], "linformer": [0.50, 0.53, 0.51], CONTROL: [0.20, 0.21, 0.19]}
    ),  # fmt: skip
    "image": rows(
        "image", {"full": [0.40, 0.41, 0.42], "linformer": [0.401, 0.409, 0.4205], CONTROL: [0.39, 0.41, 0.42]}
    ),  # fmt: skip
}


def test_table_cells_verdicts_gap_fractions_and_seed_by_seed_average():
    built = table.build(SYNTHETIC)
    assert built.mechanisms == ["full", "linformer", CONTROL] and built.tasks == ["listops", "image"]
    listops, image = built.cells[("linformer", "listops")], built.cells[("linformer", "image")]
    assert listops.verdict == "worse" and image.verdict == "on par"
    assert listops.interval.mean == pytest.approx(0.5133, abs=1e-4)
    # Δ / Δ control: (0.5133 - 0.61) / (0.20 - 0.61)
    assert listops.gap_fraction == pytest.approx((0.51333 - 0.61) / (0.20 - 0.61), abs=1e-4)
    average = built.cells[("linformer", table.AVERAGE)]
    assert average.interval.mean == pytest.approx((0.51333 + 0.41017) / 2, abs=1e-4)
    assert average.difference.mean == pytest.approx(((0.51333 + 0.41017) - (0.61 + 0.41)) / 2, abs=1e-4)
    assert built.cells[("full", table.AVERAGE)].verdict == "reference"
    assert built.cells[(CONTROL, table.AVERAGE)].gap_fraction == pytest.approx(1.0)


def test_sanity_line_tells_a_task_that_does_not_test_attention():
    built = table.build(SYNTHETIC)
    assert built.sanity["listops"].startswith("full clearly above the control")
    assert built.sanity["image"].startswith("this scale does not test attention")
    one_seed = table.build({"listops": [r for r in SYNTHETIC["listops"] if r["seed"] == 0]})
    assert one_seed.sanity["listops"].startswith("not judged") and "1 paired seed" in one_seed.sanity["listops"]


def test_a_mechanism_missing_a_task_has_no_average_and_path_x_is_left_out_of_it():
    data = {"listops": SYNTHETIC["listops"], "image": [r for r in SYNTHETIC["image"] if r["mechanism"] != "linformer"]}
    assert table.build(data).cells[("linformer", table.AVERAGE)].interval is None
    with_pathx = {**SYNTHETIC, "pathx": rows("pathx", {"full": [0.5, 0.5, 0.5], "linformer": [0.9, 0.9, 0.9]})}
    assert table.build(with_pathx).cells[("linformer", table.AVERAGE)].interval.mean == pytest.approx(0.46175, 1e-3)


def test_markdown_marks_published_tables_by_scale_and_csv_keeps_fractions(tmp_path):
    built = table.build(SYNTHETIC)
    lite = table.markdown(built, scale="lite", header=["# t"], not_run={"text": "its data are not here: x"})
    assert lite.count("other scale") == len(TABLES) and "- text: its data are not here: x" in lite
    assert "| linformer | 51.3 ± 3.8 · worse · 0.24 |" in lite
    for published in TABLES:
        assert f"## {published.title}" in lite and published.citation in lite
    assert "| Nyströmformer | nystrom | 37.15 | 65.52 | 79.56 | 41.58 | 70.94 | 58.95 |" in lite
    reference = table.markdown(built, scale="reference", header=[], not_run={})
    assert "other scale" not in reference and "same setting" in reference and "other model" in reference
    md, csv_path = table.write(tmp_path, built, scale="lite", header=["# t"], not_run={})
    csv_text = csv_path.read_text()
    assert md.is_file() and csv_text.startswith("mechanism,listops_mean,listops_ci_low")
    assert "linformer,0.5133" in csv_text


def test_published_numbers_are_the_tables_columns():
    assert TASKS == ("listops", "text", "retrieval", "image", "pathfinder")
    assert NYSTROMFORMER_TABLE_3.rows["Standard"] == (37.10, 65.02, 79.35, 38.20, 74.16, 58.77)
    for published in TABLES:
        assert all(len(values) == 6 for values in published.rows.values())


def tiny_suite(tmp_path: Path) -> Path:
    config = {
        "scale": "lite", "attentions": "full,local:window=4", "seeds": 1, "threads": 1, "control": True,
        "fit_args": TINY_FIT,
        "tasks": {
            "listops": {"task_config": str(ROOT / "configs" / "listops.yaml")},
            "text": {"task_config": str(ROOT / "configs" / "text.yaml"), "needs_data": "put aclImdb in DIR"},
        },
    }  # fmt: skip
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_tiny_suite_writes_the_table_then_resumes_without_rerunning(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--suite-config", str(tiny_suite(tmp_path)), "--runs-dir", str(tmp_path / "runs")]
    assert command.main(argv) == 0
    printed = capsys.readouterr().out
    # configs/text.yaml names data/aclImdb, which is not here
    assert "zoo lra: skipping text: its data folder data/aclImdb does not exist: put aclImdb in DIR" in printed
    suite = tmp_path / "runs" / "lra-lite"
    records = sorted(suite.glob("listops/*/seed-0/run.json"))
    assert [p.parent.parent.name for p in records] == ["full", "local", CONTROL]
    assert all(json.loads(p.read_text())["status"] == "finished" for p in records)
    md = (suite / "lra.md").read_text()
    assert "| full | " in md and "- text: its data folder data/aclImdb does not exist" in md and "other scale" in md
    assert list(suite.glob("events.out.tfevents.*.lra-layout"))
    stamps = [p.stat().st_mtime_ns for p in records]
    assert command.main(argv) == 0
    assert "3 runs, 3 finished earlier" in capsys.readouterr().out
    assert [p.stat().st_mtime_ns for p in records] == stamps
    assert len(list(suite.glob("events.out.tfevents.*.lra-layout"))) == 1


def test_a_named_task_without_data_fails_with_its_own_error_and_unknown_tasks_are_refused(tmp_path, capsys):
    argv = ["--suite-config", str(tiny_suite(tmp_path)), "--runs-dir", str(tmp_path / "runs")]
    assert command.main([*argv, "--tasks", "text"]) == 2
    error = capsys.readouterr().err
    assert "zoo compare: error:" in error and "data_dir" in error
    assert command.main([*argv, "--tasks", "listops,nope"]) == 2
    assert "zoo lra: error: no task 'nope' in" in capsys.readouterr().err


def test_gpu_step_runs_two_at_once_within_its_budget_then_resumes_from_the_committed_batch(tmp_path):
    from experiments.gpu import lra as gpu_lra

    suite = gpu_lra.smoke_suite(tmp_path)  # ListOps, full and the control, one seed: 2 runs
    committed, first, second = tmp_path / "committed", tmp_path / "out1", tmp_path / "out2"
    for folder in (first, second):
        folder.mkdir()
    detail = gpu_lra.run_batch(first, tmp_path / "work1", seconds=240, suite_path=suite, committed=committed,
                               concurrency=2)  # fmt: skip
    assert detail.startswith("2 run(s) finished in this batch (2 at once), 0 stopped") and "2 of 2 done" in detail
    with tarfile.open(first / "lra.tar.gz") as archive:
        names = archive.getnames()
        archive.extractall(committed, filter="data")  # commit the batch
    assert "lra-reference/lra.md" in names and "lra-reference/listops/full/seed-0/run.json" in names
    assert not any(name.endswith(".ckpt") for name in names)
    more = yaml.safe_load(suite.read_text()) | {"seeds": 2}
    suite.write_text(yaml.safe_dump(more))
    detail = gpu_lra.run_batch(second, tmp_path / "work2", seconds=240, suite_path=suite, committed=committed,
                               concurrency=2)  # fmt: skip
    assert detail.startswith("2 run(s) finished") and "2 committed earlier; 4 of 4 done" in detail
    md = (tmp_path / "work2" / "lra-reference" / "lra.md").read_text()
    assert "| full | " in md and "2 seeds" not in md


def test_gpu_step_with_its_budget_spent_starts_no_run_and_still_packs(tmp_path):
    from experiments.gpu import lra as gpu_lra

    detail = gpu_lra.run_batch(tmp_path, tmp_path / "work", seconds=0, suite_path=gpu_lra.smoke_suite(tmp_path),
                               committed=tmp_path / "none")  # fmt: skip
    assert detail.startswith("0 run(s) finished") and "0 of 2 done" in detail
    assert (tmp_path / "lra.tar.gz").is_file() and (tmp_path / "lra-resume.tar.gz").is_file()
