"""``experiments.compare.archive``: a real tiny ``zoo compare`` experiment archived without its checkpoints,
lost, restored into a fresh runs folder and resumed: the restored run is skipped, the missing one runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from experiments.compare import archive

ROOT = Path(__file__).resolve().parents[2]


def compare(config: Path, seeds: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "experiments.cli", "compare", "--config", str(config), "--seeds", str(seeds)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_archive_then_restore_resumes_the_experiment_with_only_the_missing_runs(tmp_path):
    runs = tmp_path / "runs"
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "experiment": "tiny",
                "task_config": str(ROOT / "configs" / "recall.yaml"),
                "runs_dir": str(runs),
                "attentions": "full",
                "fit_args": [
                    "--data.seq_len=32", "--data.num_kv_pairs=4", "--data.vocab_size=32", "--data.train_size=64",
                    "--data.val_size=16", "--data.test_size=16", "--data.batch_size=8", "--model.dim=16",
                    "--model.depth=1", "--trainer.max_steps=2", "--trainer.val_check_interval=2",
                ],
            }
        )
    )  # fmt: skip
    env = os.environ | {"ZOO_CACHE": str(tmp_path / "cache")}
    first = compare(config, 1, env)
    assert first.returncode == 0, first.stdout + first.stderr
    experiment = runs / "tiny"
    (experiment / "full" / "seed-1").mkdir()  # an unfinished run: no record, not archived
    store = tmp_path / "results" / "runs"

    assert archive.main([str(experiment), str(store)]) == 0
    kept = store / "tiny" / "full" / "seed-0"
    assert (store / "tiny" / "compare.yaml").is_file() and not (store / "tiny" / "full" / "seed-1").exists()
    assert (experiment / "full" / "seed-0" / "checkpoints").is_dir() and not (kept / "checkpoints").exists()
    record = json.loads((kept / "run.json").read_text())
    assert record["status"] == "finished" and any(kept.glob("events.out.tfevents.*"))
    assert archive.finished_runs(store / "tiny", tested=True) == []  # never evaluated by zoo test

    shutil.rmtree(runs)  # the sitting ends: the runs folder is gone
    assert archive.main(["--restore", str(store / "tiny"), str(runs)]) == 0
    assert archive.restore(store / "tiny", runs) == []  # a finished run already there is kept as it is
    second = compare(config, 2, env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "1 finished earlier" in second.stdout
    assert json.loads((experiment / "full" / "seed-0" / "run.json").read_text()) == record  # not run again
    assert json.loads((experiment / "full" / "seed-1" / "run.json").read_text())["status"] == "finished"


def test_a_folder_that_is_not_an_experiment_is_refused(tmp_path, capsys):
    assert archive.main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a zoo compare experiment" in capsys.readouterr().err
    assert archive.main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
