"""``zoo bench --segments N`` (``experiments/bench/packed.py``) on tiny sizes: the flag, its refusals, the documents,
what a run writes, and the agreement check that keeps a wrong packed path from being timed. No timing asserts."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from attention_zoo.full import FullAttention
from experiments.bench import packed
from experiments.bench.cases import Case
from experiments.bench.command import build_parser, main

TINY = ["--seq-lens", "32", "--heads", "2", "--dim-head", "8", "--repeats", "1", "--warmup", "0"]


def rows_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / packed.PACKED_FILE).read_text().splitlines()]


def test_the_flag_parses_as_a_count():
    assert build_parser().parse_args(["--segments", "4"]).segments == 4
    assert build_parser().parse_args([]).segments is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--segments", "four"])


@pytest.mark.parametrize("count", ["0", "33", "-2"])
def test_a_count_outside_one_to_the_row_length_is_refused_in_one_line(tmp_path, capsys, count):
    out = tmp_path / "out"
    assert main(["--segments", count, "--attentions", "full", *TINY, "--seq-lens", "64,32", "--out", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0
    assert f"--segments {count}" in error and "[1, 32]" in error
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--levels", "mha"], "levels must be core"),
        (["--mode", "decode-step"], "decode-step"),
        (["--rounds", "2"], "--rounds: not settings of --segments"),
        (["--check-targets"], "does not go with --check-targets"),
    ],
)
def test_settings_that_do_not_apply_are_refused(tmp_path, capsys, flags, words):
    out = tmp_path / "out"
    assert main(["--segments", "4", "--attentions", "full", *TINY, *flags, "--out", str(out)]) == 2
    assert words in capsys.readouterr().err
    assert not (out / packed.PACKED_FILE).exists()


def test_the_documents_fill_each_row_with_the_count_asked_and_repeat_with_the_seed():
    lengths = packed.document_lengths(50, 3, 7)
    assert len(lengths) == 3
    for row in lengths:
        assert len(row) == 7 and sum(row) == 50 and min(row) >= 1
    assert lengths == packed.document_lengths(50, 3, 7)
    assert len({tuple(row) for row in lengths}) == 3  # each row draws its own cuts
    assert packed.document_lengths(5, 1, 5) == [[1, 1, 1, 1, 1]]


def test_the_padded_arm_holds_the_packed_documents_one_per_row():
    case = Case("full", {}, "core", "fwd", "float32", "cpu", 12, 2, 2, 4, 1, False)
    lengths = [[5, 7], [2, 10]]
    arms = packed.build_arms(case, lengths, shared_qk=False)
    assert arms.padded[0].shape == (4, 2, 10, 4) and arms.mask.sum(1).tolist() == [5, 7, 2, 10]
    assert arms.segments.tolist() == [[0, 5, 12], [0, 2, 12]]
    q, padded_q = arms.packed[0], arms.padded[0]
    assert torch.equal(padded_q[1, :, :7], q[0, :, 5:12]) and torch.equal(padded_q[3, :, :10], q[1, :, 2:12])
    assert torch.equal(padded_q[2, :, 2:], torch.zeros_like(padded_q[2, :, 2:]))
    shared = packed.build_arms(case, lengths, shared_qk=True)
    assert shared.packed[1] is shared.packed[0] and shared.padded[1] is shared.padded[0]


def test_a_tiny_run_writes_both_arms_checked_against_the_documents_alone(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--segments", "4", "--attentions", "full,linear", *TINY, "--out", str(out)]
    assert main(argv) == 0
    rows = rows_of(out)
    assert [(r["attention"], r["status"], r["segments"]) for r in rows] == [("full", "ok", 4), ("linear", "ok", 4)]
    for row in rows:
        assert row["packed_matches_alone"] and row["padded_matches_alone"]
        assert row["packed_max_abs_diff"] <= 1e-4 and row["tolerance"] == 1e-4
        assert [sum(r) for r in row["lengths"]] == [32] and row["longest"] == max(row["lengths"][0])
        assert row["packed_ms_median"] > 0 and row["padded_ms_median"] > 0
        assert row["padded_over_packed"] == pytest.approx(row["padded_ms_median"] / row["packed_ms_median"])
        assert row["packed_tokens_per_s"] == pytest.approx(32 / (row["packed_ms_median"] / 1e3))
    with open(out / "packed.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [r["attention"] for r in table] == ["full", "linear"]
    assert {"packed_ms_median", "padded_ms_median", "padded_over_packed", "padded_tokens_per_s"} <= set(table[0])
    markdown = (out / "packed.md").read_text()
    assert "| full | 32 | 4 |" in markdown and "| linear | 32 | 4 |" in markdown and "yes, yes" in markdown
    capsys.readouterr()
    assert main(argv) == 0  # a rerun resumes: nothing measured again
    assert len(rows_of(out)) == 2


def test_a_packed_path_that_attends_across_documents_is_caught_and_not_timed(tmp_path, monkeypatch, capsys):
    def across_documents(self, q, k, v, *, segments, key_segments, causal):
        return self.attend(q, k, v, mask=None, causal=causal)  # the whole row, boundaries ignored

    monkeypatch.setattr(FullAttention, "attend_segments", across_documents)
    out = tmp_path / "out"
    assert main(["--segments", "4", "--attentions", "full", *TINY, "--out", str(out)]) == 1
    (row,) = rows_of(out)
    assert row["status"] == "wrong" and not row["packed_matches_alone"]
    assert row["padded_matches_alone"]  # the padded arm never calls attend_segments
    assert "packed_ms_median" not in row and "padded_ms_median" not in row
    assert "differs from the document alone" in row["detail"] and row["packed_max_abs_diff"] > 1e-2
    assert "disagrees with the documents alone" in capsys.readouterr().err


def test_a_padded_arm_that_differs_from_the_documents_alone_is_timed_and_flagged(tmp_path, monkeypatch):
    attend = FullAttention.attend
    monkeypatch.setattr(FullAttention, "attend", lambda self, q, k, v, *, mask, causal: attend(
        self, q, k, v, mask=None, causal=causal))  # fmt: skip
    out = tmp_path / "out"
    assert main(["--segments", "4", "--attentions", "full", *TINY, "--out", str(out)]) == 0
    (row,) = rows_of(out)
    assert row["status"] == "ok" and not row["padded_matches_alone"] and row["padded_ms_median"] > 0
    assert "padded differs" in row["detail"]
