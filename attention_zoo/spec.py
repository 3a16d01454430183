"""An attention spec: a registered mechanism's name and its options, the one value that travels from a flag, a
config or a results row to :func:`attention_zoo.create_attention`.

The flag syntax, read by every command (``--attentions``) and by :meth:`AttentionSpec.parse`:

    full                                  a mechanism with its defaults
    linformer:k=32,sharing=kv             options after ``name:``, separated by commas ...
    nystrom:num_landmarks=8:pinv=exact    ... or by colons (a value such as ``8:10`` stays whole)
    full,linformer:k=32,local:window=16   a list: an item without ``=`` starts the next entry

Values are read as typed: an int, then a float (``1e3`` is 1000.0), ``true``/``false``, ``null``, else the text
itself. Never YAML 1.1's reading, under which ``8:10`` is 490 and ``yes``/``off`` are booleans, so what runs would
not be what was typed. A spec is checked against the registry once, by :meth:`AttentionSpec.checked`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from attention_zoo import registry

#: an option after a colon: ``nystrom:num_landmarks=8:pinv=exact`` (a value such as ``8:10`` stays whole)
OPTION_SEPARATOR = re.compile(r":(?=\s*[A-Za-z_]\w*\s*=)")


@dataclass(frozen=True)
class AttentionSpec:
    """``name`` and ``options`` as :func:`attention_zoo.create_attention` takes them; equal specs have equal
    options in any order."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"an attention spec needs a mechanism name, got {self.name!r}")
        if not isinstance(self.options, Mapping) or not all(isinstance(k, str) for k in self.options):
            raise ValueError(f"attention {self.name!r}: options must be a mapping of names, got {self.options!r}")
        object.__setattr__(self, "options", dict(self.options))

    def __hash__(self) -> int:  # option values may be unhashable (lists); equal specs have equal names and keys
        return hash((self.name, tuple(sorted(self.options))))

    @classmethod
    def parse(cls, text: str) -> AttentionSpec:
        """One entry in the flag syntax: ``'linformer:k=32,sharing=kv'``."""
        specs = parse_list(text)
        if len(specs) != 1:
            raise ValueError(f"attention {text!r} names {len(specs)} mechanisms; give one (e.g. linformer:k=32)")
        return specs[0]

    @classmethod
    def of(cls, value: AttentionSpec | str | Mapping[str, Any]) -> AttentionSpec:
        """A spec from what configs hold: a spec, the flag syntax, or ``{name, options}``."""
        if isinstance(value, AttentionSpec):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, Mapping) and set(value) <= {"name", "options"} and "name" in value:
            return cls(value["name"], value.get("options") or {})
        raise ValueError(f"attention {value!r}: give a name with options (linformer:k=32) or {{name, options}}")

    def checked(self) -> AttentionSpec:
        """This spec if its name is registered and its options are the mechanism's, with their types; else
        ``ValueError`` naming the bad name or option and what is allowed."""
        registry.check_options(self.name, self.options)
        return self

    @property
    def label(self) -> str:
        """The flag syntax, which :meth:`parse` reads back: ``linformer:k=32,sharing=kv``."""
        return self.name + (":" + ",".join(f"{k}={_text(v)}" for k, v in self.options.items()) if self.options else "")

    @property
    def folder(self) -> str:
        """A folder name: ``linformer-k=32-sharing=kv`` (``linformer`` without options)."""
        return "-".join([self.name, *(f"{k}={_text(v)}" for k, v in self.options.items())]).replace("/", "_")

    def hparams(self) -> dict[str, Any]:
        """What a task records: ``{"attention": name, "attention_options": options}``."""
        return {"attention": self.name, "attention_options": dict(self.options)}


def parse_list(text: str) -> list[AttentionSpec]:
    """``'full,linformer:k=32,sharing=kv'`` -> ``[AttentionSpec('full'), AttentionSpec('linformer', {k: 32, ...})]``."""
    return [AttentionSpec(name, options or {}) for name, options in parse_entries(text)]


def parse_entries(text: str) -> list[tuple[str, dict[str, Any] | None]]:
    """The list with ``None`` for an entry given without options (a config may then supply them)."""
    if not isinstance(text, str) or not text.replace(",", "").strip():
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
    """An option value as typed: an int, a float, ``true``/``false``, ``null``, else the string itself."""
    text = text.strip()
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(text.lower(), text)  # "none" is a value (sharing=none)


def _text(value: Any) -> str:
    """A value as :func:`option_value` reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
