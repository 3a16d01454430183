"""``zoo compare``, ``zoo lra`` and ``zoo gpu-suite``: dashed flags (the underscore spellings read with a one-line
note), config files that keep their ``task_config:`` keys, plain help with examples, a misspelt flag in one line
with the closest flags, and ``zoo lra --jobs`` handed to every ``zoo compare``. Nothing here trains."""

from __future__ import annotations

import re

import pytest
import yaml

from experiments import cli
from experiments.compare import command as compare
from experiments.compare import flags
from experiments.lra import command as lra
from tests.experiments.tiny_recall import RECALL, ROOT

#: reStructuredText that must not reach a help text
RST = re.compile(r"``|:(data|mod|func|class|meth|attr):`")


def note(prog: str, old: str) -> str:
    new = old.replace("_", "-")
    return (
        f"{prog}: note: {old} read as {new} (flags are spelled with dashes; the underscore spelling is accepted in "
        "this release)\n"
    )


def test_compare_takes_dashed_flags_without_a_note(capsys):
    args = compare.build_parser().parse_args(
        ["--task-config", RECALL, "--runs-dir", "r", "--fit-args", '["--trainer.max_steps=2"]', "--force-unlock",
         "true", "--shared-dir", "s", "--ray-address", "auto", "--run-cpus", "2", "--run-gpus", "1"]
    )  # fmt: skip
    assert (args.runs_dir, args.fit_args, args.force_unlock) == ("r", ["--trainer.max_steps=2"], True)
    assert (args.shared_dir, args.ray_address, args.run_cpus, args.run_gpus) == ("s", "auto", 2.0, 1.0)
    assert str(args.task_config) == RECALL
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("old", "value", "key", "expected"),
    [("--runs_dir", "r", "runs_dir", "r"), ("--fit_args", '["a"]', "fit_args", ["a"]), ("--task_config", RECALL,
     "task_config", RECALL), ("--force_unlock", "true", "force_unlock", True)],
)  # fmt: skip
def test_compare_reads_the_underscore_spelling_with_a_note(old, value, key, expected, capsys):
    args = compare.build_parser().parse_args([old, value])
    assert (str(args[key]) if key == "task_config" else args[key]) == expected
    assert capsys.readouterr().err == note("zoo compare", old)


def test_compare_notes_an_old_spelling_once_however_often_it_parses(capsys):
    """``zoo compare`` parses its flags twice (does the command name a task? then with its defaults): one note."""
    assert compare.main(["--task_config", RECALL, "--runs_dir", "r", "--seeds", "abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(note("zoo compare", "--task_config") + note("zoo compare", "--runs_dir"))
    assert err.count("\n") == 3 and "zoo compare: error: --seeds abc: expected int" in err


def test_config_files_keep_their_underscore_keys(tmp_path):
    """``task_config:``, ``runs_dir:`` and ``fit_args:`` in a compare config are the dashed flags' keys."""
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump({"task_config": RECALL, "runs_dir": "elsewhere", "fit_args": ["--x=1"]}))
    args = compare.build_parser().parse_args(["--config", str(config)])
    assert (str(args.task_config.absolute), args.runs_dir, args.fit_args) == (RECALL, "elsewhere", ["--x=1"])
    for name in ("compare.yaml", "compare_variants.yaml"):  # the committed configs load and name their task
        assert compare.build_parser().parse_args(["--config", str(ROOT / "configs" / name)]).task_config
    assert compare.build_parser(default_experiment=True).parse_args([]).task_config.absolute.endswith("recall.yaml")
    for scale in ("lite", "reference"):  # the suite configs' tasks.<task>.task_config
        assert all(t.task_config.is_file() for t in lra.read_suite(ROOT / "configs" / "lra" / f"{scale}.yaml")
                   .tasks.values() if t.name == "listops")  # fmt: skip


def test_lra_takes_dashed_flags_and_reads_the_old_spelling_with_a_note(capsys):
    args = lra.build_parser().parse_args(["--runs-dir", "r", "--data-dirs", "{text: t}", "--suite-config", "s.yaml"])
    assert (args.runs_dir, args.data_dirs, args.suite_config) == ("r", {"text": "t"}, "s.yaml")
    assert capsys.readouterr().err == ""
    args = lra.build_parser().parse_args(["--data_dirs", "{text: t}", "--suite_config=s.yaml"])
    assert (args.data_dirs, args.suite_config) == ({"text": "t"}, "s.yaml")
    assert capsys.readouterr().err == note("zoo lra", "--data_dirs") + note("zoo lra", "--suite_config")


@pytest.mark.parametrize(
    ("command", "dashed"),
    [("compare", ["--task-config", "--runs-dir", "--fit-args", "--force-unlock"]), ("lra", ["--runs-dir",
     "--data-dirs", "--suite-config", "--jobs"]), ("gpu-suite", ["--budget-min", "--report-only"])],
)  # fmt: skip
def test_help_is_plain_text_with_examples_and_dashed_flags(command, dashed, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: zoo {command} ")
    assert not RST.search(text), RST.search(text)
    assert "%%" not in text
    examples = text.split("\nexamples:\n", 1)[1].splitlines()
    assert 1 <= len(examples) <= 2 and all(line.startswith(f"  zoo {command} ") for line in examples), examples
    options = text.split("\noptions:\n", 1)[1]
    assert all(flag in options for flag in dashed)
    assert not re.search(r"--[a-z]+_[a-z]", options.replace("--print_config", "")), "an underscore flag is left"


def test_a_misspelt_flag_is_one_line_naming_the_closest_flags(capsys):
    assert compare.main(["--seedz", "2"]) == 2
    assert capsys.readouterr().err == (
        "zoo compare: error: unrecognized argument --seedz (did you mean '--seed' or '--seeds'?)\n"
    )
    assert compare.main(["--atentions", "full"]) == 2
    assert capsys.readouterr().err == (
        "zoo compare: error: unrecognized argument --atentions (did you mean '--attentions'?)\n"
    )
    assert lra.main(["--jbos", "2"]) == 2
    assert capsys.readouterr().err == "zoo lra: error: unrecognized argument --jbos (did you mean '--jobs'?)\n"
    with pytest.raises(SystemExit) as done:
        cli.main(["gpu-suite", "--out", "unused", "--budget-mn", "3"])
    assert done.value.code == 2
    assert capsys.readouterr().err == (
        "zoo gpu-suite: error: unrecognized argument --budget-mn (did you mean '--budget-min'?)\n"
    )


def test_closest_flags_names_every_flag_about_as_close_as_the_closest():
    known = ["--seed", "--seeds", "--threads", "--jobs"]
    assert flags.closest_flags("--seedz", known) == " (did you mean '--seed' or '--seeds'?)"
    assert flags.closest_flags("--thread", known) == " (did you mean '--threads'?)"
    assert flags.closest_flags("--zzzzzzzz", known) == ""


def suite_config(tmp_path) -> str:
    """A suite of one task, recall, which needs no data."""
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"scale": "tiny", "attentions": "full", "seeds": 1, "tasks": {"recall": {
        "task_config": RECALL}}}))  # fmt: skip
    return str(path)


