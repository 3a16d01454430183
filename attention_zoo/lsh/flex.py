"""Reformer's LSH attention through FlexAttention: ``impl="flex"`` of :class:`attention_zoo.lsh.attention.LSHAttention`.

Kitaev, Kaiser, Levskaya 2020, arXiv:2001.04451, on FlexAttention (Dong et al. 2024, arXiv:2412.05496). After
each round's sort, chunked attention (a chunk attends itself and the chunk before) is a fixed band over the
sorted sequence. The rounds are folded into the head dimension, ``(B, H R, N, D)``, and one ``flex_attention``
call runs them all under one block mask:

- Block mask (:func:`band_block_mask`): per ``TILE`` x ``TILE`` tile, the key tiles that hold chunks c - 1 and c
  of every query chunk c in the tile, for both forms (the causal key sets lie inside the same chunks). It
  depends only on (length, m, device): built on the device by arithmetic, cached.
- ``mask_mod`` (:func:`lsh_mask_mod`), pointwise lookups into per-call tables in the sorted layout: key place p'
  in query i's interval [lo_i^(r), hi_i^(r)] of :func:`~attention_zoo.lsh.attention.sorted_windows` (its
  bucket, chunk or causal window), p' != p (the self-mask: the same place is the same token), and for each
  earlier round s < r, key j outside A_i^(s) (a duplicate counts once, in its first round). Padded tokens sit
  in the sentinel bucket, so no real query's interval holds one. The self-mask is a mask, not a ``score_mod``:
  the exact rule removes the pair, and a mask costs no backward term.
- Rounds combine by eq. (14) from the per-round log-sum-exps FlexAttention returns; a token whose rounds are
  all empty (every log-sum-exp -inf) attends to itself alone, o_i = exp(s_ii - s_ii) v_i, as in
  :mod:`attention_zoo.lsh.chunked`. Sorting into rounds and un-sorting are one row gather each, whose
  backward is the gather by the inverse permutation (no atomic adds).

Work: B H R N x 2 TILE scores when m divides ``TILE`` (a query tile reads two key tiles; at m = 64 twice the 2m
keys of its chunk pair), against B H N^2 for full attention. ``TILE`` = 128, torch's default block size: every
default configuration of the compiled forward and backward kernels divides it, where a block mask of m = 64
would be refused (H100's bfloat16 kernels take 128 x 128 tiles forward, 64 x 128 and 128 x 64 backward).
"""

from __future__ import annotations

import copy
from functools import lru_cache

import torch
from einops import rearrange
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from attention_zoo.masks import MaskMod
from attention_zoo.sparse.flex import flex_call, merged

#: the block mask's tile, queries and keys (module docstring)
TILE = 128


