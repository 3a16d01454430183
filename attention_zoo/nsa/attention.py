"""NSA, native sparse attention (``"nsa"``): per query, a compressed, a selected and a sliding-window branch, mixed
by learned gates. Causal only.

Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse Attention",
arXiv:2502.11089 (https://arxiv.org/abs/2502.11089), Sec. 3.2-3.3 (1-based positions, as the paper writes them):

    o_t = sum_{c in {cmp, slc, win}} g_t^c Attn(q_t, K~_t^c, V~_t^c),    g_t^c in [0, 1]                 (5)
    K~_t^cmp = { phi(k_{id+1 : id+l}) | 0 <= i <= floor((t - l) / d) }                                    (7)
    p_t^cmp = Softmax(q_t^T K~_t^cmp)                                                                     (8)
    p_t^slc[j] = sum_{m=0}^{l'/d-1} sum_{n=0}^{l/d-1} p_t^cmp[(l'/d) j + m - n]                            (9)
    p_t^slc' = sum_h p_t^{slc,(h)},   I_t = { i | rank(p_t^slc'[i]) <= n }                             (10, 11)
    K~_t^slc = Cat[{ k_{il'+1 : (i+1)l'} | i in I_t }],   K~_t^win = the last w keys (k_t included)       (12)

Eq. 9 as printed indexes p^cmp[(l'/d) j - m - n], which for 0-based j reaches compression blocks before block j;
it is read here by its stated intent ("according to their spatial relationship"): compression block i is counted
once per stride-d cell it shares with selection block j (needs d | l and d | l', the paper's conditions; l = l' =
d gives p^slc = p^cmp). I_t always holds the initial block and the 2 local blocks (the query's own and the one
before), and n counts them (Sec. 4.1); the other n - 3 are the highest-scoring blocks before those, among blocks
with a positive score (a block no visible compression block overlaps is never chosen; with fewer candidates, fewer
blocks). The choice is a top-n: it passes no gradient, as in the paper; gradients reach q, k, v, phi (its MLP and
position encoding, :mod:`attention_zoo.nsa.compression`) and the gates through the three softmaxes.

Deviations a core's contract forces: the gates come from the head's query, g_t = sigmoid(q_t W_h + b_h) (a
Linear(D, 3) per head; the paper's MLP reads the layer's input), and the three branches share the core's k and v
(the paper gives each its own). The selection is shared by all heads of the core (the paper shares it within a
GQA group; a core is one group). A query with no complete compression block yet (t < l) gets zeros from that
branch, and its selection is the forced blocks. Padding: a compression block holding a padded key is left out
(neither attended nor scored); padded keys are out of the selected blocks and the window; a branch with no real
key gives zeros. Degeneracies: at N <= w the window branch is causal full attention; when ceil(N / l') <= n
every query selects every block it sees, so the selected branch is causal full attention too.

Defaults: the paper's (Sec. 4.1) l = 32, d = 16, l' = 64, n = 16 (initial and 2 local blocks included), w = 512.
Implementation (:meth:`NativeSparseAttention.attend`): phi over the M = floor((N - l) / d) + 1 blocks at once;
the compressed branch by SDPA under the visibility mask, in slabs of rows (no N x N); the selection in chunks of
queries, no gradient; the selected blocks by MoBA's block kernel (:func:`attention_zoo.moba.tiled.moba_attention`,
rank 0 the own block, causal); the window by the band kernel (:mod:`attention_zoo.sparse.band`). Scores per head
(2D multiply-adds each, forward): about N^2 / 2d compressed, twice (branch and selection: quadratic, d-fold below
full attention's), at most N n l' selected and N w windowed (linear), plus phi's 2 N D^2 (l + 1) / d per k and v.
Decoding (:class:`NSACache`) keeps the raw and the compressed keys/values, compressing each block as it completes:
O(M D + n l' D + w D) per step. Half-precision inputs are computed in float32 (the selection's near-ties need it).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, reduce, repeat
from torch import Tensor, nn

from attention_zoo import chunking
from attention_zoo.core import AttentionCore, DecodingState, Geometry
from attention_zoo.decoding.cache import BlockState
from attention_zoo.masks import masked_attention, sdpa
from attention_zoo.moba.attention import routed_attention
from attention_zoo.moba.tiled import moba_attention
from attention_zoo.nsa.compression import BlockCompressor
from attention_zoo.precision import compute_dtype
from attention_zoo.registry import register_attention
from attention_zoo.sparse.band import Band, band_attention

#: selection scores computed at once on the CPU (a chunk of queries against every compressed key), about 1 MB in
#: float32; other devices take the larger budget of :mod:`attention_zoo.chunking`
_SELECTION_SCORES = 1 << 18
#: positions a decoding step handles at once (a long prompt fed in one step is cut into such chunks, so that its
#: dense window and compressed scores stay small)
_DECODE_CHUNK = 256
#: slabs of query rows of the compressed branch, each against the compressed keys its last row sees
_COMPRESSED_SLABS = 4
#: the forced blocks of every query besides its own (Sec. 4.1: the initial block and the block before the own)
_FORCED = 3


@register_attention("nsa")
class NativeSparseAttention(
    AttentionCore, approximation="hierarchical sparsity", causal_only=True, supports_cross_attention=False,
    has_decoding_cache=True, supports_segments=True,
):  # fmt: skip
    """Packed rows (``segments``): each document on its own (:func:`~attention_zoo.packing.unpacked_attention`);
    its blocks restart at the document's start."""

    example_configs = (
        {"compress_block": 4, "compress_stride": 2, "select_block": 4, "select_count": 4, "window": 8},
        {"compress_block": 4, "compress_stride": 2, "select_block": 8, "select_count": 4, "window": 6},
        {"compress_block": 4, "compress_stride": 4, "select_block": 4, "select_count": 5, "window": 4},
    )
    notes: ClassVar[str] = (
        "compressed + top-n selected blocks (initial and 2 local forced) + window, gated from q; branches share "
        "k, v; the selection is shared by the heads and passes no gradient"
    )

    def __init__(
        self,
        geometry: Geometry,
        *,
        compress_block: int = 32,
        compress_stride: int = 16,
        select_block: int = 64,
        select_count: int = 16,
        window: int = 512,
    ) -> None:
        """``compress_block`` l: keys per compression block (>= 1); ``compress_stride`` d: positions between
        compression blocks (>= 1, dividing l and l'); ``select_block`` l': keys per selection block;
        ``select_count`` n: selected blocks per query, the initial and the 2 local blocks included (>= 3);
        ``window`` w: keys of the sliding window, the query's own included (>= 1). Defaults: the paper's l = 32,
        d = 16, l' = 64, n = 16, w = 512."""
        super().__init__(geometry)
        for option, value, least in (
            ("compress_block", compress_block, 1),
            ("compress_stride", compress_stride, 1),
            ("select_block", select_block, 1),
            ("select_count", select_count, _FORCED),
            ("window", window, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{option} must be an int >= {least}, got {value!r}")
        if compress_block % compress_stride or select_block % compress_stride:
            raise ValueError(
                f"compress_stride={compress_stride} must divide compress_block={compress_block} and "
                f"select_block={select_block} (the paper's condition for its eq. 9)"
            )
        self.compress_block, self.compress_stride, self.select_block = compress_block, compress_stride, select_block
        self.select_count, self.window = select_count, window
        dim, heads = self.dim_head, self.heads
        self.compress_key = BlockCompressor(dim, compress_block)
        self.compress_value = BlockCompressor(dim, compress_block)
        # zero: every gate starts at 1/2
        self.gate_weight = nn.Parameter(torch.zeros(heads, dim, 3))
        self.gate_bias = nn.Parameter(torch.zeros(heads, 3))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        # b: batch, h: heads, n: positions, m: compressed block, d: head dim
        dtype, work = q.dtype, compute_dtype(q.dtype)  # half precision: float32 (near-ties of the selection)
        q, k, v = q.to(work), k.to(work), v.to(work)
        n, c = q.shape[-2], self.select_block
        keys, values, block_real = self.compressed(k, v, mask)
        compressed = self.compressed_attention(q, keys, values, block_real, offset=0)
        selected = self.select_blocks(q, keys, block_real, offset=0)
        padded = -n % c  # complete the last selection block with slots that hold no token
        real = mask
        if padded:
            present = torch.ones(q.shape[0], n, dtype=torch.bool, device=q.device) if mask is None else mask
            real = F.pad(present, (0, padded), value=False)
            selected = F.pad(selected, (0, 0, 0, padded), value=-1)
            selected[:, n:, 0] = torch.arange(n, n + padded, device=q.device) // c  # rank 0 keeps every row
        routed = repeat(selected, "b n r -> b h n r", h=self.heads)
        q_, k_, v_ = (F.pad(t, (0, 0, 0, padded)) for t in (q, k, v))
        chosen = moba_attention(q_, k_, v_, routed, real, c, True, self.scale)[:, :, :n]
        span = min(self.window, n)
        band = Band(before=span - 1, after=0, tile=64 if span >= 384 else min(32, max(8, span // 4)))
        windowed = band_attention(q, k, v, band, mask, self.scale)
        return self.mix(q, compressed, chosen, windowed).to(dtype)

    def compressed(self, k: Tensor, v: Tensor, real: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """phi of every complete compression block of k and v, (B, H, M, D) each, and (B, M) True where the
        block holds no padded key (None without a mask)."""
        keys = self.compress_key.compress(k, self.compress_stride)
        values = self.compress_value.compress(v, self.compress_stride)
        if real is None:
            return keys, values, None
        if real.shape[-1] < self.compress_block:
            return keys, values, real.new_zeros(real.shape[0], 0)
        return keys, values, real.unfold(1, self.compress_block, self.compress_stride).all(dim=-1)

    def visible(self, nq: int, blocks: int, offset: int, block_real: Tensor | None, device: torch.device) -> Tensor:
        """(B | 1, Nq, M) bool: the compressed keys query i (at position ``offset + i``) sees, those of the complete
        blocks that end at or before it and hold no padded key."""
        ends = torch.arange(blocks, device=device) * self.compress_stride + self.compress_block - 1
        seen = (ends[None, :] <= torch.arange(offset, offset + nq, device=device)[:, None])[None]
        return seen if block_real is None else seen & block_real[:, None, :]

    def seen(self, position: int, blocks: int) -> int:
        """How many of the first ``blocks`` compression blocks end at or before ``position``."""
        return max(0, min(blocks, (position - self.compress_block + 1) // self.compress_stride + 1))

    def compressed_attention(
        self, q: Tensor, keys: Tensor, values: Tensor, block_real: Tensor | None, *, offset: int
    ) -> Tensor:
        """Attn(q_t, K~_t^cmp, V~_t^cmp) for queries at positions ``offset ..``; zeros for a query that sees none.
        In ``_COMPRESSED_SLABS`` slabs of rows, each against only the compressed keys its last row sees (5/8 of
        the scores, not all). A zero key and value behind a slab's keys is allowed exactly to the queries that see
        none of them: SDPA then gives them the zero value (no NaN, zero gradient) in the same fused call."""
        # b: batch, h: heads, i: query, m: compressed key
        nq = q.shape[-2]
        height = -(-nq // _COMPRESSED_SLABS)
        outs = []
        for first in range(0, nq, height):
            rows = q[:, :, first : first + height]
            count = self.seen(offset + first + rows.shape[-2] - 1, keys.shape[-2])
            real = None if block_real is None else block_real[:, :count]
            allowed = self.visible(rows.shape[-2], count, offset + first, real, q.device)
            allowed = torch.cat([allowed, ~allowed.any(dim=-1, keepdim=True)], dim=-1)
            slab_keys, slab_values = (F.pad(t[:, :, :count], (0, 0, 0, 1)) for t in (keys, values))
            outs.append(sdpa(rows, slab_keys, slab_values, attn_mask=rearrange(allowed, "b i m -> b 1 i m")))
        return torch.cat(outs, dim=2)

    @torch.no_grad()
    def select_blocks(self, q: Tensor, keys: Tensor, block_real: Tensor | None, *, offset: int) -> Tensor:
        """(B, Nq, R) selection blocks of query i (at position ``offset + i``), shared by the heads: rank 0 its
        own block, then the forced blocks (the initial block, the one before the own) and the best-scoring
        candidates, -1 where there are fewer (R = min(n, blocks up to the own)). Scores: eq. 8-10 of the module
        docstring, computed in chunks of queries."""
        # b: batch, h: heads, i: query, m: compressed key, j: selection block, d: head dim
        batch, heads, nq, _ = q.shape
        work = compute_dtype(q.dtype)
        blocks = -(-(offset + nq) // self.select_block)
        step = max(1, chunking.chunk_elements(q.device, _SELECTION_SCORES) // max(1, batch * heads * keys.shape[-2]))
        picks = min(self.select_count, blocks) - 1
        chosen = []
        for first in range(0, nq, step):
            rows = slice(first, first + step)
            count = q[:, :, rows].shape[-2]
            own = torch.arange(offset + first, offset + first + count, device=q.device) // self.select_block
            scores = self.block_scores(q[:, :, rows], keys, block_real, offset + first, blocks, work)
            block = torch.arange(blocks, device=q.device)
            before_own = block[None, :] - own[:, None]  # (i, j)
            forced = ((block[None, :] == 0) | (before_own == -1)) & (before_own < 0)
            candidate = (before_own < -1) & (block[None, :] > 0)
            ranked = torch.where(candidate[None] & (scores > 0), scores, float("-inf"))
            ranked = ranked.masked_fill_(forced[None], float("inf"))
            best = ranked.topk(picks, dim=-1)
            gated = best.indices.masked_fill_(best.values == float("-inf"), -1)
            chosen.append(torch.cat([repeat(own, "i -> b i 1", b=batch), gated], dim=-1))
        return torch.cat(chosen, dim=1)

    def block_scores(
        self, q: Tensor, keys: Tensor, block_real: Tensor | None, offset: int, blocks: int, work: torch.dtype
    ) -> Tensor:
        """(B, Nq, blocks) p_t^slc' of eq. 9-10: p^cmp summed over heads (eq. 9 is linear, so the sum comes first),
        spread over the stride cells each compression block covers, then summed per selection block."""
        # b: batch, h: heads, i: query, m: compressed key, c: stride cell, j: selection block, d: head dim
        batch, _, nq, _ = q.shape
        ratio, span = self.select_block // self.compress_stride, self.compress_block // self.compress_stride
        count = self.seen(offset + nq - 1, keys.shape[-2])  # the blocks these queries see lie in these cells
        cells = q.new_zeros(batch, nq, blocks * ratio, dtype=work)
        allowed = self.visible(nq, count, offset, None if block_real is None else block_real[:, :count], q.device)
        scores = einsum(q.to(work) * self.scale, keys[:, :, :count].to(work), "b h i d, b h m d -> b h i m")
        scores = scores.masked_fill_(~rearrange(allowed, "b i m -> b 1 i m"), float("-inf"))
        probs = scores.softmax(dim=-1).nan_to_num_(nan=0.0)  # a query that sees no compressed key: all zero
        summed = reduce(probs, "b h i m -> b i m", "sum")
        for shift in range(span):  # block m covers the cells m .. m + l/d - 1
            cells[:, :, shift : shift + count] += summed
        return reduce(cells, "b i (j c) -> b i j", "sum", c=ratio)

    def mix(self, q: Tensor, compressed: Tensor, chosen: Tensor, windowed: Tensor) -> Tensor:
        """Eq. 5: g^cmp o^cmp + g^slc o^slc + g^win o^win, g = sigmoid(q_t W_h + b_h)."""
        # b: batch, h: heads, n: positions, d: head dim, c: branch
        weight, bias = self.gate_weight.to(q.dtype), self.gate_bias.to(q.dtype)
        logits = einsum(q, weight, "b h n d, h d c -> b h n c") + rearrange(bias, "h c -> 1 h 1 c")
        gates = torch.sigmoid(logits)
        return gates[..., 0:1] * compressed + gates[..., 1:2] * chosen + gates[..., 2:3] * windowed

    def start_decoding(self) -> DecodingState:
        self.check_decodable()
        return NSACache()

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None) -> Tensor:
        assert isinstance(state, NSACache)
        dtype, work = q.dtype, compute_dtype(q.dtype)
        q, k, v = q.to(work), k.to(work), v.to(work)
        real = torch.ones(q.shape[0], q.shape[-2], dtype=torch.bool, device=q.device) if mask is None else mask
        outs = []
        for first in range(0, q.shape[-2], _DECODE_CHUNK):
            part = slice(first, first + _DECODE_CHUNK)
            outs.append(self.decode_chunk(q[:, :, part], k[:, :, part], v[:, :, part], real[:, part], state,
                                          state.length + first))  # fmt: skip
        return torch.cat(outs, dim=2).to(dtype)

    def decode_chunk(self, q: Tensor, k: Tensor, v: Tensor, real: Tensor, state: NSACache, start: int) -> Tensor:
        """Positions ``start .. start + T - 1``: cache them, compress the blocks they complete, attend."""
        # b: batch, h: heads, t: new positions, j: cached positions, m: compressed key, d: head dim
        end, c, size, d = start + q.shape[-2], self.select_block, self.compress_block, self.compress_stride
        state.reserve(k, -(-end // c) * c)
        state.keys[:, :, start:end], state.values[:, :, start:end], state.real[:, start:end] = k, v, real
        done = state.compressed_keys.shape[-2]
        complete = (end - size) // d + 1 if end >= size else 0
        if complete > done:  # the blocks i d .. i d + l - 1 that end inside this chunk
            span = slice(done * d, (complete - 1) * d + size)
            new_keys = self.compress_key.compress(state.keys[:, :, span], d)
            new_values = self.compress_value.compress(state.values[:, :, span], d)
            new_real = state.real[:, span].unfold(1, size, d).all(dim=-1)
            state.compressed_keys = torch.cat([state.compressed_keys, new_keys], dim=2)
            state.compressed_values = torch.cat([state.compressed_values, new_values], dim=2)
            state.compressed_real = torch.cat([state.compressed_real, new_real], dim=1)
        keys, values, block_real = state.compressed_keys, state.compressed_values, state.compressed_real
        compressed = self.compressed_attention(q, keys, values, block_real, offset=start)
        selected = repeat(self.select_blocks(q, keys, block_real, offset=start), "b t r -> b h t r", h=self.heads)
        chosen = routed_attention(q, state.keys, state.values, selected, state.real, c, start, True, self.scale)
        first = max(0, start - self.window + 1)
        position, key = torch.arange(start, end, device=q.device), torch.arange(first, end, device=q.device)
        allowed = (key[None, :] <= position[:, None]) & (key[None, :] > position[:, None] - self.window)
        window_keys, window_values = state.keys[:, :, first:end], state.values[:, :, first:end]
        windowed = masked_attention(q, window_keys, window_values, allowed, state.real[:, first:end], self.scale)
        return self.mix(q, compressed, chosen, windowed)


class NSACache(BlockState):
    """NSA's decoding state (float32 for half-precision inputs): keys, values and real-token flags in whole
    selection blocks (:class:`~attention_zoo.decoding.cache.BlockState`), and the compressed keys and values of
    every complete compression block with their real flags (a block is compressed once, by the step that completes
    it). Written in place: decoding is for inference."""

    def __init__(self) -> None:
        super().__init__()
        self.compressed_keys: Tensor | None = None  # (B, H, M, D)
        self.compressed_values: Tensor | None = None
        self.compressed_real: Tensor | None = None  # (B, M) bool

    def reserve(self, like: Tensor, slots: int) -> int:
        """:meth:`BlockState.reserve`; at the first step also the empty compressed keys, values and flags."""
        if self.compressed_keys is None:
            batch, heads, _, dim = like.shape
            self.compressed_keys = like.new_zeros(batch, heads, 0, dim)
            self.compressed_values = like.new_zeros(batch, heads, 0, dim)
            self.compressed_real = torch.zeros(batch, 0, dtype=torch.bool, device=like.device)
        return super().reserve(like, slots)
