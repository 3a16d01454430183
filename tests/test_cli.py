from __future__ import annotations

import subprocess
import sys

from experiments import cli, listing


def test_zoo_list_shows_every_mechanism_with_options(capsys):
    assert cli.main(["list"]) == 0
    text = capsys.readouterr().out
    assert "full" in text and "backend" in text
    assert "k: int | list[int]" in text  # option types are shown verbatim, not eaten as rich markup
    assert {row["name"] for row in listing.rows()} == set(__import__("attention_zoo").list_attentions())


def test_unknown_command_is_an_error(capsys):
    assert cli.main(["lsit"]) == 2
    assert "unknown command 'lsit'" in capsys.readouterr().err


def test_demo_runs_every_mechanism(capsys):
    assert cli.main(["demo", "--seq-len", "64", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "full" in text and "skipped" not in text


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "experiments.cli", "list"], capture_output=True, text=True)
    assert result.returncode == 0 and "full" in result.stdout
