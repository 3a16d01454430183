"""Test perplexity of each MLM run on the test chunks that hold a file boundary, read with and without the
boundaries (``segments``): the only chunks on which ``pack`` changes what a model computes (inside one file the
packed and plain encoder outputs are equal, tests/tasks/test_mlm_packing.py).

    python results/mlm-packing/boundary_chunks.py runs/mlm-packing --out results/mlm-packing/boundary_chunks.csv
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from experiments.studies.common import load_run
from tasks.data.base import IGNORE_INDEX
from tasks.data.mlm import MaskedLMDataModule


def boundary_batches(config: Path, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """The run's test chunks that hold more than one document, with their segments, in batches."""
    options = yaml.safe_load(config.read_text())["data"]["init_args"] | {"pack": True}
    data = MaskedLMDataModule(**options)
    dataset = data.make_dataset("test", data.load_split("test"))
    chosen = [item for item in (dataset[index] for index in range(len(dataset))) if len(item[2]) > 2]
    collate = data.collate()
    return [collate(chosen[i : i + batch_size]) for i in range(0, len(chosen), batch_size)]


def perplexities(checkpoint: Path, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """exp(mean cross-entropy over the masked tokens), the batches read packed and plain."""
    task = load_run(checkpoint).task
    totals = {"packed": 0.0, "plain": 0.0}
    count = 0
    with torch.no_grad():
        for batch in batches:
            scored = batch["labels"] != IGNORE_INDEX
            count += int(scored.sum())
            for reading, segments in (("packed", (batch["segments"],)), ("plain", ())):
                logits = task(batch["tokens"], batch["mask"], *segments)
                totals[reading] += float(F.cross_entropy(logits[scored], batch["labels"][scored], reduction="sum"))
    return {"masked_tokens": count} | {f"ppl_{k}": math.exp(v / count) for k, v in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs_dir", type=Path, help="holds <experiment>/full/seed-<s>/checkpoints/last.ckpt")
    parser.add_argument("--out", type=Path, default=None, help="a CSV of the rows printed")
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args()
    rows, batches = [], None
    for checkpoint in sorted(args.runs_dir.glob("*/full/seed-*/checkpoints/last.ckpt")):
        run = checkpoint.parent.parent
        batches = batches or boundary_batches(run / "config.yaml", args.batch_size)  # one test text for every run
        row = {"experiment": run.parent.parent.name, "seed": run.name.removeprefix("seed-")}
        rows.append(row | perplexities(checkpoint, batches))
        print(rows[-1], flush=True)
    if args.out is not None:
        with args.out.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
