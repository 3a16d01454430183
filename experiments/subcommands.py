"""A table of subcommands run by name, each module imported only when its name is given: the ``zoo`` command
(``experiments/cli.py``) and ``zoo study`` (``experiments/studies/cli.py``) are each one table over
:func:`dispatch`. A module of its own, below both, so that a command package that has subcommands of its own
does not import the ``zoo`` command table that imports it."""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Iterable


def dispatch(
    argv: list[str],
    commands: dict[str, tuple[str, str, str]],
    *,
    prog: str,
    noun: str,
    heading: str,
    placeholder: str | None = None,
) -> int:
    """Run the entry of ``commands`` (name -> (module, function taking argv, one-line help)) that ``argv[0]``
    names on the rest of ``argv``, importing its module only then. No name, or ``-h`` / ``--help``: the usage
    line and the names under ``heading`` (exit code 2 and 0); an unknown name: one error line, exit code 2."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {prog} <{placeholder or noun}> [args]\n\n{heading}:")
        for name, (_, _, text) in commands.items():
            print(f"  {name:<10} {text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"{prog}: unknown {noun} {name!r}{did_you_mean(name, commands)}; choose from {', '.join(commands)}",
              file=sys.stderr)  # fmt: skip
        return 2
    module, function, _ = commands[name]
    return getattr(importlib.import_module(module), function)(rest) or 0


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'list'?)`` for the known name closest to a misspelt ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