@lru_cache(maxsize=8)
def band_block_mask(n: int, m: int, device: torch.device) -> BlockMask:
    """The tiles of the chunk band over ``n`` sorted places (n a multiple of the chunk length ``m``): query tile t
    reads the key tiles from the one holding place (c_first - 1) m to the one holding (c_last + 1) m - 1, c_first
    and c_last its first and last query chunks. Every tile is partial (the key sets depend on the data)."""
    tiles = -(-n // TILE)
    first_query = torch.arange(tiles, device=device) * TILE
    last_query = torch.clamp(first_query + TILE, max=n) - 1
    first_tile = torch.clamp((first_query // m - 1) * m, min=0) // TILE
    last_tile = (torch.clamp((last_query // m + 1) * m, max=n) - 1) // TILE
    # one row per query tile over all key tiles (torch derives the transposed tables for the backward from
    # this width); entries past a row's count are unused, kept in range
    indices = torch.minimum(first_tile[:, None] + torch.arange(tiles, device=device), last_tile[:, None])
    return BlockMask.from_kv_blocks(
        rearrange(last_tile - first_tile + 1, "t -> 1 1 t").int(),
        rearrange(indices, "t w -> 1 1 t w").int(),
        BLOCK_SIZE=TILE,
        seq_lengths=(n, n),
    )


def round_tables(order: Tensor, place: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The lookups of :func:`lsh_mask_mod` in the folded sorted layout ``(slot, B, H R, N)``, int32, from
    :func:`~attention_zoo.lsh.attention.sorted_windows`'s ``(B, H, R, N)`` tensors. For the token at place p of
    round r: ``lows`` and ``highs`` slot 0, its interval in round r; slot 1 + s, its interval in round s < r
    (empty, low N and high -1, for s >= r); ``key_places`` slot s, its place in round s, for s < R - 1."""
    # b: batch, h: heads, r: the sorted round, s: the round looked up, n: places
    b, h, rounds, n = order.shape
    at = rearrange(order, "b h r n -> b h r 1 n").expand(b, h, rounds, rounds, n)

    def by_round(x: Tensor) -> Tensor:  # [b, h, r, s, p] = x[b, h, s, order[b, h, r, p]]
        return rearrange(x.int(), "b h s n -> b h 1 s n").expand(b, h, rounds, rounds, n).gather(-1, at)

    index = torch.arange(rounds, device=order.device)
    earlier = rearrange(index[:-1], "s -> 1 s 1") < rearrange(index, "r -> r 1 1")  # round s before round r
    tables = []
    for x, empty in ((lo, n), (hi, -1)):
        x_rs = by_round(x)
        current = rearrange(x_rs.diagonal(dim1=2, dim2=3), "b h n r -> b h r 1 n")
        tables.append(torch.cat([current, torch.where(earlier, x_rs[:, :, :, :-1], empty)], dim=3))
    tables.append(by_round(place)[:, :, :, :-1])
    lows, highs, key_places = (rearrange(t, "b h r s n -> s b (h r) n").contiguous() for t in tables)
    return lows, highs, key_places


def lsh_mask_mod(lows: Tensor, highs: Tensor, key_places: Tensor) -> MaskMod:
    """j may be attended from i in round r (module docstring); q_idx, kv_idx are places of round r's sort, the
    tables those of :func:`round_tables`."""
    earlier_rounds = key_places.shape[0]

    def lsh_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        allowed = (lows[0, b, h, q_idx] <= kv_idx) & (kv_idx <= highs[0, b, h, q_idx]) & (q_idx != kv_idx)
        for s in range(earlier_rounds):  # unrolled: R is a small constant
            key_place = key_places[s, b, h, kv_idx]
            allowed = allowed & ((key_place < lows[s + 1, b, h, q_idx]) | (key_place > highs[s + 1, b, h, q_idx]))
        return allowed

    return lsh_mask


class _TakeRows(torch.autograd.Function):
    """``x[index]`` over rows of a flat ``(rows, D)`` tensor whose gradient is a gather too: ``inverse`` lists, for
    each row of ``x``, the ``copies`` output rows that read it (consecutive), summed."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor, copies: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        taken = rearrange(grad.index_select(0, inverse), "(x c) d -> x c d", c=ctx.copies)
        return taken.sum(1) if ctx.copies > 1 else taken.squeeze(1), None, None, None


def flex_lsh_attention(q: Tensor, keys: Tensor, v: Tensor, order: Tensor, place: Tensor, lo: Tensor, hi: Tensor,
                       real: Tensor, m: int) -> Tensor:  # fmt: skip
    """o of :class:`~attention_zoo.lsh.chunked.LSHFunction` through one FlexAttention call: ``q``, the unit
    ``keys`` and ``v`` ``(B, H, N, D)`` (N a multiple of the chunk length ``m``; FlexAttention runs in their
    dtype), ``order``, ``place``, ``lo``, ``hi`` ``(B, H, R, N)`` from
    :func:`~attention_zoo.lsh.attention.sorted_windows`, ``real`` ``(B, N)``. Returns ``(B, H, N, D)`` in at
    least float32 (the rounds combine there)."""
    # b: batch, h: heads, r: rounds, n: places or positions, d: head dim
    b, h, rounds, n = order.shape
    with torch.no_grad():
        mask_mod = lsh_mask_mod(*round_tables(order, place, lo, hi))
        # flat row numbers: of the folded (b h r n) layout, and of the input's (b h n)
        rows = rearrange(torch.arange(b * h * rounds, device=q.device) * n, "(b h r) -> b h r 1", b=b, h=h)
        sorted_row = rows + place  # token i of round r: its row in round r's sorted order
        token_row = rows + order  # place p of round r: its token's row in round r's token order
        input_row = rearrange(torch.arange(b * h, device=q.device) * n, "(b h) -> b h 1 1", b=b) + order
    block_mask = copy.copy(band_block_mask(n, m, q.device))  # the cached tiles, this call's rule
    block_mask.mask_mod = mask_mod

    def to_rounds(x: Tensor) -> Tensor:  # (b, h, n, d) -> each round's sorted order, (b, (h r), n, d)
        flat = rearrange(x, "b h n d -> (b h n) d")
        taken = _TakeRows.apply(flat, input_row.flatten(), rearrange(sorted_row, "b h r n -> (b h n r)"), rounds)
        return rearrange(taken, "(b h r n) d -> b (h r) n d", b=b, h=h, r=rounds)

    def to_tokens(x: Tensor) -> Tensor:  # (b, (h r), n, d) sorted -> (b, h, r, n, d) in token order
        flat = rearrange(x, "b hr n d -> (b hr n) d")
        taken = _TakeRows.apply(flat, sorted_row.flatten(), token_row.flatten(), 1)
        return rearrange(taken, "(b h r n) d -> b h r n d", b=b, h=h, r=rounds)

    out, lse = flex_call(*(to_rounds(x) for x in (q, keys, v)), block_mask, None, 1.0)
    lse = to_tokens(rearrange(lse, "b hr n -> b hr n 1"))[..., 0]
    # eq. (14): o_i = sum_r exp(lse_r - lse) o_i^(r); a round with no key has lse_r = -inf and weight 0
    combined = merged(to_tokens(out).unbind(2), lse.unbind(2))  # at least float32
    alone = torch.isneginf(lse).all(dim=2) & rearrange(real, "b n -> b 1 n")
    self_score = (q * keys).sum(dim=-1, keepdim=True).to(combined.dtype)
    alone_out = v * (self_score - self_score).exp()  # softmax over {i}: v_i, or NaN for a non-finite q_i
    return torch.where(alone[..., None], alone_out, torch.where(rearrange(real, "b n -> b 1 n 1"), combined, 0.0))
