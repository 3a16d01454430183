"""``zoo study mlm``: MLM perplexity of Linformer vs k, n and sharing (Linformer Fig. 3, Table 2).

Wang et al. 2020, "Linformer", arXiv:2006.04768, Sec. 5.1: at k = 128 for n = 512 and k = 256 for n = 1024
Linformer is "nearly on par" with the Transformer (Fig. 3 a, b); the sharing modes are about equal, layerwise
included (Fig. 3 c; Table 2 even has layerwise best downstream); at fixed k the final perplexity stays about
the same as n grows (Fig. 3 d). The runs are the ``zoo compare`` experiments of the configs in
``configs/studies/linformer_mlm/`` (one ``zoo fit`` per mechanism and seed, resumable); this command only
collects them, whatever is finished so far, and says which runs and seeds exist.

    zoo study mlm --runs-dir runs/linformer_paper --out results/linformer_paper/mlm
    zoo study mlm --replot results/linformer_paper/mlm     # table and figure from the committed CSVs

What is judged: an experiment whose config says ``test: true`` is scored by each run's final test perplexity
(``zoo test`` of its last checkpoint), on one text for every n (the data's ``eval_tokens``); an experiment
without it (the old-init runs, whose validation batches changed with n) falls back to the final validation
perplexity, labelled ``val (old init)``. Verdicts pair each variant with full attention at the same n and
evaluation, by seed (:mod:`experiments.stats`, δ = 2% of full's perplexity). Beside them: the unigram baseline
of the same evaluation text (the perplexity of predicting each masked token by its frequency among the
masked labels, as ``mlm_independent_check`` computes it: an optimistic no-context predictor) and each
variant's gap below it in nats per masked token, so a verdict reached close to that baseline can say so.

Writes ``curves.csv`` (val/ppl by step from each run's TensorBoard events), ``runs.csv`` (one row per expected
run: status, final val/ppl and test/ppl from ``run.json``), ``eval_text.csv`` (per experiment: the evaluation
text's sequences, masked tokens and unigram perplexity, from the data of the experiment's first run that saved
its ``config.yaml``), ``table.csv`` and ``table.md`` (final perplexity per variant: mean, std and 95% interval
over the finished seeds, unigram gap, paired verdict, coverage), then ``fig3.png`` from the CSVs (``mlm_plots``).
"""

from __future__ import annotations

import importlib
import json
import math
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentParser, Namespace
from rich.console import Console

from attention_zoo import attention_options, get_attention_class
from attention_zoo.linformer.attention import DEFAULT_K
from experiments.compare.command import plan
from experiments.compare.runs import read_record
from experiments.compare.summary import CONTROL
from experiments.stats import RULE, default_margin, metric_bounds, paired_difference, summarize
from experiments.studies.cli import add_output_options, run_study, study_parser
from experiments.studies.common import UnreadableRecord, read_csv, read_json, repo_path, write_csv
from experiments.studies.mlm_plots import OLD_VAL, TEST, plot

#: the study's zoo compare configs: ``configs/studies/linformer_mlm`` of the repository, package data of
#: ``experiments`` through the ``experiments/configs`` link
CONFIGS = Path(str(resources.files("experiments") / "configs" / "studies" / "linformer_mlm"))
CURVE_COLUMNS = ["experiment", "n", "attention", "k", "sharing", "label", "seed", "status", "step", "val_ppl"]
RUN_COLUMNS = ["experiment", "n", "attention", "k", "sharing", "label", "seed", "status", "step", "max_steps",
               "final_val_ppl", "evaluation", "final_test_ppl", "run_dir"]  # fmt: skip
EVAL_TEXT_COLUMNS = ["experiment", "n", "evaluation", "split", "sequences", "tokens", "masked_tokens", "unigram_ppl",
                     "run_dir"]  # fmt: skip
TABLE_COLUMNS = ["n", "attention", "k", "sharing", "evaluation", "seeds_expected", "seeds_finished", "seeds", "mean",
                 "std", "ci_low", "ci_high", "unigram_ppl", "gap_nats", "paired_seeds", "delta", "delta_lo",
                 "delta_hi", "p_value", "margin", "verdict", "on_par_margin", "gap_fraction"]  # fmt: skip
#: the runs.csv columns a replot reads (a runs.csv written before test evaluation lacks the other two)
RUN_COLUMNS_READ = [c for c in RUN_COLUMNS if c not in ("evaluation", "final_test_ppl")]
METRIC = "val/ppl"


