"""Small trees of text files the tests write: ``{relative path: text}`` under a folder."""

from __future__ import annotations

from pathlib import Path


def write_files(root: Path, files: dict[str, str]) -> Path:
    """Write each ``files`` entry below ``root`` (UTF-8, folders made as needed); returns ``root``."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root
