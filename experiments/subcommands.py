"""A table of subcommands run by name, each module imported only when its name is given: the ``zoo`` command
(``experiments/cli.py``) and ``zoo study`` (``experiments/studies/cli.py``) are each one table over
:func:`dispatch`. A module of its own, below both, so that a command package that has subcommands of its own
does not import the ``zoo`` command table that imports it.

It also holds what every command's parser shares (standard library only, so that ``--help`` stays fast): the
help text of :mod:`tasks.help_text` (plain text from a docstring, paragraphs wrapped, examples kept) and
:class:`OneLineErrors` (a usage error is one line, an unknown flag gets the
closest known one, an underscore spelling of a dashed flag is accepted with a note), put together for argparse in
:class:`ZooArgumentParser`; a jsonargparse parser takes the same two mixins."""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from tasks.help_text import PlainHelp, PlainHelpFormatter, examples_epilog, jsonargparse_formatter, plain

__all__ = [
    "OneLineErrors",
    "PlainHelp",
    "PlainHelpFormatter",
    "ZooArgumentParser",
    "did_you_mean",
    "dispatch",
    "examples_epilog",
    "jsonargparse_formatter",
    "plain",
]


def dispatch(
    argv: list[str],
    commands: dict[str, tuple[str, str, str]],
    *,
    prog: str,
    noun: str,
    heading: str,
    placeholder: str | None = None,
    examples: Sequence[str] = (),
) -> int:
    """Run the entry of ``commands`` (name -> (module, function taking argv, one-line help)) that ``argv[0]``
    names on the rest of ``argv``, importing its module only then. No name, or ``-h`` / ``--help``: the usage
    line, the names under ``heading`` and the ``examples`` (exit code 2 and 0); an unknown name: one error line,
    exit code 2."""
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, commands)) + 2
        print(f"usage: {prog} <{placeholder or noun}> [args]\n\n{heading}:")
        for name, (_, _, text) in commands.items():
            print(f"  {name:<{width}}{text}")
        if examples:
            print("\nexamples:\n" + "\n".join(f"  {line}" for line in examples))
        print(f"\n{prog} <{placeholder or noun}> --help: its options and examples")
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


class OneLineErrors:
    """A parser's usage error as one line, ``<prog>: error: <message>`` (mix in before ``argparse.ArgumentParser``
    or jsonargparse's ``ArgumentParser``): an unrecognized flag is named with the closest flag the parser has,
    jsonargparse's nested messages are flattened. A jsonargparse parser made with ``exit_on_error=False`` keeps
    raising its error for the caller. An underscore spelling (``--control_seed``) of a dashed flag
    (``--control-seed``) is read as the dashed one, with a one-line note."""

    prog: str

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **options: Any) -> Any:
        args = self.dashed(list(sys.argv[1:] if args is None else args))
        return super().parse_args(args, *rest, **options)  # type: ignore[misc]

    def dashed(self, argv: list[str]) -> list[str]:
        """``argv`` with every ``--a_b`` (or ``--a_b=value``) that this parser knows only as ``--a-b`` renamed,
        a note on stderr for each; nothing after a bare ``--`` is touched."""
        known = self.flags()
        out = list(argv)
        for i, arg in enumerate(argv):
            if arg == "--":
                break
            flag, sep, value = arg.partition("=")
            if flag.startswith("--") and "_" in flag and flag not in known:
                new = "--" + flag[2:].replace("_", "-")
                if new in known:
                    print(f"{self.prog}: note: {flag} read as {new} (flags are spelled with dashes; the underscore "
                          "spelling is accepted in this release)", file=sys.stderr)  # fmt: skip
                    out[i] = new + sep + value
        return out

    def flags(self) -> list[str]:
        """Every option string of this parser (``-h``, ``--seq-lens``, ...)."""
        return list(getattr(self, "_option_string_actions", {}))

    def error(self, message: str, *rest: Any) -> NoReturn:
        if getattr(self, "exit_on_error", True) is False:  # the caller asked for the error itself
            super().error(message, *rest)  # type: ignore[misc]
        print(f"{self.prog}: error: {self.one_line(message)}", file=sys.stderr)
        sys.exit(2)

    def one_line(self, message: str) -> str:
        """``message`` in one line: unrecognized flags each with the closest known flag (or a pointer to
        ``--help``); jsonargparse's ``Parser key "k":`` and ``<class 'int'>`` as ``--k:`` and ``int``."""
        unrecognized = re.match(r"unrecognized arguments: (.*)", message, flags=re.IGNORECASE | re.DOTALL)
        if unrecognized:
            given = unrecognized[1].split()
            flags = [arg.split("=", 1)[0] for arg in given if arg.startswith("-")] or given
            long_flags = [flag for flag in self.flags() if flag.startswith("--")]
            named = [f"{flag}{did_you_mean(flag, long_flags) if flag.startswith('-') else ''}" for flag in flags]
            hint = "" if any("did you mean" in n for n in named) else f"; {self.prog} --help lists the options"
            return f"unrecognized argument{'s' * (len(flags) > 1)} {', '.join(named)}{hint}"
        key = re.match(r'Parser key "([^"]+)":\s*(.*)', message, flags=re.DOTALL)
        if key:
            message = f"--{key[1].replace('_', '-')}: {key[2]}"
        message = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", message)
        return " ".join(message.split())


class ZooArgumentParser(OneLineErrors, argparse.ArgumentParser):
    """An argparse parser for a ``zoo`` command: :class:`OneLineErrors`, and help made of ``doc`` (a docstring,
    shown :func:`plain`, paragraphs wrapped to the terminal) and ``examples`` (a few command lines)."""

    def __init__(self, prog: str, doc: str, examples: Sequence[str] = (), **options: Any) -> None:
        super().__init__(
            prog=prog,
            description=plain(doc),
            epilog=examples_epilog(examples) if examples else None,
            formatter_class=PlainHelpFormatter,
            **options,
        )
