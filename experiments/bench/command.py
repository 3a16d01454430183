"""``zoo bench``: time, memory and FLOP/s of attention mechanisms across sequence lengths, against full
attention, written to ``--out`` as JSONL + CSV + Markdown (the papers' table layouts) + PNG + TensorBoard.

  zoo bench --attentions full,linformer:k=128 --seq-lens 512,1024 --mode fwd+bwd
  zoo bench --config configs/bench/linformer_table3.yaml --out runs/linformer_table3
  zoo bench --config configs/bench/decoding.yaml --out runs/decoding   (greedy decoding, cache vs not)
  zoo bench --check-targets          (the project's CPU performance targets; = zoo targets)
  zoo bench --segments 8 --seq-lens 4096   (8 packed documents per row against the same documents padded)

The targets are defined at fixed shapes: with ``--check-targets`` a sweep setting other than the mechanisms
named, threads, repeats, warmup, rounds, the case timeout, isolation and the memory budget is refused.

Every flag is also a YAML key of ``--config`` (underscores for dashes); flags win over the file. List
flags take comma-separated values; ``--attentions`` takes the flag syntax of :mod:`attention_zoo.spec`. Without
``--attentions`` every registered mechanism runs, with its performance-target options where the
project has a target for it, else its defaults, else its first example config (tiny: a test config).
``full`` (SDPA backend) is added as the baseline when the sweep lacks it. A rerun with the same
``--out`` resumes: cases already in ``results.jsonl`` are skipped (``--retry-failed`` redoes failures).
``--rounds R`` measures the whole sweep R times, one round after another, and reports each case's fastest
round: a case's repeats then span minutes of the machine's drift, as its baseline's do.
``--launcher ray`` spreads the cases over a Ray cluster, one timing case per device at a time
(``experiments/bench/ray_runs.py``); the default ``local`` runs them one after another and never imports Ray.

Nothing runs (and ``--out`` is not created) until the whole sweep is valid: a bad setting, an entry its
mechanism rejects at every size, or a sweep of no case at all ends ``zoo bench`` with exit code 2 and
one line per problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
import warnings
from pathlib import Path
from typing import Any

import yaml

from experiments.bench.cases import BenchConfig, Case, SweepEntry, expand, invalid_entries, load_config
from experiments.console import console
from experiments.subcommands import ZooArgumentParser
from tasks.config_paths import ConfigNotFoundError, resolve_config

if typing.TYPE_CHECKING:  # torch, the zoo and the measuring modules are imported where used: --help stays fast
    from attention_zoo.spec import AttentionSpec

#: the sweep settings that ``--check-targets`` honours; every other one would change what a target is measured at
TARGET_SETTINGS = {"attentions", "threads", "repeats", "warmup", "rounds", "case_timeout_s", "isolation",
                   "memory_budget_gb"}  # fmt: skip
#: short spellings of list flags (``--mode fwd+bwd`` reads as well as ``--modes``)
ALIASES = {"modes": "--mode", "dtypes": "--dtype", "levels": "--level"}


def _comma_list(item: type) -> Any:
    def parse(text: str) -> list[Any]:
        return [item(v) for v in text.split(",") if v]

    parse.__name__ = f"comma-separated {item.__name__}"  # argparse's "invalid ... value" names it
    return parse


TARGETS_DOC = """zoo targets: the project's CPU performance targets, measured and judged (the same command as zoo bench
--check-targets): each mechanism's speedup over full attention at n = 4096 and its scaling from n = 2048 to 8192,
at the fixed shapes the targets are defined at (the attention core, forward+backward, float32, CPU, one thread,
B=1 H=8 D=64). Only the settings below apply; a rerun with the same --out resumes.

  zoo targets
  zoo targets --attentions linear,performer --rounds 3 --paired-rounds 8 --out runs/targets
