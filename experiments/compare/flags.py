"""``zoo compare``'s command line: its parser, whose ``--help`` and ``--print_config`` show the defaults of the
command they are given with, and :func:`main`, which prints the help without importing torch, Lightning or the
zoo (:mod:`experiments.compare.command` runs the comparison)."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser
from jsonargparse.typing import Path_fr

from experiments.compare.summary import CONTROL
from experiments.subcommands import OneLineErrors, examples_epilog, jsonargparse_formatter, plain

#: what ``--help`` says the command does
DESCRIPTION = (
    "zoo compare: train one task once per attention mechanism and seed (same config, data and steps) and compare "
    "accuracy, throughput and peak memory, all measured in the same training runs."
)
#: the task configs: ``configs/`` of the repository, which ``experiments/configs`` links to, so that a wheel ships
#: them as package data of ``experiments`` and an installed ``zoo compare`` finds its default where it is installed
CONFIGS = Path(str(resources.files("experiments") / "configs"))
DEFAULT_CONFIG = CONFIGS / "compare.yaml"
#: the largest seed Lightning's seed_everything takes (numpy's seeds are unsigned 32-bit)
MAX_SEED = 2**32 - 1
#: the examples of ``--help``
EXAMPLES = (
    "zoo compare --attentions full,linformer:k=32,local:window=16 --seeds 5 --jobs 2",
    "zoo compare --task-config configs/listops.yaml --experiment listops -- --trainer.max_steps 200",
)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or ``taskset`` narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Parser(OneLineErrors, ArgumentParser):
    """jsonargparse's parser for ``zoo compare`` and ``zoo lra``: plain help (:func:`experiments.subcommands.plain`,
    examples kept line for line), a usage error in one line with the closest flags, and a flag's underscore spelling
    (``--task_config``) read as its dashed one (``--task-config``) with a note. Config files keep their keys
    (``task_config:``): jsonargparse names a dashed flag's key with underscores."""

    def __init__(self, prog: str, doc: str, examples: Sequence[str], **options: Any) -> None:
        super().__init__(
            prog=prog, description=plain(doc.split("\n\n")[0]), epilog=examples_epilog(examples),
            formatter_class=jsonargparse_formatter(), exit_on_error=False, **options,
        )  # fmt: skip

    def one_line(self, message: str) -> str:
        """:meth:`OneLineErrors.one_line`, where a misspelt flag is named with every flag about as close as the
        closest (``--seedz``: ``--seed`` or ``--seeds``; difflib alone prefers the shorter), and a setting's key
        (``task_config``) as its flag (``--task-config``)."""
        unrecognized = re.match(r"unrecognized arguments: (.*)", message, flags=re.IGNORECASE | re.DOTALL)
        if not unrecognized:
            return re.sub(r"^--(\w+)", lambda m: "--" + m[1].replace("_", "-"), super().one_line(message))
        given = [arg.split("=", 1)[0] for arg in unrecognized[1].split()]
        flags = [arg for arg in given if arg.startswith("-")] or given
        long_flags = [flag for flag in self.flags() if flag.startswith("--")]
        named = [flag + (closest_flags(flag, long_flags) if flag.startswith("-") else "") for flag in flags]
        hint = "" if any("did you mean" in n for n in named) else f"; {self.prog} --help lists the options"
        return f"unrecognized argument{'s' * (len(flags) > 1)} {', '.join(named)}{hint}"


