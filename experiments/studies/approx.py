"""``zoo study approx``: how far is each approximation from softmax attention, as its budget and n grow?

Checks Linformer's Theorems 1-2 (Wang et al. 2020, arXiv:2006.04768: a rank-k approximation with k independent
of n; Theorem 2 via eq. 7 with E, F in R^{k x n}) and the Nystromformer claim (Xiong et al. 2021,
arXiv:2102.03902: a few landmarks approximate softmax attention well), and puts every other registered
mechanism on the same axes. Per head: the relative and the lemma-normalised error of the output against
softmax attention (``approx_methods``), for

- ``svd`` (the rank-k floor), ``jl`` (Theorem 1's P R^T R V), ``linformer-random`` (eq. 7 with the fixed JL
  matrix E = F = R), ``linformer-learned[-<sharing>]`` (eq. 7 with the E, F of trained checkpoints, k theirs),
  Nystrom (landmarks; exact pinv; pinv iterations), Performer (features), LSH (hashes; bucket size), local
  (window), MoBA (top-k blocks): every method of ``approx_methods.METHODS`` whose core is registered;
- every other registered core at its defaults (one point per n).

Inputs: (a) ``gaussian``: q, k, v with i.i.d. N(0, 1) entries (d = ``--dim-head``), ``--samples`` draws per n
in ``--lengths``; (b) ``trained``: the q, k, v each layer's core received on ``--sequences`` validation
sequences of a trained MLM model (``--trained``: full-attention checkpoints, n = their max_seq_len), every
layer and head; Linformer's learned E, F (``--learned``) are measured on their own model's q, k, v (with the
SVD floor there too), and on the Gaussian inputs of their n. ``--runs DIR`` finds both kinds among the
finished ``zoo compare`` runs of a folder (``<experiment>/<label>/seed-<s>``).

    zoo study approx --runs runs/linformer_paper --out results/approximation
    zoo study approx --replot results/approximation

Resumable: ``errors.csv`` gets one row per (input, sample, layer, head, method, budget) as each unit of work
(one Gaussian draw, or one layer of one sequence) finishes; a rerun skips what it holds. Nothing larger than
one head's n x n matrices is held at a time. Then ``summary.csv`` (mean, std and 95% interval over samples)
and the figures, drawn from ``summary.csv`` (``approx_plots``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentParser, Namespace
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import Tensor

from experiments.compare.runs import is_finished
from experiments.stats import summarize
from experiments.studies.approx_methods import (
    Head,
    LearnedProjections,
    Method,
    method_output,
    methods,
)
from experiments.studies.approx_plots import plot
from experiments.studies.cli import add_output_options, run_study, study_parser
from experiments.studies.common import (
    RowLog,
    TrainedRun,
    capture,
    full_length_batches,
    load_data_module,
    load_run,
    number,
    repo_path,
    write_csv,
)

COLUMNS = [
    "input", "model", "source", "n", "dim_head", "sample", "layer", "head", "method", "knob", "budget",
    "rel_error", "lemma_error", "note",
]  # fmt: skip
SUMMARY_COLUMNS = [
    "input", "model", "n", "method", "knob", "budget", "samples", "rel_mean", "rel_std", "rel_ci_low",
    "rel_ci_high", "lemma_mean", "lemma_std", "lemma_ci_low", "lemma_ci_high", "skipped",
]  # fmt: skip
DEFAULT_LENGTHS = [256, 512, 1024, 2048, 4096]


@dataclass
class Job:
    """One method at one budget on every head of a unit (``layer`` as recorded in its rows)."""

    method: Method
    budget: int
    layer: int
    output: Callable[[Head, int], Tensor]  # (head, seed) -> (n, d)


@dataclass
class Unit:
    """One input: a Gaussian draw, or one layer of one validation sequence of a trained model."""

    input: str
    model: str
    source: str
    n: int
    dim_head: int
    sample: int
    heads: int
    seed: int
    load: Callable[[], tuple[Tensor, Tensor, Tensor]]  # q, k, v: (H, n, d)
    jobs: list[Job]

    def key(self, job: Job, head: int) -> tuple:
        return (self.input, self.source, self.n, self.sample, job.layer, head, job.method.name, job.budget)


def row_key(row: dict[str, str]) -> tuple:
    return (
        row["input"], row["source"], int(row["n"]), int(row["sample"]), int(row["layer"]), int(row["head"]),
        row["method"], int(row["budget"]),
    )  # fmt: skip


def table_jobs(chosen: list[Method], n: int, layer: int) -> list[Job]:
    return [
        Job(method, budget, layer, lambda head, seed, m=method, b=budget: method_output(m, b, head, seed))
        for method in chosen
        for budget in method.budgets_at(n)
    ]


def learned_job(bank: LearnedProjections, layer: int, head_of: Callable[[Head], int] | None = None) -> Job:
    """``bank``'s E, F of ``layer`` (of the head being measured, or of ``head_of(head)``)."""
    method = bank.method
    pick = head_of or (lambda head: head.index)
    return Job(method, bank.k, layer, lambda head, seed: bank.output(head, layer, pick(head)))


