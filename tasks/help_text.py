"""Plain help text for the command parsers: docstrings without reStructuredText markup, paragraphs wrapped to the
terminal and example lines kept as written (argparse and jsonargparse formatters). Standard library only, so that
``--help`` stays fast; in ``tasks`` so that ``zoo fit``'s parser and the ``experiments`` commands share it."""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Sequence
from functools import cache


def plain(text: str) -> str:
    """``text`` (a docstring) as plain help text, reStructuredText's markup dropped and the words kept: a double-
    backquoted literal, a role (``:func:`` and the like, ``~a.b`` read as ``b``) and a single-backquoted name each
    become their bare text; indentation and line breaks are kept."""
    text = re.sub(r":[\w:]+:`~?([^`]+)`", lambda m: m[1].rsplit(".", 1)[-1] if "~" in m[0] else m[1], text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"(?<![\w`])`([^`\n]+)`(?![\w`])", r"\1", text)


def examples_epilog(examples: Sequence[str]) -> str:
    """The ``examples:`` block of a command's help, one indented line per example (kept as written)."""
    return "examples:\n" + "\n".join(f"  {line}" for line in examples)


class PlainHelp:
    """A help formatter's text (mix in before an argparse or jsonargparse formatter): every option's help
    :func:`plain`; in the description and epilog, runs of unindented lines are wrapped to the help's width as one
    paragraph and indented lines (examples, lists) are kept line for line, where argparse's own formatter would run
    the examples together."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)  # type: ignore[misc]
        return None if text is None else plain(text)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        for block in re.split(r"\n\s*\n", textwrap.dedent(text).strip("\n")):
            lines, paragraph = [], []
            for line in [*block.splitlines(), ""]:
                if line[:1].isspace() or not line:
                    if paragraph:
                        joined = " ".join(paragraph)
                        lines.append(textwrap.fill(joined, width, initial_indent=indent, subsequent_indent=indent))
                        paragraph = []
                    if line:
                        lines.append(indent + line)
                else:
                    paragraph.append(line.strip())
            out.append("\n".join(lines))
        return "\n\n".join(out)


class PlainHelpFormatter(PlainHelp, argparse.HelpFormatter):
    """argparse's help formatter with :class:`PlainHelp`."""


@cache
def jsonargparse_formatter() -> type[argparse.HelpFormatter]:
    """jsonargparse's help formatter with :class:`PlainHelp` (jsonargparse imported only when one is asked for)."""
    from jsonargparse import DefaultHelpFormatter

    class Formatter(PlainHelp, DefaultHelpFormatter):
        pass

    return Formatter