@dataclass(frozen=True)
class ExpectedRun:
    experiment: str
    n: int
    attention: str
    k: int | None
    sharing: str
    label: str
    seed: int
    directory: Path
    evaluation: str  # TEST or OLD_VAL


def option_default(attention: str, name: str) -> Any:
    specs = {s.name: s for s in attention_options(get_attention_class(attention))}
    return specs[name].default if name in specs else None


def expected_runs(configs: Path, runs_dir: Path | None) -> list[ExpectedRun]:
    """Every (experiment, mechanism, seed) the study's ``zoo compare`` configs ask for."""
    runs = []
    for path in sorted(configs.glob("*.yaml")):
        config = yaml.safe_load(path.read_text()) or {}
        n = _max_seq_len(config.get("fit_args", []), path)
        root = runs_dir if runs_dir is not None else Path(config.get("runs_dir", "runs"))
        first, count = int(config.get("seed", 0)), int(config.get("seeds", 1))
        evaluation = TEST if config.get("test") else OLD_VAL
        for entry in plan(config["attentions"], config.get("options") or {}):
            k, sharing = None, ""
            if entry.spec.name == "linformer":
                k = entry.spec.options.get("k", min(DEFAULT_K, n))
                sharing = entry.spec.options.get("sharing", option_default("linformer", "sharing"))
            for seed in range(first, first + count):
                directory = root / config["experiment"] / entry.label / f"seed-{seed}"
                runs.append(ExpectedRun(config["experiment"], n, entry.spec.name, k, sharing, entry.label, seed,
                                        directory, evaluation))  # fmt: skip
    return runs


def _max_seq_len(fit_args: list[str], path: Path) -> int:
    for index, arg in enumerate(fit_args):
        if arg.startswith("--data.max_seq_len="):
            return int(arg.split("=", 1)[1])
        if arg == "--data.max_seq_len" and index + 1 < len(fit_args):
            return int(fit_args[index + 1])
    raise ValueError(f"{path}: fit_args set no --data.max_seq_len, so the study cannot tell its n")


