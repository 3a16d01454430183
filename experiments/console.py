"""One rich console for every ``zoo`` command; wide when output is not a terminal (logs, CI)."""

from rich.console import Console


def console() -> Console:
    out = Console()
    if not out.is_terminal:
        out.width = max(out.width, 160)
    return out
