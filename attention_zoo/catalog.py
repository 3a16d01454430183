"""The catalog of registered attention cores: name -> class, filled by ``@register_attention``
(:mod:`attention_zoo.registry`).

The package's lowest module: it imports none of it. The core contract (:mod:`attention_zoo.core`) reads it to
name, in an error, the cores that can do what a refused call asked for; the registry, built on the contract,
writes it and answers every query of it.
"""

from __future__ import annotations

from typing import Any

#: registered name -> core class (``type[AttentionCore]``)
REGISTERED: dict[str, type] = {}


def names_with(**capabilities: Any) -> list[str]:
    """Registered names, sorted, of the classes whose attributes have the given values
    (``names_with(supports_causal=True)``)."""
    return sorted(
        name for name, cls in REGISTERED.items() if all(getattr(cls, a) == v for a, v in capabilities.items())
    )
