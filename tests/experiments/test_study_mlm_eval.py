"""``zoo study mlm`` judges tested experiments by test/ppl on their one evaluation text, old ones by val/ppl
(labelled old init), and sets each variant beside the unigram baseline of that text; a tiny fake runs folder."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import yaml

from experiments import cli
from experiments.studies.common import read_csv
from tasks.data.mlm import MaskedLMDataModule

N = 32
DATA = {"max_bytes": 20_000, "max_seq_len": N, "eval_tokens": 600, "batch_size": 4}
# (label, seed): (final val/ppl, final test/ppl or None when fitted but not tested); on val the two models
# are equal (on par), on test linformer is worse on every seed
NEW = {("full", 0): (5.0, 5.0), ("full", 1): (5.2, 5.2), ("full", 2): (5.1, 5.1),
       ("linformer", 0): (5.0, 6.0), ("linformer", 1): (5.2, 6.3), ("linformer", 2): (5.1, None)}  # fmt: skip
OLD = {("full", 0): (7.0, None), ("full", 1): (7.2, None), ("linformer", 0): (7.5, None),
       ("linformer", 1): (7.8, None)}  # fmt: skip


def write_experiment(configs: Path, runs_dir: Path, name: str, finals: dict, *, test: bool) -> None:
    seeds = 1 + max(seed for _, seed in finals)
    config = {"experiment": name, "seed": 0, "seeds": seeds, "attentions": "full,linformer:k=8",
              "fit_args": [f"--data.max_seq_len={N}"]} | ({"test": True} if test else {})  # fmt: skip
    (configs / f"{name}.yaml").write_text(yaml.safe_dump(config))
    for (label, seed), (val, tested) in finals.items():
        directory = runs_dir / name / label / f"seed-{seed}"
        directory.mkdir(parents=True)
        metrics = {"val/ppl": val} | ({} if tested is None else {"test/ppl": tested})
        record = {"status": "finished", "step": 20, "max_steps": 20, "metrics": metrics}
        (directory / "run.json").write_text(json.dumps(record))
        if test:  # as zoo fit and zoo test leave it: the resolved data section and trainer limits
            data = {"class_path": "tasks.data.mlm.MaskedLMDataModule", "init_args": DATA}
            (directory / "config.yaml").write_text(yaml.safe_dump({"data": data, "trainer": {"limit_val_batches": 2}}))


def unigram_of_test_text() -> tuple[float, int]:
    """exp of the entropy of the masked labels' own frequencies over the whole test split, counted here."""
    data = MaskedLMDataModule(**DATA)
    data.setup("test")
    labels = [label for batch in data.test_dataloader() for label in batch["labels"].flatten().tolist()]
    counts = Counter(label for label in labels if label != -100)
    total = sum(counts.values())
    return math.exp(-sum(c / total * math.log(c / total) for c in counts.values())), total


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    """The study's output folder for a new (tested) and an old experiment; one data cache of its own."""
    root = tmp_path_factory.mktemp("study")
    configs, runs_dir, out = root / "configs", root / "runs", root / "mlm"
    configs.mkdir()
    write_experiment(configs, runs_dir, "new", NEW, test=True)
    write_experiment(configs, runs_dir, "old", OLD, test=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZOO_CACHE", str(root / "cache"))
        argv = ["study", "mlm", "--configs", str(configs), "--runs_dir", str(runs_dir), "--out", str(out)]
        assert cli.main(argv) == 0
        yield out


def test_tested_experiments_are_judged_by_test_ppl_and_old_ones_by_val(study):
    table = {(r["evaluation"], r["attention"]): r for r in read_csv(study / "table.csv")}
    assert set(table) == {("test", "full"), ("test", "linformer"), ("val (old init)", "full"),
                          ("val (old init)", "linformer")}  # fmt: skip
    new = table[("test", "linformer")]
    assert new["seeds"] == "0 1" and float(new["mean"]) == pytest.approx(6.15)  # seed 2 is not tested yet
    assert float(new["delta"]) == pytest.approx(1.05) and new["verdict"] == "worse"  # on val it would be on par
    assert float(table[("test", "full")]["mean"]) == pytest.approx(5.1)
    old = table[("val (old init)", "linformer")]
    assert float(old["mean"]) == pytest.approx(7.65) and float(old["delta"]) == pytest.approx(0.55)
    assert old["unigram_ppl"] == "" and old["gap_nats"] == ""  # the old runs saved no config to rebuild it from
    markdown = (study / "table.md").read_text()
    assert "new/linformer/seed-2: fitted, not tested" in markdown
    assert "| 512 |" not in markdown and "| val (old init) |" in markdown


def test_the_unigram_baseline_is_that_of_the_test_text_and_gaps_are_in_nats(study):
    unigram, masked = unigram_of_test_text()
    (text,) = read_csv(study / "eval_text.csv")
    assert (text["experiment"], text["split"], text["tokens"]) == ("new", "test", "600")
    assert int(text["masked_tokens"]) == masked and float(text["unigram_ppl"]) == pytest.approx(unigram, rel=1e-5)
    table = {(r["evaluation"], r["attention"]): r for r in read_csv(study / "table.csv")}
    linformer = table[("test", "linformer")]
    assert float(linformer["unigram_ppl"]) == pytest.approx(unigram, rel=1e-4)
    expected_gap = math.log(unigram) - (math.log(6.0) + math.log(6.3)) / 2
    assert float(linformer["gap_nats"]) == pytest.approx(expected_gap, abs=1e-4)


def test_replot_rewrites_the_same_table_from_the_csvs_and_reads_an_old_runs_csv(study, tmp_path):
    study = Path(shutil.copytree(study, tmp_path / "mlm"))
    before = (study / "table.csv").read_text()
    (study / "table.csv").unlink()
    assert cli.main(["study", "mlm", "--replot", str(study)]) == 0
    assert (study / "table.csv").read_text() == before
    # a runs.csv written before test evaluation existed: no evaluation or test columns, no eval_text.csv
    old_columns = ["experiment", "n", "attention", "k", "sharing", "label", "seed", "status", "step", "max_steps",
                   "final_val_ppl", "run_dir"]  # fmt: skip
    rows = [r for r in read_csv(study / "runs.csv") if r["experiment"] == "old"]
    lines = [",".join(old_columns)] + [",".join(r[c] for c in old_columns) for r in rows]
    (study / "runs.csv").write_text("\n".join(lines) + "\n")
    (study / "eval_text.csv").unlink()
    assert cli.main(["study", "mlm", "--replot", str(study)]) == 0
    table = read_csv(study / "table.csv")
    assert {r["evaluation"] for r in table} == {"val (old init)"}
    assert float(next(r for r in table if r["attention"] == "linformer")["delta"]) == pytest.approx(0.55)


@pytest.mark.parametrize("scale", ["full", "small"])
def test_the_committed_configs_are_new_experiments_tested_on_enough_masked_tokens(scale):
    from experiments.studies.mlm import CONFIGS, expected_runs

    folder = CONFIGS if scale == "full" else CONFIGS / "small"
    runs = expected_runs(folder, Path("runs"))
    assert {r.evaluation for r in runs} == {"test"} and all(r.experiment.startswith("mlm2-") for r in runs)
    for path in folder.glob("*.yaml"):
        (eval_tokens,) = [a.split("=")[1] for a in yaml.safe_load(path.read_text())["fit_args"] if "eval_tokens" in a]
        assert int(eval_tokens) * 0.15 >= 50_000, path  # mask_prob 0.15 of configs/mlm.yaml


def test_a_partial_study_gives_no_spread_from_one_seed_and_no_verdict_without_runs(tmp_path, monkeypatch):
    configs, runs_dir, out = tmp_path / "configs", tmp_path / "runs", tmp_path / "mlm"
    configs.mkdir()
    write_experiment(configs, runs_dir, "partial", {("full", 0): (5.0, 5.0), ("full", 1): (5.0, None)}, test=True)
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    assert cli.main(["study", "mlm", "--configs", str(configs), "--runs_dir", str(runs_dir), "--out", str(out)]) == 0
    table = {r["attention"]: r for r in read_csv(out / "table.csv")}
    assert table["full"]["seeds"] == "0" and table["linformer"]["seeds_finished"] == "0"
    assert table["linformer"]["verdict"] == "-"  # nothing to judge: not "inconclusive"
    rows = [line for line in (out / "table.md").read_text().splitlines() if line.startswith("| 32 |")]
    assert "| 5.000 |" in rows[0] and "±" not in rows[0]


def test_the_table_gives_the_smallest_on_par_margin_and_the_gap_to_the_no_attention_control():
    from experiments.studies.mlm import table_rows

    finals = {"full": (16.0, 16.5, 16.2), "linformer": (16.4, 16.7, 16.9), "self_only": (19.0, 19.6, 19.3)}
    runs = [
        {"experiment": "e", "n": 512, "attention": name, "k": "", "sharing": "", "label": name, "seed": seed,
         "status": "finished", "evaluation": "test", "final_val_ppl": "", "final_test_ppl": str(ppl)}
        for name, values in finals.items() for seed, ppl in enumerate(values)
    ]  # fmt: skip
    table = {row["attention"]: row for row in table_rows(runs)}
    deltas = [a - b for a, b in zip(finals["linformer"], finals["full"], strict=True)]
    mean = sum(deltas) / 3
    half90 = 2.919986 * math.sqrt(sum((d - mean) ** 2 for d in deltas) / 2) / math.sqrt(3)  # t_{0.95, 2}
    linformer = table["linformer"]
    assert float(linformer["on_par_margin"]) == pytest.approx(abs(mean) + half90, abs=1e-4)
    control_delta = sum(finals["self_only"]) / 3 - sum(finals["full"]) / 3
    assert float(linformer["gap_fraction"]) == pytest.approx(mean / control_delta, abs=1e-4)
    assert float(table["self_only"]["gap_fraction"]) == pytest.approx(1.0) and table["full"]["gap_fraction"] == ""
