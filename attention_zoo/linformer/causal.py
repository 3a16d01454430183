"""Blockwise Linformer that never sees the future: exact attention inside a block, Linformer summaries
of the other blocks.

Plain Linformer (Wang et al. 2020, arXiv:2006.04768, eq. 7) cannot be causal: every projected key
E_i K mixes all n positions, the future included. The WMT14 report (Linformer in a decoder) needs a form
that is. Here the sequence is cut into blocks B_1, B_2, ... of c = ``block_size`` positions, and eq. (7)
is applied per block with one E, F in R^{k_c x c} (k_c = ``block_k``), giving k_c summary keys and values
E K_{B_g}, F V_{B_g} for each block g. Query i in block g takes one softmax over

    [ its own block's keys, exactly: K_{B_g}, only j <= i when causal ]  +  [ E K_{B_g'} for g' < g ]

and the matching values [ V_{B_g} ; F V_{B_g'} ]. Causal: the summaries of block g' only contain
positions < start of block g <= i, so nothing after i ever reaches i (exactly, not approximately). The
last block may be partial: causal queries never see its summary; otherwise E, F are sliced to its length
as ``linformer`` slices them. With ``causal=False`` a query sees its whole block and the summaries of
every *other* block (g' != g: a bidirectional blockwise Linformer). Padded keys and values are zeroed
before the projection and masked in the block; summary slots that received no real token are masked.

Cost: O(n c + n (n / c) k_c) time and memory (the in-block scores plus n / c * k_c summaries per query),
a (c / k_c)-fold saving on the n^2 score matrix but still quadratic in n for a fixed block size; it is
linear in n only if c grows with n, at the price of the exact in-block part.

Decoding cache (:meth:`CausalLinformerAttention.decode`, :class:`BlockSummaryState`): the exact keys and
values of the current, unfinished block, and the k_c summaries E K_{B_g}, F V_{B_g} of every finished
block, projected once when the block completes. After n positions a sequence holds, per head,
(n mod c) exact keys and floor(n / c) k_c summaries: the state grows by k_c per c positions, the cost of
the pattern itself (a query sees every earlier summary).

Not exact: the earlier blocks are seen through k_c summaries each, except in the identity limit
(``mean_pool`` / ``max_pool`` with ``block_k = block_size``), where this is full attention.
``sharing`` and ``projection`` mean what they mean for ``linformer`` (with n = c); E has size
k_c x c, so no ``max_seq_len`` is needed and any length works.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor

from attention_zoo.core import AttentionCore, DecodingState, Geometry
from attention_zoo.decoding.cache import appended, attend_to_cache, builds_graph
from attention_zoo.linformer.projections import Projection, Sharing, build_projections, check_projected_length
from attention_zoo.masks import causal_allowed, sdpa
from attention_zoo.registry import register_attention


class BlockSummaryState(DecodingState):
    """What a causal blockwise Linformer decodes from: after n positions, the n mod c positions of the
    current block exactly, and the k_c summaries of each of the floor(n / c) finished blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.block_keys: Tensor | None = None  # (B, H, n mod c, D)
        self.block_values: Tensor | None = None
        self.block_real: Tensor | None = None  # (B, n mod c) bool
        self.summary_keys: Tensor | None = None  # (B, H, capacity, D), the first floor(n / c) k_c in use
        self.summary_values: Tensor | None = None
        self.summary_slots: Tensor | None = None  # (B, capacity) bool: the slot received a real token
        #: summaries may be appended in place: no step has built an autograd graph yet
        self.in_place = True


