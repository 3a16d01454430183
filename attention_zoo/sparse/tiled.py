"""Tiled sparse attention on CPU: exact softmax attention restricted to a mask function, in O(n * K) time
and memory, where K is the number of keys a tile of queries touches (K = T + w for a window w).

Layout. Queries are cut into tiles of T positions. A :class:`TileGroup` lists, for each of its tiles, the
K key positions the tile touches and the exact ``(T, K)`` element mask there, evaluated with the
pattern's ``mask_mod`` on those positions (one definition drives the dense reference and this path). A
sliding window's key set is the band [t T - w/2, t T + T + w/2) (:func:`band_layout`, O(n K) to build);
strided columns pair queries and keys of one residue mod l (:func:`residue_layout`); any other
pattern's key sets are found by evaluating the mask function on (rows of tiles) x (all keys) in chunks
of about 4M pairs (:func:`layout_from_mask`: O(n^2) boolean work once per sequence length; the cores
cache layouts). Tiles with different K go into different groups (padding slots waste < 25%). A query
row may appear in several groups (a pattern split into disjoint parts); no (query, key) pair may.

Kernel. :class:`TiledAttention` computes, per batch item and chunk of tiles, all heads at once,
S = Q_t K_t^T / sqrt(d) on the gathered keys, masked, and merges exp(S - m) V_t into each row's running
max m, sum and output (online softmax, as FlashAttention does). It keeps only O and the row log-sum-exp;
the backward recomputes P = exp(S - lse) from them, dS = P * (dP - rowsum(dO * O)) with dP = dO V_t^T,
and scatters dQ, dK, dV back with ``index_add_``. On the CPU per-chunk temporaries are small (about 2 MB)
so that the allocator reuses them instead of faulting fresh pages; on an accelerator they take the much
larger budget of :mod:`attention_zoo.chunking`, so that a chunk is a few kernel launches over many tiles
rather than over a few. Rows that may see no key give zeros, never NaN. :func:`tiled_forward` and
:func:`tiled_backward` give and take the row log-sum-exp, so that the layout can be one part of a larger softmax
(:mod:`attention_zoo.sparse.band_and_tiles`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange, repeat
from torch import Tensor
from torch.autograd.function import once_differentiable

from attention_zoo import chunking
from attention_zoo.masks import MaskMod
from attention_zoo.precision import compute_dtype

#: elements of the largest per-chunk temporary on the CPU: ~2 MB in float32, small enough to stay in the heap
#: (other devices: :mod:`attention_zoo.chunking`)
_CHUNK_ELEMENTS = 1 << 19
#: a tile joins a group while its key count is at least this fraction of the group's largest
_GROUP_FILL = 0.75


@dataclass(frozen=True)
class TileGroup:
    """Tiles that touch the same number K of key slots."""

    rows: Tensor  # (G, T) long: query positions of each tile; positions >= n are padding and see nothing
    key_index: Tensor  # (G, K) long: key positions of each slot, in [0, n)
    blocked: Tensor  # (G, T, K) bool: True where the query may NOT attend the slot


def band_layout(
    mask_mod: MaskMod, n: int, tile: int, before: int, after: int, device: torch.device
) -> tuple[TileGroup]:
    """One group: tile t touches the keys [t T - before, t T + T + after) (clipped to the sequence); for a
    window of w/2 each side, before = w/2 and after = w/2 (0 when causal)."""
    num_tiles = -(-n // tile)
    rows = rearrange(torch.arange(num_tiles * tile, device=device), "(t i) -> t i", i=tile)
    keys = rows[:, :1] - before + torch.arange(before + tile + after, device=device)
    return (_group(mask_mod, n, rows, keys, (keys >= 0) & (keys < n)),)


def residue_layout(mask_mod: MaskMod, n: int, period: int, tile: int, device: torch.device) -> tuple[TileGroup]:
    """One group: tiles of T queries sharing a residue r mod ``period`` (rows r, r + p, r + 2p, ...), each
    against every key of that residue (Child et al.'s strided columns: n / p keys per tile)."""
    per_residue = -(-n // period)
    tile = min(tile, per_residue)
    steps = torch.arange(-(-per_residue // tile) * tile, device=device)
    residues = torch.arange(period, device=device)
    rows = rearrange(residues[:, None] + period * steps, "r (t i) -> (r t) i", i=tile)
    keys = repeat(residues[:, None] + period * steps[:per_residue], "r j -> (r t) j", t=len(steps) // tile)
    return (_group(mask_mod, n, rows, keys, keys < n),)


def layout_from_mask(mask_mod: MaskMod, n: int, tile: int, device: torch.device) -> tuple[TileGroup, ...]:
    """Key sets of every tile found from the mask function itself; tiles grouped by key count (a tile that
    touches no key is left out)."""
    num_tiles = -(-n // tile)
    tiles_per_step = max(1, (1 << 22) // (tile * n))
    positions = torch.arange(n, device=device)
    zero = torch.zeros((), dtype=torch.long, device=device)
    touched: list[Tensor] = []
    for first in range(0, num_tiles, tiles_per_step):
        rows = torch.arange(first * tile, min(num_tiles, first + tiles_per_step) * tile, device=device)
        allowed = mask_mod(zero, zero, rows.clamp(max=n - 1)[:, None], positions[None, :]) & (rows < n)[:, None]
        allowed = rearrange(allowed.expand(len(rows), n), "(t i) j -> t i j", i=tile).any(dim=1)
        touched.extend(positions[row] for row in allowed)
    counts = torch.tensor([len(keys) for keys in touched])
    groups = []
    order = [tile_id for tile_id in counts.argsort(descending=True).tolist() if counts[tile_id] > 0]  # none: no work
    while order:
        width = max(1, int(counts[order[0]]))
        size = int((counts[order] >= _GROUP_FILL * width).sum())
        members, order = order[:size], order[size:]
        keys = torch.zeros(len(members), width, dtype=torch.long, device=device)
        real = torch.zeros(len(members), width, dtype=torch.bool, device=device)
        for slot, tile_id in enumerate(members):
            keys[slot, : counts[tile_id]] = touched[tile_id]
            real[slot, : counts[tile_id]] = True
        rows = torch.tensor(members, device=device)[:, None] * tile + torch.arange(tile, device=device)
        groups.append(_group(mask_mod, n, rows, keys, real))
    return tuple(groups)


def _group(mask_mod: MaskMod, n: int, rows: Tensor, keys: Tensor, real: Tensor) -> TileGroup:
    """The exact element mask of each (query row, key slot), from the mask function."""
    zero = torch.zeros((), dtype=torch.long, device=rows.device)
    keys = keys.clamp(0, n - 1)
    q_idx, kv_idx = rows.clamp(max=n - 1)[:, :, None], keys[:, None, :]
    allowed = mask_mod(zero, zero, q_idx, kv_idx) & real[:, None, :] & (rows < n)[:, :, None]
    return TileGroup(rows=rows, key_index=keys, blocked=~allowed)


def tiled_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: tuple[TileGroup, ...], key_padding: Tensor | None, scale: float
) -> Tensor:
    """softmax(Q K^T * scale) V restricted to ``layout`` and to real keys (``key_padding`` (B, N), True = real).
    Half-precision inputs are computed in float32 (running sums of exponentials need its range)."""
    dtype = q.dtype
    work = compute_dtype(dtype)
    q, k, v = (t.to(work).contiguous() for t in (q, k, v))
    return TiledAttention.apply(q, k, v, layout, key_padding, scale).to(dtype)


def _chunks(layout: tuple[TileGroup, ...], heads: int, dim: int, device: torch.device):
    """(group, tile slice) pairs, each holding about ``chunk_elements(device, _CHUNK_ELEMENTS)`` scores
    (H, t, T, K) or gathered keys (H, t, K, D) across heads, whichever is larger."""
    budget = chunking.chunk_elements(device, _CHUNK_ELEMENTS)
    for group in layout:
        tiles, tile, width = group.blocked.shape
        step = max(1, budget // (heads * max(tile, dim) * width))
        for first in range(0, tiles, step):
            yield group, slice(first, first + step)


def tiled_forward(
    q: Tensor, k: Tensor, v: Tensor, layout: tuple[TileGroup, ...], key_padding: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """O (B, H, N, D) over the layout's pairs and each row's log-sum-exp over them (B, H, N), -inf where a row
    sees no key (O is 0 there)."""
    # b: batch, h: heads, n: positions, d: head dim; per chunk t: tiles, i: rows of a tile, j: key slots
    batch, heads, n, dim = q.shape
    padded = 1 + max(int(group.rows.max()) for group in layout)
    # online softmax over the groups that cover a row: running max m, sum l, and sum of P V
    acc = q.new_zeros(batch, heads, padded, dim)
    row_max = q.new_full((batch, heads, padded), float("-inf"))
    row_sum = q.new_zeros(batch, heads, padded)
    for b in range(batch):
        for group, part in _chunks(layout, heads, dim, q.device):
            queries, keys, values = _gather(q[b], k[b], v[b], group, part, scale)
            scores = _masked_scores(queries, keys, group, part, key_padding, b)
            rows = group.rows[part].flatten()
            old_max = rearrange(row_max[b].index_select(1, rows), "h (t i) -> h t i 1", i=group.rows.shape[1])
            new_max = torch.maximum(old_max, scores.amax(dim=-1, keepdim=True))
            shift = new_max.nan_to_num(neginf=0.0)  # rows that have seen no key yet
            probs = scores.sub_(shift).exp_()
            rescale = rearrange((old_max - shift).exp_(), "h t i 1 -> h (t i) 1")
            flat = "h t i d -> h (t i) d"
            row_sum[b].index_copy_(
                1, rows, row_sum[b].index_select(1, rows).mul_(rescale[..., 0]) + probs.sum(dim=-1).flatten(1)
            )
            acc[b].index_copy_(1, rows, acc[b].index_select(1, rows).mul_(rescale) + rearrange(probs @ values, flat))
            row_max[b].index_copy_(1, rows, new_max.flatten(1))
    out = acc[:, :, :n] / row_sum[:, :, :n, None].clamp_min(torch.finfo(q.dtype).tiny)
    return out, (row_sum[:, :, :n].log() + row_max[:, :, :n])


def tiled_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: tuple[TileGroup, ...],
    key_padding: Tensor | None,
    scale: float,
    grad_out: Tensor,
    out: Tensor,
    lse: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dK, dV of the layout's pairs, given dO, the output O and the log-sum-exp L (B, H, N; +inf where a row
    sees no key) of the softmax they are part of: P = exp(S - L), dS = P * (dO V^T - rowsum(dO * O))."""
    batch, heads, n, dim = q.shape
    grad_out = grad_out.contiguous()
    delta = (grad_out * out).sum(dim=-1)  # rowsum(dO * O), (B, H, N)
    padded = 1 + max(int(group.rows.max()) for group in layout)
    lse = torch.nn.functional.pad(lse, (0, padded - n), value=torch.inf)
    grad_q = q.new_zeros(batch, heads, padded, dim)
    grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
    for b in range(batch):
        for group, part in _chunks(layout, heads, dim, q.device):
            queries, keys, values = _gather(q[b], k[b], v[b], group, part, scale)
            rows, slots = group.rows[part], group.key_index[part].flatten()
            tile = rows.shape[1]
            scores = _masked_scores(queries, keys, group, part, key_padding, b)
            probs = scores.sub_(rearrange(lse[b].index_select(1, rows.flatten()), "h (t i) -> h t i 1", i=tile)).exp_()
            read = rows.clamp(max=n - 1).flatten()
            grad_rows = rearrange(grad_out[b].index_select(1, read), "h (t i) d -> h t i d", i=tile)
            delta_rows = rearrange(delta[b].index_select(1, read), "h (t i) -> h t i 1", i=tile)
            grad_v[b].index_add_(1, slots, rearrange(probs.mT @ grad_rows, "h t j d -> h (t j) d"))
            grad_scores = (grad_rows @ values.mT).sub_(delta_rows).mul_(probs)  # dS, of S = (Q scale) K^T
            grad_rows_q = (grad_scores @ keys).mul_(scale)
            grad_q[b].index_add_(1, rows.flatten(), rearrange(grad_rows_q, "h t i d -> h (t i) d"))
            grad_k[b].index_add_(1, slots, rearrange(grad_scores.mT @ queries, "h t j d -> h (t j) d"))
    return grad_q[:, :, :n], grad_k, grad_v


class TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, key_padding, scale):
        out, lse = tiled_forward(q, k, v, layout, key_padding, scale)
        # +inf on rows that see no key, so that the backward's exp(S - lse) is 0 there
        ctx.save_for_backward(q, k, v, out, lse.nan_to_num_(neginf=float("inf")), key_padding)
        ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, key_padding = ctx.saved_tensors
        grads = tiled_backward(q, k, v, ctx.layout, key_padding, ctx.scale, grad_out, out, lse)
        return *grads, None, None, None


def _gather(
    q: Tensor, k: Tensor, v: Tensor, group: TileGroup, part: slice, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Queries * scale (H, t, T, D) and keys, values (H, t, K, D) of a chunk of tiles, for one batch item;
    scaling the queries rather than the scores touches T D numbers instead of T K."""
    tiles, tile = group.rows[part].shape
    slots = group.key_index[part].flatten()
    queries = q.index_select(1, group.rows[part].clamp(max=q.shape[1] - 1).flatten()).mul_(scale)
    return (
        rearrange(queries, "h (t i) d -> h t i d", i=tile),
        rearrange(k.index_select(1, slots), "h (t j) d -> h t j d", t=tiles),
        rearrange(v.index_select(1, slots), "h (t j) d -> h t j d", t=tiles),
    )


def _masked_scores(queries: Tensor, keys: Tensor, group: TileGroup, part: slice, key_padding: Tensor | None, b: int):
    """S = (Q * scale) K^T, -inf where the pattern or the key padding forbids the pair."""
    blocked = group.blocked[part]
    if key_padding is not None:
        real = key_padding[b, group.key_index[part]]
        blocked = blocked | ~rearrange(real, "t j -> t 1 j")
    return (queries @ keys.mT).masked_fill_(blocked, float("-inf"))
