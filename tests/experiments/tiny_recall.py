"""The tiny recall comparison the compare tests run (a few seconds per run, most of it start-up)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECALL = str(ROOT / "configs" / "recall.yaml")


def fit_args(max_steps: int = 4) -> list[str]:
    """``zoo fit`` flags of a 1-layer, width-16 model on 64 recall sequences of 32 tokens, validated every 2 steps."""
    data = ["--data.seq_len=32", "--data.num_kv_pairs=4", "--data.vocab_size=32", "--data.train_size=64",
            "--data.val_size=16", "--data.test_size=16", "--data.batch_size=8"]  # fmt: skip
    model = ["--model.dim=16", "--model.depth=1", "--model.warmup_steps=1"]
    trainer = [f"--trainer.max_steps={max_steps}", "--trainer.val_check_interval=2", "--trainer.log_every_n_steps=1"]
    return [*data, *model, *trainer]


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and the rows of a CSV file the commands wrote."""
    with open(path) as file:
        reader = csv.DictReader(file)
        return list(reader.fieldnames or []), list(reader)


def compare_command(cache: Path, cwd: Path, *args: str) -> Callable[..., subprocess.CompletedProcess]:
    """``zoo compare *args *more`` in a fresh process with its own data cache ``cache``, as a function of ``more``."""
    env = os.environ | {"ZOO_CACHE": str(cache)}
    base = [sys.executable, "-m", "experiments.cli", "compare", *args]

    def run(*more: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([*base, *more], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

    return run


def runs_of(result: subprocess.CompletedProcess, experiment: Path) -> list[dict[str, str]]:
    """The rows of ``experiment``'s runs.csv after a ``zoo compare`` that must have succeeded."""
    assert result.returncode == 0, result.stdout + result.stderr
    return read_csv(experiment / "runs.csv")[1]
