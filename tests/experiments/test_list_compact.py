"""``zoo list``: one line per mechanism by default, within the width COLUMNS gives; ``--long`` for every
capability; help in plain text."""

from __future__ import annotations

import re

import pytest

import attention_zoo as az
from experiments import cli


def expected_cells(name: str) -> tuple[str, str, str, str, str]:
    """The compact row's name, approximation, causal, packed and decoding, from the class's declarations."""
    cls = az.get_attention_class(name)
    if cls.has_decoding_cache:
        decoding = "cache"
    elif cls.supports_causal:
        decoding = "recompute"
    else:
        decoding = f"via {cls.causal_counterpart}" if cls.causal_counterpart else "-"
    yes_no = {True: "yes", False: "no"}
    causal = "only" if cls.causal_only else yes_no[cls.supports_causal]
    return name, cls.approximation, causal, yes_no[cls.supports_segments], decoding


def listed(capsys, monkeypatch, columns: int, *argv: str) -> list[str]:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.main(["list", *argv]) == 0
    return capsys.readouterr().out.rstrip("\n").splitlines()


def test_the_default_is_one_line_per_mechanism_with_every_column_at_full_width(capsys, monkeypatch):
    lines = listed(capsys, monkeypatch, 400)
    header, rows = re.split(r"\s{2,}", lines[0].strip()), lines[1:]
    assert header == ["name", "approximation", "causal", "packed", "decoding", "options"]
    assert len(rows) == len(az.list_attentions())
    for name, line in zip(az.list_attentions(), rows, strict=True):
        cells = re.split(r"\s{2,}", line.strip())
        options = ", ".join(spec.name for spec in az.attention_options(az.get_attention_class(name))) or "-"
        assert tuple(cells) == (*expected_cells(name), options), line


@pytest.mark.parametrize("columns", [80, 100])
def test_at_80_columns_every_line_fits_and_name_causal_packed_are_whole(columns, capsys, monkeypatch):
    lines = listed(capsys, monkeypatch, columns)
    assert len(lines) == 1 + len(az.list_attentions())
    assert max(len(line.rstrip()) for line in lines) <= columns
    for name, line in zip(az.list_attentions(), lines[1:], strict=True):
        cells = re.split(r"\s{2,}", line.strip())
        name_, approximation, causal, packed, decoding = expected_cells(name)
        assert cells[0] == name_ and cells[2:4] == [causal, packed], line
        # a cut cell keeps its start and ends in an ellipsis
        for shown, whole in ((cells[1], approximation), (cells[4], decoding)):
            assert shown == whole or (shown.endswith("…") and whole.startswith(shown[:-1])), (shown, whole)


def test_long_is_the_full_table(capsys, monkeypatch):
    text = "\n".join(listed(capsys, monkeypatch, 200, "--long"))
    for word in ("grad²", "needs max_seq_len", "list[int]", "notes", "shared qk"):
        assert word in text
    assert all(re.search(rf"│ {name}\s+│", text) for name in az.list_attentions())


def test_list_help_is_plain_text_with_examples(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["list", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and not re.search(r":(data|mod|func|class):", text)
    assert "--long" in text and "\nexamples:\n  zoo list\n  zoo list --long" in text
