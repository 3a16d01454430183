"""One ``zoo compare`` per experiment folder at a time.

Two commands writing into one experiment would train the same runs twice into the same folders and
overwrite each other's records and summary. The first command takes ``<experiment>/.lock``, a JSON file
that names its holder: ``pid``, ``host``, the process's start time (``/proc``; None where unknown),
``started`` and the ``command``. The file is created whole, atomically: written under a private name, then
hard-linked to ``.lock``, which fails when a lock exists (a link is atomic on local and NFS file systems,
where ``--shared-dir`` experiments live). A lock that exists is:

- held by a running process on this host: refused (:class:`ExperimentLocked`, one line naming the holder);
- left by a process of this host that no longer runs (killed, crashed, or its pid now belongs to another
  process, which the start time tells): taken over, with a message saying so;
- held from another host: this host cannot tell whether that process runs, so it is refused unless
  ``force_unlock`` (``zoo compare --force-unlock``) takes it over, with a message;
- unreadable (not what this module writes): refused unless ``force_unlock``.

A takeover renames the old lock aside and checks that it renamed the lock it judged, so two commands
taking over one stale lock at once cannot both win. The holder removes its lock when the command ends
(also on Ctrl-C or an error); a lock it no longer owns (forced away) is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

LOCK_NAME = ".lock"


class ExperimentLocked(RuntimeError):
    """The experiment is locked by another command; the message is one line that says by whom and what to do."""


@contextlib.contextmanager
def experiment_lock(
    directory: Path, *, force_unlock: bool = False, say: Callable[[str], Any] = print
) -> Iterator[None]:
    """Hold ``directory``'s lock for the ``with`` block (module docstring); ``say`` prints takeover messages."""
    token = acquire(directory, force_unlock=force_unlock, say=say)
    try:
        yield
    finally:
        release(directory, token)


def acquire(directory: Path, *, force_unlock: bool = False, say: Callable[[str], Any] = print) -> str:
    """Take the lock of ``directory``; returns this holder's token (for :func:`release`). Raises
    :class:`ExperimentLocked` when another command holds it."""
    lock = directory / LOCK_NAME
    me = _holder()
    for _ in range(3):  # a lock that disappears (released, or taken over by another) between two looks: again
        if _create(lock, me):
            return me["token"]
        try:
            text = lock.read_text()
        except FileNotFoundError:
            continue
        holder = _parse(text)
        reason = _takeover_reason(lock, holder, force_unlock)
        if _take_over(lock, text):
            say(reason)
    raise ExperimentLocked(f"{directory}: could not take its lock {lock} (other commands keep taking it); try again")


def release(directory: Path, token: str) -> None:
    """Remove ``directory``'s lock if it is still the one with ``token``."""
    lock = directory / LOCK_NAME
    with contextlib.suppress(FileNotFoundError):
        if (_parse(lock.read_text()) or {}).get("token") == token:
            lock.unlink()


def _holder() -> dict[str, Any]:
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "process_start": _process_start(pid),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),  # the program by name, not its install path
        "token": uuid.uuid4().hex,
    }


def _create(lock: Path, holder: dict[str, Any]) -> bool:
    """Write the whole lock under a private name, then link it into place: False when a lock exists."""
    private = lock.with_name(f"{lock.name}.{holder['token']}")
    private.write_text(json.dumps(holder))
    try:
        os.link(private, lock)
        return True
    except FileExistsError:
        return False
    finally:
        private.unlink()


def _parse(text: str) -> dict[str, Any] | None:
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return None
    return holder if isinstance(holder, dict) and {"pid", "host", "token"} <= holder.keys() else None


def _takeover_reason(lock: Path, holder: dict[str, Any] | None, force_unlock: bool) -> str:
    """Why the lock may be taken over (the message to print), or :class:`ExperimentLocked` why not."""
    directory = lock.parent
    if holder is None:
        if force_unlock:
            return f"--force-unlock: replacing the unreadable lock {lock}"
        raise ExperimentLocked(
            f"{directory}: its lock {lock} is unreadable (not written by zoo compare?); if no zoo compare runs in this "
            "experiment, rerun with --force-unlock"
        )
    who = f"pid {holder['pid']} on host {holder['host']} (since {holder.get('started', '?')})"
    if holder["host"] == socket.gethostname():
        if not _runs(holder):
            return f"taking over the lock of {directory}: its holder, {who}, no longer runs"
        raise ExperimentLocked(
            f"{directory} is in use by another zoo compare, {who}: {holder.get('command', '')!r}; wait for it to "
            "end or stop it (two commands in one experiment overwrite each other's runs)"
        )
    if force_unlock:
        return f"--force-unlock: taking over the lock of {directory} from {who}"
    raise ExperimentLocked(
        f"{directory} is locked by {who}, which this host ({socket.gethostname()}) cannot check; if no zoo compare "
        "runs there any more, rerun with --force-unlock"
    )


def _runs(holder: dict[str, Any]) -> bool:
    """Whether the holder's process (on this host) still runs: its pid exists and, where known, started when
    the holder's did (a pid the system handed to another process since does not count)."""
    pid = int(holder["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    recorded, now = holder.get("process_start"), _process_start(pid)
    return recorded is None or now is None or recorded == now


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name in parentheses may hold spaces


def _take_over(lock: Path, judged: str) -> bool:
    """Move the lock whose content was ``judged`` aside (then :func:`acquire` creates its own). False when the
    lock changed in between: another command took it over or released it first, so judge again."""
    aside = lock.with_name(f"{lock.name}.stale.{uuid.uuid4().hex}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return False
    if aside.read_text() == judged:
        aside.unlink()
        return True
    # a fresh lock of another command was moved: put it back (unless a third took the place meanwhile)
    with contextlib.suppress(FileExistsError):
        os.link(aside, lock)
    aside.unlink()
    return False
