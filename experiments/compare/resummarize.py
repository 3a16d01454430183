"""Rewrite the summaries of finished ``zoo compare`` experiments from their ``runs.csv``, without training.

    python -m experiments.compare.resummarize results/compare-default results/compare-variants

For results committed before the verdict rule (:mod:`experiments.stats`) or the summary's columns changed: each
folder's ``summary.csv`` and ``summary.md`` are written again from its ``runs.csv`` (read checked, as ``zoo report``
reads it) with the metric, reference and margin its ``compare.yaml`` recorded, under the heading lines its old
``summary.md`` opened with. ``runs.csv``, the plots and everything else are left as they are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from experiments.compare.report import load_compare
from experiments.compare.summary import write_summary
from experiments.records import read_text

#: the line that opens the verdict paragraph of summary.md; what comes before it is the experiment's heading
VERDICT_OPENING = "Mean ± 95% interval over seeds"


def heading(directory: Path) -> list[str]:
    """The lines ``summary.md`` opened with before its verdict paragraph (the experiment's title and settings)."""
    path = directory / "summary.md"
    if not path.is_file():
        return [f"# zoo compare: {directory.name}"]
    lines = read_text(path, "a zoo compare summary").splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith(VERDICT_OPENING)), len(lines))
    while end and not lines[end - 1].strip():
        end -= 1
    return lines[:end]


def settings(directory: Path) -> dict[str, Any]:
    """metric, reference and margin from the experiment's ``compare.yaml`` (the defaults where it has none)."""
    path = directory / "compare.yaml"
    config = yaml.safe_load(read_text(path, "a zoo compare experiment"))
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a zoo compare config (a mapping of its settings)")
    return {"metric": config.get("metric"), "reference": config.get("reference") or "full",
            "margin": config.get("margin")}  # fmt: skip


def resummarize(directory: Path) -> None:
    rows = load_compare(directory)
    write_summary(directory, rows, heading(directory), **settings(directory))


def main(argv: list[str] | None = None) -> int:
    prog = "python -m experiments.compare.resummarize"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("experiments", nargs="+", type=Path, help="zoo compare experiment folders (with runs.csv)")
    args = parser.parse_args(argv)
    for directory in args.experiments:
        try:
            resummarize(directory)
        except (ValueError, yaml.YAMLError) as error:
            print(f"{parser.prog}: error: {str(error).splitlines()[0]}", file=sys.stderr)
            return 2
        print(f"rewrote {directory / 'summary.csv'} and {directory / 'summary.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
