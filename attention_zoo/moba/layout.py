"""MoBA's layout of the gated (query, key block) pairs: grouped by key block, so that each key block is read once
per batch and scored against every query that selected it (the kernels are :mod:`attention_zoo.moba.tiled` and
:mod:`attention_zoo.moba.flash`).

Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs", arXiv:2502.13189, Sec. 2 (the
authors' varlen FlashAttention is key-block-major too). The (query, block) pairs are sorted by key block; the
(b, h) sequences of a block are batched together, their query lists padded to the longest; sequences whose
lists are much shorter go to another batch (at most 15% of a batch's rows are padding: gathering a block's keys
for a batch costs less than padded rows; a batch of every sequence reads them as a view), and lists that would
exceed the per-chunk budget are cut. A query selects a block at most once, so the rows of a batch are distinct.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor

#: a sequence joins a batch of a key block while its query count is at least this fraction of the batch's largest
_BATCH_FILL = 0.85


@dataclass(frozen=True)
class GatedBatch:
    """Queries of some (b, h) sequences that selected key block ``block``, scored together."""

    block: int
    sequences: Tensor | None  # (G,) long: the flattened (b h) sequence of each batch row; None = all, in order
    rows: Tensor  # (G, M) long: flattened (b h i) query of each row; B H N pads and sees nothing


def gated_layout(gated: Tensor, block_size: int, budget: int) -> tuple[GatedBatch, ...]:
    """Batches of the (query, block) pairs of ``gated`` (B, H, N, top_k), grouped by key block (see the module
    docstring); each batch holds at most ``budget`` scores."""
    device = gated.device
    sequences, n, picks = gated.shape[0] * gated.shape[1], gated.shape[2], gated.shape[3]
    blocks_of = n // block_size
    segments = blocks_of * sequences
    block = rearrange(gated, "b h i r -> (b h) (i r)")
    # a pair's segment is its (key block, sequence); unrouted pairs (block -1) sort after every segment
    key = (block * sequences + torch.arange(sequences, device=device)[:, None]).masked_fill_(block < 0, segments)
    # stable: queries stay in position order within a segment, so its gathers walk memory forwards
    segment, order = key.flatten().to(torch.int32).sort(stable=True)
    counts = torch.bincount(segment, minlength=segments + 1)[:segments]
    routed = int(counts.sum())
    segment, query = segment[:routed].long(), order[:routed] // picks  # (s i r) position -> query s n + i
    cap = max(1, budget // block_size)  # rows of one sequence in one batch
    batches, piece_start, first_piece, start = [], [], [], 0
    for j, row in enumerate(counts.view(blocks_of, sequences).tolist()):
        pieces = []  # (rows, sequence, index of the piece)
        for s, count in enumerate(row):
            first_piece.append(len(piece_start) + len(pieces))
            pieces.extend((min(cap, count - at), s, len(pieces)) for at in range(0, count, cap))
        base = len(piece_start)
        piece_start.extend([0] * len(pieces))
        pieces.sort(key=lambda p: -p[0])
        while pieces:
            width = pieces[0][0]
            size = 1
            while size < min(len(pieces), max(1, budget // (width * block_size))):
                if pieces[size][0] < _BATCH_FILL * width:
                    break
                size += 1
            members, pieces = sorted(pieces[:size], key=lambda p: p[1]), pieces[size:]
            for slot, (_, _, index) in enumerate(members):
                piece_start[base + index] = start + slot * width
            seqs = [p[1] for p in members]
            batches.append((j, None if seqs == list(range(sequences)) else seqs, width, start))
            start += len(members) * width
    segment_start = counts.cumsum(0) - counts
    first_piece = torch.tensor(first_piece, dtype=torch.long, device=device)
    # one spare entry: an empty segment's first piece is the next segment's (or none, after the last)
    piece_start = torch.tensor(piece_start + [0], dtype=torch.long, device=device)
    if cap >= int(counts.max()):  # at most one piece a segment: its rows start at that piece's slot
        slots = (piece_start[first_piece] - segment_start)[segment] + torch.arange(routed, device=device)
    else:
        within = torch.arange(routed, device=device) - segment_start[segment]
        slots = piece_start[first_piece[segment] + within // cap] + within % cap
    rows = torch.full((start,), sequences * n, dtype=torch.long, device=device)
    rows[slots] = query
    return tuple(
        GatedBatch(
            block=j,
            sequences=None if seqs is None else torch.tensor(seqs, device=device),
            rows=rows[first : first + len(seqs or range(sequences)) * width].view(-1, width),
        )
        for j, seqs, width, first in batches
    )


def block_keys(blocks: Tensor, batch: GatedBatch) -> Tensor:
    """(G, B, D) keys (or values) of a batch's key block: a view when the batch holds every sequence."""
    keys = blocks[:, batch.block]
    return keys if batch.sequences is None else keys.index_select(0, batch.sequences)


def block_bias(key_bias: Tensor | None, batch: GatedBatch, block_size: int) -> Tensor | None:
    """(G, B) additive key mask (0 / -inf) of a batch's key block, from ``key_bias`` (S, N); None without one."""
    if key_bias is None:
        return None
    bias = key_bias[:, batch.block * block_size : (batch.block + 1) * block_size]
    return bias if batch.sequences is None else bias.index_select(0, batch.sequences)


def add_block(blocks: Tensor, batch: GatedBatch, part: Tensor) -> None:
    """Adds a batch's (G, B, D) gradient into the rows of its key block."""
    target = blocks[:, batch.block]
    if batch.sequences is None:
        target.add_(part)
    else:
        target.index_add_(0, batch.sequences, part)
