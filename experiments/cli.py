"""The ``zoo`` command: ``zoo <command> [args]``; each command lives in its own module, imported lazily
(:func:`experiments.subcommands.dispatch`) so that ``zoo list`` never pays for Lightning. This table is the top
of ``experiments``: no command imports it back."""

from __future__ import annotations

import sys

from experiments.subcommands import dispatch

#: command -> (module, function taking argv, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "list": ("experiments.listing", "main", "every registered attention with its capabilities and options"),
    "targets": (
        "experiments.bench.command",
        "targets_main",
        "measure the CPU performance targets (= zoo bench --check-targets)",
    ),
    "bench": (
        "experiments.bench.command",
        "main",
        "time, memory and FLOP/s of mechanisms across lengths vs full attention",
    ),
    "demo": ("experiments.demo", "main", "build every registered attention on a small input and print a table"),
    "compare": (
        "experiments.compare.flags",
        "main",
        "train one task per attention and seed; summary with intervals, plots",
    ),
    "lra": (
        "experiments.lra.command",
        "main",
        "the Long Range Arena suite: zoo compare per task, the LRA table beside the published ones",
    ),
    "report": (
        "experiments.compare.report",
        "main",
        "join a compare and a bench: Pareto plot, which mechanism at which length",
    ),
    "study": ("experiments.studies.cli", "main", "the papers' claims as studies: spectrum, approx, mlm"),
    "fit": ("tasks.cli", "run_fit", "train a task: zoo fit -c recall --model.attention nystrom"),
    "validate": ("tasks.cli", "run_validate", "evaluate a checkpoint on the validation split"),
    "test": ("tasks.cli", "run_test", "evaluate a checkpoint on the test split"),
    "gpu-suite": ("experiments.gpu.suite", "main", "the GPU harness in one command, under a budget (--smoke: on CPU)"),
    "copy-baseline": ("tasks.translation_metrics", "main", "BLEU and chrF of a translation split's sources as output"),
}


#: ``zoo --help``'s examples: the README's tour in three lines
EXAMPLES = (
    "zoo list",
    "zoo fit -c recall --model.attention linformer --model.attention_options.k 32",
    "zoo compare --attentions full,nystrom --seeds 2",
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return dispatch(argv, COMMANDS, prog="zoo", noun="command", heading="commands", examples=EXAMPLES)


if __name__ == "__main__":
    sys.exit(main())
