"""``zoo lra``: the Long Range Arena suite (Tay et al. 2020, arXiv:2011.04006) as one ``zoo compare`` per task.

    zoo lra                                                # the lite suite: configs/lra/lite.yaml
    zoo lra --scale reference --tasks listops,pathfinder --seeds 1
    zoo lra --tasks text --data-dirs '{text: data/aclImdb}'
    zoo lra --attentions full,nystrom -- --trainer.max_steps 200

The suite config (``configs/lra/<scale>.yaml``, or ``--suite-config``) names, per task, its ``zoo fit`` config,
the mechanisms' budgets (``options``, with their published sources) and whether the task needs data that cannot
be generated (``needs_data``: where to put them). Every task runs the same mechanisms (``--attentions``, else the
config's) with the no-attention control arm and the same seeds, through ``zoo compare``'s own entry point
(:func:`experiments.compare.command.main`) into ``<runs_dir>/lra-<scale>/<task>/``: each run its own process,
paired verdicts against ``full``, resumable. Rerunning the same command resumes every task; a task whose
comparison was interrupted stops the suite (rerun to resume).

A task that needs data is skipped, with one line saying why and where the data go, when its config has no
``data.data_dir`` and ``--data-dirs`` gives none; named in ``--tasks``, it runs, and ``zoo compare`` refuses it
with the data module's own one-line error. Arguments after ``--`` go to every ``zoo fit`` of every task;
``--jobs N`` goes to every ``zoo compare`` (runs at once; its default, the usable cores, when left out).

Outputs in ``<runs_dir>/lra-<scale>/``: each task's ``zoo compare`` outputs; ``lra.md`` and ``lra.csv`` (the
table of :mod:`experiments.lra.table`, beside the published tables of :mod:`experiments.lra.published`); and
one TensorBoard layout for the whole suite (``tensorboard --logdir <runs_dir>/lra-<scale>``: runs are
``<task>/<mechanism>/seed-<s>``, and TensorBoard's run filter, e.g. ``^listops/``, shows one task).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import ArgumentError, ArgumentParser

from experiments.compare.flags import CONFIGS, Parser
from experiments.console import console
from experiments.lra import table
from experiments.machine_paths import shown_path

Scale = Literal["lite", "reference"]
#: the suite configs: ``configs/lra/<scale>.yaml``
SUITES = CONFIGS / "lra"
#: the examples of ``--help``
EXAMPLES = (
    "zoo lra --jobs 2",
    "zoo lra --scale reference --tasks listops,pathfinder --seeds 1",
)


@dataclass(frozen=True)
class Task:
    """One task of a suite config: its ``zoo fit`` config (absolute), the mechanisms' options, extra fit
    arguments, for a task whose data cannot be generated where its data go (``needs_data``), and the optional
    package its data come from (``needs_package``)."""

    name: str
    task_config: Path
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    fit_args: tuple[str, ...] = ()
    needs_data: str | None = None
    needs_package: str | None = None


@dataclass(frozen=True)
class Suite:
    """A suite config: its scale, mechanisms, seeds, torch threads per run, the control arm and its tasks."""

    path: Path
    scale: str
    attentions: str
    seeds: int
    threads: int
    control: bool
    tasks: dict[str, Task]


def read_suite(path: Path) -> Suite:
    """The suite config at ``path``; ValueError, one line naming the file and the key, when it is not one.
    Task configs are relative to the suite config's folder."""
    shown = shown_path(path)
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"{shown}: cannot read the suite config ({str(error).splitlines()[0]})") from None
    if not isinstance(config, dict) or not isinstance(config.get("tasks"), dict) or not config["tasks"]:
        raise ValueError(f"{shown}: a suite config is a mapping with a non-empty 'tasks' mapping")
    unknown = sorted(set(config) - {"scale", "attentions", "seeds", "threads", "control", "fit_args", "tasks"})
    if unknown:
        raise ValueError(f"{shown}: unknown key(s) {', '.join(unknown)}")
    shared_args = tuple(str(a) for a in config.get("fit_args") or [])
    tasks = {}
    for name, entry in config["tasks"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("task_config"), str):
            raise ValueError(f"{shown}: tasks.{name} needs task_config, a path relative to the suite config")
        extra = sorted(set(entry) - {"task_config", "options", "fit_args", "needs_data", "needs_package"})
        if extra:
            raise ValueError(f"{shown}: tasks.{name}: unknown key(s) {', '.join(extra)}")
        options = entry.get("options") or {}
        if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
            raise ValueError(f"{shown}: tasks.{name}.options maps a mechanism to its options ({{k: 256}})")
        tasks[str(name)] = Task(
            str(name),
            (path.parent / entry["task_config"]).resolve(),
            options,
            shared_args + tuple(str(a) for a in entry.get("fit_args") or []),
            entry.get("needs_data"),
            entry.get("needs_package"),
        )
    try:
        return Suite(
            path, str(config.get("scale", path.stem)), str(config["attentions"]), int(config.get("seeds", 3)),
            int(config.get("threads", 1)), bool(config.get("control", True)), tasks,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{shown}: attentions, seeds or threads missing or of the wrong type ({error})") from None


def task_data_dir(task: Task, given: dict[str, str]) -> str | None:
    """The data folder a task reads: ``--data-dirs``' for it, else its config's ``data.init_args.data_dir``."""
    if task.name in given:
        return given[task.name]
    try:
        config = yaml.safe_load(task.task_config.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return None
    data = config.get("data") if isinstance(config, dict) else None
    init = data.get("init_args", {}) if isinstance(data, dict) else {}
    return init.get("data_dir") if isinstance(init, dict) else None


def skip_reason(task: Task, given: dict[str, str]) -> str | None:
    """Why a task that was not named cannot run here (None when it can): its config is missing, or it needs
    data and has none."""
    if not task.task_config.is_file():
        return f"its task config {shown_path(task.task_config)} does not exist"
    if task.needs_package and importlib.util.find_spec(task.needs_package) is None:
        return f"its data come from the package {task.needs_package}, not installed: pip install {task.needs_package}"
    if task.needs_data is None:
        return None
    folder = task_data_dir(task, given)
    if folder is None:
        return f"its data are not here: {task.needs_data}"
    if not Path(folder).is_dir():
        return f"its data folder {folder} does not exist: {task.needs_data}"
    return None


def compare_arguments(
    task: Task, suite: Suite, *, attentions: str, seeds: int, runs_dir: Path, data_dir: str | None,
    timeout: float | None, fit_extra: list[str], jobs: int | None = None,
) -> list[str]:  # fmt: skip
    """The ``zoo compare`` command line of one task of the suite; ``jobs`` None leaves compare's ``--jobs`` default."""
    fit_args = [*task.fit_args, *(["--data.data_dir", data_dir] if data_dir else []), *fit_extra]
    arguments = [
        "--task-config", str(task.task_config), "--experiment", task.name, "--runs-dir", str(runs_dir),
        "--attentions", attentions, "--options", json.dumps(task.options), "--control", str(suite.control).lower(),
        "--seeds", str(seeds), "--threads", str(suite.threads), "--fit-args", json.dumps(fit_args),
    ]  # fmt: skip
    arguments += ["--timeout", str(timeout)] if timeout is not None else []
    return arguments + (["--jobs", str(jobs)] if jobs is not None else [])


def build_parser() -> ArgumentParser:
    parser = Parser("zoo lra", __doc__, EXAMPLES)
    parser.add_argument("--scale", type=Scale, default="lite", help="lite (CPU minutes per run) or reference")
    parser.add_argument(
        "--suite-config", type=str | None, default=None, help="a suite config (default configs/lra/<scale>.yaml)"
    )
    parser.add_argument("--tasks", type=str | None, default=None, help="comma-separated tasks (default: every task)")
    parser.add_argument(
        "--attentions", type=str | None, default=None, help="mechanisms in the flag syntax (default: the config's)"
    )
    parser.add_argument("--seeds", type=int | None, default=None, help="seeds per mechanism (default: the config's)")
    parser.add_argument("--runs-dir", type=str, default="runs", help="the suite goes to <runs_dir>/lra-<scale>/")
    parser.add_argument(
        "--data-dirs", type=dict[str, str], default={}, help="task -> its data folder, e.g. {text: data/aclImdb}"
    )
    parser.add_argument("--timeout", type=float | None, default=None, help="seconds per run before it is stopped")
    parser.add_argument(
        "--jobs", type=int | None, default=None,
        help="runs at once in each task's zoo compare (default: compare's, the usable cores)",
    )  # fmt: skip
    return parser


def main(argv: list[str]) -> int:
    """``zoo lra``; a refused setting is one ``zoo lra: error:`` line, exit code 2."""
    own, fit_extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    out = console()
    parser = build_parser()
    try:
        config = parser.parse_args(own)
    except ArgumentError as error:
        print(f"zoo lra: error: {parser.one_line(str(error).strip())}", file=sys.stderr)
        return 2
    path = Path(config.suite_config) if config.suite_config else SUITES / f"{config.scale}.yaml"
    try:
        suite = read_suite(path)
        named = [t.strip() for t in config.tasks.split(",") if t.strip()] if config.tasks else []
        unknown = [t for t in [*named, *config.data_dirs] if t not in suite.tasks]
        if unknown:
            raise ValueError(
                f"no task {', '.join(map(repr, unknown))} in {shown_path(path)}; choose from {', '.join(suite.tasks)}"
            )
        if config.seeds is not None and config.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {config.seeds}")
        if config.jobs is not None and config.jobs < 1:
            raise ValueError(f"--jobs must be >= 1 (runs at once), got {config.jobs}")
    except ValueError as error:
        print(f"zoo lra: error: {error}", file=sys.stderr)
        return 2
    return run_suite(suite, config, named, fit_extra, out)


def run_suite(suite: Suite, config: Any, named: list[str], fit_extra: list[str], out: Any) -> int:
    """Run each selected task's comparison in turn, then write the suite's table and layout."""
    from experiments.compare import command as compare

    directory = Path(config.runs_dir) / f"lra-{suite.scale}"
    attentions, seeds = config.attentions or suite.attentions, config.seeds or suite.seeds
    not_run: dict[str, str] = {}
    selected = []
    for name, task in suite.tasks.items():
        if named and name not in named:
            continue
        reason = None if name in named else skip_reason(task, config.data_dirs)
        if reason:
            out.print(f"zoo lra: skipping {name}: {reason}")
            not_run[name] = reason
        else:
            selected.append(task)
    codes = {}
    for index, task in enumerate(selected, start=1):
        where = directory / task.name
        out.print(f"[bold]zoo lra[/] {suite.scale}: task {index}/{len(selected)}, {task.name} -> {where}")
        arguments = compare_arguments(
            task, suite, attentions=attentions, seeds=seeds, runs_dir=directory,
            data_dir=config.data_dirs.get(task.name), timeout=config.timeout, fit_extra=fit_extra,
            jobs=config.jobs,
        )  # fmt: skip
        codes[task.name] = compare.main(arguments)
        if codes[task.name] == 130:  # interrupted: the rest waits for the rerun that resumes
            break
    for name, code in codes.items():
        if code == 2:
            not_run[name] = "zoo compare refused it (its error line is above)"
    written = write_outputs(directory, suite, [t.name for t in selected if codes.get(t.name) in (0, 1, 130)], not_run)
    if written:
        out.print(f"wrote {written[0]} and {written[1]}; curves: tensorboard --logdir {directory}")
    if 130 in codes.values():
        out.print("[yellow]interrupted[/]: rerun the same command to resume the suite")
        return 130
    return 2 if 2 in codes.values() else (0 if codes and all(c == 0 for c in codes.values()) else 1)


def write_outputs(directory: Path, suite: Suite, tasks: list[str], not_run: dict[str, str]) -> tuple[Path, Path] | None:
    """``lra.md``, ``lra.csv`` and the suite's TensorBoard layout from the tasks' ``runs.csv``; None when no
    task has finished runs yet."""
    from experiments.compare.report import load_compare

    rows = {}
    for name in tasks:
        if (directory / name / "runs.csv").is_file():
            rows[name] = load_compare(directory / name)
    if not rows:
        return None
    header = [
        f"# Long Range Arena, {suite.scale} scale (zoo lra)",
        "",
        f"- suite config `{shown_path(suite.path.resolve())}`; tasks {', '.join(rows)}; each task's comparison, its "
        "runs and verdicts in its own folder (`<task>/summary.md`)",
    ]
    paths = table.write(directory, table.build(rows), scale=suite.scale, header=header, not_run=not_run)
    write_suite_layout(directory, sorted({f"val/{k[4:]}" for r in rows.values() for row in r for k in row
                                          if k.startswith("val_")}))  # fmt: skip
    return paths


def write_suite_layout(directory: Path, val_metrics: list[str]) -> None:
    """One Custom Scalars layout for the whole suite at ``directory``'s root (replacing an earlier one): the
    charts of :func:`experiments.compare.tensorboard_layout.layout` over every task's metrics, under the
    category ``LRA``; TensorBoard's layouts select tags, not runs, so each chart overlays every task's runs."""
    from torch.utils.tensorboard import SummaryWriter

    from experiments.compare.tensorboard_layout import layout

    for old in directory.glob("events.out.tfevents.*.lra-layout"):
        old.unlink()
    writer = SummaryWriter(log_dir=str(directory), filename_suffix=".lra-layout")
    writer.add_custom_scalars({"LRA (filter runs by task: ^listops/, ...)": layout(val_metrics)["zoo compare"]})
    writer.close()
