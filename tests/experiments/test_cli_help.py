"""Every command's help is its own, in plain text, with examples; a usage error is one line with the closest flag;
underscore spellings of dashed flags are read with a note; output that is not a terminal is as wide as COLUMNS."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from experiments import cli

#: reStructuredText that must not reach a help text
RST = re.compile(r"``|:(data|mod|func|class|meth|attr):`")


def help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(("columns", "width"), [("72", 72), ("200", 200), (None, 160), ("wide", 160), ("0", 160)])
def test_output_that_is_not_a_terminal_is_as_wide_as_columns(columns, width, monkeypatch):
    from experiments.console import console

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    out = console()
    assert not out.is_terminal and out.width == width


@pytest.mark.parametrize(
    "argv", [["list"], ["demo"], ["bench"], ["targets"], ["study", "spectrum"], ["study", "approx"], ["study", "mlm"]]
)
def test_each_help_is_its_own_plain_text_with_examples(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    text = help_of(argv, capsys)
    prog = "zoo " + " ".join(argv)
    assert text.startswith(f"usage: {prog} ")
    assert not RST.search(text), RST.search(text)
    examples = [line.strip() for line in text.splitlines() if line.startswith("  zoo ")]
    assert examples and all(line.startswith(prog + " ") or line == prog for line in examples), examples
    assert max(map(len, text.splitlines())) <= 100 or any(len(e) > 96 for e in examples)  # wrapped, examples kept


def test_targets_help_lists_only_what_a_target_honours(capsys):
    text = help_of(["targets"], capsys)
    options = text.split("\noptions:\n", 1)[1]
    for flag in ("--attentions", "--threads", "--repeats", "--rounds", "--out", "--paired-rounds"):
        assert flag in options
    for flag in ("--seq-lens", "--levels", "--segments", "--check-targets", "--config"):
        assert flag not in options
    assert "zoo bench [" not in text


def test_demo_help_describes_every_option(capsys):
    text = help_of(["demo"], capsys)
    for flag in ("--seq-len SEQ_LEN", "--heads HEADS", "--dim-head DIM_HEAD", "--repeats REPEATS"):
        line = next(line for line in text.splitlines() if line.lstrip().startswith(flag))
        assert line.split(flag, 1)[1].strip(), f"{flag} has no description"


def test_zoo_help_aligns_every_command_and_shows_examples(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("  ") and not line.startswith("  zoo ")]
    starts = {len(line) - len(line[2:].split(" ", 1)[1].lstrip()) for line in rows}
    assert len(rows) == len(cli.COMMANDS) and len(starts) == 1  # one column, copy-baseline included
    assert "\nexamples:\n  zoo list\n" in text


def test_a_misspelt_bench_flag_is_one_line_with_the_closest_flag(capsys):
    from experiments.bench import command

    with pytest.raises(SystemExit) as done:
        command.main(["--attentionz", "full", "--out", "unused"])
    assert done.value.code == 2
    assert capsys.readouterr().err == (
        "zoo bench: error: unrecognized argument --attentionz (did you mean '--attentions'?)\n"
    )
    with pytest.raises(SystemExit):
        command.targets_main(["--repeat-count", "3"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zoo targets: error: unrecognized argument --repeat-count")
    with pytest.raises(SystemExit):
        command.main(["--seq-lens", "x"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seq-lens" in err and "'x'" in err


def test_a_misspelt_study_flag_is_one_line_with_the_closest_flag(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["study", "spectrum", "--control-sed", "1"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err == "zoo study spectrum: error: unrecognized argument --control-sed (did you mean '--control-seed'?)\n"
    with pytest.raises(SystemExit):
        cli.main(["study", "approx", "--samples", "many"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zoo study approx: error: --samples:") and "int" in err


def test_dashed_flags_and_the_old_underscore_spellings_with_a_note(capsys):
    from experiments.studies import approx, mlm, spectrum

    assert spectrum.build_parser().parse_args(["--control-seed", "4"]).control_seed == 4
    assert capsys.readouterr().err == ""
    assert spectrum.build_parser().parse_args(["--control_seed", "3"]).control_seed == 3
    assert capsys.readouterr().err == (
        "zoo study spectrum: note: --control_seed read as --control-seed (flags are spelled with dashes; the "
        "underscore spelling is accepted in this release)\n"
    )
    args = approx.build_parser().parse_args(["--dim_head=8", "--run-seed", "2"])
    assert (args.dim_head, args.run_seed) == (8, 2)
    assert capsys.readouterr().err.count("note: --dim_head read as --dim-head") == 1
    assert mlm.build_parser().parse_args(["--runs-dir", "r"]).runs_dir == "r"


def test_zoo_fit_help_is_its_own(capsys):
    from tasks import cli as fit_cli

    with pytest.raises(SystemExit):
        fit_cli.run("fit", ["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: zoo fit [")
    assert "  zoo fit -c recall --model.attention nystrom\n" in text
    description = text[: text.index("\noptions:\n")]
    assert "zoo fit: train a task" in description and "Runs the full optimization routine" not in description
    assert "The main advantage is" not in text and "Base of every task" not in text  # cut docstring lines
    assert not RST.search(text)


@pytest.mark.parametrize("argv", [["list"], ["demo"], ["study"]])
def test_help_imports_neither_torch_nor_lightning(argv):
    """The cost of --help is its imports: these commands' help must not load torch (seconds)."""
    code = (
        "import sys\nfrom experiments import cli\n"
        f"try:\n    cli.main({[*argv, '--help']!r})\nexcept SystemExit:\n    pass\n"
        "print('loaded:', sorted(m for m in ('torch', 'lightning', 'attention_zoo') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("loaded: []"), result.stdout[-300:]
