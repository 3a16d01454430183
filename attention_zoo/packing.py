"""Packed sequences: several documents in one row, attention only within each.

A row of N positions holds documents one after another from position 0; ``segments`` (B, S + 1) int64 gives
each row's document boundaries: document s of row b spans positions ``segments[b, s] .. segments[b, s + 1] - 1``.
Boundaries start at 0 and never decrease; a repeated boundary is an empty document (so rows with fewer
documents repeat their last boundary); positions from ``segments[b, -1]`` to N - 1 are padding. This is
flash-attention's ``cu_seqlens`` per row (:func:`segments_from_cu_seqlens` converts one packed 1-d stream;
:func:`segments_from_position_ids` reads Hugging Face's ``position_ids`` restarting at 0;
:func:`segments_from_lengths` builds them from document lengths).

The contract of a core given segments: the output at every position of a document equals the core applied
to that document alone, with the same options and ``causal`` aligned within the document; padding positions
give 0. Cross-attention takes the queries' and the keys' boundaries, with the same number of documents:
query document s reads key document s only.

The generic path (:func:`unpacked_attention`) gathers each document into a row of its own, pads those rows to
the longest document and calls the core's ``attend`` once with the padding mask; exact for a core whose output on
a padded sequence equals its output on the sequence alone. ``group_by_length=True`` instead calls the core once
per distinct document length with no padding at all, exact for every batch-independent core.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor

__all__ = [
    "document_ids",
    "positions_in_documents",
    "segments_from_cu_seqlens",
    "segments_from_lengths",
    "segments_from_position_ids",
]


def check_segments(segments: object, n: int, batch: int, *, name: str, mask: Tensor | None = None,
                   device: torch.device | None = None) -> Tensor:  # fmt: skip
    """``segments`` if it is a valid (B, S + 1) boundary tensor for rows of ``n`` positions (module docstring),
    else ValueError naming the row and the offending value; ``mask``, when given, must be True exactly on the
    documents' positions."""
    if not isinstance(segments, Tensor):
        raise ValueError(
            f"{name}: segments must be a (B, S + 1) int64 tensor of boundaries, got {type(segments).__name__}"
        )
    if segments.dtype != torch.long or segments.ndim != 2 or segments.shape[0] != batch or segments.shape[1] < 2:
        raise ValueError(
            f"{name}: segments must be int64 (B, S + 1) = ({batch}, S + 1) with S >= 1 documents per row; "
            f"got {segments.dtype} {tuple(segments.shape)}"
        )
    if device is not None and segments.device != device:
        raise ValueError(f"{name}: segments are on {segments.device}, the inputs on {device}; put them on one device")
    checked = _CheckedSegments.of(segments, mask, n)
    if checked is not None and any(earlier.same(checked) for earlier in _checked):
        return segments
    bounds = segments.tolist()
    for row, edges in enumerate(bounds):
        if edges[0] != 0:
            raise ValueError(f"{name}: segments row {row} starts at {edges[0]}; the first document starts at 0")
        for index in range(1, len(edges)):
            if edges[index] < edges[index - 1]:
                raise ValueError(
                    f"{name}: segments row {row}: boundary {edges[index]} at index {index} is below the previous one "
                    f"{edges[index - 1]} (documents would overlap; boundaries never decrease)"
                )
        if edges[-1] > n:
            raise ValueError(f"{name}: segments row {row} ends at {edges[-1]}, past the row's {n} positions")
    if mask is not None:
        expected = torch.arange(n, device=segments.device)[None, :] < segments[:, -1:]
        disagree = (expected != mask.to(segments.device)).nonzero()
        if disagree.numel():
            row, position = disagree[0].tolist()
            inside = bool(expected[row, position])
            raise ValueError(
                f"{name}: mask disagrees with segments in row {row} at position {position}: "
                + ("inside a document but masked out" if inside else "after the last document but marked real")
                + f" (documents cover positions 0 .. {bounds[row][-1] - 1})"
            )
    if checked is not None:
        _checked.append(checked)
        del _checked[:-_CHECKED_KEPT]
    return segments


@dataclass(frozen=True, eq=False)
class _CheckedSegments:
    """Boundaries found valid for rows of ``n`` positions (and ``mask``): the same tensor objects at the same
    versions (an in-place write bumps a tensor's version). A model passes one boundary tensor to the core of every
    layer, and each check reads it back to the host, which on an accelerator is a synchronisation per layer."""

    segments: weakref.ref
    version: int
    n: int
    mask: weakref.ref | None
    mask_version: int | None

    @staticmethod
    def of(segments: Tensor, mask: Tensor | None, n: int) -> _CheckedSegments | None:
        """None for a tensor without a version counter (made under ``torch.inference_mode``): checked every time."""
        if segments.is_inference() or (mask is not None and mask.is_inference()):
            return None
        masked = (None, None) if mask is None else (weakref.ref(mask), mask._version)
        return _CheckedSegments(weakref.ref(segments), segments._version, n, *masked)

    def same(self, other: _CheckedSegments) -> bool:
        """The same live tensors at the same versions, for the same n (identity, never the values)."""
        if (self.version, self.n, self.mask_version) != (other.version, other.n, other.mask_version):
            return False
        if self.segments() is None or self.segments() is not other.segments():
            return False
        if self.mask is None or other.mask is None:
            return self.mask is other.mask
        return self.mask() is not None and self.mask() is other.mask()


