"""``zoo compare``: train one task once per attention mechanism and seed (same config, data and steps) and
compare accuracy, throughput and peak memory, all measured in the same training runs.

    zoo compare                                            # the embedded default (configs/compare.yaml)
    zoo compare --attentions 'full,linformer:k=32,local:window=16' --seeds 5
    zoo compare --task-config configs/listops.yaml --experiment listops -- --trainer.max_steps 200

Without ``--task-config`` (or a ``--config`` naming one), ``configs/compare.yaml`` supplies the task, its
sizes (``fit_args``), the seeds and per-mechanism ``options``; with one, only what is given applies. ``--help``
and ``--print_config`` show the defaults of the command they are given with: ``configs/compare.yaml``'s for a
command that names no task, the parser's own (one seed, every mechanism that takes padding masks) otherwise.

``--attentions`` is a list in the flag syntax of every command (``full,linformer:k=32,sharing=kv,local:window=16``;
written out once, with how values are typed, in :mod:`attention_zoo.spec`). An entry without options takes them
from the config's ``options`` section, else the mechanism's defaults. Without ``--attentions``, the config's
``attentions`` list, else every registered mechanism that takes padding masks. Each entry is checked against the
registry (:meth:`attention_zoo.AttentionSpec.checked`) before anything else: an unknown name or option is refused
in one line naming what is allowed. The same mechanism with the same options listed twice (in any order) is
refused. A mechanism listed once runs in the folder of its name; one listed more than once runs in
``AttentionSpec.folder``'s (``linformer-k=32-sharing=kv``, ``linformer-defaults`` without options).
``--control`` adds the no-attention control arm, the registered core ``self_only`` (each position attends only to
itself), as if it were listed by name, unless the list has it. Arguments after ``--`` go to every ``zoo fit``. Every
entry is built (model and data module, no training) before anything runs: a bad name or option stops the comparison
with every bad entry listed.

``--seeds N`` trains each mechanism with seeds ``seed .. seed + N - 1``: the seed sets the model's
initialisation (``seed_everything``) and the training order (``data.shuffle_seed``, where the data module
has it); the data themselves stay the same. Runs go seed by seed (every mechanism with the first seed,
then the second...), so an interrupted comparison has whole seeds done. The summary gives mean ± std and
a 95% interval per mechanism, and each mechanism's paired difference from ``--reference`` (default ``full``)
with its verdict by the rule of ``experiments/stats.py`` (``on par`` within ``--margin``, ``better``,
``worse`` or ``inconclusive``). A ``--reference`` that is none of the entries is refused before anything runs
(left out, it is ``full``, and a comparison without ``full`` has no verdicts); ``--metric`` must be a metric
column (``val_*``, ``test_*``, ``decode_*``, or a throughput, memory or time column), and one that the first
finished run did not log stops the comparison there, with the metrics it logged, before the other runs.

Each run trains in its own ``zoo fit`` process (``threads`` torch threads), so a crash or an out-of-memory
error stays its own and the peak memory is that run's alone (its resident set, even beside other runs); the
processes are forked from one that has imported torch and Lightning once (``experiments/preload.py``),
so a run does not pay those imports. Outputs, in ``<runs_dir>/<experiment>/``: one TensorBoard run per mechanism
and seed (``<label>/seed-<s>``) and a Custom Scalars layout with one chart per metric; ``runs.csv``,
``summary.csv``, ``summary.md``, ``accuracy_vs_throughput.png``, ``peak_memory.png``; the resolved
``compare.yaml``. With ``--bench DIR`` (a ``zoo bench --out`` folder) it also writes ``zoo report``'s Pareto plot
and length table; else with ``long_n`` (the default config's [1024, 4096]) it ends with ``zoo bench`` of the same
mechanisms at those n into ``bench/`` and joins accuracy, time and memory (:mod:`experiments.compare.axes`).

``--test`` also runs ``zoo test`` on each run's ``last.ckpt`` once it is fitted (translation: test BLEU with
beam search, chrF, decoding speed); the test metrics join the run's row (``test_*`` columns).

Rerunning the same command resumes: runs that finished are kept, unfinished ones continue from their last
checkpoint (or start over), missing ones run; more ``--seeds`` add runs. An experiment directory that
holds a different comparison is never touched: the command stops and says so. ``--fresh`` starts a new
directory (``<experiment>-2``, ...). A run that cannot continue (its ``last.ckpt`` unreadable) fails with its
name while the others run; ``--restart <label>/seed-<s>[,...]`` deletes those runs' folders and trains them anew,
and touches no other run. A ``compare.yaml`` that cannot be read stops the command with one line: restore it,
delete it (the folder's runs are then resumed under the command's settings) or pass ``--fresh``.

The files an experiment holds name no path of the machine: ``compare.yaml`` and the summaries name files
relative to the working directory (or to the checkout), and each run's logs, ``run.json`` and ``config.yaml``
are rewritten when its process ends (``experiments/compare/runs.py``).

``--jobs N`` (default: the cores this process may use, ``os.sched_getaffinity``) runs up to N runs at once
with the local launcher, started in the seed-major order above; a run's accuracy does not depend on it (each run
is its own process with its own seeds), but its speed, memory and time do: runs share the cores, caches and
memory bandwidth. Each run records how many runs trained beside it at most (``runs_at_once`` in ``run.json``
and ``runs.csv``); the summary says how many ran at once and marks its speed, memory and time columns
``measured concurrently`` when any run shared the machine (``--jobs 1`` for timings of one run alone). With
``--threads T`` above 1, N x T above the usable cores oversubscribes them: the command says so.

A finished run that logged no ``val_*`` metric never validated (fewer steps than the trainer's
``val_check_interval``): its row says ``validated no``, its mechanism's verdict is ``not validated`` rather than a
verdict on another metric, and one warning line (console and ``summary.md``) names such runs.

Ctrl-C stops the running runs cleanly, writes the summary of what finished (the rest marked interrupted or not
run) and exits with 130. One command at a time per experiment: a second one stops with one error line
(``experiments/compare/lock.py``; ``--force-unlock`` takes over a lock that another host holds).

``--launcher ray`` runs the same ``zoo fit`` subprocesses as Ray tasks, several at once, on a local Ray or on
the cluster at ``--ray-address`` (``experiments/compare/ray_runs.py``); the default ``local`` never imports Ray.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import platform
import re
import shutil
import signal
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentError
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

import attention_zoo as az
from attention_zoo.spec import AttentionSpec, parse_entries
from experiments import preload
from experiments.compare.flags import (
    DEFAULT_CONFIG,
    MAX_SEED,
    build_parser,
    names_task,
    usable_cores,
)
from experiments.compare.lock import ExperimentLocked, experiment_lock
from experiments.compare.ray_runs import LAUNCHER_SETTINGS, run_compare
from experiments.compare.runs import (
    METRIC_STAGES,
    RUN_RECORD,
    Entry,
    Run,
    RunSettings,
    attempt,
    attention_arguments,
    eta_text,
    is_finished,
    is_tested,
    record_runs_at_once,
    run_row,
)
from experiments.compare.summary import (
    CONTROL,
    CORE_METRICS,
    format_interval,
    metric_columns,
    plot,
    primary_metric,
    print_table,
    validation_warning,
    write_runs,
    write_summary,
)
from experiments.compare.tensorboard_layout import write_layout
from experiments.console import console
from experiments.machine_paths import resolve_shown, shown_path
from experiments.ray_launcher import RayLauncherError, connect, require_ray

#: settings that may change between a run of an experiment and its resumption
RESUMABLE_CHANGES = (
    "seeds", "timeout", "fresh", "bench", "long_n", "config", "metric", "reference", "margin", "test", "force_unlock",
    "jobs", *LAUNCHER_SETTINGS,
)  # fmt: skip
#: paths of compare.yaml that name one place however they are written (relative or not)
PATH_SETTINGS = ("task_config", "runs_dir", "shared_dir")


def default_attentions() -> list[str]:
    """Every registered mechanism that accepts padding masks (task batches are padded)."""
    return az.list_attentions(mask=True)


def plan(attentions: str | None, options: dict[str, dict[str, Any]], *, control: bool = False) -> list[Entry]:
    """The mechanisms, in order, each checked against the registry; ``control`` adds the control arm
    (:data:`CONTROL`, as if listed by name) unless the list has it. Raises ValueError, one line, for an unknown
    name or option (every bad entry named) or a repeated entry."""
    requested = parse_entries(attentions) if attentions is not None else [(n, None) for n in default_attentions()]
    if control and all(name != CONTROL for name, _ in requested):
        requested.append((CONTROL, None))
    given = []
    for name, listed in requested:
        if listed is not None:
            given.append((AttentionSpec(name, listed), "command line"))
        elif name in options:
            given.append((AttentionSpec(name, options[name]), "config"))
        else:
            given.append((AttentionSpec(name), "defaults"))
    problems = []
    for spec, _ in given:
        try:
            spec.checked()
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError("; ".join(dict.fromkeys(problems)))
    entries, seen = [], set()
    for spec, options_from in given:
        twins = sum(other.name == spec.name for other, _ in given)
        label = spec.name if twins == 1 else (spec.folder if spec.options else f"{spec.name}-defaults")
        if spec in seen or label in (e.label for e in entries):  # equal specs: the same options in any order
            raise ValueError(f"--attentions lists the same mechanism and options twice: {label}")
        seen.add(spec)
        entries.append(Entry(spec, options_from, label))
    return entries


def reference_problem(reference: str | None, entries: list[Entry]) -> str | None:
    """Why ``--reference`` names no single entry (None when it does, or when it was left out): it must be an
    entry's label, or the mechanism of exactly one entry (as the summary finds it)."""
    if reference is None or any(e.label == reference for e in entries):
        return None
    named = [e.label for e in entries if e.spec.name == reference]
    if len(named) == 1:
        return None
    if named:
        return f"--reference {reference!r} names {len(named)} entries ({', '.join(named)}); give one of these labels"
    labels = ", ".join(e.label for e in entries)
    return f"--reference {reference!r} is none of the entries; choose one of {labels} (left out: full)"


