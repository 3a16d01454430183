"""The translation experiment's tables and curves, in the layout of the WMT14 Linformer report (M. Pampaloni,
"Evaluating Linformer's performance on the WMT14 EN-DE machine translation task", 2024):
its results table (Model | PPL (dev) | BLEU (dev)) extended with test BLEU and chrF, the training time of its
section 6.2 and the inference speed of section 6.3, plus the "copy the source" baseline row.

    python -m experiments.studies.translation_report runs/translation-en-de --out results/translation
    python -m experiments.studies.translation_report runs/tr-full runs/tr-k32 --out ...   # one experiment per core

Reads ``zoo compare --test`` experiments over ``configs/translation.yaml`` (each run's ``run.json`` and
TensorBoard events) and writes ``results.md``, ``results.csv``, ``curves.png`` (validation BLEU and
perplexity, training loss, by step) and ``curves.csv`` (the same numbers, so the figure can be redrawn with
``--replot``).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

from experiments.studies.common import read_csv, read_json

COLUMNS = (
    ("model", "Model"),
    ("seed", "Seed"),
    ("ppl_dev", "PPL (dev)"),
    ("bleu_dev", "BLEU (dev, greedy, subset)"),
    ("bleu_test", "BLEU (test, beam 4)"),
    ("chrf_test", "chrF (test)"),
    ("train_tokens_per_s", "train tokens/s"),
    ("train_wall_min", "train wall (min)"),
    ("greedy_cached", "greedy sent/s (cache)"),
    ("greedy_recomputed", "greedy sent/s (recompute)"),
    ("beam_cached", "beam sent/s (cache)"),
    ("beam_recomputed", "beam sent/s (recompute)"),
)
CURVE_TAGS = ("val/bleu", "val/ppl", "train/loss")


def runs_of(experiment: Path) -> list[tuple[str, Path, dict[str, Any]]]:
    """(label, run directory, run.json) of every finished run, in label order."""
    found = []
    for record_path in sorted(experiment.glob("*/seed-*/run.json")):
        record = read_json(record_path, "a zoo compare run record")
        if record.get("status") == "finished":
            run_dir = record_path.parent
            found.append((f"{run_dir.parent.name}/{run_dir.name}", run_dir, record))
    if not found:
        raise ValueError(f"{experiment} holds no finished run (expected <label>/seed-<s>/run.json)")
    return found


def table_rows(runs: list[tuple[str, Path, dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for label, _, record in runs:
        metrics = record.get("metrics", {})
        rows.append(
            {
                "label": label,
                "model": model_name(record),
                "seed": int(label.rsplit("seed-", 1)[1]),
                "ppl_dev": metrics.get("val/ppl"),
                "bleu_dev": metrics.get("val/bleu"),
                "bleu_test": metrics.get("test/bleu"),
                "chrf_test": metrics.get("test/chrf"),
                "train_tokens_per_s": record.get("tokens_per_s"),
                "train_wall_min": record["fit_seconds"] / 60 if record.get("fit_seconds") else None,
                **{
                    f"{search}_{cache}": metrics.get(f"test/{search}_{cache}_sentences_per_s")
                    for search in ("greedy", "beam")
                    for cache in ("cached", "recomputed")
                },
            }
        )
    baseline = runs[0][2].get("copy_baseline", {})
    if baseline:
        rows.append(
            {
                "label": "copy",
                "model": "copy the source (no model)",
                "bleu_dev": baseline.get("val_bleu_subset", {}).get("bleu"),
                "bleu_test": baseline.get("test", {}).get("bleu"),
                "chrf_test": baseline.get("test", {}).get("chrf"),
            }
        )
    return rows


def curves(runs: list[tuple[str, Path, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every (label, tag, step, value) of the curve tags, from the runs' TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = []
    for label, run_dir, _ in runs:
        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        events.Reload()
        for tag in CURVE_TAGS:
            if tag in events.Tags()["scalars"]:
                points += [{"label": label, "tag": tag, "step": e.step, "value": e.value} for e in events.Scalars(tag)]
    return points


def plot(points: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one colour per arm (the label without its seed), one line per seed
    arm = lambda label: label.rsplit("/seed-", 1)[0]
    arms = sorted({arm(p["label"]) for p in points})
    figure, axes = plt.subplots(1, len(CURVE_TAGS), figsize=(5 * len(CURVE_TAGS), 4))
    for axis, tag in zip(axes, CURVE_TAGS, strict=True):
        named = set()
        for label in sorted({p["label"] for p in points}):
            series = sorted((p["step"], p["value"]) for p in points if p["label"] == label and p["tag"] == tag)
            if series:
                legend = None if arm(label) in named else arm(label)
                named.add(arm(label))
                axis.plot(*zip(*series, strict=True), label=legend, color=f"C{arms.index(arm(label)) % 10}",
                          alpha=0.8, marker="o" if tag != "train/loss" else None, markersize=3)  # fmt: skip
        axis.set_title(tag)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if tag == "val/ppl":
            axis.set_yscale("log")
    axes[0].legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def runs_of_all(experiments: list[Path]) -> list[tuple[str, Path, dict[str, Any]]]:
    """The finished runs of several experiments (one mechanism per experiment, say, run on separate cores).

    Each label is prefixed with its experiment's folder name. They must share one corpus (the copy baseline
    row is taken from the first).
    """
    runs = [run for experiment in experiments for run in runs_of(experiment)]
    if len(experiments) > 1:  # one mechanism per experiment: the runs inside are all called <mechanism>/seed-<s>
        runs = [(f"{run_dir.parent.parent.name}/{label}", run_dir, record) for label, run_dir, record in runs]
    labels = [label for label, _, _ in runs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"runs {', '.join(repeated)} are given more than once")
    hashes = {str(record.get("corpus", {}).get("content_hash")) for _, _, record in runs}
    if len(hashes) > 1:
        raise ValueError(f"the experiments were trained on different corpora (content hashes {sorted(hashes)})")
    return runs


def write(experiments: list[Path], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    runs = runs_of_all(experiments)
    title = ", ".join(experiment.name for experiment in experiments)
    rows = table_rows(runs)
    with open(out / "results.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["label", *(key for key, _ in COLUMNS)])
        writer.writeheader()
        writer.writerows(rows)
    corpus = runs[0][2].get("corpus", {})
    lines = [
        f"# Translation EN -> DE: {title}",
        "",
        f"- corpus: {corpus.get('source', '?')} {corpus.get('source_lang', 'en')}-{corpus.get('target_lang', 'de')}, "
        f"{corpus.get('catalogs', '?')} catalogs, pairs {json.dumps(corpus.get('pairs', {}))}, content hash "
        f"`{str(corpus.get('content_hash', '?'))[:16]}`",
        "- PPL (dev): exp of the token-weighted NLL on the validation split (no label smoothing); BLEU (dev): "
        "sacreBLEU 13a, greedy, on the validation subset; BLEU/chrF (test): beam 4, length penalty 0.6, whole test "
        "split; speed: sentences/s decoding the first test sentences, with the decoding cache or recomputing the "
        "prefix (one thread)",
        "",
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(key), key) for key, _ in COLUMNS) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    points = curves(runs)
    with open(out / "curves.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["label", "tag", "step", "value"])
        writer.writeheader()
        writer.writerows(points)
    plot(points, out / "curves.png", title)


def replot(out: Path) -> None:
    """Redraw ``curves.png`` from ``curves.csv``, read checked (:func:`experiments.studies.common.read_csv`)."""
    rows = read_csv(out / "curves.csv", ("label", "tag", "step", "value"), what="a translation report's folder",
                    integers=("step",), numbers=("value",))  # fmt: skip
    points = [{**row, "step": int(row["step"]), "value": float(row["value"])} for row in rows]
    plot(points, out / "curves.png", out.name)


def model_name(record: dict[str, Any]) -> str:
    """A run as it ran, from its run.json: encoder attention and options, then the decoder self-attention."""
    name = f"{record['attention']} {_options(record.get('attention_options'))}".strip()
    decoder = record.get("decoder_attention", {})
    if decoder:
        name += f"; decoder {decoder.get('attention')} {_options(decoder.get('options'))}".rstrip()
    return name


def _options(options: dict | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (options or {}).items())


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str) or key == "seed":
        return str(value)
    if key in ("train_tokens_per_s",) or key.startswith(("greedy", "beam")):
        return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"
    return f"{value:.2f}" if key in ("ppl_dev", "train_wall_min") else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiments", type=Path, nargs="*", help="zoo compare --test experiment folders")
    parser.add_argument("--out", type=Path, required=True, help="where results.md/csv and the curves go")
    parser.add_argument("--replot", action="store_true", help="redraw curves.png from curves.csv in --out")
    args = parser.parse_args(argv)
    if args.replot:
        try:
            replot(args.out)
        except ValueError as error:  # a missing, truncated or foreign curves.csv
            parser.error(str(error))
    elif not args.experiments:
        parser.error("give one or more experiment folders (or --replot)")
    else:
        try:
            write(args.experiments, args.out)
        except ValueError as error:
            parser.error(str(error))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