#: how many boundary tensors found valid are remembered (a model's self- and cross-attention use two or three)
_CHECKED_KEPT = 8
_checked: list[_CheckedSegments] = []


def document_ids(segments: Tensor, n: int) -> Tensor:
    """(B, n) int64: the index of the document each position belongs to, -1 for padding after the last one."""
    positions = torch.arange(n, device=segments.device)
    ids = torch.searchsorted(segments[:, 1:].contiguous(), positions.expand(segments.shape[0], n).contiguous(),
                             right=True)  # fmt: skip
    return ids.masked_fill(positions[None, :] >= segments[:, -1:], -1)


def positions_in_documents(segments: Tensor, n: int) -> Tensor:
    """(B, n) int64: each position's offset from the start of its document (0 for padding)."""
    ids = document_ids(segments, n)
    starts = segments.gather(1, ids.clamp(min=0))
    offsets = torch.arange(n, device=segments.device)[None, :] - starts
    return offsets.masked_fill(ids < 0, 0)


def padding_mask(segments: Tensor, n: int) -> Tensor:
    """(B, n) bool, True on the documents' positions (False on padding after the last document)."""
    return torch.arange(n, device=segments.device)[None, :] < segments[:, -1:]


def segments_from_lengths(lengths: Sequence[Sequence[int]], n: int | None = None, *,
                          device: torch.device | str | None = None) -> Tensor:  # fmt: skip
    """Boundaries for rows of documents of the given lengths (``[[5, 3], [8]]``); rows with fewer documents repeat
    their last boundary. ``n`` (the row length), when given, is checked: no row may hold more positions."""
    rows = [list(map(int, row)) for row in lengths]
    for row, sizes in enumerate(rows):
        bad = next((size for size in sizes if size < 0), None)
        if bad is not None:
            raise ValueError(f"segments_from_lengths: row {row} has a document of length {bad}; lengths are >= 0")
        if n is not None and sum(sizes) > n:
            raise ValueError(f"segments_from_lengths: row {row} holds {sum(sizes)} positions, more than n={n}")
    width = max((len(sizes) for sizes in rows), default=0) or 1
    table = []
    for sizes in rows:
        edges = [0]
        for size in sizes:
            edges.append(edges[-1] + size)
        table.append(edges + [edges[-1]] * (width + 1 - len(edges)))
    return torch.tensor(table, dtype=torch.long, device=device).reshape(len(rows), width + 1)


def segments_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """flash-attention's ``cu_seqlens`` (1-d, cumulative, starting at 0) of a stream of ``cu_seqlens[-1]`` packed
    positions, as the boundaries of one row holding that stream: (1, S + 1)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-d tensor of at least 2 offsets, got {cu_seqlens!r}")
    return cu_seqlens.to(torch.long)[None, :]


def segments_from_position_ids(position_ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """Boundaries from positions that restart at 0 at each document (Hugging Face's packed ``position_ids``,
    (B, N)): a document starts wherever the position is 0, and its positions must count up by one. Positions
    where ``mask`` is False (padding) must come after the last document."""
    if position_ids.ndim != 2:
        raise ValueError(f"position_ids must be (B, N), got shape {tuple(position_ids.shape)}")
    b, n = position_ids.shape
    real = torch.ones(b, n, dtype=torch.bool, device=position_ids.device) if mask is None else mask
    lengths: list[list[int]] = []
    for row, (ids, keep) in enumerate(zip(position_ids.tolist(), real.tolist(), strict=True)):
        count = sum(keep)
        if any(keep[count:]) or not all(keep[:count]):
            raise ValueError(f"position_ids row {row}: padding must come after the last document")
        sizes: list[int] = []
        for index, position in enumerate(ids[:count]):
            if position == 0:
                sizes.append(1)
            elif sizes and position == ids[index - 1] + 1:
                sizes[-1] += 1
            else:
                raise ValueError(
                    f"position_ids row {row}: position {position} at index {index} neither restarts at 0 nor "
                    "follows the previous one; packed position_ids count 0, 1, 2, ... within each document"
                )
        lengths.append(sizes)
    return segments_from_lengths(lengths, n, device=position_ids.device)


@dataclass(frozen=True)
class Documents:
    """Where the documents of a packed batch lie: ``rows``, ``starts``, ``lengths`` (one int per document, in row
    order, empty documents left out) and the matching entries of the other side (``key_*``) for cross-attention."""

    rows: list[int]
    starts: list[int]
    lengths: list[int]
    key_starts: list[int]
    key_lengths: list[int]

    @staticmethod
    def of(segments: Tensor, key_segments: Tensor) -> Documents:
        rows, starts, lengths, key_starts, key_lengths = [], [], [], [], []
        for row, (edges, key_edges) in enumerate(zip(segments.tolist(), key_segments.tolist(), strict=True)):
            for s in range(len(edges) - 1):
                if edges[s + 1] > edges[s]:
                    rows.append(row)
                    starts.append(edges[s])
                    lengths.append(edges[s + 1] - edges[s])
                    key_starts.append(key_edges[s])
                    key_lengths.append(key_edges[s + 1] - key_edges[s])
        return Documents(rows, starts, lengths, key_starts, key_lengths)


def document_slots(rows: list[int], starts: list[int], lengths: list[int], width: int,
                   device: torch.device) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The listed documents as rows of ``width`` slots, for :func:`gathered`: each one's packed row ``(S,)``, each
    slot's position in it (0 where unused) and whether it is used ``(S, width)``."""
    offsets = torch.arange(width, device=device)
    real = offsets[None, :] < torch.tensor(lengths, dtype=torch.long, device=device)[:, None]
    position = (torch.tensor(starts, dtype=torch.long, device=device)[:, None] + offsets).masked_fill(~real, 0)
    return torch.tensor(rows, dtype=torch.long, device=device), position, real