def metric_name_problem(metric: str | None) -> str | None:
    """Why ``--metric`` cannot be a metric column of ``runs.csv`` whatever the task logs (None when it can)."""
    if metric is None or metric in CORE_METRICS or metric.startswith(tuple(f"{s}_" for s in METRIC_STAGES)):
        return None
    return (
        f"--metric {metric!r} is no metric column; give val_<name>, test_<name> (with --test), decode_<name>, or one "
        f"of {', '.join(CORE_METRICS)}"
    )


def unlogged_metric(metric: str | None, run: Run, row: dict[str, Any]) -> str | None:
    """Why ``metric`` cannot judge the comparison, seen in the row of a finished run: the run did not log it
    (None when it did, or when ``metric`` is None or the run did not finish)."""
    if metric is None or row["status"] != "ok":
        return None
    logged = [m for m in metric_columns([row]) if isinstance(row.get(m), (int, float))]
    if metric in logged:
        return None
    return (
        f"--metric {metric!r}: the run {run.name} logged no such metric; it logged {', '.join(logged)} (finished runs "
        "are kept: rerun with one of these to resume)"
    )


def restarted_runs(text: str | None, runs: list[Run]) -> list[Run]:
    """The runs ``--restart`` names (comma-separated ``<label>/seed-<s>``); ValueError for a name that is no run
    of this comparison."""
    if text is None:
        return []
    by_name = {run.name: run for run in runs}
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in by_name]
    if unknown or not names:
        labels = ", ".join(dict.fromkeys(run.entry.label for run in runs))
        seeds = sorted({run.seed for run in runs})
        given = ", ".join(map(repr, unknown)) if unknown else repr(text)
        raise ValueError(
            f"--restart {given}: no run of this comparison; runs are <label>/seed-<s> with label {labels} and s "
            f"{seeds[0]}..{seeds[-1]} (e.g. {runs[0].name})"
        )
    return [by_name[name] for name in dict.fromkeys(names)]


