"""Rewrite the absolute paths of the machine a result was made on into paths that mean something in any checkout.

    python -m tools.relative_paths results            # rewrites in place, prints each file it changed

- a checkout's root (this checkout's, or any absolute folder followed by one of this repository's top-level
  folders, such as ``/somewhere/checkout/tasks/data/base.py``) is dropped: ``tasks/data/base.py``; this checkout's
  root alone becomes ``.``;
- an interpreter's packages (``<prefix>/lib/pythonX.Y/site-packages/``, or a folder that ``pip install --target``
  filled, listed in ``TARGET_FOLDERS``) become ``<site-packages>/``, its standard library ``<python>/``;
- an interpreter's executable (``<prefix>/bin/python3.12``) becomes ``python3``.

Text files only (a file with a NUL byte, or not UTF-8, is left alone); nothing else in a file changes.
``tests/test_committed_results.py`` fails on any absolute machine path left in the committed results.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("attention_zoo", "configs", "docs", "experiments", "results", "runs", "tasks", "tests", "tools")
# the scratch folder the GPU runs installed their carried wheels into (experiments/gpu/wheels.sh)
TARGET_FOLDERS = ("/tmp/site/",)

_SEGMENT = r"/[\w.+@-]+"
_START = r"(?<![\w.~/-])"  # an absolute path starts the token: not inside a relative path or a URL
RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(rf"{_START}(?:{_SEGMENT})+?/lib/python\d+(?:\.\d+)?/(?:site|dist)-packages/"), "<site-packages>/"),
    *((re.compile(_START + re.escape(folder)), "<site-packages>/") for folder in TARGET_FOLDERS),
    (re.compile(rf"{_START}(?:{_SEGMENT})+?/lib/python\d+(?:\.\d+)?/"), "<python>/"),
    (re.compile(rf"{_START}(?:{_SEGMENT})+?/bin/(python\d*(?:\.\d+)?)\b"), "python3"),
    (re.compile(rf"{_START}(?:{_SEGMENT})+?/(?=(?:{'|'.join(TOP_LEVEL)})/)"), ""),
    (re.compile(rf"{_START}{re.escape(str(REPO))}/"), ""),
    (re.compile(rf"{_START}{re.escape(str(REPO))}(?![\w.+@/-])"), "."),
)


def relative(text: str) -> str:
    """``text`` with every absolute machine path rewritten by ``RULES``, in order."""
    for pattern, replacement in RULES:
        text = pattern.sub(replacement, text)
    return text


def text_files(paths: list[Path]) -> Iterator[Path]:
    for path in paths:
        if not path.exists():
            raise SystemExit(f"relative_paths: error: {path} does not exist (give files or folders)")
        yield from sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="files or folders, rewritten in place")
    args = parser.parse_args(argv)
    for path in text_files(args.paths):
        raw = path.read_bytes()
        if b"\0" in raw:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if (new := relative(text)) != text:
            path.write_bytes(new.encode("utf-8"))
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
