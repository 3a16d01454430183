"""Translation quality with sacreBLEU, and the "copy the source" baseline every model must beat.

BLEU (Papineni et al. 2002) as sacreBLEU computes it (Post 2018, arXiv:1804.08771): corpus-level, on
detokenised text, its ``13a`` tokenisation (the WMT standard, mixed case), exponential smoothing; chrF
(Popovic 2015) with sacreBLEU's defaults (character 6-grams, beta 2). Hypotheses are the data module's
detokenised outputs, references its raw target texts, so the scores are comparable to published ones.

The copy baseline scores the sources themselves as translations. On software messages (the ``gettext``
corpus) it is far from zero: names, placeholders (``%s``), options and numbers pass through
translation unchanged. ``zoo copy-baseline -c configs/translation.yaml --split test`` prints it for the
config's data; :class:`tasks.translation.TranslationTask` records it with every run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningDataModule
from sacrebleu.metrics import BLEU, CHRF

Split = Literal["train", "val", "test"]


class ParallelTexts(Protocol):
    def texts(self, split: str) -> tuple[list[str], list[str]]: ...


def corpus_scores(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """``{"bleu", "chrf", "bleu_signature", "chrf_signature", "sentences"}`` of detokenised hypotheses against
    one reference each; an empty corpus scores 0."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu, chrf = BLEU(tokenize="13a"), CHRF()
    empty = not hypotheses
    return {
        "bleu": 0.0 if empty else bleu.corpus_score(hypotheses, [references]).score,
        "chrf": 0.0 if empty else chrf.corpus_score(hypotheses, [references]).score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "sentences": len(hypotheses),
    }


def copy_baseline(data: ParallelTexts, split: Split, limit: int | None = None) -> dict[str, Any]:
    """BLEU and chrF of the sources of ``split`` (its first ``limit`` pairs, if given) as translations."""
    sources, references = data.texts(split)
    return corpus_scores(sources[:limit], references[:limit])


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="zoo copy-baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", type=str, required=True, help="a zoo fit config: its data section is used")
    parser.add_subclass_arguments(LightningDataModule, "data", required=True)
    parser.add_argument("--split", type=Split, default="test", help="the split to score")
    parser.add_argument("--limit", type=int | None, default=None, help="only the first N pairs of the split")
    return parser


def main(argv: list[str]) -> int:
    """``zoo copy-baseline -c CONFIG [--data.* overrides] [--split test]``: the baseline's scores as JSON."""
    parser = build_parser()
    config = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-c", "--config")), None)
    if config is not None:  # only the data section of a zoo fit config applies here
        data = (yaml.safe_load(Path(config).read_text()) or {}).get("data")
        if data is not None:
            parser.set_defaults(data=data)
    args = parser.parse_args(argv)
    datamodule = parser.instantiate_classes(args).data
    scores = copy_baseline(datamodule, args.split, args.limit)
    summary = getattr(datamodule, "corpus_summary", None)
    print(json.dumps({"split": args.split, **scores, "corpus": summary() if summary else None}, indent=2))
    return 0
