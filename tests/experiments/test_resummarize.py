"""``python -m experiments.compare.resummarize`` rewrites a finished experiment's summaries from its runs.csv by the
current rule, with the settings its compare.yaml recorded and the heading its summary.md had; runs.csv untouched."""

from __future__ import annotations

import csv

from experiments.compare.resummarize import main
from experiments.compare.summary import RUN_COLUMNS, summarize_mechanisms
from tests.experiments.test_stats import rows


def experiment(tmp_path):
    runs = rows({"full": [0.98, 0.97, 0.99], "nystrom": [0.05, 0.30, 0.02], "moba": [0.975, 0.972, 0.985]})
    with open(tmp_path / "runs.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[*RUN_COLUMNS], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(runs)
    (tmp_path / "compare.yaml").write_text("experiment: x\nreference: full\nmargin: 0.05\nmetric: val_acc\n")
    (tmp_path / "summary.md").write_text("# zoo compare: x\n\n- seeds 0..2\n\nMean ± 95% interval over seeds, old\n")
    return runs


def test_the_summaries_are_rewritten_by_the_current_rule_under_the_old_heading(tmp_path):
    runs = experiment(tmp_path)
    before = (tmp_path / "runs.csv").read_bytes()
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "runs.csv").read_bytes() == before
    markdown = (tmp_path / "summary.md").read_text()
    assert markdown.startswith("# zoo compare: x\n\n- seeds 0..2\n\nMean ± 95% interval over seeds, best val_acc")
    assert "δ = 0.05" in markdown and "| on par from δ |" in markdown
    nystrom = next(line for line in markdown.splitlines() if line.startswith("| nystrom |"))
    assert "[-1.000, " in nystrom  # an accuracy difference clipped to what it can take
    expected = {s["mechanism"]: s["verdict"] for s in summarize_mechanisms(runs, "val_acc", margin=0.05)}
    with open(tmp_path / "summary.csv") as file:
        assert {r["mechanism"]: r["verdict"] for r in csv.DictReader(file)} == expected


def test_a_cut_runs_csv_is_refused_in_one_line(tmp_path, capsys):
    experiment(tmp_path)
    text = (tmp_path / "runs.csv").read_text()
    (tmp_path / "runs.csv").write_text(text[: len(text) // 2])
    assert main([str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "runs.csv" in error
