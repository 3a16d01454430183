"""MoBA through FlexAttention (``impl="flex"`` of :class:`attention_zoo.moba.attention.MixtureOfBlockAttention`): the
gate's selection becomes a ``BlockMask`` over (query, block) pairs sorted by block, built on the device.

Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs", arXiv:2502.13189, Sec. 2 (the authors'
varlen FlashAttention is key-block-major too); Dong et al. 2024, "Flex Attention", arXiv:2412.05496. Each query's
R = 1 + top_k selected blocks make R pairs; the pairs of a (b, h) are sorted by block (stable: by query within a
block) and their queries gathered into P = N R rows, so that a tile of ``Q_BLOCK`` rows holds one block's pairs
(two at a boundary). Pair p attends the keys [lo_p, hi_p): its block, cut at the sequence's end and, when causal,
at its query (only the own block reaches it). A tile of ``Q_BLOCK`` rows x ``KV_BLOCK`` keys is in the mask when a
row's interval meets it (a scatter-add of the rows' tiles, then a sort: no host synchronisation), and full (no
``mask_mod``) when every row's interval covers it. One FlexAttention call gives each pair its output and
log-sum-exp; the R pairs of a query are merged as the partial softmaxes they are
(:func:`~attention_zoo.sparse.flex.merged`).

Work: per (b, h) P / ``Q_BLOCK`` row tiles, each against its block's key tiles (one when B = ``KV_BLOCK``), plus
one key tile more for each block boundary inside a row tile (at most N / B): the scores MoBA keeps, as the tiled
kernel of :mod:`attention_zoo.moba.tiled` computes them, not the union of many queries' choices (128 queries of a
block choosing their top 4 of 63 blocks independently would touch nearly all of them). Blocks smaller than
``KV_BLOCK`` share a key tile, so the kernel computes up to ``KV_BLOCK`` / B times the scores it keeps. Memory: the
gathered rows, their outputs and the merge, O(N R D) per head.

Key padding is the ``score_mod`` of :mod:`attention_zoo.sparse.flex`; a pair or query with no allowed key gives
zeros. The call is :func:`attention_zoo.sparse.flex.flex_call` (compiled on CUDA), forward and backward (the
log-sum-exp is differentiable); on the CPU torch's eager fallback runs it (forward only, dense over the P x N
scores). Decoding keeps the tiled kernel; packed rows are unpacked into padded rows
(:func:`attention_zoo.packing.unpacked_attention`), which run this path where the call resolves to it.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attention_zoo.sparse import flex

#: rows (gathered pairs) and keys per tile of the block mask: torch's default, which the block sizes of every
#: default kernel configuration (powers of two up to 128, forward and backward) divide
Q_BLOCK = KV_BLOCK = 128


def moba_flex_attention(
    q: Tensor, k: Tensor, v: Tensor, selected: Tensor, mask: Tensor | None, block_size: int, causal: bool, scale: float
) -> Tensor:
    """softmax(q K^T * scale) V of each query over the blocks ``selected`` (B, H, N, R) gives it (rank 0 its own
    block, -1 = none; N = q's length, not padded), real keys only (``mask`` (B, N) bool or None), causal inside
    the own block when ``causal``."""
    # b: batch, h: heads, i: query, r: rank, p: pair, d: head dim
    n, ranks = q.shape[-2], selected.shape[-1]
    blocks = -(-n // block_size)
    # pairs sorted by block; -1 sorts last, as block `blocks`, whose interval [lo, hi) is empty
    key = rearrange(selected.masked_fill(selected < 0, blocks), "b h i r -> b h (i r)")
    block, order = key.sort(dim=-1, stable=True)
    query = order // ranks
    lo = block * block_size
    hi = (lo + block_size).clamp_max(n)
    if causal:  # only the own block reaches past its query
        hi = torch.minimum(hi, query + 1)
    block_mask = pair_block_mask(lo, hi, block_size, n)
    rows = q.gather(2, query[..., None].expand(-1, -1, -1, q.shape[-1]))
    out, lse = flex.flex_call(rows, k, v, block_mask, mask, scale)
    positions = torch.arange(order.shape[-1], device=q.device).expand_as(order)
    unsort = torch.empty_like(order).scatter_(-1, order, positions)
    out = rearrange(out.gather(2, unsort[..., None].expand_as(out)), "b h (i r) d -> b h i r d", r=ranks)
    lse = rearrange(lse.gather(-1, unsort), "b h (i r) -> b h i r", r=ranks)
    return flex.merged(out.unbind(-2), lse.unbind(-1)).to(q.dtype)


def pair_block_mask(lo: Tensor, hi: Tensor, block_size: int, n: int) -> BlockMask:
    """The block mask of P rows against ``n`` keys in which row p attends keys [lo_p, hi_p) ((B, H, P) long,
    rows sorted by lo); built on the device, without host synchronisation."""
    # b: batch, h: heads, t: row tile, q: row in a tile, s: key tile a row may touch
    batch, heads, pairs = lo.shape
    row_tiles, key_tiles = -(-pairs // Q_BLOCK), -(-n // KV_BLOCK)
    # rows past P (the last tile's padding) attend nothing: an empty interval
    lo, hi = (torch.nn.functional.pad(t, (0, row_tiles * Q_BLOCK - pairs), value=0) for t in (lo, hi))
    span = -(-block_size // KV_BLOCK) + (block_size % KV_BLOCK != 0)  # key tiles an interval of B keys can meet
    tile = rearrange(lo // KV_BLOCK, "b h p -> b h p 1") + torch.arange(span, device=lo.device)
    start, lo, hi = tile * KV_BLOCK, lo[..., None], hi[..., None]
    meets = (start < hi) & (start + KV_BLOCK > lo)
    covers = (start >= lo) & (start + KV_BLOCK <= hi)
    counts = []
    for rows_in in (meets, covers):  # rows per (row tile, key tile); column key_tiles takes the rest
        index = rearrange(tile.masked_fill(~rows_in, key_tiles), "b h (t q) s -> b h t (q s)", q=Q_BLOCK)
        total = torch.zeros(batch, heads, row_tiles, key_tiles + 1, dtype=torch.int32, device=lo.device)
        counts.append(total.scatter_add_(-1, index, torch.ones_like(index, dtype=torch.int32))[..., :key_tiles])
    full = counts[1] == Q_BLOCK  # every row of the tile attends every key of it
    partial = (counts[0] > 0) & ~full
    tables = [t for tiles in (partial, full) for t in _kv_table(tiles)]
    lo, hi = lo[..., 0], hi[..., 0]

    def in_pair_block(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (lo[b, h, q_idx] <= kv_idx) & (kv_idx < hi[b, h, q_idx])

    return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=in_pair_block,
                                    seq_lengths=(pairs, n))  # fmt: skip


def _kv_table(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """(counts, indices) of a (B, H, row tiles, key tiles) bool table: the key tiles of each row tile first."""
    indices = tiles.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
    return tiles.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)