"""


def config_file(value: str) -> str:
    """``--config``: a sweep file here, or a packaged one by name (``bench/decoding``,
    :func:`tasks.config_paths.resolve_config`)."""
    try:
        return resolve_config(value)
    except ConfigNotFoundError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser(prog: str = "zoo bench", *, targets_only: bool = False) -> ZooArgumentParser:
    """``zoo bench``'s parser, or with ``targets_only`` ``zoo targets``'s: its own help, which lists only the
    settings a target honours (:data:`TARGET_SETTINGS`); the other sweep flags stay accepted, unlisted, so that a
    sweep setting is refused with the reason (:func:`plan`), not as an unknown flag."""
    parser = ZooArgumentParser(prog, TARGETS_DOC if targets_only else __doc__)
    hidden = argparse.SUPPRESS
    config_help = "YAML sweep file, or a packaged one by name: bench/decoding (keys: the flags below, underscores)"
    parser.add_argument("--config", type=config_file, help=hidden if targets_only else config_help)
    hints = typing.get_type_hints(BenchConfig)
    for spec in dataclasses.fields(BenchConfig):
        flags = ["--" + spec.name.replace("_", "-")] + ([ALIASES[spec.name]] if spec.name in ALIASES else [])
        hint, text = hints[spec.name], spec.metadata["help"]
        shown = not targets_only or spec.name in TARGET_SETTINGS
        options: dict[str, Any] = {"default": argparse.SUPPRESS, "help": text if shown else hidden}
        if spec.name == "attentions":
            options["type"] = str
        elif hint is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is list:
            options["type"] = _comma_list(typing.get_args(hint)[0])
        else:
            options["type"] = next(t for t in (int, float, str) if t in (hint, *typing.get_args(hint)))
        parser.add_argument(*flags, dest=spec.name, **options)
    default_out = "runs/targets" if targets_only else "runs/bench; runs/targets with --check-targets"
    parser.add_argument("--out", help=f"results directory, reused = resumed (default {default_out})")
    parser.add_argument("--retry-failed", action="store_true", help="rerun cases whose status is not ok")
    parser.add_argument("--report-only", action="store_true", help="only redraw tables and plots from --out")
    if targets_only:
        parser.set_defaults(check_targets=True, segments=None)
    else:
        parser.add_argument(
            "--check-targets",
            action="store_true",
            help="run the performance-target cases (of the --attentions named, default all) and print them",
        )
    paired = "after the sweep" if targets_only else "with --check-targets: after the sweep"
    parser.add_argument(
        "--paired-rounds",
        type=int,
        default=0,
        help=f"{paired}, time every speedup and scaling target interleaved with its baseline for this many rounds "
        "and judge it on its 95%% interval (experiments/bench/paired_targets.py; default 0: not run)",
    )
    parser.add_argument(
        "--paired-blocks", type=int, default=4, help="runs of rounds the paired intervals are over (default 4)"
    )
    parser.add_argument(
        "--paired-keep-freed",
        action="store_true",
        help="the paired rows with glibc keeping freed memory (experiments/bench/allocator.py; rows kept apart)",
    )
    parser.add_argument(
        "--launcher", choices=["local", "ray"], default="local", help="local: one case after another; ray: Ray tasks"
    )
    parser.add_argument("--ray-address", help="ray: auto, ray://host:port or host:port (default: a local Ray)")
    parser.add_argument("--run-cpus", type=float, help="ray: CPUs reserved per case (default 1)")
    if not targets_only:
        parser.add_argument(
            "--segments",
            type=int,
            help="time each mechanism on rows of this many packed documents against the same documents padded one "
            "per row, interleaved in one process (experiments/bench/packed.py; default: not run)",
        )
    return parser


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def default_attentions() -> list[AttentionSpec]:
    """One config per registered mechanism (see the module docstring for which)."""
    import attention_zoo as az
    from experiments.bench import targets

    target_options = {t.attention: t.options for t in targets.TARGETS}
    specs = []
    for name in az.list_attentions():
        cls = az.get_attention_class(name)
        if name in target_options:
            options = target_options[name]
        elif all(not s.required for s in az.attention_options(cls)):
            options = {}
        else:
            options = cls.example_configs[0]
        specs.append(az.AttentionSpec(name, options))
    return specs


def with_baseline(config: BenchConfig) -> BenchConfig:
    from attention_zoo.spec import AttentionSpec
    from experiments.bench import tables

    if not config.attentions:
        config = dataclasses.replace(config, attentions=[SweepEntry(spec) for spec in default_attentions()])
    if any(tables.is_baseline({"attention": e.spec.name, "options": e.spec.options}) for e in config.attentions):
        return config
    console().print("adding full (SDPA backend) as the baseline")
    return dataclasses.replace(config, attentions=[SweepEntry(AttentionSpec("full")), *config.attentions])


def plan(args: argparse.Namespace, overrides: dict[str, Any]) -> tuple[BenchConfig, list[Case], set[str] | None]:
    """The validated sweep and its cases (and, with ``--check-targets``, the mechanisms named); raises
    ``ValueError`` listing every problem, before anything has run or been written."""
    from experiments.bench import targets

    config = load_config(args.config, overrides)
    names = None
    if args.check_targets:
        given = named_settings(args, overrides)
        fixed = [name for name in dataclasses.fields(BenchConfig) if name.name in given - TARGET_SETTINGS]
        if fixed:
            flags = ", ".join("--" + spec.name.replace("_", "-") for spec in fixed)
            raise ValueError(
                f"{flags}: not settings of the performance targets, which are defined at fixed shapes (core fwd+bwd, "
                "float32, CPU, B=1 H=8 D=64, n = 256 to 8192); zoo targets takes "
                + ", ".join("--" + name.replace("_", "-") for name in sorted(TARGET_SETTINGS))
                + "; zoo bench times other shapes"
            )
        names = {e.spec.checked().name for e in config.attentions} if "attentions" in overrides else None
        if not targets.selected(names):
            have = ", ".join(sorted({t.attention for t in targets.TARGETS}))
            raise ValueError(f"no performance target for {sorted(names or [])}; targets exist for: {have}")
        return config, [c for t in config.threads for c in targets.target_cases(names, t)], names
    config = with_baseline(config)
    problems = invalid_entries(config)
    if problems:
        raise ValueError(
            f"{len(problems)} invalid attention entr{'y' if len(problems) == 1 else 'ies'}, nothing was run:\n  "
            + "\n  ".join(problems)
        )
    cases = expand(config, resolve_device(config.device))
    if not cases:
        bounds = ", ".join(f"{e.spec.label} [{e.min_seq_len}, {e.max_seq_len or 'any'}]" for e in config.attentions)
        raise ValueError(f"the sweep has no case: no attention applies to seq_lens {config.seq_lens} ({bounds})")
    for entry in config.attentions:
        if not any(entry.fits(n) for n in config.seq_lens):
            bounds = f"[{entry.min_seq_len}, {entry.max_seq_len or 'any'}]"
            console().print(f"skipping {entry.spec.label}: no n of seq_lens {config.seq_lens} lies in its {bounds}")
    return config, cases, names


def named_settings(args: argparse.Namespace, overrides: dict[str, Any]) -> set[str]:
    """The sweep settings set on the command line (``overrides``) or in the ``--config`` file."""
    return set(overrides) | (set(yaml.safe_load(Path(args.config).read_text()) or {}) if args.config else set())


def main(argv: list[str], prog: str = "zoo bench") -> int:
    return run(build_parser(prog).parse_args(argv), prog)


def run(args: argparse.Namespace, prog: str) -> int:
    """Run a parsed ``zoo bench`` or ``zoo targets`` (``prog``) command line."""
    from experiments.bench.store import HalfWrittenLine

    args.out, args.prog = Path(args.out or ("runs/targets" if args.check_targets else "runs/bench")), prog
    show = warnings.showwarning

    def one_line(message: Warning | str, category: type[Warning], *rest: Any, **options: Any) -> None:
        if issubclass(category, HalfWrittenLine):
            print(f"{prog}: note: {message}", file=sys.stderr)
        else:
            show(message, category, *rest, **options)

    with warnings.catch_warnings():
        warnings.showwarning = one_line
        return _main(args)


def _results_folder(out: Path, report_only: bool, check_targets: bool) -> str | None:
    """Why ``out`` cannot hold this command's results (or, ``report_only``, has none to report), or None."""
    from experiments.bench import paired_targets

    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder"
    records = ["results.jsonl"] + [paired_targets.PAIRED_FILE] * check_targets
    if report_only and not any((out / name).is_file() for name in records):
        return f"--out {out} holds no {' or '.join(records)}: nothing to report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"--out {out}: cannot create the folder ({error.strerror})"
    return None


