"""``zoo compare``: train one task once per attention mechanism (same config, seed, data and steps) and
compare accuracy, throughput and peak memory, all measured in the same training runs.

    zoo compare                                            # the embedded default (configs/compare.yaml)
    zoo compare --attentions 'full,linformer:k=32,local:window=16'
    zoo compare --task_config configs/listops.yaml --experiment listops -- --trainer.max_steps 200

Without ``--task_config`` (or a ``--config`` naming one), ``configs/compare.yaml`` supplies the task, its
sizes (``fit_args``) and per-mechanism ``options``; with one, only what is given applies.

``--attentions`` is a comma-separated list; ``name:opt=value`` starts an entry with options and further
``opt=value`` items add to it (``linformer:k=32,sharing=kv,local:window=16``); values are YAML
(``32`` an int, ``true`` a bool). An entry without options takes them from the config's ``options``
section, else the mechanism's defaults, else (when an option is required) its first ``example_configs``
entry, which is sized for sequences of about 64 tokens. Without ``--attentions``, every
registered mechanism that takes padding masks runs. Arguments after ``--`` go to every ``zoo fit``.

Each mechanism trains in its own ``zoo fit`` subprocess (``threads`` torch threads), so a crash or an
out-of-memory error stays its own and the peak memory is that run's alone. Outputs, in a new
``<runs_dir>/<experiment>/`` (suffixed ``-2``, ``-3``... rather than touching an earlier one): one
TensorBoard run per mechanism (``tensorboard --logdir <runs_dir>/<experiment>`` overlays them, with
HParams), ``summary.csv``, ``summary.md``, ``accuracy_vs_throughput.png``, ``peak_memory.png`` and the
resolved ``compare.yaml``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser
from jsonargparse.typing import Path_fr
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import attention_zoo as az
from attention_zoo.registry import attention_options
from experiments.console import console
from tasks.callbacks import RUN_RECORD

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = CONFIGS / "compare.yaml"
COLUMNS = (
    "mechanism", "attention", "options", "options_from", "status", "val_acc", "val_loss", "train_loss", "val_ppl",
    "tokens_per_s", "peak_mem_mb", "train_mem_mb", "parameters", "steps", "fit_s", "wall_s", "reason",
)  # fmt: skip


@dataclass
class Entry:
    """One mechanism run: ``label`` names its directory and its row."""

    attention: str
    options: dict[str, Any]
    options_from: str
    label: str = ""


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="zoo compare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", action=ActionConfigFile, help="a compare config (configs/compare.yaml if no --task_config)"
    )
    parser.add_argument("--experiment", type=str | None, default=None, help="experiment directory (default: the task)")
    parser.add_argument("--task_config", type=Path_fr, help="the zoo fit config (relative paths: to the config file)")
    parser.add_argument(
        "--attentions",
        type=str | None,
        default=None,
        help="comma-separated; name:opt=value[,opt=value] sets options, e.g. full,linformer:k=32,sharing=kv",
    )
    parser.add_argument("--options", type=dict[str, dict[str, Any]], default={}, help="options per mechanism")
    parser.add_argument("--fit_args", type=list[str], default=[], help="extra zoo fit arguments for every run")
    parser.add_argument("--seed", type=int, default=0, help="seed_everything of every run (model init, dropout)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (OMP_NUM_THREADS)")
    parser.add_argument("--runs_dir", type=str, default="runs", help="where the experiment directory goes")
    parser.add_argument("--timeout", type=float | None, default=None, help="seconds per mechanism before it is stopped")
    return parser


def parse_attentions(text: str) -> list[tuple[str, dict[str, Any] | None]]:
    """``'full,linformer:k=32,sharing=kv'`` -> ``[("full", None), ("linformer", {"k": 32, "sharing": "kv"})]``;
    ``None`` means "no options given here"."""
    entries: list[tuple[str, dict[str, Any] | None]] = []
    for item in (part.strip() for part in text.split(",")):
        if ":" in item:
            name, option = item.split(":", 1)
            entries.append((name.strip(), {}))
        elif "=" in item:
            if not entries or entries[-1][1] is None:
                raise ValueError(f"--attentions: option {item!r} follows no 'name:' entry (write name:{item})")
            option = item
        else:
            if item:
                entries.append((item, None))
            continue
        key, sep, value = option.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--attentions: {item!r} is not name:option=value")
        entries[-1][1][key.strip()] = yaml.safe_load(value)
    return entries


def default_attentions() -> list[str]:
    """Every registered mechanism that accepts padding masks (task batches are padded)."""
    return [name for name in az.list_attentions() if az.get_attention_class(name).supports_mask]


def plan(attentions: str | None, options: dict[str, dict[str, Any]]) -> list[Entry]:
    """The runs, in order; raises ValueError for an unknown mechanism name before anything runs."""
    requested = parse_attentions(attentions) if attentions else [(name, None) for name in default_attentions()]
    entries = []
    for name, given in requested:
        cls = az.get_attention_class(name)  # unknown name: ValueError listing the known ones
        if given is not None:
            entries.append(Entry(name, given, "command line"))
        elif name in options:
            entries.append(Entry(name, dict(options[name]), "config"))
        elif not any(spec.required for spec in attention_options(cls)):
            entries.append(Entry(name, {}, "defaults"))
        else:  # a required option (a window, a rank) has no default to fall back on
            entries.append(Entry(name, dict(cls.example_configs[0]), "example_configs"))
    for entry in entries:
        twins = [e for e in entries if e.attention == entry.attention]
        options_text = "-".join(f"{k}={v}" for k, v in entry.options.items())
        entry.label = entry.attention if len(twins) == 1 else f"{entry.attention}-{options_text or 'defaults'}"
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--attentions lists the same mechanism and options twice: {labels}")
    return entries


def new_experiment_dir(runs_dir: Path, name: str) -> Path:
    """``runs_dir/name``, or ``name-2``, ``name-3``... if taken; never an existing directory."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    for suffix in ("", *(f"-{i}" for i in range(2, 10_000))):
        path = runs_dir / f"{name}{suffix}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free experiment directory for {name!r} under {runs_dir}")