def read_curve(directory: Path, tag: str = METRIC) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` in the run's event files; a step logged twice (a resumed run) keeps the later."""
    if not directory.is_dir():
        return []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    if tag not in accumulator.Tags().get("scalars", []):
        return []
    latest: dict[int, tuple[float, float]] = {}
    for event in accumulator.Scalars(tag):
        if event.step not in latest or event.wall_time >= latest[event.step][0]:
            latest[event.step] = (event.wall_time, event.value)
    return [(step, value) for step, (_, value) in sorted(latest.items())]


def collect(expected: list[ExpectedRun]) -> tuple[list[dict], list[dict]]:
    """(curve rows, run rows) of every expected run, present or not."""
    curves, runs = [], []
    for run in expected:
        record = read_record(run.directory)
        status = record.get("status", "missing" if not run.directory.exists() else "no record")
        metrics = record.get("metrics", {}) if status == "finished" else {}
        base = {"experiment": run.experiment, "n": run.n, "attention": run.attention, "k": run.k or "",
                "sharing": run.sharing, "label": run.label, "seed": run.seed, "status": status}  # fmt: skip
        finals = {f"final_{stage}_ppl": _cell(metrics.get(f"{stage}/ppl")) for stage in ("val", "test")}
        progress = {"step": record.get("step", ""), "max_steps": record.get("max_steps", "")}
        runs.append(base | progress | finals | {"evaluation": run.evaluation, "run_dir": repo_path(run.directory)})
        curves += [base | {"step": step, "val_ppl": f"{value:.6g}"} for step, value in read_curve(run.directory)]
    return curves, runs


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def evaluation_of(row: dict) -> str:
    """How a runs.csv row is judged; a runs.csv written before test evaluation existed holds old-init runs."""
    return row.get("evaluation") or OLD_VAL


def judged_ppl(row: dict) -> float | None:
    """The row's final perplexity on its evaluation text: test/ppl, or val/ppl for an old experiment; None if
    the run has not finished (or, for test, not been tested)."""
    cell = row.get("final_test_ppl", "") if evaluation_of(row) == TEST else row["final_val_ppl"]
    return float(cell) if row["status"] == "finished" and cell else None


def eval_text(run_dir: Path, evaluation: str) -> dict | None:
    """The evaluation text of a run, rebuilt from the data section of its ``config.yaml``: for TEST the test
    split (``limit_test_batches`` of it), for OLD_VAL the ``limit_val_batches`` validation batches; its
    masked tokens and their unigram perplexity exp(H), H the entropy of their own frequencies. None when the
    run saved no config."""
    from tasks.data.base import IGNORE_INDEX  # imports Lightning: only a run of the study needs it, not --replot

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    config = yaml.safe_load(path.read_text()) or {}
    section = config["data"]
    module_name, _, class_name = section["class_path"].rpartition(".")
    data = getattr(importlib.import_module(module_name), class_name)(**(section.get("init_args") or {}))
    split = "test" if evaluation == TEST else "val"
    data.setup("test" if split == "test" else "validate")
    loader = data.test_dataloader() if split == "test" else data.val_dataloader()
    limit = (config.get("trainer") or {}).get(f"limit_{split}_batches")
    # Lightning's rule: an int is a batch count, a float a share of the batches
    batches = len(loader) if limit is None else limit if isinstance(limit, int) else int(limit * len(loader))
    counts: Counter[int] = Counter()
    sequences = tokens = 0
    for _, batch in zip(range(batches), loader, strict=False):
        sequences += len(batch["mask"])
        tokens += int(batch["mask"].sum())
        counts.update(batch["labels"][batch["labels"] != IGNORE_INDEX].tolist())
    masked = sum(counts.values())
    entropy = -sum(c / masked * math.log(c / masked) for c in counts.values())
    return {"split": split, "sequences": sequences, "tokens": tokens, "masked_tokens": masked,
            "unigram_ppl": f"{math.exp(entropy):.6g}"}  # fmt: skip


def eval_texts(expected: list[ExpectedRun]) -> list[dict]:
    """One :func:`eval_text` row per experiment (and n), from its first run that saved a config."""
    rows, seen = [], set()
    for run in expected:
        if (run.experiment, run.n) in seen:
            continue
        text = eval_text(run.directory, run.evaluation)
        if text is not None:
            seen.add((run.experiment, run.n))
            rows.append({"experiment": run.experiment, "n": run.n, "evaluation": run.evaluation} | text
                        | {"run_dir": repo_path(run.directory)})  # fmt: skip
    return rows


def table_rows(runs: list[dict], texts: list[dict] | None = None) -> list[dict]:
    """Final perplexity per (n, attention, k, sharing, evaluation) over its finished seeds (:func:`judged_ppl`),
    in first-seen order, with the unigram baseline of its experiment's evaluation text (``texts``: rows of
    :func:`eval_texts`) and the gap below it, ln(unigram) - ln(ppl) in nats per masked token (mean over seeds),
    and the paired difference from full attention at the same n and evaluation, its verdict (the rule of
    :mod:`experiments.stats`, margin 2% of full's perplexity), the smallest margin at which it would be ``on par``,
    and, where the no-attention control (``self_only``) ran at that n, Δ as a fraction of the control's Δ."""
    unigram = {(t["experiment"], str(t["n"])): float(t["unigram_ppl"]) for t in texts or []}
    groups: dict[tuple, list[dict]] = {}
    for row in runs:
        key = (row["n"], row["attention"], row["k"], row["sharing"], evaluation_of(row))
        groups.setdefault(key, []).append(row)
    finals = {key: {int(r["seed"]): judged_ppl(r) for r in rows if judged_ppl(r) is not None}
              for key, rows in groups.items()}  # fmt: skip
    table = []
    for key, rows in groups.items():
        n, attention, k, sharing, evaluation = key
        per_seed = finals[key]
        interval = summarize(list(per_seed.values()), bounds=metric_bounds("val_ppl"))
        item = {"n": n, "attention": attention, "k": k, "sharing": sharing, "evaluation": evaluation,
                "seeds_expected": len(rows), "seeds_finished": len(per_seed),
                "seeds": " ".join(str(s) for s in per_seed)}  # fmt: skip
        for part, name in (("mean", "mean"), ("std", "std"), ("low", "ci_low"), ("high", "ci_high")):
            item[name] = "" if interval is None else f"{getattr(interval, part):.4f}"
        baseline = unigram.get((rows[0]["experiment"], str(n)))
        item["unigram_ppl"] = "" if baseline is None else f"{baseline:.4f}"
        gaps = [math.log(baseline) - math.log(ppl) for ppl in per_seed.values()] if baseline else []
        item["gap_nats"] = f"{sum(gaps) / len(gaps):.4f}" if gaps else ""
        reference = next((finals[other] for other in finals if other[0] == n and other[1] == "full"
                          and other[4] == evaluation), None)  # fmt: skip
        item |= dict.fromkeys(("paired_seeds", "delta", "delta_lo", "delta_hi", "p_value", "margin"), "")
        item |= {"verdict": "reference" if attention == "full" else "-", "on_par_margin": "", "gap_fraction": ""}
        if attention != "full" and reference and per_seed:
            full_mean = sum(reference.values()) / len(reference)
            margin = default_margin("val_ppl", full_mean)
            difference = paired_difference(per_seed, reference, margin=margin, higher_is_better=False,
                                           bounds=metric_bounds("val_ppl"))  # fmt: skip
            item |= {"paired_seeds": difference.n, "margin": f"{margin:.4f}", "verdict": difference.verdict}
            for name, value in (("delta", difference.mean), ("delta_lo", difference.low),
                                ("delta_hi", difference.high), ("p_value", difference.p_value),
                                ("on_par_margin", difference.on_par_margin)):  # fmt: skip
                item[name] = f"{value:.4f}" if math.isfinite(value) else ""
        table.append(item)
    for item in table:  # Δ over the control's Δ at the same n and evaluation
        control = next((c for c in table if c["attention"] == CONTROL and c["n"] == item["n"]
                        and c["evaluation"] == item["evaluation"] and c["delta"] != ""), None)  # fmt: skip
        if control is not None and item["delta"] != "" and float(control["delta"]) != 0:
            item["gap_fraction"] = f"{float(item['delta']) / float(control['delta']):.4f}"
    return table


def markdown(table: list[dict], runs: list[dict], texts: list[dict] | None = None) -> str:
    lines = [
        "Final perplexity: `test` = test/ppl of each run's last checkpoint on one evaluation text for every n;"
        " `val (old init)` = final val/ppl of an old experiment (its validation batches change with n)."
        " Unigram: the perplexity of predicting each masked token of the same text by its frequency among the"
        " masked labels (no context, optimistic); gap: ln(unigram) - ln(ppl), nats per masked token, mean over"
        " seeds. Δ: the paired difference from full attention at the same n and evaluation over shared seeds"
        " (95% interval), p: paired t-test; verdict by the rule of `experiments/stats.py` with δ = 2% of full's"
        f" perplexity: {RULE}. On par from δ: the smallest margin (PPL) at which the verdict would be `on par`."
        f" Δ / Δ control: Δ over the Δ of `{CONTROL}`, the no-attention control (each position sees only itself),"
        " at the same n: 0 = full attention's perplexity, 1 = no better than no attention.",
        "",
        "| n | model | k | sharing | evaluation | final ppl, mean ± std | 95% interval | unigram | gap (nats) "
        "| seeds finished | Δ vs full [95% CI] | p | verdict | on par from δ | Δ / Δ control |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        value = f"{float(row['mean']):.3f}" if row["mean"] else "-"
        value += f" ± {float(row['std']):.3f}" if row["seeds_finished"] > 1 else ""  # no spread from one seed
        interval = f"[{float(row['ci_low']):.3f}, {float(row['ci_high']):.3f}]" if row["seeds_finished"] > 1 else "-"
        seeds = f"{row['seeds_finished']}/{row['seeds_expected']}" + (f" ({row['seeds']})" if row["seeds"] else "")
        delta = f"{float(row['delta']):+.3f}" if row["delta"] != "" else "-"
        if row["delta_lo"] != "":
            delta += f" [{float(row['delta_lo']):+.3f}, {float(row['delta_hi']):+.3f}]"
        p_value = f"{float(row['p_value']):.2g}" if row["p_value"] != "" else "-"
        unigram = f"{float(row['unigram_ppl']):.2f}" if row["unigram_ppl"] else "-"
        gap = f"{float(row['gap_nats']):.3f}" if row["gap_nats"] else "-"
        on_par = f"{float(row['on_par_margin']):.3f}" if row.get("on_par_margin") else "-"
        fraction = f"{float(row['gap_fraction']):.2f}" if row.get("gap_fraction") else "-"
        lines.append(
            f"| {row['n']} | {row['attention']} | {row['k'] or '-'} | {row['sharing'] or '-'} | {row['evaluation']} "
            f"| {value} | {interval} | {unigram} | {gap} | {seeds} | {delta} | {p_value} | {row['verdict']} "
            f"| {on_par} | {fraction} |"
        )
    if texts:
        lines += ["", "Evaluation texts (from each experiment's first run with a config.yaml):"]
        lines += [
            f"- {t['experiment']} (n = {t['n']}, {t['evaluation']}): {t['split']} split, {int(t['sequences']):,}"
            f" sequences, {int(t['tokens']):,} tokens, {int(t['masked_tokens']):,} masked; unigram"
            f" {float(t['unigram_ppl']):.3f}"
            for t in texts
        ]
    missing = [r for r in runs if judged_ppl(r) is None]
    lines += ["", f"Coverage: {len(runs) - len(missing)} of {len(runs)} expected runs finished."]
    if missing:
        lines.append("Not finished (status, step reached):")
        lines += [
            f"- {r['experiment']}/{r['label']}/seed-{r['seed']}: "
            + ("fitted, not tested" if r["status"] == "finished" else r["status"])
            + (f", step {r['step']} of {r['max_steps']}" if r["step"] != "" and r["status"] != "finished" else "")
            for r in missing
        ]
    return "\n".join(lines) + "\n"


#: zoo study mlm --help's examples
EXAMPLES = (
    "zoo study mlm --runs-dir runs/linformer_paper --out results/linformer_paper/mlm",
    "zoo study mlm --replot results/linformer_paper/mlm     # the table and figure from the committed CSVs",
)


def build_parser() -> ArgumentParser:
    parser = study_parser("zoo study mlm", __doc__, EXAMPLES)
    parser.add_argument("--configs", type=str, default=str(CONFIGS), help="folder of the study's zoo compare configs")
    parser.add_argument(
        "--runs-dir", type=str | None, default=None, help="where the experiments ran (default: each config's runs_dir)"
    )
    replot = "rewrite the table and redraw the figure of this folder's CSVs"
    return add_output_options(parser, out="runs/studies/mlm", replot=replot)


def main(argv: list[str]) -> int:
    return run_study(build_parser(), argv, replot=_replot, run=_run)


def _replot(directory: Path, args: Namespace) -> list[Path]:
    what = "the folder of a zoo study mlm"
    runs = read_csv(directory / "runs.csv", RUN_COLUMNS_READ, what=what, integers=("n", "seed"),
                    numbers=("final_val_ppl", "final_test_ppl"))  # fmt: skip
    saved = directory / "mlm.json"
    expected = read_json(saved, what).get("expected_runs", {}) if saved.is_file() else {}
    if not isinstance(expected, dict):
        raise UnreadableRecord(f"{saved}: expected_runs {expected!r} is not a mapping of experiment to runs")
    for experiment, count in Counter(row["experiment"] for row in runs).items():
        if expected.get(experiment, count) != count:  # a file cut at a line end: its last experiment is short
            raise UnreadableRecord(f"{directory / 'runs.csv'}: {count} runs of {experiment}, {saved} says the study "
                                   f"expected {expected.get(experiment)}: a truncated file")  # fmt: skip
    texts = []
    if (directory / "eval_text.csv").is_file():
        texts = read_csv(directory / "eval_text.csv", EVAL_TEXT_COLUMNS[:-1], what=what, allow_empty=True,
                         integers=("n", "sequences", "tokens", "masked_tokens"), numbers=("unigram_ppl",))  # fmt: skip
    table = table_rows(runs, texts)
    write_csv(directory / "table.csv", table, TABLE_COLUMNS)
    (directory / "table.md").write_text(markdown(table, runs, texts))
    return [directory / "table.csv", directory / "table.md", *plot(directory)]


def _run(parser: ArgumentParser, args: Namespace, out: Console) -> int:
    expected = expected_runs(Path(args.configs), Path(args.runs_dir) if args.runs_dir else None)
    if not expected:
        parser.error(f"no zoo compare config (*.yaml) in {args.configs}")
    curves, runs = collect(expected)
    texts = eval_texts(expected)
    table = table_rows(runs, texts)
    directory = Path(args.out)
    write_csv(directory / "curves.csv", curves, CURVE_COLUMNS)
    write_csv(directory / "runs.csv", runs, RUN_COLUMNS)
    write_csv(directory / "eval_text.csv", texts, EVAL_TEXT_COLUMNS)
    write_csv(directory / "table.csv", table, TABLE_COLUMNS)
    (directory / "table.md").write_text(markdown(table, runs, texts))
    settings = {"configs": repo_path(args.configs), "runs_dir": repo_path(args.runs_dir),
                "expected_runs": Counter(run.experiment for run in expected)}  # fmt: skip
    (directory / "mlm.json").write_text(json.dumps(settings, indent=2) + "\n")
    written = plot(directory)
    finished = sum(judged_ppl(r) is not None for r in runs)
    out.print(f"{finished} of {len(runs)} runs finished; wrote {directory}/curves.csv, runs.csv, eval_text.csv, "
              "table.csv, table.md, " + ", ".join(p.name for p in written))  # fmt: skip
    return 0
