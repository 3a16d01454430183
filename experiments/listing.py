"""``zoo list``: every registered mechanism, its capabilities, options (with defaults) and caveats.

``decoding`` says how step-by-step causal decoding runs: ``cache`` (the core keeps its own state),
``recompute`` (the fallback: the causal forward over the whole prefix at every step) or ``-`` (not causal;
a decoder uses the core named in the causal column instead, where there is one). ``grad²``: second-order
gradients (a backward with create_graph=True: gradient penalty, Hessian-vector product) are exact (``yes``)
or refused with one error naming the core (``no``). ``approximation``: what the core computes in place of
softmax over every key (:data:`attention_zoo.core.APPROXIMATIONS`): ``none`` is full attention; ``fixed
sparsity`` and ``content-selected sparsity`` are exact softmax over the keys of a fixed pattern or of the core's
own selection, not equality with full attention. ``packed``: the core takes packed rows (``segments``: several
documents per row, :mod:`attention_zoo.packing`), or the reason it refuses them."""

from __future__ import annotations

import argparse

from rich.markup import escape
from rich.table import Table

import attention_zoo as az
from attention_zoo.registry import attention_options
from experiments.console import console

CAPABILITIES = (
    "supports_causal",
    "supports_mask",
    "supports_cross_attention",
    "needs_shared_qk",
    "requires_max_seq_len",
    "supports_double_backward",
    "supports_segments",
)


def rows() -> list[dict[str, str]]:
    out = []
    for name in az.list_attentions():
        cls = az.get_attention_class(name)
        options = ", ".join(
            f"{s.name}: {s.type_name()}" + ("" if s.required else f" = {s.default!r}") for s in attention_options(cls)
        )
        caps = {c: ("yes" if getattr(cls, c) else "no") for c in CAPABILITIES}
        if cls.supports_causal:
            caps["supports_causal"] = "yes"
        elif cls.causal_counterpart:
            caps["supports_causal"] = f"no (decoders: {cls.causal_counterpart})"
        if not cls.supports_segments:
            caps["supports_segments"] = f"no ({cls.segments_refusal})"
        decoding = "cache" if cls.has_decoding_cache else "recompute" if cls.supports_causal else "-"
        out.append(
            {
                "name": name,
                "approximation": cls.approximation,
                **caps,
                "decoding": decoding,
                "options": options or "-",
                "notes": cls.notes or "-",
            }
        )
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zoo list", description=__doc__)
    parser.parse_args(argv)
    table = Table(title="registered attention mechanisms", show_lines=True)
    headers = [
        "name", "approximation", "causal", "mask", "cross", "shared qk", "needs max_seq_len", "grad²", "packed",
        "decoding",
        "options", "notes",
    ]  # fmt: skip
    for header in headers:
        table.add_column(header, overflow="fold")
    for row in rows():
        table.add_row(
            row["name"],
            row["approximation"],
            *(row[c] for c in CAPABILITIES),
            row["decoding"],
            escape(row["options"]),
            escape(row["notes"]),
        )
    console().print(table)
    return 0
