"""``zoo compare`` under hostile input: option lists written another way, an experiment named beyond the Basic
Multilingual Plane, seeds past the largest, a reference or metric that names nothing, a broken run and a corrupt
``compare.yaml`` (said in one line, with the way out, no other run lost), the control arm, and files that name no
path of the machine. One slow end-to-end test runs the tiny recall task of ``test_compare.py`` from a folder of
its own."""

from __future__ import annotations

import json
import os
import site
import sys
import sysconfig
import threading
from pathlib import Path

import pytest
import yaml

import attention_zoo as az
from experiments.compare import command as compare
from experiments.compare.runs import (
    Entry,
    Run,
    RunSettings,
    attempt,
    fit_command,
    path_rewrites,
    portable_text,
    readable_checkpoint,
)
from tests.experiments.tiny_recall import RECALL, ROOT, compare_command, fit_args, runs_of

TINY_FIT_ARGS = fit_args(max_steps=2)
#: a fit argument every entry fails on: a setting the comparison refuses first never reaches the entries' check
UNBUILDABLE = ["--fit-args", json.dumps(["--trainer.no_such_option=1"])]


def refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one error line of a ``zoo compare`` that must stop with exit code 2."""
    assert compare.main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("zoo compare: error: ")
    return line


def test_options_after_a_colon_and_the_same_entry_reordered_is_refused():
    assert [e.spec for e in compare.plan("nystrom:num_landmarks=8:pinv=exact,local:window=8", {})] == [
        az.AttentionSpec("nystrom", {"num_landmarks": 8, "pinv": "exact"}),
        az.AttentionSpec("local", {"window": 8}),
    ]
    with pytest.raises(ValueError, match="same mechanism and options twice: nystrom-pinv=exact-num_landmarks=8$"):
        compare.plan("nystrom:num_landmarks=8:pinv=exact,nystrom:pinv=exact:num_landmarks=8", {})
    with pytest.raises(ValueError, match="twice"):
        compare.plan("nystrom:num_landmarks=8,pinv=exact,nystrom:pinv=exact:num_landmarks=8", {})


def test_an_experiment_named_beyond_the_basic_multilingual_plane_reaches_zoo_fit_whole(tmp_path):
    run = Run(Entry(az.AttentionSpec("local", {"note": "🐍"}), "command line", "local"), 0)
    command = fit_command(run, RECALL, tmp_path / "snake🐍", [], vary_data_order=False)
    # jsonargparse reads a JSON value with its YAML loader, which takes \ud83d\udc0d as two broken characters
    logger = yaml.safe_load(command[command.index("--trainer.logger") + 1])
    options = yaml.safe_load(command[command.index("--model.attention_options") + 1])
    assert logger["init_args"]["name"] == "snake🐍" and options == {"note": "🐍"}


def test_seeds_past_the_largest_a_run_takes_are_refused(tmp_path, capsys):
    line = refusal(capsys, ["--seed", str(2**32 - 1), "--seeds", "2", "--runs-dir", str(tmp_path), *UNBUILDABLE])
    assert "goes past 4294967295" in line
    assert compare.build_parser().parse_args(["--seed", str(2**32 - 1)]).seed == 2**32 - 1  # the largest is fine


def test_a_reference_that_is_none_of_the_entries_is_refused_before_anything_runs(tmp_path, capsys):
    argv = ["--task-config", RECALL, "--attentions", "full,local:window=8", "--runs-dir", str(tmp_path / "runs")]
    line = refusal(capsys, [*argv, "--reference", "nosuch", *UNBUILDABLE])
    assert "--reference 'nosuch' is none of the entries; choose one of full, local" in line
    assert not (tmp_path / "runs").exists()
    twins = compare.plan("full,full:backend=math,local:window=8", {"full": {"backend": "sdpa"}})
    assert "names 2 entries (full-backend=sdpa, full-backend=math)" in compare.reference_problem("full", twins)
    entries = compare.plan("full,local:window=8", {})
    assert [compare.reference_problem(r, entries) for r in (None, "full", "local")] == [None] * 3


def test_a_metric_that_is_no_metric_column_is_refused_before_anything_runs(tmp_path, capsys):
    line = refusal(capsys, ["--task-config", RECALL, "--metric", "acc", "--runs-dir", str(tmp_path), *UNBUILDABLE])
    assert "--metric 'acc' is no metric column" in line and "val_<name>" in line
    assert all(compare.metric_name_problem(m) is None for m in (None, "val_acc_typo", "test_bleu", "tokens_per_s"))


def test_unknown_restart_runs_are_refused_with_the_names_runs_have():
    runs = [Run(entry, seed) for seed in (0, 1) for entry in compare.plan("full,local:window=8", {})]
    assert compare.restarted_runs("local/seed-1, full/seed-0,local/seed-1", runs) == [runs[3], runs[0]]
    with pytest.raises(ValueError, match=r"'local/seed-7'.*label full, local and s 0\.\.1 \(e\.g\. full/seed-0\)"):
        compare.restarted_runs("full/seed-0,local/seed-7", runs)


@pytest.mark.parametrize(
    ("text", "why"),
    [("a: [1\n", "not YAML at line 2"), ("- 1\n- 2\n", "holds a list"), ("", "is empty")],
)
def test_a_corrupt_compare_yaml_is_one_line_with_the_ways_out(tmp_path, text, why):
    experiment = tmp_path / "exp"
    (experiment / "full" / "seed-0").mkdir(parents=True)
    (experiment / "full" / "seed-0" / "run.json").write_text('{"status": "finished"}')
    (experiment / "compare.yaml").write_text(text)
    with pytest.raises(ValueError, match="compare.yaml is corrupt") as error:
        compare.experiment_directory(tmp_path, "exp", {"task_config": RECALL}, fresh=False)
    message = str(error.value)
    assert "\n" not in message and why in message and "delete it" in message and "--fresh" in message
    # deleted, as the line offers: the folder's runs are resumed under the command's settings
    (experiment / "compare.yaml").unlink()
    assert compare.experiment_directory(tmp_path, "exp", {"task_config": RECALL}, fresh=False) == (experiment, True)


def test_an_experiment_resumes_whichever_way_its_paths_and_control_are_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    earlier = {"task_config": RECALL, "runs_dir": str(tmp_path / "runs"), "attentions": "full", "seeds": 1}
    now = {**earlier, "task_config": "configs/recall.yaml", "runs_dir": "runs", "control": False, "seeds": 3}
    assert compare._identity(earlier) == compare._identity(now)  # a compare.yaml written before --control existed
    assert compare._identity(earlier) != compare._identity({**now, "control": True})


def test_control_adds_the_self_only_arm_once():
    assert [e.label for e in compare.plan("full,local:window=8", {}, control=True)] == ["full", "local", "self_only"]
    assert [e.label for e in compare.plan("self_only,full", {}, control=True)] == ["self_only", "full"]
    assert [e.label for e in compare.plan("full", {}, control=False)] == ["full"]
    parser = compare.build_parser()
    assert parser.parse_args(["--control"]).control is True and parser.parse_args([]).control is False
    assert parser.parse_args(["--control", "false"]).control is False


def test_a_run_whose_checkpoint_is_unreadable_is_not_started_and_names_its_way_out(tmp_path):
    run = Run(Entry(az.AttentionSpec("full"), "defaults", "full"), 0)
    run_dir = run.directory(tmp_path / "exp")
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04" + bytes(100))  # a zip cut short
    (run_dir / "run.json").write_text('{"status": "runn')
    settings = RunSettings(RECALL, tuple(TINY_FIT_ARGS), 1, 60.0, False, False, shown_experiment="exp")
    how, wall, ok, reason = attempt(run, tmp_path / "exp", settings, stop=threading.Event())
    assert (how, wall, ok) == ("not continued", 0.0, False)
    assert "last.ckpt is unreadable" in reason and "--restart full/seed-0" in reason
    assert not (run_dir / "fit.log").exists()  # no zoo fit was started, and nothing was deleted
    assert not readable_checkpoint(run_dir / "checkpoints" / "last.ckpt")


def test_a_runs_files_are_rewritten_without_the_machines_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scratch = Path("/tmp/zoo-ray-abc/exp")  # a Ray worker's scratch copy of runs/exp
    packages = Path(sysconfig.get_paths()["purelib"])
    text = (
        f"Restoring states from the checkpoint path at {scratch}/full/seed-0/checkpoints/last.ckpt\n"
        f"{packages}/lightning/pytorch/utilities/_pytree.py:21: deprecated\n"
        f'  File "{ROOT}/tasks/cli.py", line 3\n'
        f"save_dir: {scratch.parent}\n"
        f"{scratch.parent}-other/x and {ROOT}2/y are other folders\n"
    )
    assert portable_text(text, path_rewrites(scratch, "runs/exp")) == (
        "Restoring states from the checkpoint path at runs/exp/full/seed-0/checkpoints/last.ckpt\n"
        "<site-packages>/lightning/pytorch/utilities/_pytree.py:21: deprecated\n"
        '  File "tasks/cli.py", line 3\n'
        "save_dir: runs\n"
        f"{scratch.parent}-other/x and {ROOT}2/y are other folders\n"
    )


def machine_paths() -> set[str]:
    """Folders of this machine that no file of an experiment may name."""
    paths = {str(ROOT), sys.prefix, sys.base_prefix, *site.getsitepackages(), *sysconfig.get_paths().values()}
    return {path for path in paths if path and path != os.sep}


@pytest.mark.slow
def test_a_broken_run_restarts_alone_and_no_file_names_a_machine_path(tmp_path):
    """From a folder of its own (so that paths below it are relative): an experiment named beyond the BMP with
    the control arm and zoo test; its files name no machine path. A run with a truncated checkpoint and a corrupt
    run.json then trains anew with --restart while the control's run stays as it was; an unlogged --metric stops
    the next command at the first finished run, before the runs of a new seed."""
    args = ["--task-config", RECALL, "--experiment", "snake🐍", "--attentions", "full", "--control", "--test", "true"]
    zoo = compare_command(tmp_path / "cache", tmp_path, *args, "--fit-args", json.dumps(TINY_FIT_ARGS))
    experiment = tmp_path / "runs" / "snake🐍"
    result = zoo()
    rows = runs_of(result, experiment)
    assert [(r["mechanism"], r["status"], r["run_dir"]) for r in rows] == [
        ("full", "ok", "runs/snake🐍/full/seed-0"),
        ("self_only", "ok", "runs/snake🐍/self_only/seed-0"),
    ]
    saved = yaml.safe_load((experiment / "compare.yaml").read_text())
    assert (saved["task_config"], saved["runs_dir"], saved["control"]) == ("configs/recall.yaml", "runs", True)
    test_log = (experiment / "full" / "seed-0" / "test.log").read_text()
    assert "checkpoint path at runs/snake🐍/full/seed-0/checkpoints/last.ckpt" in test_log
    texts = {p: p.read_text() for p in experiment.rglob("*") if p.suffix in (".log", ".json", ".yaml", ".csv", ".md")}
    assert len(texts) >= 12
    named = [(p.name, m) for p, text in texts.items() for m in machine_paths() | {str(tmp_path)} if m in text]
    assert named == []

    broken = experiment / "full" / "seed-0"
    (broken / "run.json").write_text('{"status": "fin')
    checkpoint = broken / "checkpoints" / "last.ckpt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    control = {p: p.read_bytes() for p in (experiment / "self_only").rglob("*") if p.is_file()}
    restarted = zoo("--restart", "full/seed-0")
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    assert "deleted runs/snake🐍/full/seed-0; full/seed-0 trains anew" in restarted.stdout
    assert json.loads((broken / "run.json").read_text())["status"] == "finished" and readable_checkpoint(checkpoint)
    assert {p: p.read_bytes() for p in (experiment / "self_only").rglob("*") if p.is_file()} == control

    typo = zoo("--metric", "val_acc_typo", "--seeds", "2")
    assert typo.returncode == 2 and not (experiment / "full" / "seed-1").exists()
    last = typo.stderr.strip().splitlines()[-1]
    assert last.startswith("zoo compare: error: --metric 'val_acc_typo': the run full/seed-0 logged no such metric")
    assert "it logged val_acc, val_loss, val_ppl" in last and "test_acc" in last
