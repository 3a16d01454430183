"""``zoo study mlm``: MLM validation perplexity of Linformer vs k, n and sharing (Linformer Fig. 3, Table 2).

Wang et al. 2020, "Linformer", arXiv:2006.04768, Sec. 5.1: at k = 128 for n = 512 and k = 256 for n = 1024
Linformer is "nearly on par" with the Transformer (Fig. 3 a, b); the sharing modes are about equal, layerwise
included (Fig. 3 c; Table 2 even has layerwise best downstream); at fixed k the final perplexity stays about
the same as n grows (Fig. 3 d). The runs are the ``zoo compare`` experiments of the configs in
``experiments/studies/linformer_mlm/`` (one ``zoo fit`` per mechanism and seed, resumable); this command only
collects them, whatever is finished so far, and says which runs and seeds exist.

    zoo study mlm --runs_dir runs/linformer_paper --out experiments/results/linformer_paper/mlm
    zoo study mlm --replot experiments/results/linformer_paper/mlm     # table and figure from the committed CSVs

Writes ``curves.csv`` (val/ppl by step from each run's TensorBoard events), ``runs.csv`` (one row per expected
run: status, final val/ppl from ``run.json``), ``table.csv`` and ``table.md`` (final perplexity per variant:
mean, std and 95% interval over the finished seeds, with coverage), then ``fig3.png`` from the CSVs
(``mlm_plots``).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentParser, Namespace
from rich.console import Console

from attention_zoo import attention_options, get_attention_class
from attention_zoo.linformer import DEFAULT_K
from experiments.compare.command import plan
from experiments.compare.runs import read_record
from experiments.stats import RULE, default_margin, metric_bounds, paired_difference, summarize
from experiments.studies.cli import add_output_options, run_study
from experiments.studies.common import write_csv
from experiments.studies.mlm_plots import plot

#: the study's zoo compare configs (package data of experiments.studies)
CONFIGS = Path(str(resources.files("experiments.studies") / "linformer_mlm"))
CURVE_COLUMNS = ["experiment", "n", "attention", "k", "sharing", "label", "seed", "status", "step", "val_ppl"]
RUN_COLUMNS = ["experiment", "n", "attention", "k", "sharing", "label", "seed", "status", "step", "max_steps",
               "final_val_ppl", "run_dir"]  # fmt: skip
TABLE_COLUMNS = ["n", "attention", "k", "sharing", "seeds_expected", "seeds_finished", "seeds", "mean", "std",
                 "ci_low", "ci_high", "paired_seeds", "delta", "delta_lo", "delta_hi", "p_value", "margin",
                 "verdict"]  # fmt: skip
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
        for entry in plan(config["attentions"], config.get("options") or {}):
            k, sharing = None, ""
            if entry.attention == "linformer":
                k = entry.options.get("k", min(DEFAULT_K, n))
                sharing = entry.options.get("sharing", option_default("linformer", "sharing"))
            for seed in range(first, first + count):
                directory = root / config["experiment"] / entry.label / f"seed-{seed}"
                runs.append(
                    ExpectedRun(config["experiment"], n, entry.attention, k, sharing, entry.label, seed, directory)
                )
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
        final = record.get("metrics", {}).get(METRIC) if status == "finished" else None
        base = {"experiment": run.experiment, "n": run.n, "attention": run.attention, "k": run.k or "",
                "sharing": run.sharing, "label": run.label, "seed": run.seed, "status": status}  # fmt: skip
        final_text = "" if final is None else f"{final:.6g}"
        progress = {"step": record.get("step", ""), "max_steps": record.get("max_steps", "")}
        runs.append(base | progress | {"final_val_ppl": final_text, "run_dir": str(run.directory)})
        curves += [base | {"step": step, "val_ppl": f"{value:.6g}"} for step, value in read_curve(run.directory)]
    return curves, runs


def table_rows(runs: list[dict]) -> list[dict]:
    """Final perplexity per (n, attention, k, sharing) over its finished seeds, in first-seen order, with the
    paired difference from full attention at the same n and its verdict (the rule of :mod:`experiments.stats`,
    margin 2% of full's perplexity)."""
    groups: dict[tuple, list[dict]] = {}
    for row in runs:
        groups.setdefault((row["n"], row["attention"], row["k"], row["sharing"]), []).append(row)
    finals = {
        key: {int(r["seed"]): float(r["final_val_ppl"]) for r in rows if r["status"] == "finished"
              and r["final_val_ppl"] != ""}
        for key, rows in groups.items()
    }  # fmt: skip
    table = []
    for (n, attention, k, sharing), rows in groups.items():
        per_seed = finals[(n, attention, k, sharing)]
        interval = summarize(list(per_seed.values()), bounds=metric_bounds("val_ppl"))
        item = {"n": n, "attention": attention, "k": k, "sharing": sharing, "seeds_expected": len(rows),
                "seeds_finished": len(per_seed), "seeds": " ".join(str(s) for s in per_seed)}  # fmt: skip
        for part, name in (("mean", "mean"), ("std", "std"), ("low", "ci_low"), ("high", "ci_high")):
            item[name] = "" if interval is None else f"{getattr(interval, part):.4f}"
        reference = next((finals[key] for key in finals if key[0] == n and key[1] == "full"), None)
        item |= dict.fromkeys(("paired_seeds", "delta", "delta_lo", "delta_hi", "p_value", "margin"), "")
        item["verdict"] = "reference" if attention == "full" else "-"
        if attention != "full" and reference:
            full_mean = sum(reference.values()) / len(reference)
            margin = default_margin("val_ppl", full_mean)
            difference = paired_difference(per_seed, reference, margin=margin, higher_is_better=False)
            item |= {"paired_seeds": difference.n, "margin": f"{margin:.4f}", "verdict": difference.verdict}
            for name, value in (("delta", difference.mean), ("delta_lo", difference.low),
                                ("delta_hi", difference.high), ("p_value", difference.p_value)):  # fmt: skip
                item[name] = f"{value:.4f}" if value == value else ""
        table.append(item)
    return table


def markdown(table: list[dict], runs: list[dict]) -> str:
    lines = [
        "Δ: the paired difference from full attention at the same n over shared seeds (95% interval), p: paired"
        f" t-test; verdict by the rule of `experiments/stats.py` with δ = 2% of full's perplexity: {RULE}.",
        "",
        "| n | model | k | sharing | final val ppl, mean ± std | 95% interval | seeds finished | Δ vs full [95% CI]"
        " | p | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in table:
        value = f"{float(row['mean']):.3f} ± {float(row['std']):.3f}" if row["mean"] else "-"
        interval = f"[{float(row['ci_low']):.3f}, {float(row['ci_high']):.3f}]" if row["seeds_finished"] > 1 else "-"
        seeds = f"{row['seeds_finished']}/{row['seeds_expected']}" + (f" ({row['seeds']})" if row["seeds"] else "")
        delta = f"{float(row['delta']):+.3f}" if row["delta"] != "" else "-"
        if row["delta_lo"] != "":
            delta += f" [{float(row['delta_lo']):+.3f}, {float(row['delta_hi']):+.3f}]"
        p_value = f"{float(row['p_value']):.2g}" if row["p_value"] != "" else "-"
        lines.append(
            f"| {row['n']} | {row['attention']} | {row['k'] or '-'} | {row['sharing'] or '-'} | {value} | {interval} "
            f"| {seeds} | {delta} | {p_value} | {row['verdict']} |"
        )
    missing = [r for r in runs if r["status"] != "finished"]
    lines += ["", f"Coverage: {len(runs) - len(missing)} of {len(runs)} expected runs finished."]
    if missing:
        lines.append("Not finished (status, step reached):")
        lines += [
            f"- {r['experiment']}/{r['label']}/seed-{r['seed']}: {r['status']}"
            + (f", step {r['step']} of {r['max_steps']}" if r["step"] != "" else "")
            for r in missing
        ]
    return "\n".join(lines) + "\n"


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="zoo study mlm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=str, default=str(CONFIGS), help="folder of the study's zoo compare configs")
    parser.add_argument(
        "--runs_dir", type=str | None, default=None, help="where the experiments ran (default: each config's runs_dir)"
    )
    replot = "rewrite the table and redraw the figure of this folder's CSVs"
    return add_output_options(parser, out="runs/studies/mlm", replot=replot)


def main(argv: list[str]) -> int:
    return run_study(build_parser(), argv, replot=_replot, run=_run)


def _replot(directory: Path, args: Namespace) -> list[Path]:
    with open(directory / "runs.csv") as file:
        runs = list(csv.DictReader(file))
    table = table_rows(runs)
    write_csv(directory / "table.csv", table, TABLE_COLUMNS)
    (directory / "table.md").write_text(markdown(table, runs))
    return [directory / "table.csv", directory / "table.md", *plot(directory)]


def _run(parser: ArgumentParser, args: Namespace, out: Console) -> int:
    expected = expected_runs(Path(args.configs), Path(args.runs_dir) if args.runs_dir else None)
    if not expected:
        parser.error(f"no zoo compare config (*.yaml) in {args.configs}")
    curves, runs = collect(expected)
    table = table_rows(runs)
    directory = Path(args.out)
    write_csv(directory / "curves.csv", curves, CURVE_COLUMNS)
    write_csv(directory / "runs.csv", runs, RUN_COLUMNS)
    write_csv(directory / "table.csv", table, TABLE_COLUMNS)
    (directory / "table.md").write_text(markdown(table, runs))
    (directory / "mlm.json").write_text(
        json.dumps({"configs": args.configs, "runs_dir": args.runs_dir}, indent=2) + "\n"
    )
    written = plot(directory)
    finished = sum(r["status"] == "finished" for r in runs)
    out.print(f"{finished} of {len(runs)} runs finished; wrote {directory}/curves.csv, runs.csv, table.csv, table.md, "
              + ", ".join(p.name for p in written))  # fmt: skip
    return 0
