"""``zoo study <name>``: the source papers' claims, checked with this project's own code.

    zoo study spectrum --checkpoint CKPT      # Linformer Fig. 1: spectrum of P, trained vs random init
    zoo study approx                          # Theorems 1-2 and the Nystromformer claim: error vs budget and n
    zoo study mlm                             # Linformer Fig. 3 / Table 2: MLM perplexity vs k, n, sharing
    zoo study <name> --replot DIR             # redraw a study's figures from its committed CSVs

Each study writes CSVs first and draws its figures from them; ``zoo study <name> --help`` gives its options.
Every study takes ``--out`` and ``--replot`` (:func:`add_output_options`) and runs through :func:`run_study`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from experiments.console import console
from experiments.subcommands import OneLineErrors, dispatch, examples_epilog, jsonargparse_formatter, plain

if TYPE_CHECKING:
    from jsonargparse import ArgumentParser, Namespace
    from rich.console import Console

#: study -> (module, function taking argv, one-line help)
STUDIES: dict[str, tuple[str, str, str]] = {
    "spectrum": (
        "experiments.studies.spectrum",
        "main",
        "normalised cumulative singular values of P per layer and head",
    ),
    "approx": ("experiments.studies.approx", "main", "relative error of each approximation vs softmax attention"),
    "mlm": (
        "experiments.studies.mlm",
        "main",
        "MLM perplexity curves, and the final table and verdicts (test perplexity on one text) of the Linformer runs",
    ),
}


EXAMPLES = (
    "zoo study approx --inputs '[gaussian]' --lengths '[256, 512]'",
    "zoo study mlm --replot results/linformer_paper/mlm",
)


def main(argv: list[str]) -> int:
    return dispatch(
        argv, STUDIES, prog="zoo study", noun="study", heading="studies", placeholder="name", examples=EXAMPLES
    )


@cache
def _parser_class() -> type[ArgumentParser]:
    """jsonargparse's parser with :class:`OneLineErrors` and plain help (imported on first use: ``zoo study
    --help`` lists the studies without it)."""
    from jsonargparse import ArgumentParser

    class Parser(OneLineErrors, ArgumentParser):
        def __init__(self, *args: object, **options: object) -> None:
            super().__init__(*args, formatter_class=jsonargparse_formatter(), **options)

    return Parser


def study_parser(prog: str, doc: str, examples: Sequence[str]) -> ArgumentParser:
    """A study's parser: its help is the first paragraph of ``doc`` (the study's docstring), plain, and the
    ``examples``; a usage error is one line, an unknown flag named with the closest one, and a flag's underscore
    spelling (``--dim_head``) is read as its dashed one (``--dim-head``) with a note."""
    return _parser_class()(prog=prog, description=plain(doc.split("\n\n")[0]), epilog=examples_epilog(examples))


def add_output_options(
    parser: ArgumentParser, *, out: str, replot: str = "redraw the figures of this folder's CSV"
) -> ArgumentParser:
    """Add the options of every study, ``--out`` (its output folder, default ``out``) and ``--replot``."""
    parser.add_argument("--out", type=str, default=out, help="output folder")
    parser.add_argument("--replot", type=str | None, default=None, help=replot)
    return parser


def run_study(
    parser: ArgumentParser,
    argv: list[str],
    *,
    replot: Callable[[Path, Namespace], list[Path]],
    run: Callable[[ArgumentParser, Namespace, Console], int],
    check: Callable[[Namespace], str | None] = lambda args: None,
) -> int:
    """``zoo study <name>``: parse ``argv`` (a problem ``check`` names is a usage error), then with ``--replot DIR``
    redraw from that folder's CSVs (``replot`` returns the files it wrote, listed here), else ``run`` the study.
    A replot reads its files checked (:func:`experiments.studies.common.read_csv`): a missing folder or file, a
    truncated file or one the study did not write is one error line, exit code 2."""
    args = parser.parse_args(argv)
    out = console()
    problem = check(args)
    if problem:
        parser.error(problem)
    if args.replot:
        from experiments.studies.common import UnreadableRecord

        folder = Path(args.replot)
        try:
            if not folder.is_dir():
                raise UnreadableRecord(f"--replot {folder}: {'not a folder' if folder.exists() else 'no such folder'}")
            written = replot(folder, args)
        except UnreadableRecord as error:  # a missing, truncated or foreign results file: one line
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
            return 2
        out.print("wrote " + ", ".join(str(p) for p in written))
        return 0
    return run(parser, args, out)