def gaussian_units(lengths: list[int], samples: int, dim_head: int, seed: int, chosen, banks) -> list[Unit]:
    """One unit per (n, draw); learned E, F join the draws of the n they were trained for (each layer's, of
    head 0 when heads have their own), so two checkpoints with the same sharing, k and n cannot both be used."""
    seen: dict[tuple, str] = {}
    for bank in banks:
        key = (bank.method.name, bank.k, bank.n)
        if key in seen:
            raise ValueError(
                f"learned projections {seen[key]} and {bank.label} are both {key[0]} with k={key[1]} at n={key[2]}; "
                "their Gaussian rows would collide: use one seed per variant (--run-seed)"
            )
        seen[key] = bank.label
    units = []
    for n in lengths:
        for sample in range(samples):
            unit_seed = seed * 1_000_003 + n * 1_009 + sample
            jobs = table_jobs(chosen, n, -1)
            for bank in banks:
                if bank.n == n:  # learned E, F measured at the length they were trained for
                    jobs += [learned_job(bank, layer, lambda head: 0) for layer in range(len(bank.cores))]

            def load(unit_seed=unit_seed, n=n) -> tuple[Tensor, Tensor, Tensor]:
                generator = torch.Generator().manual_seed(unit_seed)
                return tuple(torch.randn(1, n, dim_head, generator=generator, dtype=torch.float64) for _ in range(3))

            units.append(Unit("gaussian", "-", "gaussian", n, dim_head, sample, 1, unit_seed, load, jobs))
    return units


def trained_units(run: TrainedRun, sequences: int, seed: int, jobs_for_layer) -> list[Unit]:
    """One unit per (sequence, layer) of ``run``; inputs captured lazily, one sequence at a time."""
    depth, heads = int(run.hparams["depth"]), int(run.hparams["heads"])
    dim_head = run.hparams.get("dim_head") or int(run.hparams["dim"]) // heads
    n = run.max_seq_len
    batches: list[Tensor] = []

    @lru_cache(maxsize=1)
    def layers_of(sequence: int):
        if not batches:
            data = load_data_module(run)
            batches.extend(t for tokens, _ in full_length_batches(data, sequences, n) for t in tokens)
            if len(batches) < sequences:
                raise ValueError(f"{run.label}: {len(batches)} full-length validation sequences, asked for {sequences}")
        tokens = batches[sequence][None]
        return capture(run, tokens, torch.ones_like(tokens, dtype=torch.bool))

    units = []
    for sequence in range(sequences):
        for layer in range(depth):

            def load(sequence=sequence, layer=layer) -> tuple[Tensor, Tensor, Tensor]:
                inputs = layers_of(sequence)[layer]
                return inputs.q[0].double(), inputs.k[0].double(), inputs.v[0].double()

            unit_seed = seed * 1_000_003 + sequence * 101 + layer
            jobs = jobs_for_layer(layer)
            units.append(Unit("trained", run.attention, run.label, n, dim_head, sequence, heads, unit_seed, load, jobs))
    return units


