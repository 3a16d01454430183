"""``experiments.studies.translation_verdicts``: sacreBLEU's paired bootstrap per seed and the verdict rule over
seeds, on fake tested runs (real sacreBLEU on real sentences)."""

from __future__ import annotations

import csv
import json
import math
import random
import statistics
from pathlib import Path

import pytest
import sacrebleu

from experiments.studies import translation_verdicts
from tasks.translation import TEST_TRANSLATIONS

REFERENCES = [
    "Die Datei konnte nicht geöffnet werden.",
    "Verzeichnis %s kann nicht gelesen werden.",
    "Unbekannte Option in der Befehlszeile.",
    "Der Speicher ist erschöpft.",
    "Zu viele Argumente für den Befehl.",
    "Die Verbindung wurde vom Server getrennt.",
] * 8


def write_run(experiment: Path, seed: int, outputs: list[str], attention: str, references: list[str]) -> None:
    run_dir = experiment / attention / f"seed-{seed}"
    run_dir.mkdir(parents=True)
    record = {"attention": attention, "attention_options": {"k": 32} if attention != "full" else {}}
    (run_dir / "run.json").write_text(json.dumps(record | {"status": "finished"}))
    rows = [
        {"index": i, "source": "-", "reference": r, "translation": o}
        for i, (o, r) in enumerate(zip(outputs, references, strict=True))
    ]
    random.Random(seed).shuffle(rows)  # the file's order is not the test order
    (run_dir / TEST_TRANSLATIONS).write_text("".join(json.dumps(row) + "\n" for row in rows))


def damaged(sentence: str, rng: random.Random, drop: float) -> str:
    words = sentence.split()
    return " ".join(w for w in words if rng.random() > drop) or words[0]


def test_identical_arm_is_on_par_and_a_damaged_arm_is_worse(tmp_path):
    """Five seeds: an identical arm's Δ is 0 on every seed, which the sign-flip test calls on par from 5 seeds."""
    reference, same, worse = tmp_path / "ref", tmp_path / "same", tmp_path / "worse"
    for seed in range(5):
        rng = random.Random(seed)
        outputs = [damaged(r, rng, 0.1) for r in REFERENCES]
        write_run(reference, seed, outputs, "full", REFERENCES)
        write_run(same, seed, outputs, "linformer", REFERENCES)
        write_run(worse, seed, [damaged(o, rng, 0.5) for o in outputs], "linformer", REFERENCES)
    out = tmp_path / "out"
    assert translation_verdicts.main(["--reference", str(reference), "--arms", str(same), str(worse)]
                                     + ["--out", str(out), "--samples", "200"]) == 0  # fmt: skip
    rows = {(r["arm"].split("(")[1].rstrip(")"), r["seed"]): r for r in csv_rows(out / "verdicts.csv")}
    assert rows[("same", "all")]["verdict"] == "on par" and float(rows[("same", "all")]["difference"]) == 0
    assert rows[("worse", "all")]["verdict"] == "worse"
    for seed in range(3):
        row = rows[("worse", str(seed))]
        outputs = [json.loads(line) for line in (worse / "linformer" / f"seed-{seed}" / TEST_TRANSLATIONS).open()]
        outputs.sort(key=lambda r: r["index"])
        expected = sacrebleu.corpus_bleu([r["translation"] for r in outputs], [REFERENCES]).score
        assert float(row["arm_bleu"]) == pytest.approx(expected)  # test-index order restored before scoring
        assert float(row["p_value"]) < 0.05 and int(row["segments"]) == len(REFERENCES)
    assert "worse" in (out / "verdicts.md").read_text()


def test_runs_that_translated_different_test_sets_are_refused(tmp_path, capsys):
    reference, arm = tmp_path / "ref", tmp_path / "arm"
    write_run(reference, 0, REFERENCES, "full", REFERENCES)
    write_run(arm, 0, REFERENCES, "linformer", list(reversed(REFERENCES)))
    with pytest.raises(SystemExit):
        translation_verdicts.main(["--reference", str(reference), "--arms", str(arm), "--out", str(tmp_path / "o")])
    assert "different test sets" in capsys.readouterr().err


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_the_verdict_row_gives_the_smallest_on_par_margin(tmp_path):
    reference, arm = tmp_path / "ref", tmp_path / "arm"
    for seed in range(3):
        rng = random.Random(seed)
        outputs = [damaged(r, rng, 0.1) for r in REFERENCES]
        write_run(reference, seed, outputs, "full", REFERENCES)
        write_run(arm, seed, [damaged(o, rng, 0.3) for o in outputs], "linformer", REFERENCES)
    out = tmp_path / "out"
    assert translation_verdicts.main(["--reference", str(reference), "--arms", str(arm), "--out", str(out),
                                      "--samples", "50"]) == 0  # fmt: skip
    row = next(r for r in csv_rows(out / "verdicts.csv") if r["seed"] == "all")
    per_seed = [float(r["difference"]) for r in csv_rows(out / "verdicts.csv") if r["seed"] != "all"]
    mean = sum(per_seed) / 3
    half90 = 2.919986 * statistics.stdev(per_seed) / math.sqrt(3)  # t_{0.95, 2}
    assert float(row["on_par_margin"]) == pytest.approx(abs(mean) + half90, rel=1e-5)
    assert "| on par from δ |" in (out / "verdicts.md").read_text()