@pytest.mark.parametrize(("given", "jobs"), [(["--jobs", "2"], 2), ([], compare.usable_cores())])
def test_lra_jobs_reaches_every_compare(given, jobs, tmp_path, monkeypatch, capsys):
    """``zoo lra --jobs 2`` hands ``--jobs 2`` to each task's ``zoo compare``; left out, compare's default applies."""
    handed: list[list[str]] = []
    monkeypatch.setattr(compare, "main", lambda argv: handed.append(argv) or 0)
    runs = str(tmp_path / "runs")
    assert lra.main(["--suite-config", suite_config(tmp_path), "--runs-dir", runs, *given]) == 0
    (argv,) = handed
    args = compare.build_parser().parse_args(argv)
    assert args.jobs == jobs and ("--jobs" in argv) == bool(given)
    assert (args.experiment, args.runs_dir, args.seeds) == ("recall", str(tmp_path / "runs" / "lra-tiny"), 1)
    assert "note:" not in capsys.readouterr().err  # lra hands compare its dashed flags


def test_lra_jobs_below_one_is_refused_in_one_line(tmp_path, capsys):
    assert lra.main(["--suite-config", suite_config(tmp_path), "--jobs", "0"]) == 2
    assert capsys.readouterr().err == "zoo lra: error: --jobs must be >= 1 (runs at once), got 0\n"


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--config", "compare_causal"), ("--config", "configs/compare_causal.yaml"), ("--config=", "compare_causal"),
     ("--task-config", "recall"), ("--task_config", "configs/recall.yaml")],
)  # fmt: skip
def test_configs_are_found_by_name_from_any_folder(flag, value, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the packaged configs are read
    argv = [flag + value] if flag.endswith("=") else [flag, value]
    with pytest.raises(SystemExit) as done:
        cli.main(["compare", *argv, "--print_config"])
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    if "config" in flag and "task" not in flag:
        assert printed["experiment"] == "recall-64-causal" and printed["fit_args"] == ["--model.causal", "true"]
    else:
        assert printed["task_config"].endswith("recall.yaml")


def test_a_config_that_names_nothing_is_one_line_with_the_closest_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["compare", "--task-config", "recal"]) == 2
    err = capsys.readouterr().err
    assert err == "zoo compare: error: --task-config recal: 'recal' is neither a file here nor a packaged config; " \
                  "did you mean 'recall'?\n"  # fmt: skip