def _main(args: argparse.Namespace) -> int:
    from rich.markdown import Markdown

    from experiments.bench import paired_targets, tables, targets
    from experiments.bench.report import write_outputs
    from experiments.bench.runner import Runner
    from experiments.bench.store import ResultStore, selected_rows

    if args.launcher == "local" and (args.ray_address is not None or args.run_cpus is not None):
        print(f"{args.prog}: error: --ray-address and --run-cpus go with --launcher ray", file=sys.stderr)
        return 2
    if (args.paired_rounds or args.paired_keep_freed) and not args.check_targets:
        print(f"{args.prog}: error: --paired-rounds and --paired-keep-freed go with --check-targets (zoo targets)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.paired_rounds < 0 or args.paired_blocks < 1 or args.paired_rounds % args.paired_blocks:
        print(f"{args.prog}: error: --paired-rounds must be >= 0 and a multiple of --paired-blocks (>= 1), got "
              f"{args.paired_rounds} and {args.paired_blocks}", file=sys.stderr)  # fmt: skip
        return 2
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in fields}
    if args.segments is not None:
        from experiments.bench import packed  # it builds on this module

        return packed.main(args, overrides)
    try:
        config, cases, names = plan(args, overrides)
    except (ValueError, OSError, yaml.YAMLError) as error:  # OSError, YAMLError: an unreadable --config file
        print(f"{args.prog}: error: {error}", file=sys.stderr)
        return 2
    out = console()
    device = "cpu" if args.check_targets else resolve_device(config.device)
    if args.launcher == "ray" and not args.report_only:
        from experiments import ray_launcher
        from experiments.bench import ray_runs

        try:  # before --out is created: Ray installed, reachable, one timing slot per device
            ray_launcher.connect(args.ray_address, bench_device=device)
        except ray_launcher.RayLauncherError as error:
            print(f"{args.prog}: error: {error}", file=sys.stderr)
            return 2
    problem = _results_folder(args.out, args.report_only, args.check_targets)
    if problem:
        print(f"{args.prog}: error: {problem}", file=sys.stderr)
        return 2
    try:
        store = ResultStore(args.out)
        paired_path = args.out / paired_targets.PAIRED_FILE
        measure_paired = args.check_targets and args.paired_rounds > 0 and not args.report_only
        paired_rows = paired_targets.read_rows(paired_path, repair=measure_paired) if args.check_targets else []
    except ValueError as error:  # a line that is not a result row: refused before anything is measured or written
        print(f"{args.prog}: error: {error}", file=sys.stderr)
        return 2
    if args.launcher == "ray" and not args.report_only:
        ray_runs.run_bench(config, store, device, cases, retry_failed=args.retry_failed, run_cpus=args.run_cpus or 1)
    elif not args.report_only:
        Runner(config, store, device).run(cases, retry_failed=args.retry_failed)
    paths = write_outputs(store)
    results = store.best()
    if args.check_targets:
        for threads in config.threads:
            out.print(targets.targets_table(results, names, threads))
        chosen = targets.selected(names)
        allocator = "keep-freed" if args.paired_keep_freed else "default"
        if measure_paired:
            settings = dict(rounds=args.paired_rounds, blocks=args.paired_blocks, keep_freed=args.paired_keep_freed)
            out.print(paired_targets.table(paired_targets.run(chosen, paired_path, **settings), chosen, allocator))
        elif paired_rows:
            out.print(paired_targets.table(paired_rows, chosen, allocator))
    else:
        if args.report_only:  # what --out holds, not the cases a sweep of these settings would run
            swept = selected_rows(list(results.values()), config, named_settings(args, overrides))
            others = sorted({tables.label(r) for r in results.values() if not tables.is_baseline(r)})
            if others and all(tables.is_baseline(r) for r in swept):
                print(f"{args.prog}: note: the settings named select no stored case but full's; {args.out} holds "
                      f"{', '.join(others)}", file=sys.stderr)  # fmt: skip
        else:
            keys = {c.key() for c in cases}
            swept = [row for key, row in results.items() if key in keys]
        out.print(Markdown(tables.nystromformer_table(swept)))
        out.print(Markdown("**Crossover**\n\n" + tables.crossover_table(swept)))
        decoding = tables.decoding_table(swept)
        if decoding:
            out.print(Markdown("**Greedy decoding: cache vs recomputation**\n\n" + decoding))
    out.print(
        f"wrote {paths['jsonl']}, {paths['csv']}, {paths['markdown']}, {len(paths['plots'])} plot(s) "
        f"in {args.out}/plots, TensorBoard logs in {paths['tensorboard']}"
    )
    return 0


def targets_main(argv: list[str]) -> int:
    """``zoo targets [--attentions a,b] [--repeats R] [--threads T] [--out DIR]``: ``zoo bench --check-targets``
    with a parser and help of its own."""
    return run(build_parser("zoo targets", targets_only=True).parse_args(argv), "zoo targets")