def fit_command(entry: Entry, task_config: str, experiment_dir: Path, seed: int, fit_args: list[str]) -> list[str]:
    logger = {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {
            "save_dir": str(experiment_dir.parent),
            "name": experiment_dir.name,
            "version": entry.label,
            "default_hp_metric": False,
        },
    }
    return [
        sys.executable, "-m", "experiments.cli", "fit", "-c", task_config,
        "--seed_everything", str(seed),
        "--model.attention", entry.attention,
        "--model.attention_options", json.dumps(entry.options),
        "--trainer.logger", json.dumps(logger),
        "--trainer.enable_progress_bar", "false",
        *fit_args,
    ]  # fmt: skip


def run_entry(
    entry: Entry, command: list[str], run_dir: Path, threads: int, timeout: float | None, progress: Progress
) -> dict[str, Any]:
    """Run one ``zoo fit`` subprocess, following its ``run.json`` on the progress bar; return its row."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    task = progress.add_task(entry.label, total=None)
    started = time.perf_counter()
    timed_out = False
    with open(run_dir / "fit.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        while process.poll() is None:
            record = read_record(run_dir)
            if record.get("max_steps"):
                progress.update(task, completed=record.get("step", 0), total=record["max_steps"])
            if timeout is not None and time.perf_counter() - started > timeout:
                timed_out = True
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                break
            time.sleep(0.25)
        process.wait()
    wall = time.perf_counter() - started
    record = read_record(run_dir)
    ok = process.returncode == 0 and record.get("status") == "finished" and not timed_out
    progress.update(task, completed=record.get("step", 0), total=record.get("max_steps") or 1)
    progress.update(task, description=f"{entry.label} [{'green' if ok else 'red'}]{'ok' if ok else 'failed'}[/]")
    metrics = record.get("metrics", {})
    reason = "" if ok else failure_reason(process.returncode, record, run_dir / "fit.log", timed_out, timeout)
    return {
        "mechanism": entry.label,
        "attention": entry.attention,
        "options": json.dumps(entry.options),
        "options_from": entry.options_from,
        "status": "ok" if ok else "failed",
        "val_acc": metrics.get("val/acc"),
        "val_loss": metrics.get("val/loss"),
        "train_loss": metrics.get("train/loss"),
        "val_ppl": metrics.get("val/ppl"),
        "tokens_per_s": record.get("tokens_per_s") if ok else None,
        "peak_mem_mb": record.get("peak_mem_mb") if ok else None,
        "train_mem_mb": record["peak_mem_mb"] - record["fit_start_mem_mb"] if ok else None,
        "parameters": record.get("parameters"),
        "steps": record.get("step"),
        "fit_s": record.get("fit_seconds"),
        "wall_s": wall,
        "reason": reason,
    }


def read_record(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}


def failure_reason(returncode: int, record: dict, log: Path, timed_out: bool, timeout: float | None) -> str:
    if timed_out:
        return f"timed out after {timeout:g} s"
    if record.get("status") == "failed" and record.get("error"):
        return record["error"]
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (" (out of memory?)" if -returncode == signal.SIGKILL else "")
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):  # a clean CLI error, else the exception line closing a traceback
        if line.startswith("zoo fit: error:") or line.startswith("error:"):
            return line
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return line
    return f"exit code {returncode}; see {log}"


def write_summary(rows: list[dict[str, Any]], directory: Path, header: list[str]) -> None:
    with open(directory / "summary.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table += ["| " + " | ".join(cell(row[c], c).replace("|", "\\|") for c in COLUMNS) + " |" for row in rows]
    (directory / "summary.md").write_text("\n".join(header + [""] + table) + "\n")


def cell(value: Any, column: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if column in ("val_acc", "val_loss", "train_loss", "val_ppl"):
        return f"{value:.3f}"
    if column in ("tokens_per_s", "peak_mem_mb", "train_mem_mb"):
        return f"{value:,.0f}"
    if column in ("fit_s", "wall_s"):
        return f"{value:.1f}"
    if column == "parameters":
        return f"{value:,}"
    return str(value)


def plot(rows: list[dict[str, Any]], directory: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["status"] == "ok"]
    failed = [r["mechanism"] for r in rows if r["status"] != "ok"]
    note = f"\nfailed: {', '.join(failed)}" if failed else ""

    figure, axes = plt.subplots(figsize=(8, 5))
    markers = "osD^vP*Xh<>"
    for index, row in enumerate(done):  # a legend, not annotations: close points would overprint their labels
        axes.scatter(row["tokens_per_s"], row["val_acc"] or 0.0, marker=markers[index % len(markers)],
                     s=50, label=row["mechanism"])  # fmt: skip
    axes.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    axes.set_xlabel("training throughput (real tokens / s)")
    axes.set_ylabel("validation accuracy (final)")
    axes.set_title(f"{title}: accuracy vs throughput{note}", fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(directory / "accuracy_vs_throughput.png", dpi=120)
    plt.close(figure)

    names = [r["mechanism"] for r in done]
    start = [r["peak_mem_mb"] - r["train_mem_mb"] for r in done]
    figure, axes = plt.subplots(figsize=(7, 0.4 * max(len(done), 3) + 1.5))
    axes.barh(names, start, color="lightgray", label="in use when training started")
    axes.barh(names, [r["train_mem_mb"] for r in done], left=start, label="added by training (to the peak)")
    axes.invert_yaxis()
    axes.set_xlabel("peak memory (MB): CUDA allocated, or CPU resident set size")
    axes.set_title(f"{title}: peak memory{note}", fontsize=10)
    axes.legend(fontsize=8, loc="lower right")
    axes.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(directory / "peak_memory.png", dpi=120)
    plt.close(figure)


def main(argv: list[str]) -> int:
    own, fit_extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = build_parser()
    config = parser.parse_args(own)
    if config.task_config is None:  # no task named: the embedded default experiment, under the given overrides
        if not DEFAULT_CONFIG.is_file():
            parser.error(f"give --task_config or --config (the default {DEFAULT_CONFIG} is missing)")
        config = parser.parse_args(["--config", str(DEFAULT_CONFIG), *own])
    out = console()
    try:
        entries = plan(config.attentions, config.options)
    except ValueError as error:
        parser.error(str(error))
    task_config = str(Path(config.task_config.absolute))
    fit_args = [*config.fit_args, *fit_extra]
    directory = new_experiment_dir(Path(config.runs_dir), config.experiment or Path(task_config).stem)
    parser.save(config, directory / "compare.yaml", skip_none=False, skip_check=True)
    out.print(f"[bold]zoo compare[/]: {len(entries)} mechanism(s) on {task_config} -> {directory}")

    rows = []
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=out,
    ) as progress:  # fmt: skip
        overall = progress.add_task("[bold]mechanisms", total=len(entries))
        for entry in entries:
            command = fit_command(entry, task_config, directory, config.seed, fit_args)
            row = run_entry(entry, command, directory / entry.label, config.threads, config.timeout, progress)
            rows.append(row)
            progress.advance(overall)
            # one line per finished run, so logs (no live bar off a terminal) show progress too
            out.print(
                f"  {entry.label}: {row['status']}, val_acc {cell(row.get('val_acc'), 'val_acc')}, "
                f"{cell(row.get('tokens_per_s'), 'tokens_per_s')} tokens/s, {cell(row.get('wall_s'), 'wall_s')} s"
            )

    header = [
        f"# zoo compare: {directory.name}",
        "",
        f"- task config: `{task_config}`; extra fit args: `{' '.join(fit_args) or '-'}`; seed {config.seed}",
        f"- {config.threads} torch thread(s) per run; {platform.platform()}; Python {platform.python_version()}",
        "- val_acc, val_loss, val_ppl: last validation of the run; train_loss: last logged training step",
        "- tokens_per_s: real (unpadded) tokens per second of training steps (forward, backward, optimizer),"
        " after 5 warm-up steps; peak_mem_mb: CUDA max allocated, or on CPU the run's peak resident set size"
        " (includes the PyTorch process baseline); train_mem_mb: that peak minus the memory in use when"
        " training started",
        "- fit_s: Trainer.fit wall time; wall_s: the whole subprocess (start-up and data included)",
    ]
    write_summary(rows, directory, header)
    plot(rows, directory, directory.name)
    print_table(rows, out)
    out.print(
        f"wrote {directory}/summary.md, summary.csv, accuracy_vs_throughput.png, peak_memory.png; "
        f"curves: tensorboard --logdir {directory}"
    )
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def print_table(rows: list[dict[str, Any]], out: Any) -> None:
    shown = ("mechanism", "options", "val_acc", "val_loss", "tokens_per_s", "peak_mem_mb", "train_mem_mb", "fit_s")
    table = Table(title="zoo compare")
    for column in (*shown, "status"):
        table.add_column(column, overflow="fold")
    for row in rows:
        status = "ok" if row["status"] == "ok" else f"[red]failed: {escape(str(row['reason']))}[/]"
        table.add_row(*(escape(cell(row[c], c)) for c in shown), status)
    out.print(table)