def check_entries(
    entries: list[Entry], task_config: str, fit_args: list[str], *, verbose: bool = False
) -> tuple[list[tuple[str, str]], bool]:
    """Build every entry's model and data module as its ``zoo fit`` would (no training, nothing written).
    Returns the problems, ``(label, the one line zoo fit would refuse it with)`` per bad entry, and whether
    the data module takes ``shuffle_seed``. ``verbose``: a parser error's full message goes to stderr too."""
    from tasks.cli import VERBOSE_ENV, VERBOSE_FLAG, build, init_options, parser_error_line

    problems, shuffle = [], False
    quiet = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        for entry in entries:
            argv = ["-c", task_config, *attention_arguments(entry.spec), *fit_args]
            try:
                with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                    _, data = build(argv, exit_on_error=False)
                shuffle = shuffle or "shuffle_seed" in init_options(type(data))
            except ArgumentError as error:  # jsonargparse: a bad flag or value, shortened as zoo fit shortens it
                if verbose:
                    print(f"{entry.label}: {error}", file=sys.stderr)
                more = "" if verbose else f" ({VERBOSE_FLAG} or {VERBOSE_ENV}=1: the parser's full message)"
                problems.append((entry.label, parser_error_line(str(error)) + more))
            except SystemExit:  # --help or --print_config among the fit arguments: zoo fit prints and stops
                problems.append((entry.label, "zoo fit stops before training (--help or --print_config?)"))
            except Exception as error:  # noqa: BLE001  (any construction error is this entry's problem)
                problems.append((entry.label, str(error)))
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return problems, shuffle