@register_attention("linformer_causal")
class CausalLinformerAttention(
    AttentionCore, approximation="low rank", supports_cross_attention=False, supports_double_backward=True,
    has_decoding_cache=True, supports_segments=True,
):  # fmt: skip
    """Packed rows (``segments``): blocks and block summaries restart at each document, whose last block may be
    short (computed by unpacking the documents, :func:`~attention_zoo.packing.unpacked_attention`)."""

    example_configs = (
        {"block_size": 8, "block_k": 2},
        {"block_size": 16, "block_k": 4, "sharing": "none"},
        {"block_size": 8, "block_k": 4, "sharing": "layerwise"},
        {"block_size": 16, "block_k": 4, "projection": "mean_pool"},
        {"block_size": 8, "block_k": 2, "projection": "max_pool"},
        {"block_size": 16, "block_k": 4, "projection": "conv", "sharing": "kv"},
        {"block_size": 8, "block_k": 4, "projection": "random"},
    )
    notes: ClassVar[str] = (
        "blockwise: exact within a block of block_size, block_k Linformer summaries per other (causal: "
        "earlier) block; no leak; O(n c + n^2 k_c / c), not linear for a fixed block"
    )

    def __init__(
        self,
        geometry: Geometry,
        *,
        block_size: int = 256,
        block_k: int = 32,
        sharing: Sharing = "headwise",
        projection: Projection = "linear",
    ) -> None:
        """``block_size`` c: positions per block; ``block_k`` k_c: summaries per block (1 <= k_c <= c).
        Defaults c = 256, k_c = 32 (ours: the report gives no block form; 32 is its smallest k, and c = 256
        keeps the exact part at the paper's default k)."""
        super().__init__(geometry)
        check_projected_length(projection, block_k, block_size, "block_k", "block_size")
        self.bound_by_length("block_size", block_size)  # before E and F (k_c x c) are allocated
        self.block_size, self.block_k, self.sharing, self.projection = block_size, block_k, sharing, projection
        self.key_projection, self.value_projection = build_projections(
            projection, sharing, block_k, block_size, self.heads, self.context, shared_key="linformer_causal_E"
        )

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        # b: batch, h: heads, g: block, i / j: query / key position in a block, r: summary slot of a block,
        # s: summary slot over all blocks (block-major), d: head dim
        batch, n, c = q.shape[0], q.shape[-2], self.block_size
        blocks = -(-n // c)
        overhang = blocks * c - n
        real = mask
        if overhang:  # complete the last block with positions that are not part of the input
            present = torch.ones(batch, n, dtype=torch.bool, device=q.device) if mask is None else mask
            real = F.pad(present, (0, overhang), value=False)
            q, k, v = (F.pad(t, (0, 0, 0, overhang)) for t in (q, k, v))
        # one batch row per (sequence, block): the block's queries, its own keys, every block's summaries
        per_block = lambda t: rearrange(t, "b h (g i) d -> (b g) h i d", i=c)
        block_queries, block_keys, block_values = per_block(q), per_block(k), per_block(v)
        block_real = None if real is None else rearrange(real, "b (g j) -> (b g) j", j=c)
        summary_keys, slots = self.key_projection(block_keys, block_real)  # E K_{B_g}: ((b g), h, r, d)
        summary_values, _ = self.value_projection(block_values, block_real)
        every_summary = lambda t: repeat(t, "(b g2) h r d -> (b g) h (g2 r) d", b=batch, g=blocks)
        keys = torch.cat([block_keys, every_summary(summary_keys)], dim=-2)
        values = torch.cat([block_values, every_summary(summary_values)], dim=-2)

        local = (
            rearrange(causal_allowed(c, c, q.device), "i j -> 1 1 i j")
            if causal
            else torch.ones(1, 1, c, c, dtype=torch.bool, device=q.device)
        )
        if block_real is not None:
            local = local & rearrange(block_real, "bg j -> bg 1 1 j")
        query_block = torch.arange(blocks, device=q.device)
        summary_block = torch.arange(blocks * self.block_k, device=q.device) // self.block_k
        offset = summary_block[None, :] - query_block[:, None]  # (g, s): summary's block minus query's block
        seen = offset < 0 if causal else offset != 0
        summary = repeat(seen, "g s -> (b g) 1 1 s", b=batch)
        if slots is not None:
            summary = summary & repeat(slots, "(b g2) r -> (b g) 1 1 (g2 r)", b=batch, g=blocks)
        allowed = torch.cat([local.expand(batch * blocks, 1, c, c), summary.expand(-1, 1, c, -1)], dim=-1)
        has_key = allowed.any(dim=-1, keepdim=True)
        if not bool(has_key.all()):
            allowed = allowed | ~has_key  # let empty rows see every key, then zero them below
        out = sdpa(block_queries, keys, values, allowed) * has_key
        return rearrange(out, "(b g) h i d -> b h (g i) d", b=batch)[:, :, :n]

    def start_decoding(self) -> BlockSummaryState:
        self.check_decodable()
        return BlockSummaryState()

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None) -> Tensor:
        # b: batch, h: heads, i: new positions, j: keys of the current block, s: summary slots, d: head dim
        assert isinstance(state, BlockSummaryState)
        state.in_place = state.in_place and not builds_graph(q, k, v, *self.parameters())
        c, first, end = self.block_size, state.length, state.length + q.shape[-2]
        real = torch.ones(q.shape[0], q.shape[-2], dtype=torch.bool, device=q.device) if mask is None else mask
        outputs, position = [], first
        while position < end:  # one piece per block that the new positions fall in
            piece_end = min(end, (position // c + 1) * c)
            piece = slice(position - first, piece_end - first)
            state.block_keys = _extended(state.block_keys, k[:, :, piece], dim=2)
            state.block_values = _extended(state.block_values, v[:, :, piece], dim=2)
            state.block_real = _extended(state.block_real, real[:, piece], dim=1)
            outputs.append(self._attend_block_and_summaries(q[:, :, piece], state, finished=position // c))
            position = piece_end
            if position % c == 0:  # the block is complete: its summaries, once
                self._summarise_block(state, block=position // c - 1)
        return torch.cat(outputs, dim=-2)

    def _attend_block_and_summaries(self, q: Tensor, state: BlockSummaryState, finished: int) -> Tensor:
        """The queries of one piece of the current block against that block so far (causal) and the
        summaries of the ``finished`` earlier blocks."""
        assert state.block_keys is not None and state.block_values is not None and state.block_real is not None
        used = finished * self.block_k
        seen = state.block_keys.shape[-2]
        local = rearrange(causal_allowed(q.shape[-2], seen, q.device), "i j -> 1 1 i j") & rearrange(
            state.block_real, "b j -> b 1 1 j"
        )
        keys, values, allowed = state.block_keys, state.block_values, local
        if used:
            assert state.summary_keys is not None and state.summary_values is not None
            assert state.summary_slots is not None
            keys = torch.cat([keys, state.summary_keys[:, :, :used]], dim=-2)
            values = torch.cat([values, state.summary_values[:, :, :used]], dim=-2)
            summary = rearrange(state.summary_slots[:, :used], "b s -> b 1 1 s").expand(-1, 1, q.shape[-2], -1)
            allowed = torch.cat([local, summary], dim=-1)
        return attend_to_cache(q, keys, values, allowed, self.scale)

    def _summarise_block(self, state: BlockSummaryState, block: int) -> None:
        assert state.block_keys is not None and state.block_values is not None and state.block_real is not None
        summary_keys, slots = self.key_projection(state.block_keys, state.block_real)
        summary_values, _ = self.value_projection(state.block_values, state.block_real)
        if slots is None:
            slots = summary_keys.new_ones(summary_keys.shape[0], summary_keys.shape[-2], dtype=torch.bool)
        used = block * self.block_k
        state.summary_keys = appended(state.summary_keys, used, summary_keys, dim=2, in_place=state.in_place)
        state.summary_values = appended(state.summary_values, used, summary_values, dim=2, in_place=state.in_place)
        state.summary_slots = appended(state.summary_slots, used, slots, dim=1, in_place=state.in_place)
        state.block_keys = state.block_values = state.block_real = None


def _extended(block: Tensor | None, new: Tensor, dim: int) -> Tensor:
    """The current block so far, ``new`` appended (a block holds fewer than c positions: a copy is cheap)."""
    return new if block is None else torch.cat([block, new], dim=dim)
