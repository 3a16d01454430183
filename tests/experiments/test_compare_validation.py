"""What ``zoo compare`` says about runs that never validated, which defaults its ``--help`` and ``--print_config``
show, and its table at 80 columns. Synthetic runs (run.json files and rows written here) stand for trained ones,
except in the one end-to-end test, a single tiny run."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console

import attention_zoo as az
from experiments.compare import command as compare
from experiments.compare.runs import Entry, Run, run_row
from experiments.compare.summary import (
    format_difference,
    format_interval,
    print_table,
    summarize_mechanisms,
    write_runs,
    write_summary,
)
from tests.experiments.tiny_recall import RECALL, ROOT, compare_command, fit_args, read_csv

DEFAULT = yaml.safe_load((ROOT / "configs" / "compare.yaml").read_text())


def finished_run(directory: Path, label: str, seed: int, metrics: dict[str, float]) -> dict:
    """The row zoo compare makes of a finished run whose run.json holds ``metrics``."""
    run = Run(Entry(az.AttentionSpec(label), "defaults", label), seed)
    run_dir = run.directory(directory)
    run_dir.mkdir(parents=True)
    record = {"status": "finished", "step": 20, "tokens_per_s": 5000.0 + seed, "peak_mem_mb": 400.0,
              "fit_start_mem_mb": 380.0, "fit_seconds": 3.0, "metrics": metrics}  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps(record))
    return run_row(run, run_dir, status="ok", wall_s=4.0)


def test_runs_that_never_validated_get_no_verdict_on_another_metric_and_one_warning(tmp_path):
    rows = [finished_run(tmp_path, name, seed, {"train/loss": 3.5 - seed / 10}) for seed in (0, 1) for name in
            ("full", "local")]  # fmt: skip
    assert [row["validated"] for row in rows] == ["no"] * 4
    write_runs(tmp_path, rows)
    write_summary(tmp_path, rows, ["# t"])
    assert {r["validated"] for r in read_csv(tmp_path / "runs.csv")[1]} == {"no"}
    summary = {r["mechanism"]: r for r in read_csv(tmp_path / "summary.csv")[1]}
    assert {(r["verdict"], r["validated"]) for r in summary.values()} == {("not validated", "0")}
    markdown = (tmp_path / "summary.md").read_text()
    warnings = [line for line in markdown.splitlines() if "validation never ran" in line]
    assert warnings == [
        "**Warning**: validation never ran in 4 of 4 finished runs (full/seed-0, local/seed-0, full/seed-1 and 1 "
        "more): no val_* metric, so their verdict is 'not validated'; train more steps than "
        "--trainer.val_check_interval, or lower it."
    ]
    assert "`full` never validated: no verdicts." in markdown and "inconclusive" not in markdown


def test_a_mechanism_that_never_validated_is_named_beside_those_that_did(tmp_path):
    rows = [finished_run(tmp_path, "full", seed, {"val/acc": 0.5 + seed / 10, "val/loss": 2.0}) for seed in (0, 1)]
    rows += [finished_run(tmp_path, "local", seed, {"train/loss": 3.0}) for seed in (0, 1)]
    summary = {s["mechanism"]: s for s in write_summary(tmp_path, rows, ["# t"])}
    assert (summary["full"]["verdict"], summary["local"]["verdict"]) == ("reference", "not validated")
    markdown = (tmp_path / "summary.md").read_text()
    assert "validation never ran in 2 of 4 finished runs (local/seed-0, local/seed-1)" in markdown
    assert "| ok/seeds | validated | verdict |" in markdown
    assert next(line for line in markdown.splitlines() if line.startswith("| local |")).startswith(
        "| local | - | 2/2 | 0/2 | not validated |"
    )
    assert "Verdict: the paired difference from `full` on val_acc" in markdown


@pytest.mark.parametrize("flag", ["--print_config", "--help"])
def test_help_and_print_config_show_the_defaults_of_the_bare_command(flag, capsys):
    with pytest.raises(SystemExit) as stopped:
        compare.main([flag])
    assert stopped.value.code == 0
    shown = capsys.readouterr().out
    if flag == "--print_config":
        printed = yaml.safe_load(shown)
        for key in ("experiment", "attentions", "seeds", "control", "options"):
            assert printed[key] == DEFAULT[key], key
    else:
        flat = " ".join(shown.split())  # the help wraps its lines
        assert f"default: {DEFAULT['experiment']})" in flat and "seed, seed + 1, ... (type: int, default: 3)" in flat
        assert "".join(f"default: {DEFAULT['attentions']})".split()) in "".join(flat.split())


def test_with_a_task_config_print_config_shows_the_parsers_own_defaults(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--task-config", RECALL, "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["seeds"], printed["attentions"], printed["experiment"], printed["options"]) == (1, None, None, {})


def summary_of_the_default_mechanisms() -> list[dict]:
    """Three seeds of each default mechanism and the control, as runs.csv rows, each mechanism a fixed offset
    from full plus a small seed-dependent wobble."""
    names = [*DEFAULT["attentions"].split(","), "self_only"]
    rows = []
    for index, name in enumerate(names):
        for seed in range(3):
            accuracy = 0.9 - 0.07 * index + (0.011 * seed * index) % 0.03
            rows.append({"mechanism": name, "attention": name, "options": json.dumps(DEFAULT["options"].get(name, {})),
                         "options_from": "config", "seed": seed, "status": "ok", "val_acc": accuracy,
                         "tokens_per_s": 123456.0 + 1000 * seed, "peak_mem_mb": 512.0, "train_mem_mb": 12.0 + seed,
                         "runs_at_once": 2})  # fmt: skip
    return summarize_mechanisms(rows, "val_acc")


@pytest.mark.parametrize("width", [80, 100])
def test_at_80_columns_the_table_keeps_mechanism_interval_difference_and_verdict_whole(width):
    summary = summary_of_the_default_mechanisms()
    out = Console(file=io.StringIO(), width=width, force_terminal=False)
    print_table(summary, "val_acc", out)
    lines = out.file.getvalue().splitlines()
    assert max(map(len, lines)) <= width
    for s in summary:
        (line,) = [line for line in lines if line.startswith(f"│ {s['mechanism']} ")]
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        interval = format_interval(s["intervals"]["val_acc"], "val_acc")
        assert cells[cells.index(interval) + 1 :][:2] == [format_difference(s["difference"], "val_acc",
                                                                           interval=False), s["verdict"]]  # fmt: skip
    if width == 80:
        assert "tokens/s" not in out.file.getvalue() and "train MB" not in out.file.getvalue()  # these go first


def test_at_120_columns_the_table_keeps_throughput_and_memory_flagged_as_measured_concurrently():
    summary = summary_of_the_default_mechanisms()
    out = Console(file=io.StringIO(), width=120, force_terminal=False)
    print_table(summary, "val_acc", out, concurrent=True)
    text = out.file.getvalue()
    assert max(map(len, text.splitlines())) <= 120
    assert "tokens/s*" in text and "train MB*" in text and "*: measured concurrently" in text
    assert "124.5k ± 2.5k" in text  # mean 124456 ± t(0.975, 2) 4.302653 x std 1000 / sqrt(3) = 2484


@pytest.mark.slow
def test_a_comparison_too_short_to_validate_says_so(tmp_path):
    """One run of 1 step, validated every 2: the console and summary.md warn, runs.csv says validated no."""
    args = ["--task-config", RECALL, "--attentions", "full", "--runs-dir", str(tmp_path / "runs"), "--experiment",
            "short", "--jobs", "1", "--fit-args", json.dumps(fit_args(max_steps=1))]  # fmt: skip
    result = compare_command(tmp_path / "cache", ROOT, *args)()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "full/seed-0: ok, validation never ran," in result.stdout
    (warning,) = [line for line in result.stdout.splitlines() if line.startswith("warning: validation never ran")]
    assert "in 1 of 1 finished runs (full/seed-0)" in warning
    with open(tmp_path / "runs" / "short" / "runs.csv") as file:
        ((validated, verdict),) = [(r["validated"], r["status"]) for r in csv.DictReader(file)]
    assert (validated, verdict) == ("no", "ok")
    assert "**Warning**: validation never ran" in (tmp_path / "runs" / "short" / "summary.md").read_text()
