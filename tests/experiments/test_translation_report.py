"""The translation report reads a compare experiment's runs into the seed report's table (with the copy
baseline row) and curves, and redraws the figure from its CSV."""

from __future__ import annotations

import csv
import json

import pytest
from torch.utils.tensorboard import SummaryWriter

from experiments.studies import translation_report


def fake_run(root, label, attention, options, bleu):
    run_dir = root / label / "seed-0"
    writer = SummaryWriter(str(run_dir))
    for step in (0, 250, 500):
        writer.add_scalar("val/bleu", bleu * step / 500, step)
        writer.add_scalar("val/ppl", 100 / (1 + step), step)
        writer.add_scalar("train/loss", 5 - step / 200, step)
    writer.close()
    metrics = {"val/ppl": 3.5, "val/bleu": bleu, "test/bleu": bleu + 1, "test/chrf": 50.0}
    metrics |= {f"test/{s}_{c}_sentences_per_s": 10.0 * (2 if c == "cached" else 1) for s in ("greedy", "beam")
                for c in ("cached", "recomputed")}  # fmt: skip
    record = {
        "status": "finished", "attention": attention, "attention_options": options, "metrics": metrics,
        "tokens_per_s": 1234.0, "fit_seconds": 600.0,
        "decoder_attention": {"attention": {"linformer": "linformer_causal"}.get(attention, attention), "options": {}},
        "corpus": {"source": "gettext", "catalogs": 94, "pairs": {"train": 10}, "content_hash": "ab" * 32},
        "copy_baseline": {"val_bleu_subset": {"bleu": 14.0}, "test": {"bleu": 15.3, "chrf": 25.3}},
    }  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps(record))


def test_report_table_curves_and_replot(tmp_path):
    experiment = tmp_path / "translation"
    fake_run(experiment, "full", "full", {}, 20.0)
    fake_run(experiment, "linformer-k=32", "linformer", {"k": 32}, 18.0)
    out = tmp_path / "out"
    assert translation_report.main([str(experiment), "--out", str(out)]) == 0
    table = (out / "results.md").read_text()
    assert "| full; decoder full | 0 | 3.50 | 20.0 | 21.0 | 50.0 | 1,234 | 10.00 | 20.0 | 10.0 | 20.0 | 10.0 |" in table
    assert "linformer k=32; decoder linformer_causal" in table
    assert "| copy the source (no model) | - | - | 14.0 | 15.3 | 25.3 |" in table
    with open(out / "curves.csv") as file:
        points = list(csv.DictReader(file))
    assert len(points) == 2 * 3 * 3 and {p["tag"] for p in points} == set(translation_report.CURVE_TAGS)
    (out / "curves.png").unlink()
    assert translation_report.main(["--replot", "--out", str(out)]) == 0
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_report_joins_experiments_and_refuses_one_given_twice(tmp_path, capsys):
    fake_run(tmp_path / "tr-full", "full", "full", {}, 20.0)
    fake_run(tmp_path / "tr-k32", "linformer-k=32", "linformer", {"k": 32}, 18.0)
    out = tmp_path / "out"
    assert translation_report.main([str(tmp_path / "tr-full"), str(tmp_path / "tr-k32"), "--out", str(out)]) == 0
    table = (out / "results.md").read_text()
    assert "tr-full, tr-k32" in table and "linformer k=32; decoder linformer_causal" in table
    assert table.count("copy the source") == 1
    fake_run(tmp_path / "tr-k64", "linformer", "linformer", {"k": 64}, 19.0)  # one mechanism: label = its name
    fake_run(tmp_path / "tr-k128", "linformer", "linformer", {"k": 128}, 19.5)
    assert translation_report.main([str(tmp_path / "tr-k64"), str(tmp_path / "tr-k128"), "--out", str(out)]) == 0
    with open(out / "results.csv") as file:
        assert [row["label"] for row in csv.DictReader(file)] == [
            "tr-k64/linformer/seed-0", "tr-k128/linformer/seed-0", "copy"
        ]  # fmt: skip
    with pytest.raises(SystemExit):
        translation_report.main([str(tmp_path / "tr-k64"), str(tmp_path / "tr-k64"), "--out", str(out)])
    assert "runs tr-k64/linformer/seed-0 are given more than once" in capsys.readouterr().err
