"""The ``--attentions`` list every command reads (``zoo compare``, ``zoo bench``, ``zoo targets``, the paired
timings): one parser, so one text means one set of mechanisms and options everywhere.

``full,linformer:k=32,sharing=kv,nystrom:num_landmarks=8:pinv=exact``: entries are separated by commas; ``name:``
starts an entry with options, and further ``opt=value`` items, after a comma or a colon, add to it (a value such
as ``8:10`` stays whole). Values are taken as typed (:func:`option_value`), never as YAML 1.1 reads them.
"""

from __future__ import annotations

import re
from typing import Any

#: an option after a colon: ``nystrom:num_landmarks=8:pinv=exact`` (a value such as ``8:10`` stays whole)
OPTION_SEPARATOR = re.compile(r":(?=\s*[A-Za-z_]\w*\s*=)")


def parse_attentions(text: str) -> list[tuple[str, dict[str, Any] | None]]:
    """``'full,linformer:k=32,sharing=kv'`` -> ``[("full", None), ("linformer", {"k": 32, "sharing": "kv"})]``;
    ``None`` means "no options given here"."""
    if not text.replace(",", "").strip():
        raise ValueError(
            f"--attentions {text!r} names no mechanism; give at least one (e.g. full,linformer:k=32), or leave the "
            "flag out for the config's list"
        )
    entries: list[tuple[str, dict[str, Any] | None]] = []
    for item in (part.strip() for part in text.split(",")):
        if ":" in item:
            name, rest = item.split(":", 1)
            entries.append((name.strip(), {}))
            options = OPTION_SEPARATOR.split(rest)
        elif "=" in item:
            if not entries or entries[-1][1] is None:
                raise ValueError(f"--attentions: option {item!r} follows no 'name:' entry (write name:{item})")
            options = [item]
        else:
            if item:
                entries.append((item, None))
            continue
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--attentions: {item!r} is not name:option=value")
            if key.strip() in entries[-1][1]:
                raise ValueError(f"--attentions: option {key.strip()!r} given twice for {entries[-1][0]!r}")
            entries[-1][1][key.strip()] = option_value(value)
    return entries


def option_value(text: str) -> Any:
    """An option value as typed: an int, a float, ``true``/``false``, ``null``, else the string itself. Not YAML:
    YAML 1.1 reads ``8:10`` as 490 and ``yes``/``no``/``on``/``off`` as booleans, so what ran would not be what
    was typed."""
    text = text.strip()
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(text.lower(), text)  # "none" is a value (sharing=none)
