"""zoo list: every registered attention mechanism, one line each; --long for every capability, each option's
type and default, and the caveats.

Columns. approximation: what the core computes in place of softmax over every key (none is full attention;
fixed sparsity and content-selected sparsity are exact softmax over the keys of a fixed pattern or of the
core's own selection, not equality with full attention; hierarchical sparsity (NSA) mixes softmaxes over block
summaries, selected blocks and a window; recurrent state is no softmax at all). causal: whether the core takes
causal=True (only: it refuses causal=False, e.g. a recurrence). packed:
whether it takes packed rows (segments: several documents per row; --long gives the reason of a no). decoding:
how step-by-step causal decoding runs: cache (the core keeps its own state), recompute (the causal forward over
the whole prefix at every step), "via <core>" (not causal: a decoder uses that core instead) or - (none).
options: the names a spec sets (linformer:k=64). With --long also: mask, cross-attention, shared query/key,
whether max_seq_len is required, and grad² (second-order gradients, a backward with create_graph=True: exact,
yes, or refused with one error naming the core, no)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from experiments.subcommands import ZooArgumentParser

if TYPE_CHECKING:
    from rich.table import Table

CAPABILITIES = (
    "supports_causal",
    "supports_mask",
    "supports_cross_attention",
    "needs_shared_qk",
    "requires_max_seq_len",
    "supports_double_backward",
    "supports_segments",
)
#: spaces between two columns of the compact table
COLUMN_GAP = 2
EXAMPLES = ("zoo list", "zoo list --long        # every capability, option types and defaults, caveats")


def rows() -> list[dict[str, str]]:
    """One row per registered mechanism, every column of the long table as text (``-`` where there is none)."""
    import attention_zoo as az
    from attention_zoo.registry import attention_options

    out = []
    for name in az.list_attentions():
        cls = az.get_attention_class(name)
        specs = attention_options(cls)
        options = ", ".join(f"{s.name}: {s.type_name()}" + ("" if s.required else f" = {s.default!r}") for s in specs)
        caps = {c: ("yes" if getattr(cls, c) else "no") for c in CAPABILITIES}
        if cls.causal_only:
            caps["supports_causal"] = "only"
        elif cls.supports_causal:
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
                "option_names": ", ".join(s.name + ("" if not s.required else " (required)") for s in specs) or "-",
                "notes": cls.notes or "-",
                "counterpart": cls.causal_counterpart or "",
            }
        )
    return out


def compact_table(rows: list[dict[str, str]], width: int) -> Table:
    """One line per mechanism, at most ``width`` characters: name, approximation, causal, packed, decoding (of a
    non-causal core: the core its decoders use) and the option names. Where the width runs out, cells are cut with
    an ellipsis: the options down to 40 characters first, then the approximation to 14, the options to 16, the
    decoding to 9 and the options to 8; name, causal and packed are never cut."""
    from rich.markup import escape
    from rich.table import Table

    cells = []
    for row in rows:
        decoding = f"via {row['counterpart']}" if row["decoding"] == "-" and row["counterpart"] else row["decoding"]
        causal, packed = (row[c].split(" ", 1)[0] for c in ("supports_causal", "supports_segments"))
        cells.append((row["name"], row["approximation"], causal, packed, decoding, row["option_names"]))
    headers = ("name", "approximation", "causal", "packed", "decoding", "options")
    widths = dict(zip(headers, (max(map(len, column)) for column in zip(headers, *cells, strict=True)), strict=True))
    excess = sum(widths.values()) + COLUMN_GAP * (len(headers) - 1) - width
    for header, floor in (("options", 40), ("approximation", 14), ("options", 16), ("decoding", 9), ("options", 8)):
        cut = max(0, min(excess, widths[header] - floor))
        widths[header] -= cut
        excess -= cut
    table = Table(box=None, pad_edge=False, padding=(0, COLUMN_GAP // 2), header_style="bold")
    for header in headers:
        table.add_column(header, no_wrap=True, overflow="ellipsis", max_width=widths[header])
    for row_cells in cells:
        table.add_row(*map(escape, row_cells))
    return table


def long_table(rows: list[dict[str, str]]) -> Table:
    """Every capability, each option's type and default, and the notes (cells folded over several lines)."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="registered attention mechanisms", show_lines=True)
    headers = [
        "name", "approximation", "causal", "mask", "cross", "shared qk", "needs max_seq_len", "grad²", "packed",
        "decoding",
        "options", "notes",
    ]  # fmt: skip
    for header in headers:
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(
            row["name"],
            row["approximation"],
            *(row[c] for c in CAPABILITIES),
            row["decoding"],
            escape(row["options"]),
            escape(row["notes"]),
        )
    return table


def main(argv: list[str]) -> int:
    parser = ZooArgumentParser("zoo list", __doc__.split("\n\n", 1)[1], EXAMPLES)
    parser.add_argument(
        "--long", action="store_true", help="every capability, option types and defaults, and the notes"
    )
    args = parser.parse_args(argv)
    from experiments.console import console

    out = console()
    out.print(long_table(rows()) if args.long else compact_table(rows(), out.width))
    return 0