def gathered(t: Tensor, row: Tensor, position: Tensor, real: Tensor) -> Tensor:
    """The pieces of ``t`` (B, H, N, D) at ``row``, ``position``, ``real`` (of :func:`document_slots`, or the kernel
    family's pieces of documents), as (P, H, c, D) with unused slots 0 (whatever padding holds, NaN included, stays
    out)."""
    pieces = t[row[:, None], :, position].masked_fill(~rearrange(real, "p c -> p c 1 1"), 0.0)  # (p, c, h, d)
    return rearrange(pieces, "p c h d -> p h c d")


def scattered(pieces: Tensor, row: Tensor, position: Tensor, real: Tensor, shape: torch.Size) -> Tensor:
    """The inverse of :func:`gathered`: pieces (P, H, c, D) at their positions of packed rows of ``shape``
    (B, H, N, D), 0 at every position no piece covers (padding)."""
    values = rearrange(pieces, "p h c d -> p c h d")[real]  # (positions, h, d)
    b, h, n, d = shape
    rows = row[:, None].expand_as(position)[real]
    return rearrange(values.new_zeros(b, n, h, d).index_put((rows, position[real]), values), "b n h d -> b h n d")


Attend = Callable[..., Tensor]


def unpacked_attention(attend: Attend, q: Tensor, k: Tensor, v: Tensor, segments: Tensor, key_segments: Tensor, *,
                       causal: bool, group_by_length: bool = False) -> Tensor:  # fmt: skip
    """A core's ``attend(q, k, v, *, mask, causal)`` applied to each document on its own (module docstring):
    one call over the documents padded to the longest, or (``group_by_length``) one unpadded call per distinct
    (query length, key length). Padding positions give 0."""
    docs = Documents.of(segments, key_segments)
    if not docs.rows:
        return torch.zeros_like(q)
    if causal and docs.lengths != docs.key_lengths:
        raise ValueError("causal packed attention needs each document's query and key lengths to be equal")
    if not group_by_length:
        return _attend_documents(attend, q, k, v, docs, list(range(len(docs.rows))), causal=causal, padded=True)
    groups: dict[tuple[int, int], list[int]] = {}
    for index, shape in enumerate(zip(docs.lengths, docs.key_lengths, strict=True)):
        groups.setdefault(shape, []).append(index)
    out = torch.zeros_like(q)
    for members in groups.values():
        out = out + _attend_documents(attend, q, k, v, docs, members, causal=causal, padded=False)
    return out


def _attend_documents(attend: Attend, q: Tensor, k: Tensor, v: Tensor, docs: Documents, members: list[int], *,
                      causal: bool, padded: bool) -> Tensor:  # fmt: skip
    pick = lambda values: [values[i] for i in members]  # noqa: E731
    rows = pick(docs.rows)
    queries = document_slots(rows, pick(docs.starts), pick(docs.lengths), max(pick(docs.lengths)), q.device)
    key_lengths = pick(docs.key_lengths)
    width = max(key_lengths)
    if width == 0:
        return torch.zeros_like(q)
    keys = document_slots(rows, pick(docs.key_starts), key_lengths, width, q.device)
    q_docs = gathered(q, *queries)
    k_docs = q_docs if k is q else gathered(k, *keys)
    k_real = keys[2]
    mask = k_real if padded and not bool(k_real.all()) else None
    out = attend(q_docs, k_docs, gathered(v, *keys), mask=mask, causal=causal)
    return scattered(out, *queries, q.shape)