def run_unit(unit: Unit, done: set[tuple]) -> list[dict[str, Any]]:
    """The rows of ``unit`` that ``done`` lacks; a job that cannot run gives rows with its reason as note."""
    q, k, v = unit.load()
    rows = []
    for index in range(unit.heads):
        head = Head(q[index], k[index], v[index], index)
        for job in unit.jobs:
            if unit.key(job, index) in done:
                continue
            row = {
                "input": unit.input, "model": unit.model, "source": unit.source, "n": unit.n,
                "dim_head": unit.dim_head, "sample": unit.sample, "layer": job.layer, "head": index,
                "method": job.method.name, "knob": job.method.knob, "budget": job.budget,
                "rel_error": "", "lemma_error": "", "note": "",
            }  # fmt: skip
            try:
                relative, lemma = head.errors(job.output(head, unit.seed + index), job.method)
                row["rel_error"] = f"{relative:.6g}"
                row["lemma_error"] = "" if lemma is None else f"{lemma:.6g}"
            except (ValueError, RuntimeError, NotImplementedError) as error:
                row["note"] = f"{type(error).__name__}: {error}".replace("\n", " ")[:300]
            rows.append(row)
    return rows


def summary_rows(rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Mean, std and 95% interval over samples (draws, or sequences x layers x heads) per curve point."""
    groups: dict[tuple, list[dict[str, str]]] = {}
    for row in rows:
        key = (row["input"], row["model"], int(row["n"]), row["method"], row["knob"], int(row["budget"]))
        groups.setdefault(key, []).append(row)
    summary = []
    for (input_kind, model, n, method, knob, budget), group in sorted(groups.items()):
        relative = summarize([number(r["rel_error"]) for r in group if r["rel_error"]])
        lemma = summarize([number(r["lemma_error"]) for r in group if r["lemma_error"]])
        notes = sorted({r["note"] for r in group if r["note"]})
        item: dict[str, Any] = {
            "input": input_kind, "model": model, "n": n, "method": method, "knob": knob, "budget": budget,
            "samples": relative.n if relative else 0, "skipped": "; ".join(notes)[:300],
        }  # fmt: skip
        for prefix, interval in (("rel", relative), ("lemma", lemma)):
            for part, name in (("mean", "mean"), ("std", "std"), ("low", "ci_low"), ("high", "ci_high")):
                item[f"{prefix}_{name}"] = "" if interval is None else f"{getattr(interval, part):.6g}"
        summary.append(item)
    return summary


def find_runs(folder: Path, seed: int) -> tuple[list[Path], list[Path]]:
    """Finished ``zoo compare`` runs of ``seed`` under ``folder``: (full-attention, linformer) checkpoints."""
    full, linformer = [], []
    for run_dir in sorted(folder.glob(f"*/*/seed-{seed}")):
        checkpoint = run_dir / "checkpoints" / "last.ckpt"
        if not (checkpoint.is_file() and is_finished(run_dir)):
            continue
        label = run_dir.parent.name
        if label == "full":
            full.append(checkpoint)
        elif label == "linformer" or label.startswith("linformer-"):
            linformer.append(checkpoint)
    return full, linformer


#: zoo study approx --help's examples
EXAMPLES = (
    "zoo study approx --inputs '[gaussian]' --lengths '[256, 512]' --samples 2 --out runs/studies/approx-quick",
    "zoo study approx --runs runs/linformer_paper --out results/approximation",
)


def build_parser() -> ArgumentParser:
    parser = study_parser("zoo study approx", __doc__, EXAMPLES)
    parser.add_argument("--lengths", type=list[int], default=DEFAULT_LENGTHS, help="n of the Gaussian inputs")
    parser.add_argument("--samples", type=int, default=4, help="Gaussian draws per n")
    parser.add_argument("--dim-head", type=int, default=64, help="d of the Gaussian inputs")
    parser.add_argument("--methods", type=list[str] | None, default=None, help="only these methods or attentions")
    parser.add_argument("--trained", type=list[str], default=[], help="full-attention checkpoints: inputs (b)")
    parser.add_argument("--learned", type=list[str], default=[], help="linformer checkpoints: learned E, F")
    parser.add_argument("--runs", type=str | None, default=None, help="find --trained and --learned in this folder")
    parser.add_argument("--run-seed", type=int, default=0, help="with --runs: the seed-<s> runs to use")
    parser.add_argument("--sequences", type=int, default=2, help="validation sequences per trained model")
    parser.add_argument("--inputs", type=list[str], default=["gaussian", "trained"], help="gaussian and/or trained")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Gaussian draws and random projections")
    parser.add_argument("--plot", type=bool, default=True, help="draw the figures (false: CSVs only, --replot later)")
    return add_output_options(parser, out="runs/studies/approximation")


def main(argv: list[str]) -> int:
    return run_study(build_parser(), argv, replot=lambda directory, args: plot(directory), run=_run)


def _run(parser: ArgumentParser, args: Namespace, out: Console) -> int:
    unknown = sorted(set(args.inputs) - {"gaussian", "trained"})
    if unknown or min(args.samples, args.sequences, args.dim_head, *args.lengths) < 1:
        parser.error(f"--inputs takes gaussian and/or trained (got {unknown}); sizes must be >= 1")
    chosen, left_out = methods(args.methods)
    trained, learned = [Path(p) for p in args.trained], [Path(p) for p in args.learned]
    if args.runs:
        found_full, found_linformer = find_runs(Path(args.runs), args.run_seed)
        trained, learned = trained + found_full, learned + found_linformer
    learned_runs = [load_run(p) for p in learned]
    banks = [LearnedProjections(run.encoder, run.label) for run in learned_runs]

    units: list[Unit] = []
    if "gaussian" in args.inputs:
        units += gaussian_units(args.lengths, args.samples, args.dim_head, args.seed, chosen, banks)
    if "trained" in args.inputs:
        for path in trained:
            run = load_run(path)
            units += trained_units(
                run, args.sequences, args.seed, lambda layer, n=run.max_seq_len: table_jobs(chosen, n, layer)
            )
        floor = [m for m in chosen if m.name == "svd"]
        for run, bank in zip(learned_runs, banks, strict=True):
            jobs = lambda layer, bank=bank, n=run.max_seq_len: [*table_jobs(floor, n, layer), learned_job(bank, layer)]
            units += trained_units(run, args.sequences, args.seed, jobs)

    directory = Path(args.out)
    log = RowLog(directory / "errors.csv", COLUMNS)
    done = {row_key(r) for r in log.rows()}
    todo = [u for u in units if any(u.key(j, h) not in done for j in u.jobs for h in range(u.heads))]
    settings = {k: v for k, v in vars(args).items() if k not in ("replot", "plot", "trained", "learned")}
    settings |= {"out": repo_path(args.out), "runs": repo_path(args.runs), "trained": [repo_path(p) for p in trained],
                 "learned": [repo_path(p) for p in learned], "left_out": left_out}  # fmt: skip
    (directory / "approx.json").write_text(json.dumps(settings, indent=2, default=str) + "\n")
    for reason in left_out:
        out.print(f"[yellow]left out[/] {reason}")
    out.print(f"{len(units)} units ({len(units) - len(todo)} done earlier), {len(chosen)} methods -> {directory}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=out) as progress:
        task = progress.add_task("approx", total=len(todo))
        for index, unit in enumerate(todo, start=1):
            name = f"{unit.input} {unit.source} n={unit.n} sample {unit.sample}" + (
                f" layer {unit.jobs[0].layer}" if unit.input == "trained" and unit.jobs else ""
            )
            progress.update(task, description=name)
            with torch.no_grad():
                log.append(run_unit(unit, done))
            progress.advance(task)
            if not out.is_terminal:  # off a terminal (a log file) the bar is not redrawn: one line per unit
                out.print(f"  {index}/{len(todo)} {name}")
    write_csv(directory / "summary.csv", summary_rows(log.rows()), SUMMARY_COLUMNS)
    written = plot(directory) if args.plot else []
    out.print(f"wrote {directory}/errors.csv, summary.csv, " + ", ".join(p.name for p in written))
    return 0