def closest_flags(flag: str, known: Sequence[str]) -> str:
    """`` (did you mean '--seed' or '--seeds'?)``: the known flags within 0.1 of the closest one's similarity
    (difflib's ratio, at least 0.6), at most three; ``""`` when none is close."""
    scored = sorted(((difflib.SequenceMatcher(None, flag, k).ratio(), k) for k in known), reverse=True)
    close = [k for score, k in scored[:3] if score >= 0.6 and score >= scored[0][0] - 0.1] if scored else []
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def build_parser(*, default_experiment: bool = False) -> ArgumentParser:
    """The command's parser; ``default_experiment``: with :data:`DEFAULT_CONFIG` as its default config file, so
    that its defaults, in ``--help`` and ``--print_config`` too, are those of the bare ``zoo compare``."""
    parser = Parser(
        "zoo compare", DESCRIPTION, EXAMPLES,
        default_config_files=[str(DEFAULT_CONFIG)] if default_experiment else None,
    )  # fmt: skip
    parser.add_argument(
        "--config", action=ActionConfigFile, help="a compare config (configs/compare.yaml if no --task-config)"
    )
    parser.add_argument(
        "--experiment", type=str | None, default=None, help="experiment name, a folder of --runs-dir (null: the task's)"
    )
    parser.add_argument("--task-config", type=Path_fr, help="the zoo fit config (relative paths: to the config file)")
    parser.add_argument(
        "--attentions",
        type=str | None,
        default=None,
        help="mechanisms in the flag syntax of attention_zoo.spec, e.g. full,linformer:k=32,sharing=kv (null: every "
        "mechanism that takes padding masks)",
    )
    parser.add_argument("--options", type=dict[str, dict[str, Any]], default={}, help="options per mechanism")
    parser.add_argument("--fit-args", type=list[str], default=[], help="extra zoo fit arguments for every run")
    parser.add_argument(
        "--seed", type=int, default=0, help=f"the first seed, 0 to {MAX_SEED} (model initialisation, data order)"
    )
    parser.add_argument("--seeds", type=int, default=1, help="seeds per mechanism: seed, seed + 1, ...")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (OMP_NUM_THREADS)")
    parser.add_argument(
        "--jobs", type=int, default=usable_cores(),
        help="local launcher: runs at once (default: the usable cores of this machine); above 1, speed and memory "
        "are measured concurrently",
    )  # fmt: skip
    parser.add_argument("--runs-dir", type=str, default="runs", help="where the experiment directory goes")
    parser.add_argument("--timeout", type=float | None, default=None, help="seconds per run before it is stopped")
    parser.add_argument(
        "--metric", type=str | None, default=None, help="order and judge by this metric (default: val_acc, ...)"
    )
    parser.add_argument(
        "--reference", type=str | None, default=None,
        help="the entry every verdict compares with (paired by seed): a label, or a mechanism listed once "
        "(default: full)",
    )  # fmt: skip
    parser.add_argument(
        "--control", type=bool, nargs="?", const=True, default=False,
        help=f"add the no-attention control arm, {CONTROL} (each position attends only to itself), unless listed; "
        "--control alone or --control true",
    )  # fmt: skip
    parser.add_argument(
        "--restart", type=str | None, default=None,
        help="comma-separated runs, <label>/seed-<s> (e.g. linformer/seed-1), to delete and train anew: a run "
        "that cannot continue (unreadable checkpoint); the other runs are kept",
    )  # fmt: skip
    parser.add_argument(
        "--margin", type=float | None, default=None,
        help="equivalence margin δ in the metric's units (default: acc 0.01, loss 0.02, BLEU 0.5, ppl 2% of the "
        "reference's)",
    )  # fmt: skip
    parser.add_argument("--bench", type=str | None, default=None, help="a zoo bench --out folder: also run zoo report")
    parser.add_argument(
        "--long-n", type=list[int] | None, default=None,
        help="after the runs, time the same mechanisms with zoo bench at these n (core, fwd+bwd, one thread) into "
        "<experiment>/bench/ and join accuracy, time and memory in one table (experiments/compare/axes.py; "
        "null: no benchmark)",
    )  # fmt: skip
    parser.add_argument("--fresh", type=bool, default=False, help="never resume: use a new experiment directory")
    parser.add_argument(
        "--test", type=bool, default=False, help="after each fit, zoo test its last.ckpt (test metrics join the run)"
    )
    parser.add_argument(
        "--launcher",
        type=Literal["local", "ray"],
        default="local",
        help="local: --jobs runs at once on this machine; ray: Ray tasks",
    )
    parser.add_argument(
        "--ray-address", type=str | None, default=None,
        help="ray: auto, ray://host:port or host:port (default: start a local Ray on this machine)",
    )  # fmt: skip
    parser.add_argument("--run-cpus", type=float | None, default=None, help="ray: CPUs per run (default: --threads)")
    parser.add_argument("--run-gpus", type=float, default=0, help="ray: GPUs per run")
    parser.add_argument(
        "--shared-dir", type=str | None, default=None,
        help="ray: a folder every node mounts at the same path; the experiment goes there (instead of --runs-dir) and "
        "runs write into it directly (without it, a cluster run's files are sent back to this machine)",
    )  # fmt: skip
    parser.add_argument(
        "--force-unlock", type=bool, default=False,
        help="take over the experiment's lock even when another host holds it (experiments/compare/lock.py)",
    )  # fmt: skip
    return parser


def names_task(own: list[str]) -> bool:
    """Whether the command's own arguments name a task (``--task-config``, or a ``--config`` that has one); when
    they cannot be parsed, True: the parser without the default experiment then refuses them as before.
    ``--help`` and ``--print_config`` (with its flags) are left out, since they would stop the parse."""
    probe, skip = [], False
    for argument in own:
        if skip and not argument.startswith("-"):
            skip = False
            continue
        skip = argument == "--print_config"
        if argument not in ("-h", "--help") and not argument.startswith("--print_config"):
            probe.append(argument)
    try:
        return build_parser().parse_args(probe).task_config is not None
    except ArgumentError:
        return True


def main(argv: list[str]) -> int:
    """``zoo compare``: its help (``-h``, ``--help`` before any ``--``) from the parser alone; anything else is the
    comparison, :func:`experiments.compare.command.main`."""
    own = argv[: argv.index("--")] if "--" in argv else argv
    if "-h" in own or "--help" in own:
        parser = build_parser(default_experiment=not names_task(own))
        parser.parse_args(parser.dashed(own))  # prints the help and exits
    from experiments.compare.command import main as compare

    return compare(argv)
