"""Packing a batch of variable-length examples into fewer rows, for the data option ``pack``.

First-fit decreasing bin packing (Johnson 1973; the "packing" of Krell et al. 2021, arXiv:2107.02027, Sec. 3): the
examples of a batch, longest first, each go into the first row with room for every one of its sides (an example of
translation has a source side and a target side, each with its own row length), else into a new row. Within a row
the examples keep their order in the batch, so a row is a function of the batch alone. The rows' document
boundaries are :mod:`attention_zoo.packing`'s ``segments``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attention_zoo.packing import segments_from_lengths


def first_fit(sizes: Sequence[Sequence[int]], capacities: Sequence[int]) -> list[list[int]]:
    """Rows of example indices: ``sizes[i]`` are example i's lengths, one per side, ``capacities`` each side's row
    length. Every example fits alone (else ValueError naming it); each row lists its examples in batch order."""
    for index, example in enumerate(sizes):
        if len(example) != len(capacities):
            raise ValueError(f"example {index} has {len(example)} sides, the rows {len(capacities)}")
        for side, (size, capacity) in enumerate(zip(example, capacities, strict=True)):
            if not 0 <= size <= capacity:
                raise ValueError(f"example {index}: side {side} has {size} tokens; a row holds 0 .. {capacity}")
    order = sorted(range(len(sizes)), key=lambda i: (-max(sizes[i]), i))
    rows: list[list[int]] = []
    room: list[list[int]] = []
    for index in order:
        fits = next(
            (r for r, left in enumerate(room) if all(s <= f for s, f in zip(sizes[index], left, strict=True))), None
        )
        if fits is None:
            rows.append([])
            room.append(list(capacities))
            fits = len(rows) - 1
        rows[fits].append(index)
        room[fits] = [f - s for f, s in zip(room[fits], sizes[index], strict=True)]
    return [sorted(row) for row in rows]


def pack_side(sequences: Sequence[Tensor], rows: list[list[int]], length: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """The examples' 1-d token tensors ``sequences`` laid out by ``rows`` (from :func:`first_fit`): tokens
    (R, ``length``) padded with ``pad_id`` after each row's last document, and the rows' segments (R, S + 1) with S
    the most examples in a row."""
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for index in members:
            size = sequences[index].numel()
            tokens[r, at : at + size] = sequences[index]
            at += size
    segments = segments_from_lengths([[sequences[i].numel() for i in members] for members in rows], length)
    return tokens, segments
