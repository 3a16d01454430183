"""Source and target lengths of a translation corpus in BPE tokens, per split: how much a Linformer with k
projected keys (or a blockwise decoder) can compress them.

    python -m experiments.studies.translation_lengths -c configs/translation.yaml --k 32 64
    python -m experiments.studies.translation_lengths -c configs/translation.yaml --set messages_per_document=8 \\
        --set split_by=normalised --json lengths.json

Lengths are those the model sees, counted on the tokenised splits of the data module (pairs that
``overlong="drop"`` removed are not counted): a source is its tokens + EOS (n, the encoder's length), a
target its tokens + BOS (the decoder's length). Per split and side: count, mean, median, p90, p99 (nearest
rank: a length that occurs), max, and for each k the share of inputs longer than k (``longer``: those where
k < n, the only ones a rank-k projection compresses) and the compression ratio n / k at the median and at p90
(below 1: no bottleneck for half, or 90 %, of the inputs).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tasks.data.base import SPLITS
from tasks.data.translation import TranslationDataModule


def describe(lengths: Sequence[int], ks: Sequence[int]) -> dict[str, Any]:
    """count, mean, median, p90, p99, max, and per k the share longer than k and n / k at the median and p90."""
    values = sorted(int(n) for n in lengths)
    if not values:
        raise ValueError("no lengths to describe")
    stats: dict[str, Any] = {"count": len(values), "mean": sum(values) / len(values)}
    # nearest rank ("inverted_cdf"): the smallest value with at least a share q of the values at or below it
    quantiles = np.percentile(values, [50, 90, 99], method="inverted_cdf")
    stats |= {name: int(value) for name, value in zip(("median", "p90", "p99"), quantiles, strict=True)}
    stats["max"] = values[-1]
    stats["k"] = {
        str(k): {
            "longer": sum(n > k for n in values) / len(values),
            "ratio_median": stats["median"] / k,
            "ratio_p90": stats["p90"] / k,
        }
        for k in ks
    }
    return stats


def length_distribution(dm: TranslationDataModule, ks: Sequence[int] = (32, 64)) -> dict[str, dict[str, Any]]:
    """``{split: {"source": describe(...), "target": describe(...)}}`` from the module's tokenised splits."""
    if any(k < 1 for k in ks):
        raise ValueError(f"every k must be >= 1; got {list(ks)}")
    result = {}
    for split in SPLITS:
        lengths = dm.load_split(split).lengths().tolist()  # source + EOS, target, source + EOS, ...
        sources, targets = lengths[0::2], [n + 1 for n in lengths[1::2]]
        result[split] = {"source": describe(sources, ks), "target": describe(targets, ks)}
    return result


def markdown(distribution: dict[str, dict[str, Any]]) -> str:
    """One row per split and side: the statistics, then ``longer`` and the median n / k for each k."""
    ks = list(next(iter(distribution.values()))["source"]["k"])
    head = ["split", "side", "count", "median", "p90", "p99", "max"]
    head += [f"> {k}" for k in ks] + [f"median n/{k}" for k in ks]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for split, sides in distribution.items():
        for side, stats in sides.items():
            cells = [split, side, *(str(stats[name]) for name in ("count", "median", "p90", "p99", "max"))]
            cells += [f"{100 * stats['k'][k]['longer']:.1f} %" for k in ks]
            cells += [f"{stats['k'][k]['ratio_median']:.2f}" for k in ks]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def data_module(config: Path | None, overrides: Sequence[str]) -> TranslationDataModule:
    """The data module of a LightningCLI config (its ``data.init_args``), with ``name=value`` overrides (YAML)."""
    options: dict[str, Any] = {}
    if config is not None:
        loaded = yaml.safe_load(config.read_text()) or {}
        options = dict((loaded.get("data") or {}).get("init_args") or {})
    for override in overrides:
        name, sep, value = override.partition("=")
        if not sep or not name:
            raise ValueError(f"--set expects name=value, got {override!r}")
        options[name.strip()] = yaml.safe_load(value)
    return TranslationDataModule(**options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", type=Path, help="a LightningCLI config whose data is translation")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a data option (repeatable)")
    parser.add_argument("--k", type=int, nargs="+", default=[32, 64], help="projected lengths (default 32 64)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    try:
        dm = data_module(args.config, args.set)
        distribution = length_distribution(dm, args.k)
    except (ValueError, TypeError, FileNotFoundError) as error:
        parser.error(str(error))
    print(markdown(distribution), end="")
    if args.json:
        args.json.write_text(json.dumps(distribution, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
