"""Configs by name from any folder: ``zoo fit -c recall``, ``zoo fit -c configs/recall.yaml`` and
``zoo compare --task-config configs/listops.yaml`` mean the same file wherever they are run.

A file that exists where the command runs always wins (a local edit of a config, or a config of one's own); only
a path that names no file here is looked up among the configs installed with the package (``configs/`` of the
repository, which ``experiments/configs`` links to and a wheel ships as package data): ``recall``, ``recall.yaml``,
``configs/recall.yaml`` and ``bench/decoding`` all name one. Nothing else is guessed: a value that names neither is
one error line with the closest packaged names.
"""

from __future__ import annotations

import difflib
from pathlib import Path, PurePosixPath

#: the packaged configs' folder name, which a path written from the repository root starts with
FOLDER = "configs"
#: where the configs are installed, relative to the folder holding this package: a path, read as files only
PACKAGE_DATA = f"experiments/{FOLDER}"
#: a config's file suffix, which a name may leave out
SUFFIX = ".yaml"


class ConfigNotFoundError(FileNotFoundError):
    """A config value that names neither a file here nor a packaged config; its message is one line."""


def packaged_configs() -> Path:
    """The folder of the configs installed with the package (every ``*.yaml`` of ``configs/``): the ``experiments``
    package's package data, beside this package in a checkout and in site-packages alike (found by path: ``tasks``
    never imports ``experiments``)."""
    return Path(__file__).resolve().parent.parent / PACKAGE_DATA


def packaged_names() -> list[str]:
    """Every packaged config by the name that :func:`resolve_config` takes: its path under ``configs/`` without
    ``.yaml`` (``recall``, ``bench/decoding``, ``lra/lite/listops``), sorted."""
    root = packaged_configs()
    return sorted(path.relative_to(root).with_suffix("").as_posix() for path in root.rglob(f"*{SUFFIX}"))


def resolve_config(value: str) -> str:
    """The config file that ``value`` names: ``value`` itself when it is a file here (relative to the working
    folder, or absolute); else the packaged config ``configs/<name>`` or ``configs/<name>.yaml``, where ``name`` is
    ``value`` without a leading ``configs/`` (or ``./configs/``). Raises :class:`ConfigNotFoundError` (one line,
    the closest packaged names) when it names neither."""
    if Path(value).expanduser().is_file():
        return value
    name = _packaged_name(value)
    if name is not None:
        root = packaged_configs()
        for candidate in (root / name, root / f"{name}{SUFFIX}"):
            if candidate.is_file():
                return str(candidate)
    known = packaged_names()
    wanted = (name or value).removesuffix(SUFFIX)
    close = difflib.get_close_matches(wanted, known, n=3, cutoff=0.6)
    if not close:  # a misspelt folder or a name given without its folder: compare the last part alone
        by_stem = {PurePosixPath(k).name: k for k in known}
        close = [by_stem[m] for m in difflib.get_close_matches(PurePosixPath(wanted).name, by_stem, n=3, cutoff=0.6)]
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"packaged: {', '.join(_top(known))}"
    raise ConfigNotFoundError(f"{value!r} is neither a file here nor a packaged config; {hint}")


def _packaged_name(value: str) -> str | None:
    """``value`` as a path under ``configs/`` (its leading ``./`` and ``configs/`` dropped), or None for a value
    that cannot name a packaged config (absolute, or leaving the folder with ``..``)."""
    path = PurePosixPath(value.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or not path.parts:
        return None
    parts = path.parts[1:] if path.parts[0] == FOLDER else path.parts
    return PurePosixPath(*parts).as_posix() if parts else None


def _top(names: list[str]) -> list[str]:
    """The configs at the top of ``configs/`` and its folders (``bench/``): a short list to choose from."""
    return [name for name in names if "/" not in name] + sorted({f"{n.split('/')[0]}/..." for n in names if "/" in n})
