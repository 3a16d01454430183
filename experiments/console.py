"""One rich console for every ``zoo`` command, as wide as ``COLUMNS`` says wherever it is set; otherwise the
terminal's width, or :data:`UNSET_WIDTH` when output is not a terminal (a log, a pipe, CI), where rich would
fall back to 80 and fold the wide tables."""

from __future__ import annotations

import os

from rich.console import Console

#: the width of output that is not a terminal when ``COLUMNS`` is not set
UNSET_WIDTH = 160


def columns() -> int | None:
    """``COLUMNS`` as a width (a positive integer), or None when it is unset or not one."""
    value = os.environ.get("COLUMNS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def console() -> Console:
    width = columns()
    out = Console(width=width)
    if width is None and not out.is_terminal:
        out.width = UNSET_WIDTH
    return out
