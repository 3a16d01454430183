"""Sliding-window attention at block granularity: exact softmax attention over a band of keys,
i - before <= j <= i + after, with no gathers and no scatters.

Beltagy et al. 2020, "Longformer: The Long-Document Transformer", arXiv:2004.05150, sec. 3.1: a window of w
keys, w/2 on each side (before = after = w/2; causal: before = w/2, after = 0). Per query i,

    O_i = softmax(q_i K_{[i - before, i + after]}^T / sqrt(d)) V_{[i - before, i + after]}.

Layout. Queries are cut into tiles of T rows; tile t needs the keys [t T - before, t T + T + after), which
are L = T + before + after (rounded up to a multiple of T) consecutive positions. The keys (and values) of
all B * H sequences are copied once into one zero-padded row buffer in which position p of sequence s sits
at row s N' + before + p (N': n rounded up to T). Tile g = s (N' / T) + t then reads rows [g T, g T + L):
one ``as_strided`` view with tile stride T rows, so every score block is a plain ``bmm`` on contiguous
keys. Key rows a tile sees outside its own sequence (the ends of the band) are masked; only the first and
last T columns of a tile can hold the band's edges, so the band mask touches 2 T of the L columns, and the
tiles at either end of a sequence (or all, with key padding) take a mask of real positions.

Kernel. Each row's keys lie in one tile, so the forward is one softmax per tile, no online rescaling:
S = (Q_t * scale) K_t^T, P = softmax(S) (one fused pass), O_t = P V_t. It keeps P (n L numbers per head, linear
in n: T + w over d times the size of Q) rather than recomputing it as FlashAttention does: the recomputation is
one more product and more passes over the scores, and the band holds few scores per row. The backward is
dV_t = P^T dO_t, dS = P * (dO_t V_t^T - rowsum(dO * O)), dQ_t = scale dS K_t, dK_t = dS^T (Q_t * scale).
Tile g's L key rows are the T-row blocks g, ..., g + L/T - 1 of the buffer, so dK_t and dV_t are added back
block by block (L/T strided adds per chunk), not by index. Work runs over chunks of consecutive tiles
holding about ``_CHUNK_ELEMENTS`` scores, with the chunk's temporaries allocated once per call and reused. Rows
with no key give zeros, never NaN. For a band that is one part of a larger softmax
(:mod:`attention_zoo.sparse.band_and_tiles`), :func:`band_forward` also gives each row's log-sum-exp over its band and
:func:`band_backward` takes the final O and factors exp(L_band - L) for the rows of the kept P; a learned sink
(:mod:`attention_zoo.sinks`) is that case with L = log(exp(L_band) + exp(σ_h)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange, repeat
from torch import Tensor
from torch.autograd.function import once_differentiable

from attention_zoo import chunking
from attention_zoo.precision import compute_dtype
from attention_zoo.sinks import add_sink, sink_gradient

#: scores per chunk on the CPU: ~2 MB in float32, so that a chunk's working set stays in cache
_CHUNK_ELEMENTS = 1 << 19


@dataclass(frozen=True)
class Band:
    """Query i sees keys i - ``before`` .. i + ``after``; queries are cut into tiles of ``tile`` rows."""

    before: int
    after: int
    tile: int

    def __post_init__(self) -> None:
        if self.before < 0 or self.after < 0 or self.tile < 1:
            raise ValueError(f"a band needs before, after >= 0 and tile >= 1, got {self}")

    @property
    def width(self) -> int:
        """L: key slots per tile, T + before + after rounded up to a multiple of T."""
        return -(-(self.tile + self.before + self.after) // self.tile) * self.tile


def band_attention(
    q: Tensor, k: Tensor, v: Tensor, band: Band, key_padding: Tensor | None, scale: float, sinks: Tensor | None = None
) -> Tensor:
    """softmax(Q K^T * scale) V over the band, and over real keys (``key_padding`` (B, N), True = real), for
    (B, H, N, D) self-attention inputs; with ``sinks`` (H,), one more logit per head in the denominator
    (:mod:`attention_zoo.sinks`). Half precision is computed in float32."""
    if k.shape[-2] != q.shape[-2]:
        raise ValueError(f"band attention is self-attention: {q.shape[-2]} queries but {k.shape[-2]} keys")
    work = compute_dtype(q.dtype)
    sinks = None if sinks is None else sinks.to(work)
    return BandAttention.apply(q.to(work), k.to(work), v.to(work), band, key_padding, scale, sinks).to(q.dtype)


class BandRows:
    """The padded row buffer of one call: B * H sequences of N' = tiles * T rows, shifted by ``before``."""

    def __init__(self, band: Band, q: Tensor) -> None:
        batch, heads, self.n, self.dim = q.shape
        self.band, self.heads = band, heads
        self.tiles = -(-self.n // band.tile)
        self.seqs = batch * heads
        self.n_pad = self.tiles * band.tile
        self.rows = self.seqs * self.n_pad + band.width - band.tile

    def keys(self, x: Tensor) -> Tensor:
        """(rows, D): x's positions at their buffer rows, zeros elsewhere (written once: no separate zero fill)."""
        buffer = x.new_empty(self.rows, x.shape[-1])
        before, end = self.band.before, self.band.before + self.seqs * self.n_pad
        buffer[:before], buffer[end:] = 0, 0
        positions = self.positions(buffer)
        positions[:, : self.n] = rearrange(x, "b h n d -> (b h) n d")
        positions[:, self.n :] = 0
        return buffer

    def positions(self, buffer: Tensor) -> Tensor:
        """(B H, N', ...) view of the rows that hold positions 0 .. N' - 1 of each sequence."""
        before = self.band.before
        return buffer[before : before + self.seqs * self.n_pad].view(self.seqs, self.n_pad, *buffer.shape[1:])

    def windows(self, buffer: Tensor) -> Tensor:
        """(B H tiles, L, ...) overlapping view: the key slots of every tile."""
        trailing = buffer.shape[1:]
        inner = buffer.stride()[0]
        return buffer.as_strided(
            (self.seqs * self.tiles, self.band.width, *trailing),
            (self.band.tile * inner, inner, *buffer.stride()[1:]),
        )

    def queries(self, x: Tensor) -> Tensor:
        """(B H tiles, T, D) zero-padded tiles of x."""
        tiles = x.new_empty(self.seqs, self.n_pad, x.shape[-1])
        tiles[:, : self.n] = rearrange(x, "b h n d -> (b h) n d")
        tiles[:, self.n :] = 0
        return rearrange(tiles, "s (t i) d -> (s t) i d", i=self.band.tile)

    def unpad(self, tiles: Tensor, batch: int) -> Tensor:
        return rearrange(tiles, "(b h t) i d -> b h (t i) d", b=batch, h=self.heads)[:, :, : self.n]


class _Masks:
    """What each tile may not attend: the band's edges (the same for every tile), and key slots outside its
    own sequence or on padded keys (``runs``: (first tile, end tile, first row of ``blocked``) of the tiles
    that need this position mask: those at either end of a sequence, or every tile with key padding)."""

    def __init__(self, rows: BandRows, key_padding: Tensor | None, device: torch.device) -> None:
        band, tile, width, tiles = rows.band, rows.band.tile, rows.band.width, rows.tiles
        i = torch.arange(tile, device=device)[:, None]
        offset = torch.arange(width, device=device)[None, :] - band.before - i
        self.edge = (offset < -band.before) | (offset > band.after)  # (T, L)
        self.tail = band.before + band.after + 1  # the edge lies in the first T columns and from here on
        position = torch.arange(tiles, device=device)[:, None] * tile - band.before + torch.arange(width, device=device)
        real = (position >= 0) & (position < rows.n)  # (tiles, L)
        if key_padding is None:
            first, last = -(-band.before // tile), (rows.n + band.before - width) // tile + 1
            ends = [(0, tiles)] if first >= last else [(0, first), (max(last, 0), tiles)]
            self.runs = [(s * tiles + a, s * tiles + b, a) for s in range(rows.seqs) for a, b in ends if b > a]
            self.blocked = ~real
        else:
            real = real & key_padding.bool()[:, position.clamp(0, rows.n - 1)]  # (B, tiles, L)
            self.runs = [(0, rows.seqs * tiles, 0)]
            self.blocked = repeat(~real, "b t j -> (b h t) j", h=rows.heads)

    def apply(self, scores: Tensor, first: int) -> list[tuple[int, int]]:
        """Masks ``scores`` (c, T, L) of tiles first .. first + c - 1 with -inf, in place; returns the ranges of
        the chunk's tiles that took the position mask (only their rows can be left with no key)."""
        tile = self.edge.shape[0]
        if self.tail >= tile:
            scores[:, :, :tile].masked_fill_(self.edge[:, :tile], float("-inf"))
            scores[:, :, self.tail :].masked_fill_(self.edge[:, self.tail :], float("-inf"))
        else:
            scores.masked_fill_(self.edge, float("-inf"))
        last = first + scores.shape[0]
        masked = []
        for start, stop, row in self.runs:
            lo, hi = max(start, first), min(stop, last)
            if lo < hi:
                blocked = self.blocked[row + lo - start : row + hi - start, None, :]
                scores[lo - first : hi - first].masked_fill_(blocked, float("-inf"))
                masked.append((lo - first, hi - first))
        return masked


def to_tiles(band: Band, x: Tensor) -> Tensor:
    """(B H tiles, T, ...) zero-padded query tiles of x (B, H, N, ...), as the kernel's rows."""
    return BandRows(band, x).queries(x)


def from_tiles(band: Band, tiles: Tensor, shape: torch.Size) -> Tensor:
    """The (B, H, N, ...) view of ``tiles`` (B H tiles, T, ...) for queries of ``shape`` (B, H, N, D)."""
    batch, heads, n = shape[:3]
    return rearrange(tiles, "(b h t) i ... -> b h (t i) ...", b=batch, h=heads)[:, :, :n]


def _chunk_tiles(rows: BandRows, device: torch.device) -> int:
    """Tiles per chunk: about ``chunk_elements(device, _CHUNK_ELEMENTS)`` scores, at most every tile."""
    budget = chunking.chunk_elements(device, _CHUNK_ELEMENTS) // (rows.band.tile * rows.band.width)
    return min(rows.seqs * rows.tiles, max(1, budget))


def band_forward(
    q: Tensor, k: Tensor, v: Tensor, band: Band, key_padding: Tensor | None, scale: float, *, with_lse: bool
):
    """The forward over the band: (O in tiles (B H tiles, T, D), what the backward needs, and with ``with_lse``
    each row's log-sum-exp over its band keys (B H tiles, T), -inf where it sees none)."""
    # g: tiles, i: rows of a tile, j: key slots of a tile, d: head dim
    rows = BandRows(band, q)
    masks = _Masks(rows, key_padding, q.device)
    queries = rows.queries(q).mul_(scale)
    key_rows, value_rows = rows.keys(k), rows.keys(v)
    keys, values = rows.windows(key_rows), rows.windows(value_rows)
    out = queries.new_empty(len(queries), band.tile, v.shape[-1])
    weights = queries.new_empty(len(queries), band.tile, band.width)  # P = softmax(S)
    lse = queries.new_empty(len(queries), band.tile) if with_lse else None
    step = _chunk_tiles(rows, q.device)
    scores = queries.new_empty(step, band.tile, band.width)
    for first in range(0, len(queries), step):
        part = slice(first, min(first + step, len(queries)))
        chunk = torch.bmm(queries[part], keys[part].mT, out=scores[: part.stop - first])
        # rows that see no key (only in position-masked tiles): all -inf, where softmax gives NaN; a NaN
        # of the input is not -inf there, so it stays NaN
        empty = [
            (lo, hi, chunk[lo:hi].amax(dim=-1, keepdim=True) == -torch.inf) for lo, hi in masks.apply(chunk, first)
        ]
        if lse is not None:
            torch.logsumexp(chunk, dim=-1, out=lse[part])
        probs = torch.softmax(chunk, dim=-1, out=weights[part])
        for lo, hi, rows_empty in empty:
            probs[lo:hi].masked_fill_(rows_empty, 0.0)
        torch.bmm(probs, values[part], out=out[part])
    return out, (queries, key_rows, value_rows, weights), lse


def band_backward(
    saved: tuple[Tensor, ...], band: Band, scale: float, grad_out: Tensor, out: Tensor, weight_scale: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dK, dV ((B, H, N, D) each) of the band part, given dO (B, H, N, D) and, in tiles (B H tiles, T, ...:
    :func:`to_tiles`), the output O whose rowsum(dO * O) the softmax gradient takes and ``weight_scale`` or
    None: factors of the kept P's rows, exp(L_band - L), when the band is one part of a softmax normalised over
    more keys (L)."""
    # dV = P^T dO, dS = P (dO V^T - rowsum(dO O))
    queries, key_rows, value_rows, weights = saved
    batch = grad_out.shape[0]
    rows = BandRows(band, grad_out)
    keys, values = rows.windows(key_rows), rows.windows(value_rows)
    grad_rows = rows.queries(grad_out)
    delta = (grad_rows * out).sum(dim=-1, keepdim=True)
    if weight_scale is not None:
        weights = weights * weight_scale
    grad_q = torch.empty_like(queries)
    grad_k, grad_v = (
        queries.new_zeros(rows.rows // band.tile, band.tile, dim) for dim in (key_rows.shape[-1], value_rows.shape[-1])
    )
    blocks = band.width // band.tile
    step = _chunk_tiles(rows, queries.device)
    grad_scores = queries.new_empty(step, band.tile, band.width)
    dims = queries.shape[-1], value_rows.shape[-1]
    grad_window = queries.new_empty(step, band.width, max(dims))
    for first in range(0, len(queries), step):
        part = slice(first, min(first + step, len(queries)))
        size = part.stop - first
        probs = weights[part]
        _add_blocks(grad_v, torch.bmm(probs.mT, grad_rows[part], out=grad_window[:size, :, : dims[1]]), first, blocks)
        ds = torch.bmm(grad_rows[part], values[part].mT, out=grad_scores[:size]).sub_(delta[part]).mul_(probs)
        torch.bmm(ds, keys[part], out=grad_q[part])
        _add_blocks(grad_k, torch.bmm(ds.mT, queries[part], out=grad_window[:size, :, : dims[0]]), first, blocks)
    grad_k, grad_v = (
        rearrange(rows.positions(g.view(rows.rows, -1))[:, : rows.n], "(b h) n d -> b h n d", b=batch)
        for g in (grad_k, grad_v)
    )
    return rows.unpad(grad_q.mul_(scale), batch), grad_k, grad_v


class BandAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, band, key_padding, scale, sinks):
        out, saved, lse = band_forward(q, k, v, band, key_padding, scale, with_lse=sinks is not None)
        gate = total = None
        if sinks is not None:  # O g with g = exp(L - L'), and P g in the backward
            lse = from_tiles(band, lse, q.shape)
            total = add_sink(lse, sinks)
            gate = to_tiles(band, (lse - total).exp_()[..., None])
            out.mul_(gate)
        ctx.save_for_backward(*saved, out, gate, total, sinks)
        ctx.band, ctx.scale = band, scale
        return from_tiles(band, out, q.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        *saved, out, gate, total, sinks = ctx.saved_tensors
        band = ctx.band
        grads = band_backward(tuple(saved), band, ctx.scale, grad_out, out, gate)
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[6]:
            grad_sinks = sink_gradient(grad_out, from_tiles(band, out, grad_out.shape), total, sinks)
        return (*grads, None, None, None, grad_sinks)


def _add_blocks(target: Tensor, window: Tensor, first: int, blocks: int) -> None:
    """Adds tile (first + c)'s key-slot gradients (c, L, D) to buffer blocks first + c .. first + c + L/T - 1."""
    size = window.shape[0]
    window = rearrange(window, "c (o i) d -> c o i d", o=blocks)
    for block in range(blocks):
        target[first + block : first + block + size].add_(window[:, block])