def entry_problems(problems: list[tuple[str, str]], total: int) -> str:
    """The refusal of a comparison with entries that cannot be built: one line when they all fail the same way
    (a bad fit argument fails every entry), else a line per problem, with the entries that have it."""
    labels: dict[str, list[str]] = {}
    for label, problem in problems:
        labels.setdefault(problem, []).append(label)
    count = f"{len(problems)} of {total} entr{'y' if total == 1 else 'ies'} cannot be built, nothing was run"
    if len(labels) == 1:
        ((problem, names),) = labels.items()
        return f"{count} ({', '.join(names)}): {problem}"
    return f"{count}:\n  " + "\n  ".join(f"{', '.join(names)}: {problem}" for problem, names in labels.items())


def experiment_directory(runs_dir: Path, name: str, identity: dict[str, Any], fresh: bool) -> tuple[Path, bool]:
    """``(directory, resuming)``: ``runs_dir/name`` when it is new or holds this same comparison (resume), or
    holds runs without a ``compare.yaml`` (deleted because it was corrupt: resumed under ``identity``); a new
    ``name-2``, ``name-3``... with ``fresh``. ValueError when it holds a different comparison, is no
    comparison, or its ``compare.yaml`` cannot be read."""
    unprintable = any(not c.isprintable() for c in name)
    if not name or name in (".", "..") or "/" in name or "\\" in name or unprintable or len(name.encode()) > 255:
        raise ValueError(
            f"--experiment {name!r} must be a plain folder name (no '/' or '..'); choose where it goes with --runs-dir"
        )
    runs_dir.mkdir(parents=True, exist_ok=True)
    path = runs_dir / name
    if path.exists() and not fresh:
        saved = path / "compare.yaml"
        if not saved.is_file():
            if any(path.glob(f"*/seed-*/{RUN_RECORD}")):
                return path, True
            raise ValueError(f"{path} exists but is not a zoo compare experiment; choose another --experiment")
        earlier, identity = _identity(read_saved_config(saved)), _identity(identity)
        if earlier != identity:
            changed = sorted(k for k in set(earlier) | set(identity) if earlier.get(k) != identity.get(k))
            raise ValueError(
                f"{path} holds a different comparison (it differs in: {', '.join(changed)}); rerun its own command "
                f"to resume it, pass --fresh for a new directory, or choose another --experiment"
            )
        return path, True
    for suffix in ("", *(f"-{i}" for i in range(2, 10_000))):
        candidate = runs_dir / f"{name}{suffix}"
        try:
            candidate.mkdir()
            return candidate, False
        except FileExistsError:
            continue
    raise RuntimeError(f"no free experiment directory for {name!r} under {runs_dir}")


