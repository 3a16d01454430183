"""Test-BLEU verdicts of translation arms against a reference arm: sacreBLEU's paired bootstrap per seed, then
the verdict rule of :mod:`experiments.stats` over seeds.

    python -m experiments.studies.translation_verdicts --reference runs/tr-doc-full \\
        --arms runs/tr-doc-linformer-k32 runs/tr-doc-linformer-k32-encoder --out results/translation

Each argument is a ``zoo compare --test`` experiment (one arm); a seed counts when the arm's and the
reference's runs of that seed are both tested, that is, both hold ``test_translations.jsonl`` (written by
``zoo test``, :mod:`tasks.translation`). Per arm and shared seed: the two runs' test BLEU, and sacreBLEU's
paired bootstrap resampling (``sacrebleu.significance.PairedTest``, Koehn 2004; ``--samples`` resamples of
the test segments, sacreBLEU's fixed seed): each system's bootstrap mean with its 95% interval, and the p-value
of the arm's difference from the reference. Over seeds: the paired difference of test BLEU (arm - reference),
its intervals, and the verdict of the rule with the BLEU margin (``--margin``, default
:data:`experiments.stats.DEFAULT_MARGINS` ``bleu``). The bootstrap measures how much the test set's sampling
moves one pair of runs; the rule over seeds also sees how much training moves them.

Writes ``verdicts.csv`` (one row per arm and seed, then one ``all`` row per arm with the verdict) and
``verdicts.md``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

from experiments.records import read_json_lines
from experiments.stats import DEFAULT_MARGINS, RULE, margin_text, metric_bounds, paired_difference
from experiments.studies.common import read_json, write_csv
from experiments.studies.translation_report import model_name
from tasks.translation import TEST_TRANSLATIONS

COLUMNS = (
    "arm", "seed", "reference_bleu", "arm_bleu", "difference", "low", "high", "p_value", "verdict", "on_par_margin",
    "reason", "reference_bootstrap", "arm_bootstrap", "segments",
)  # fmt: skip


def tested_runs(experiment: Path) -> dict[int, Path]:
    """seed -> the run directory, for every run of the experiment that ``zoo test`` has translated."""
    found = {}
    for kept in sorted(experiment.glob(f"*/seed-*/{TEST_TRANSLATIONS}")):
        found[int(kept.parent.name.removeprefix("seed-"))] = kept.parent
    return found


def translations(run_dir: Path) -> tuple[list[str], list[str]]:
    """(translations, references) of a tested run, in test-index order."""
    path = run_dir / TEST_TRANSLATIONS
    numbered, fragment = read_json_lines(path)
    if fragment:  # a test set cut short would score fewer segments than its reference's
        raise ValueError(f"{path}: its last line is half-written ({len(fragment)} bytes): rerun zoo test")
    missing = [n for n, row in numbered if not {"index", "translation", "reference"} <= set(row)]
    if missing:
        raise ValueError(f"{path} line {missing[0]}: a translation row without index, translation and reference")
    rows = [row for _, row in numbered]
    rows.sort(key=lambda row: row["index"])
    return [row["translation"] for row in rows], [row["reference"] for row in rows]


def arm_name(experiment: Path, run_dir: Path) -> str:
    """The arm as run (:func:`translation_report.model_name`), with its experiment."""
    return f"{model_name(read_json(run_dir / 'run.json', 'a zoo compare run record'))} ({experiment.name})"


def seed_row(reference: Path, arm: Path, samples: int) -> dict[str, Any]:
    """Both runs' test BLEU and sacreBLEU's paired bootstrap of the arm against the reference."""
    (reference_out, references), (arm_out, arm_references) = translations(reference), translations(arm)
    if references != arm_references:
        raise ValueError(f"{reference} and {arm} translated different test sets: their references differ")
    test = PairedTest(
        [("reference", reference_out), ("arm", arm_out)],
        {"BLEU": BLEU()},
        references=[references],
        test_type="bs",
        n_samples=samples,
    )
    _, scores = test()
    reference_result, arm_result = scores["BLEU"]
    return {
        "reference_bleu": reference_result.score,
        "arm_bleu": arm_result.score,
        "difference": arm_result.score - reference_result.score,
        "p_value": arm_result.p_value,
        "reference_bootstrap": f"{reference_result.mean:.2f} ± {reference_result.ci:.2f}",
        "arm_bootstrap": f"{arm_result.mean:.2f} ± {arm_result.ci:.2f}",
        "segments": len(references),
    }


def verdict_rows(reference: Path, arms: list[Path], samples: int, margin: float) -> list[dict[str, Any]]:
    reference_runs = tested_runs(reference)
    rows: list[dict[str, Any]] = []
    for arm in arms:
        arm_runs = tested_runs(arm)
        seeds = sorted(set(reference_runs) & set(arm_runs))
        if not seeds:
            raise ValueError(f"{arm} shares no tested seed with {reference}")
        name = arm_name(arm, arm_runs[seeds[0]])
        per_seed = [{"arm": name, "seed": s} | seed_row(reference_runs[s], arm_runs[s], samples) for s in seeds]
        rows += per_seed
        result = paired_difference(
            {r["seed"]: r["arm_bleu"] for r in per_seed},
            {r["seed"]: r["reference_bleu"] for r in per_seed},
            margin=margin,
            higher_is_better=True,
            bounds=metric_bounds("test_bleu"),
        )
        rows.append(
            {
                "arm": name,
                "seed": "all",
                "reference_bleu": sum(r["reference_bleu"] for r in per_seed) / len(per_seed),
                "arm_bleu": sum(r["arm_bleu"] for r in per_seed) / len(per_seed),
                "difference": result.mean,
                "low": result.low,
                "high": result.high,
                "p_value": result.p_value,
                "verdict": result.verdict,
                "on_par_margin": result.on_par_margin,
                "reason": result.reason,
                "segments": per_seed[0]["segments"],
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], reference: Path, samples: int, margin: float) -> str:
    lines = [
        f"Reference: `{reference.name}`. Per seed: test BLEU of both runs, Δ = arm - reference, and sacreBLEU's paired "
        f"bootstrap ({samples} resamples of the test segments: each system's mean ± 95% interval, the p-value of Δ). "
        f"Over seeds (`all`): the paired difference, its 95% interval and the verdict, {margin_text(margin)}: {RULE}; "
        "on par from δ: the smallest margin (BLEU points) at which it would be `on par`.",
        "",
        "| arm | seed | reference BLEU | arm BLEU | Δ [95% CI] | p | verdict | on par from δ | bootstrap: reference |"
        " bootstrap: arm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        low = row.get("low")
        interval = f" [{low:+.2f}, {row['high']:+.2f}]" if low is not None and not math.isnan(low) else ""
        p_value = "-" if row.get("p_value") is None else f"{row['p_value']:.3g}"
        on_par = row.get("on_par_margin")
        on_par_text = "-" if on_par is None or math.isnan(on_par) else "∞" if math.isinf(on_par) else f"{on_par:.2f}"
        cells = [
            row["arm"], str(row["seed"]), f"{row['reference_bleu']:.2f}", f"{row['arm_bleu']:.2f}",
            f"{row['difference']:+.2f}{interval}", p_value, row.get("verdict", ""), on_par_text,
            row.get("reference_bootstrap", ""), row.get("arm_bootstrap", ""),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="the reference arm's zoo compare experiment")
    parser.add_argument("--arms", type=Path, nargs="+", required=True, help="the other arms' experiments")
    parser.add_argument("--out", type=Path, required=True, help="folder for verdicts.csv and verdicts.md")
    parser.add_argument("--samples", type=int, default=1000, help="bootstrap resamples per seed pair (1000)")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGINS["bleu"], help="δ in BLEU points (0.5)")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples must be >= 1, got {args.samples}")
    try:
        rows = verdict_rows(args.reference, args.arms, args.samples, args.margin)
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "verdicts.csv", rows, list(COLUMNS))
    text = markdown(rows, args.reference, args.samples, args.margin)
    (args.out / "verdicts.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
