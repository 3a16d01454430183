"""The folders of the machine a result was made on, written as what they are, so that no committed file names one.

Every file a zoo command writes for a reader (a run's record, logs and configs; the GPU suite's rows, logs and
environment) passes through :func:`portable_text` with the folders of :func:`machine_folders`: the checkout's
root drops out (its files by their repository-relative path; the root alone is ``.``), the interpreter's packages
become ``<site-packages>``, its standard library ``<python>`` and its executable its name; a caller adds its own
folders (an experiment's scratch copy on a Ray worker, the GPU suite's work folder). The longest folder is
replaced first, so a folder inside another keeps its own label; a folder is replaced only as whole path
components (``/a/b`` is not a prefix of ``/a/bc``) at the start of a token (not inside a relative path or a URL).
``tools/relative_paths.py`` rewrites results made on other machines, whose folders this one cannot know.
"""

from __future__ import annotations

import contextlib
import os
import re
import site
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path

#: the checkout this package runs from (an installed wheel: its site-packages folder)
CHECKOUT = Path(__file__).resolve().parents[1]
_START = r"(?<![\w.~/-])"
_END = r"(?![\w.+@/-])"


def site_folders() -> set[str]:
    """The interpreter's package folders (site-packages, user site, and any other folder on ``sys.path`` outside
    the checkout, the working directory and the standard library, such as a ``pip install --target`` folder), as
    given and resolved. (``python -m`` puts the working directory on ``sys.path``: it is no package folder.)"""
    paths = sysconfig.get_paths()
    stdlib = os.path.realpath(paths["stdlib"])
    here = os.path.realpath(os.getcwd())
    on_path = {
        folder for folder in map(os.path.realpath, filter(None, sys.path))
        if os.path.isdir(folder) and not folder.startswith((str(CHECKOUT), stdlib)) and folder not in (os.sep, here)
    }  # fmt: skip
    folders = {*site.getsitepackages(), site.getusersitepackages(), paths["purelib"], paths["platlib"], *on_path}
    return folders | {os.path.realpath(folder) for folder in folders}


def is_site_folder(path: Path) -> bool:
    """Whether ``path`` is (or is below) a folder of installed packages."""
    return any(path == folder or folder in path.parents for folder in map(Path, site_folders()))


def machine_folders(extra: Mapping[str | Path, str] | None = None) -> list[tuple[str, str]]:
    """(absolute folder, what it is written as), longest first: ``extra`` (the caller's folders), the
    interpreter's packages and standard library, then the checkout and the working directory, dropped (their files
    by relative path) unless they are package folders themselves (an installed wheel)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    labels = dict.fromkeys(site_folders(), "<site-packages>")
    labels |= {stdlib: "<python>", os.path.realpath(stdlib): "<python>"}
    for folder, label in (extra or {}).items():
        labels |= {str(Path(folder).absolute()): label, os.path.realpath(folder): label}
    for folder in (str(CHECKOUT), os.getcwd()):
        if not is_site_folder(Path(folder)):
            labels.setdefault(folder, "")
    labels.pop(os.sep, None)  # a working directory of / would make every path relative
    return sorted(labels.items(), key=lambda item: -len(item[0]))


def portable_text(text: str, folders: list[tuple[str, str]]) -> str:
    """``text`` with the interpreter's executable written as its name and each folder of ``folders`` (from
    :func:`machine_folders`) as its label; a folder labelled ``""`` leaves the relative path below it, or ``.``."""
    for executable in {sys.executable, os.path.realpath(sys.executable)}:
        text = re.sub(_START + re.escape(executable) + _END, Path(sys.executable).name, text)
    for folder, label in folders:
        pattern = re.compile(rf"{_START}{re.escape(folder)}(/|{_END})")
        text = pattern.sub(lambda m, label=label: f"{label}{m[1]}" if label else ("" if m[1] else "."), text)
    return text


def shown_path(path: str | Path) -> str:
    """``path`` as the files of a comparison name it: relative to the working directory when below it, else
    relative to the checkout when below it (``configs/recall.yaml``), else normalised and absolute."""
    normal = Path(os.path.normpath(Path(path).absolute()))
    for base in (Path.cwd(), CHECKOUT):
        if not is_site_folder(base):
            with contextlib.suppress(ValueError):
                return str(normal.relative_to(base))
    return str(normal)


def resolve_shown(text: str) -> str:
    """The absolute path that :func:`shown_path` wrote as ``text``: a relative one below the working directory
    when it exists there, else below the checkout."""
    path = Path(text)
    if path.is_absolute():
        return str(path)
    here = Path.cwd() / path
    return str(here if here.exists() or not (CHECKOUT / path).exists() else CHECKOUT / path)