def read_saved_config(saved: Path) -> dict[str, Any]:
    """An experiment's ``compare.yaml``; ValueError, one line with the ways out, when it cannot be read."""
    try:
        config = yaml.safe_load(saved.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        why = f"not YAML{where}: {getattr(error, 'problem', None) or error}"
    else:
        if isinstance(config, dict):
            return config
        kinds = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
        why = "is empty" if config is None else f"holds {kinds.get(type(config), 'a value')}, not a mapping of settings"
    raise ValueError(
        f"{shown_path(saved)} is corrupt ({why}); it records which comparison {shown_path(saved.parent)} holds: "
        "restore it, or delete it to resume that folder's runs under this command's settings, or pass --fresh for "
        "a new directory"
    )


def _identity(config: dict[str, Any]) -> dict[str, Any]:
    """What makes a comparison the same one; a path by the place it names (``a/../configs/x.yaml``, a link to
    it, the file itself and its path relative to the working directory or the checkout are one config); no
    control arm is the same as ``control: false`` (a compare.yaml written before the flag existed)."""
    identity = {k: v for k, v in config.items() if k not in RESUMABLE_CHANGES}
    for key in PATH_SETTINGS:
        if isinstance(identity.get(key), str):
            identity[key] = os.path.realpath(resolve_shown(identity[key]))
    if not identity.get("control"):
        identity.pop("control", None)
    return identity


#: the flags whose value is a config file, or the name of a packaged one
CONFIG_FILE_FLAGS = ("--config", "--task-config")


def main(argv: list[str]) -> int:
    """``zoo compare``; a refused setting (jsonargparse's errors and the checks below, all raised as
    ``ArgumentError`` before anything is written) is one ``zoo compare: error:`` line, exit code 2; a bare
    ``--verbose`` or ``ZOO_VERBOSE=1`` prints the parser's full message first."""
    from tasks.cli import VERBOSE_ENV, VERBOSE_FLAG, ConfigError, parser_error_line, resolve_config_flags, take_verbose

    own, fit_extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    (own, verbose), (fit_extra, fit_verbose) = take_verbose(own), take_verbose(fit_extra)
    verbose = verbose or fit_verbose  # a bare --verbose is no zoo fit option: after -- it asks this command too
    parser = build_parser()
    own = parser.dashed(own)  # once, so that the parses below see dashed flags and each note is printed once
    try:  # a config by name, or by its path in the repository, from any folder (tasks/config_paths.py)
        own = resolve_config_flags(own, CONFIG_FILE_FLAGS)
    except ConfigError as error:
        print(f"zoo compare: error: {error}", file=sys.stderr)
        return 2
    try:
        with contextlib.ExitStack() as held:  # the experiment's lock, once _compare knows the experiment
            return _compare(own, fit_extra, held, verbose)
    except ArgumentError as error:
        message = str(error).strip()
        unrecognized = message.lower().startswith("unrecognized arguments")
        line = parser.one_line(message) if unrecognized else parser_error_line(message)
        if line.endswith(":"):  # jsonargparse's heading of a reason on the lines below (a file that does not exist)
            reasons = [part.strip() for part in message.splitlines()[1:] if part.strip()]
            line = re.sub(r'^Parser key "([^"]+)":', r"--\1:", line) + (f" {reasons[-1]}" if reasons else "")
        line = re.sub(r"^--(\w+)", lambda m: "--" + m[1].replace("_", "-"), line)  # a key as its flag
        if verbose:
            print(message, file=sys.stderr)
        whole = verbose or unrecognized or line == message  # nothing more to see in the parser's full message
        more = "" if whole else f" ({VERBOSE_FLAG} or {VERBOSE_ENV}=1: the parser's full message)"
        print(f"zoo compare: error: {line}{more}", file=sys.stderr)
        return 2


def _compare(own: list[str], fit_extra: list[str], held: contextlib.ExitStack, verbose: bool) -> int:
    default = not names_task(own)  # no task named: the embedded default experiment, under the given overrides
    if default and not DEFAULT_CONFIG.is_file():
        build_parser().error(f"give --task-config or --config (the default {DEFAULT_CONFIG} is missing)")
    parser = build_parser(default_experiment=default)
    config = parser.parse_args(own)
    out = console()
    if config.seed < 0:
        parser.error(f"--seed must be >= 0 (seeds are seed .. seed + seeds - 1), got {config.seed}")
    if config.seeds < 1 or config.threads < 1:
        parser.error(f"--seeds and --threads must be >= 1, got seeds={config.seeds}, threads={config.threads}")
    if config.jobs < 1:
        parser.error(f"--jobs must be >= 1 (runs at once; {usable_cores()} usable cores here), got {config.jobs}")
    if config.seed + config.seeds - 1 > MAX_SEED:
        parser.error(
            f"--seed {config.seed} with --seeds {config.seeds} goes past {MAX_SEED}, the largest seed a run takes"
        )
    if problem := metric_name_problem(config.metric):
        parser.error(problem)
    if config.margin is not None and not config.margin >= 0:
        parser.error(f"--margin must be >= 0 (in the metric's units), got {config.margin}")
    ray_settings = [f"--{k.replace('_', '-')}" for k in LAUNCHER_SETTINGS[1:] if getattr(config, k) not in (None, 0)]
    if config.launcher == "local" and ray_settings:
        parser.error(f"{', '.join(ray_settings)} go with --launcher ray")
    if config.launcher == "ray":
        try:
            require_ray()
        except RayLauncherError as error:
            print(f"zoo compare: error: {error}", file=sys.stderr)
            return 2
    if config.bench is not None:  # the report at the end needs its timings: a bad folder stops the comparison now
        from experiments.compare.report import load_bench

        try:
            load_bench(Path(config.bench))
        except ValueError as error:
            parser.error(f"--bench: {error}")
    task_config = os.path.realpath(config.task_config.absolute)  # the file, as the summary and resume name it
    shown_config = shown_path(task_config)
    fit_args = [*config.fit_args, *fit_extra]
    try:
        entries = plan(config.attentions, config.options, control=config.control)
        seeds = list(range(config.seed, config.seed + config.seeds))
        runs = [Run(entry, seed) for seed in seeds for entry in entries]  # seed-major: whole seeds finish first
        restart = restarted_runs(config.restart, runs)
    except ValueError as error:
        parser.error(str(error))
    if problem := reference_problem(config.reference, entries):
        parser.error(problem)
    if config.launcher == "local":
        preload.warm_up()  # the runs' imports, in parallel with the checks
    out.print(f"[bold]zoo compare[/]: checking {len(entries)} mechanism(s) on {shown_config} ...")
    problems, vary_data_order = check_entries(entries, task_config, fit_args, verbose=verbose)
    if problems:
        print(f"zoo compare: error: {entry_problems(problems, len(entries))}", file=sys.stderr)
        return 2
    resolved = yaml.safe_load(parser.dump(config, skip_none=False, skip_check=True))
    resolved.pop("restart")  # an action on this command's runs, not a setting: a rerun from compare.yaml repeats none
    resolved["task_config"], resolved["fit_args"] = shown_config, fit_args
    for key in ("runs_dir", "shared_dir", "bench"):
        if resolved[key] is not None:
            resolved[key] = shown_path(resolved[key])
    if config.launcher == "ray":
        try:  # before the experiment directory is made
            connect(config.ray_address)
        except RayLauncherError as error:
            print(f"zoo compare: error: {error}", file=sys.stderr)
            return 2
    runs_dir = Path(config.shared_dir or config.runs_dir)  # --shared_dir: the runs directory every node sees
    try:
        directory, resuming = experiment_directory(
            runs_dir, config.experiment or Path(config.task_config.absolute).stem, _identity(resolved), config.fresh
        )
    except ValueError as error:
        parser.error(str(error))
    try:  # before anything in the experiment is written: a second command there would overwrite the first's runs
        held.enter_context(experiment_lock(directory, force_unlock=config.force_unlock, say=out.print))
    except ExperimentLocked as error:
        print(f"zoo compare: error: {error}", file=sys.stderr)
        return 2
    (directory / "compare.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True))
    for run in restart:
        if run.directory(directory).exists():
            shutil.rmtree(run.directory(directory))
            out.print(f"--restart: deleted {shown_path(run.directory(directory))}; {run.name} trains anew")
    settings = RunSettings(
        task_config, tuple(fit_args), config.threads, config.timeout, config.test, vary_data_order=vary_data_order,
        shown_experiment=shown_path(directory),
    )  # fmt: skip
    reference = config.reference or "full"

    done = [r for r in runs if _is_done(r.directory(directory), config.test)]
    out.print(
        f"{'resuming' if resuming else 'new experiment'} {directory}: {len(entries)} mechanism(s) x {len(seeds)} "
        f"seed(s) = {len(runs)} runs" + (f", {len(done)} finished earlier" if done else "")
    )
    if not vary_data_order and len(seeds) > 1:
        out.print("[yellow]the data module has no shuffle_seed: seeds vary the model initialisation only[/]")

    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    rows: list[dict[str, Any]] = []
    metric_check = MetricCheck(config.metric)
    try:
        if config.launcher == "ray":
            for run in done:  # finished earlier: the metric is checked before anything is sent to Ray
                metric_check(run, _unrun_row(run, directory, config.test))
            if not metric_check.problem:

                def finish(run: Run, *result: Any) -> dict[str, Any]:
                    row = _finish(run, run.directory(directory), *result, stop=stop, out=out)
                    if metric_check(run, row):
                        stop.set()  # cancels the other runs, which a rerun resumes
                    return row

                pending = [run for run in runs if run not in done]
                finished = run_compare(
                    pending, len(runs), directory, settings, config, stop=stop, finish=finish, out=out
                )
                rows = [finished.get(run.name) or _unrun_row(run, directory, config.test) for run in runs]
        else:
            if config.jobs > 1 and config.jobs * config.threads > usable_cores():
                out.print(
                    f"[yellow]--jobs {config.jobs} x --threads {config.threads} is more than the {usable_cores()} "
                    "usable cores: the runs share them[/]"
                )
            rows = run_locally(runs, done, directory, settings, config.jobs, stop=stop, check=metric_check, out=out)
    finally:
        signal.signal(signal.SIGINT, previous)
    if metric_check.problem:
        print(f"zoo compare: error: {metric_check.problem}", file=sys.stderr)
        return 2

    metric = config.metric or primary_metric(rows)
    header = [
        f"# zoo compare: {directory.name}",
        "",
        f"- task config: `{shown_config}`; extra fit args: `{' '.join(fit_args) or '-'}`",
        f"- seeds {seeds[0]}..{seeds[-1]} per mechanism (model initialisation"
        + (" and training order" if vary_data_order else " only; the data module has no shuffle_seed")
        + "); the data are the same in every run",
        f"- {config.threads} torch thread(s) per run, "
        + (
            at_once_text(rows, config.jobs)
            if config.launcher == "local"
            else f"runs as Ray tasks at once ({config.run_cpus or config.threads:g} CPU, {config.run_gpus:g} GPU each)"
        )
        + f"; {platform.platform()}; Python {platform.python_version()}",
        "- val_*: last validation of the run; tokens_per_s: real (unpadded) tokens per second of training steps "
        "(forward, backward, optimizer) after 5 warm-up steps; peak_mem_mb: CUDA max allocated, or on CPU the run's "
        "peak resident set size (includes the PyTorch process baseline); train_mem_mb: that peak minus the memory "
        "in use when training started; fit_s: Trainer.fit wall time",
    ]
    concurrent = config.launcher == "ray" or measured_concurrently(rows)
    write_runs(directory, rows)
    summary = write_summary(
        directory, rows, header, metric=metric, reference=reference, margin=config.margin, concurrent=concurrent
    )
    plot(summary, metric or primary_metric(rows), directory, directory.name)
    write_layout(directory, sorted({f"val/{k[4:]}" for r in rows for k in r if k.startswith("val_")}))
    print_table(summary, metric, out, concurrent=concurrent)
    if warning := validation_warning(rows):
        out.print(f"[yellow]warning[/]: {escape(warning)}")
    written = "summary.md, summary.csv, runs.csv, accuracy_vs_throughput.png, peak_memory.png"
    if config.bench:
        from experiments.compare.report import write_report

        try:
            report = write_report(directory, Path(config.bench))
            written += f", {report.name}, pareto.png"
        except ValueError as error:  # e.g. no finished full run to compare with: the comparison's files stand
            print(f"zoo compare: warning: no zoo report: {error}", file=sys.stderr)
    elif config.long_n and not stop.is_set():  # an interrupted comparison is not timed
        from experiments.compare.axes import long_n_axes

        joined = long_n_axes(directory, [e.spec for e in entries], config.long_n, metric=metric, reference=reference,
                             margin=config.margin, say=lambda line: print(line, file=sys.stderr))  # fmt: skip
        written += "".join(f", {name}" for name in joined)
    out.print(f"wrote {directory}/ {written}; curves: tensorboard --logdir {directory}")
    if stop.is_set():
        out.print(f"[yellow]interrupted[/]: rerun the same command to resume {directory}")
        return 130
    return 0 if any(r["status"] == "ok" for r in rows) else 1


class MetricCheck:
    """``--metric`` against the first run that finishes (:func:`unlogged_metric`): called with each run and its
    row, True (and ``problem`` set) when the comparison must stop; later runs are not looked at."""

    def __init__(self, metric: str | None) -> None:
        self.metric, self.checked, self.problem = metric, metric is None, ""

    def __call__(self, run: Run, row: dict[str, Any]) -> bool:
        if not self.checked and row["status"] == "ok":
            self.checked, self.problem = True, unlogged_metric(self.metric, run, row) or ""
        return bool(self.problem)


def run_locally(
    runs: list[Run],
    done: list[Run],
    directory: Path,
    settings: RunSettings,
    jobs: int,
    *,
    stop: threading.Event,
    check: MetricCheck,
    out: Any,
) -> list[dict[str, Any]]:
    """Run every run of ``runs`` not in ``done``, up to ``jobs`` at once, in the order of ``runs``: each in a
    thread of this process that starts and watches its own ``zoo fit`` process (:func:`attempt`), while this
    thread starts the next ones, records each finished run's ``runs_at_once`` and prints its line. ``check`` sees
    the runs finished earlier first (nothing starts when one of them stops the comparison), then each run as it
    ends; its stopping the comparison, or ``stop`` (Ctrl-C), interrupts the runs under way (a rerun resumes them)
    and starts no other. Returns the rows of ``runs``, in order."""
    rows = {run.name: _unrun_row(run, directory, settings.test) for run in done}
    if any(check(run, rows[run.name]) for run in done):
        return [rows.get(run.name) or _unrun_row(run, directory, settings.test) for run in runs]
    waiting = [run for run in runs if run not in done]
    running: dict[Future, Run] = {}
    at_once: dict[str, int] = {}  # per running run: the most runs under way at once since it started
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with (
        Progress(*columns, TimeElapsedColumn(), console=out) as progress,
        ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="zoo-run") as pool,
    ):
        overall = progress.add_task("[bold]runs", total=len(runs), completed=len(done))
        trained_s: list[float] = []  # wall times of the runs trained now: the ETA's mean
        progress.update(overall, description=f"[bold]runs[/] {eta_text(trained_s, len(waiting), jobs)}")
        try:
            while waiting or running:
                while waiting and len(running) < jobs and not stop.is_set():
                    run = waiting.pop(0)
                    running[pool.submit(_attempt, run, directory, settings, stop, progress)] = run
                    for name in (r.name for r in running.values()):
                        at_once[name] = max(at_once.get(name, 0), len(running))
                if not running:
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in sorted(finished, key=lambda f: runs.index(running[f])):
                    run = running.pop(future)
                    run_dir = run.directory(directory)
                    most = at_once.pop(run.name)
                    how, wall, ok, reason = future.result()
                    if ok and how != "already fitted":  # trained now: its speed and memory were measured now
                        record_runs_at_once(run_dir, most)
                        trained_s.append(wall)
                    rows[run.name] = _finish(run, run_dir, how, wall, ok, reason, stop=stop, out=out)
                    progress.advance(overall)
                    if check(run, rows[run.name]):
                        stop.set()  # interrupts the runs under way, which a rerun resumes
                left = eta_text(trained_s, len(waiting) + len(running), jobs)
                progress.update(overall, description=f"[bold]runs[/] {left}")
        except BaseException:
            stop.set()  # the pool's threads stop their runs before the pool is left
            raise
    return [rows.get(run.name) or _unrun_row(run, directory, settings.test) for run in runs]


def _attempt(
    run: Run, directory: Path, settings: RunSettings, stop: threading.Event, progress: Progress
) -> tuple[str, float, bool, str]:
    """:func:`attempt` with a progress bar of the run's steps while it trains (its step as its ``run.json`` says,
    rewritten every second by the run; ``starting`` until the run has begun training)."""
    task = progress.add_task(f"{run.name} [dim]starting[/]", total=None)
    on_progress = lambda step, total: progress.update(task, description=run.name, completed=step, total=total)
    try:
        return attempt(run, directory, settings, stop=stop, on_progress=on_progress)
    finally:
        progress.remove_task(task)


def measured_concurrently(rows: list[dict[str, Any]]) -> bool:
    """Whether any finished run trained beside another (its ``runs_at_once`` above 1)."""
    return any((row.get("runs_at_once") or 1) > 1 for row in rows if row["status"] == "ok")


def at_once_text(rows: list[dict[str, Any]], jobs: int) -> str:
    """How the local launcher ran the runs, for the summary's heading."""
    most = max((row.get("runs_at_once") or 1 for row in rows if row["status"] == "ok"), default=1)
    if most == 1:
        return f"runs one after another (--jobs {jobs})"
    return f"up to {most} runs at once (--jobs {jobs}; speed, memory and time measured concurrently)"


def _unrun_row(run: Run, directory: Path, test: bool) -> dict[str, Any]:
    """The row of a run that did not run now: finished earlier, or never started before an interruption."""
    run_dir = run.directory(directory)
    if _is_done(run_dir, test):
        return run_row(run, run_dir, status="ok", wall_s=None)
    return run_row(run, run_dir, status="not run", wall_s=None, reason="the comparison was interrupted first")


def _finish(
    run: Run, run_dir: Path, how: str, wall: float, ok: bool, reason: str, *, stop: threading.Event, out: Any
) -> dict[str, Any]:
    """The row of a run that has just ended (here or on Ray), and its one line of output."""
    status = "ok" if ok else ("interrupted" if stop.is_set() else "failed")
    row = run_row(run, run_dir, status=status, wall_s=wall, reason=reason)
    # one line per finished run, so logs (no live bar off a terminal) show progress too
    extra = "" if how == "new" else f" ({how})"
    accuracy = f"val_acc {format_interval(_single(row.get('val_acc')), 'val_acc')}"
    out.print(
        f"  {run.name}: {status}{extra}, {'validation never ran' if row['validated'] == 'no' else accuracy}, "
        f"{format_interval(_single(row.get('tokens_per_s')), 'tokens_per_s')} tokens/s, {wall:.1f} s"
        + (f" - {reason}" if reason else "")
    )
    return row


def _is_done(run_dir: Path, test: bool) -> bool:
    return is_finished(run_dir) and (not test or is_tested(run_dir))


def _single(value: Any):
    from experiments.stats import summarize

    return summarize([value]) if isinstance(value, (int, float)) else None
