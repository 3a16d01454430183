"""MoBA, Mixture of Block Attention (``"moba"``): each query attends, with exact softmax, to its own block of
keys and to the ``top_k`` other blocks whose mean key it scores highest.

Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs", arXiv:2502.13189
(https://arxiv.org/abs/2502.13189), Sec. 2. The N keys are cut into n blocks of B = ``block_size``,
I_i = [(i - 1) B + 1, i B]; a query q attends to the union I of the blocks its gate opens:

    MoBA(q, K, V) = Softmax(q K[I]^T / sqrt(d)) V[I],      I = U_{g_i > 0} I_i
    g_i = 1 if s_i in Topk({s_j | j in [n]}, k), else 0,   s_i = <q, mean_pool(K[I_i])>

Causal (the paper's setting): s_i = -inf (g_i = 0) for every block that does not end before q's own
block, and q always attends its own block, with the causal mask j <= pos(q) inside it. The paper's k
counts that forced block (the authors' code sets its gate to +inf, so it is one of the top k); here
``top_k`` counts the gated blocks only, so a query attends to 1 + ``top_k`` blocks (paper's k = top_k + 1).
Non-causal (not in the paper, which trains decoders): every other block is a candidate, the own block
is attended whole. A query with fewer candidates than ``top_k`` (the first blocks, when causal) takes all
of them. Key padding: padded keys are left out of the block means and out of the attention; a block with no
real key is never gated in; a query that then sees no key gets zeros. The selection is a top-k, piecewise
constant in q and K: like the paper's parameter-free gate it passes no gradient; gradients reach q, K and V
through the softmax over the selected keys.

Defaults ``block_size=512, top_k=2``: the paper's scaling-law setting (block 512, top-k 3 with the own block, at
8K context), the shortest context the paper trains; its 1M-token Llama-8B setting is block 4096, top-k 12. At
n <= block_size MoBA is full attention.

Implementation (:meth:`MixtureOfBlockAttention.attend`): the gate in chunks of queries, then exact attention over
the selected blocks by the block-level kernel of :mod:`attention_zoo.moba.tiled` (each key block read once against
every query that selected it; :mod:`attention_zoo.moba.flash` on the CPU), or on CUDA by one FlexAttention call
over the (query, block) pairs sorted by block (:mod:`attention_zoo.moba.block_mask`); ``impl="dense"`` forms the
same selection as an (N, N) mask instead. Cost per head: gate 2 N n d (n = N / B blocks: quadratic, but B-fold
below full attention's); attention 4 N (top_k + 1) B d (linear in N); memory O(N d + N top_k), plus the kernels'
fixed-size chunks. Decoding (:class:`BlockCache`): O((N / B) d) for the gate and O((top_k + 1) B d) for the
attention per step; for inference only.

Limits: the selection is discontinuous, so float32 and float64 (or a decoding step and the forward) can
pick different blocks at a near-tie of two gate scores (ties have probability zero on continuous
inputs). Self-attention only: the own block is the query's position in the key sequence, which
cross-attention does not have.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, reduce, repeat
from torch import Tensor

from attention_zoo import chunking
from attention_zoo.core import AttentionCore, DecodingState, Geometry
from attention_zoo.decoding.cache import BlockState, grown
from attention_zoo.masks import masked_attention
from attention_zoo.moba.block_mask import moba_flex_attention
from attention_zoo.moba.tiled import moba_attention
from attention_zoo.precision import compute_dtype
from attention_zoo.registry import register_attention
from attention_zoo.sparse import flex
from attention_zoo.sparse.tiled import TileGroup, tiled_attention

#: gate scores computed at once on the CPU (a chunk of queries against every block), about 1 MB in float32;
#: other devices take the larger budget of :mod:`attention_zoo.chunking`
_GATE_SCORES = 1 << 18
#: the largest query tile; smaller tiles are used when fewer queries route to each block
_MAX_TILE = 64
Impl = Literal["auto", "tiled", "dense", "flex"]


@register_attention("moba")
class MixtureOfBlockAttention(
    AttentionCore, approximation="content-selected sparsity", supports_cross_attention=False, has_decoding_cache=True,
    supports_segments=True,
):  # fmt: skip
    """Packed rows (``segments``): blocks restart at each document (its last block may be short) and the gate
    chooses among the document's own blocks (computed by unpacking the documents,
    :func:`~attention_zoo.packing.unpacked_attention`)."""

    example_configs = (
        {"block_size": 4, "top_k": 2},
        {"block_size": 8, "top_k": 1},
        {"block_size": 6, "top_k": 3},
        {"block_size": 4, "top_k": 2, "impl": "dense"},
    )
    notes: ClassVar[str] = (
        "exact over its selection: own block + top_k blocks by <q, mean key> (paper's top-k = top_k + 1); "
        "self-attention only; the selection passes no gradient"
    )

    def __init__(self, geometry: Geometry, *, block_size: int = 512, top_k: int = 2, impl: Impl = "auto") -> None:
        """``block_size`` B: keys per block (>= 1); ``top_k``: gated blocks per query besides its own (>= 0;
        0 = attention inside blocks only). Defaults: the paper's block 512, top-k 3 (own block included).
        ``impl``: ``"auto"`` (default) ``"flex"`` on CUDA where FlexAttention takes the inputs (float32,
        bfloat16 or float16, head dim >= 16), ``"tiled"`` elsewhere; ``"flex"`` one FlexAttention call over the
        (query, block) pairs sorted by block (:mod:`attention_zoo.moba.block_mask`), without host
        synchronisation; on the CPU forward only (torch's eager fallback, O(N^2)); ``"tiled"`` the block-level
        kernel of :mod:`attention_zoo.moba.tiled`, O(N (top_k + 1) B) per head;
        ``"dense"`` the (N, N) mask of the same selection and a masked softmax, O(N^2): the same output, and
        faster at short lengths, where the tiled kernel's per-call layout costs more than the scores it skips."""
        super().__init__(geometry)
        self.bound_by_length("block_size", block_size)
        if top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (gated blocks besides the own block), got {top_k}")
        if impl == "flex":
            flex.check_flex_dim_head(self.dim_head, fallback="tiled")
        self.block_size, self.top_k, self.impl = block_size, top_k, impl

    def resolved_impl(self, q: Tensor) -> str:
        """The implementation a call with these queries runs: ``impl``, or for ``"auto"`` flex on CUDA where
        FlexAttention takes the dtype and head dim, else tiled."""
        if self.impl != "auto":
            return self.impl
        return "flex" if q.is_cuda and flex.flex_refusal(q) is None else "tiled"

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        """(1) The gate, s for every (query, block) in chunks of queries (a fixed number of scores per chunk, set
        per device by :mod:`attention_zoo.chunking`: the whole (N, n) score matrix only where it fits one chunk),
        top-k under the masks of the module docstring, giving each query its own block (rank 0) and its gated
        blocks (ranks 1..top_k). (2) Exact attention over the selected blocks, for a whole sequence by the
        block-level kernel of :mod:`attention_zoo.moba.tiled`: the own blocks as plain batched attention (no
        gather), then each key block read once and scored against every query that selected it, the (query,
        block) pairs sorted by block by :mod:`attention_zoo.moba.layout` (the authors' varlen FlashAttention is
        key-block-major too), an online softmax across a query's blocks and recomputation in the backward. The
        query lists of the sequences batched on one key block are padded to the longest; the causal own block
        computes 5/8 of its scores (in slabs of rows; only their diagonal squares are masked). The dense (N, N)
        score matrix is never formed, except with ``impl="dense"``. With ``impl="flex"`` (``"auto"``'s choice on
        CUDA) step (2) is one FlexAttention call (:mod:`attention_zoo.moba.block_mask`)."""
        # b: batch, h: heads, n: positions (padded to whole blocks), g: block, j: position in a block, d: head dim
        n, c, impl = q.shape[-2], self.block_size, self.resolved_impl(q)
        if impl == "flex":
            flex.check_flex_inputs(q, k, v, fallback="tiled")
        unpadded, real = (q, k, v), mask
        if n % c:  # complete the last block with slots that hold no token
            present = torch.ones(q.shape[0], n, dtype=torch.bool, device=q.device) if mask is None else mask
            real = F.pad(present, (0, -n % c), value=False)
            q, k, v = (F.pad(t, (0, 0, 0, -n % c)) for t in (q, k, v))
        work = compute_dtype(q.dtype)  # a sum of B keys needs float32's range
        sums = reduce(k.detach().to(work), "b h (g j) d -> b h g d", "sum", j=c)
        if real is None:
            counts = torch.full((q.shape[0], q.shape[-2] // c), float(c), dtype=work, device=q.device)
        else:
            counts = reduce(real.to(work), "b (g j) -> b g", "sum", j=c)
        selected = self.select_blocks(q, sums, counts, offset=0, causal=causal)
        selected[:, :, n:, 1:] = -1  # the completing slots gate nothing in (rank 0 keeps every row in the kernel)
        if impl == "flex":
            return moba_flex_attention(*unpadded, selected[:, :, :n], mask, c, causal, self.scale)
        if impl == "dense":
            return dense_routed_attention(q, k, v, selected, real, c, causal, self.scale)[:, :, :n]
        return moba_attention(q, k, v, selected, real, c, causal, self.scale)[:, :, :n]

    @torch.no_grad()
    def select_blocks(self, q: Tensor, sums: Tensor, counts: Tensor, *, offset: int, causal: bool) -> Tensor:
        """(B, H, Nq, 1 + top_k) block indices: rank 0 the query's own block, then its gated blocks, best
        first; -1 where there are fewer candidates. ``sums``: (B, H, n, D) key sums per block, ``counts``:
        (B, n) real keys per block; query i sits at position ``offset + i``."""
        # b: batch, h: heads, i: query, g: block, d: head dim
        batch, heads, nq, _ = q.shape
        blocks = sums.shape[-2]
        own = (torch.arange(nq, device=q.device) + offset) // self.block_size
        ranks = [repeat(own, "i -> b h i 1", b=batch, h=heads)]
        picks = min(self.top_k, blocks - 1)
        if picks > 0:
            means = sums / rearrange(counts.clamp(min=1), "b g -> b 1 g 1")
            block = torch.arange(blocks, device=q.device)
            step = _gate_step(batch, heads, blocks, q.device)
            gated = []
            for first in range(0, nq, step):
                rows = slice(first, first + step)
                scores = einsum(q[:, :, rows].to(means.dtype), means, "b h i d, b h g d -> b h i g")
                after_own = block[None, :] - own[rows, None]  # the candidate's block minus the query's
                candidate = after_own < 0 if causal else after_own != 0
                allowed = rearrange(candidate, "i g -> 1 1 i g") & rearrange(counts > 0, "b g -> b 1 1 g")
                best = scores.masked_fill_(~allowed, float("-inf")).topk(picks, dim=-1)
                gated.append(best.indices.masked_fill_(best.values == float("-inf"), -1))
            ranks.append(torch.cat(gated, dim=2))
        return torch.cat(ranks, dim=-1)

    def start_decoding(self) -> DecodingState:
        self.check_decodable()
        return BlockCache()

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None) -> Tensor:
        # b: batch, h: heads, t: new positions, d: head dim
        assert isinstance(state, BlockCache)
        start, end, c = state.length, state.length + q.shape[-2], self.block_size
        real = torch.ones(q.shape[0], q.shape[-2], dtype=torch.bool, device=q.device) if mask is None else mask
        state.reserve_blocks(k, -(-end // c) * c, c)
        state.keys[:, :, start:end] = k
        state.values[:, :, start:end] = v
        state.real[:, start:end] = real
        block = torch.arange(start, end, device=q.device) // c
        state.key_sums.index_add_(2, block, k.to(state.key_sums.dtype))
        state.key_counts.index_add_(1, block, real.to(state.key_counts.dtype))
        selected = self.select_blocks(q, state.key_sums, state.key_counts, offset=start, causal=True)
        return routed_attention(q, state.keys, state.values, selected, state.real, c, start, True, self.scale)


class BlockCache(BlockState):
    """MoBA's decoding state: keys, values and real-token flags in whole blocks (:class:`BlockState`), and each
    block's running key sum and real-key count (float32 for half inputs); causal gating reads a block's mean only
    once the block is complete. A step (a few queries at an offset) uses the tiled kernel of
    :mod:`attention_zoo.sparse.tiled`: the (b, h, position) axes flattened into one row axis and, per rank, the pairs
    sorted by block and cut into tiles of T queries against the B keys of that block. The cache is written in place,
    so autograd cannot reach back through earlier steps (it raises): decoding is for inference."""

    def __init__(self) -> None:
        super().__init__()
        self.key_sums: Tensor | None = None  # (B, H, capacity / block_size, D)
        self.key_counts: Tensor | None = None  # (B, capacity / block_size)

    def reserve_blocks(self, like: Tensor, slots: int, block_size: int) -> None:
        """:meth:`BlockState.reserve`, and room for the sums and counts of the blocks added."""
        extra = self.reserve(like, slots)
        if extra:
            batch, heads, _, dim = like.shape
            work = compute_dtype(like.dtype)
            self.key_sums = grown(self.key_sums, (batch, heads, extra // block_size, dim), work, like.device)
            self.key_counts = grown(self.key_counts, (batch, extra // block_size), work, like.device)


def routed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    selected: Tensor,
    real: Tensor | None,
    block_size: int,
    offset: int,
    causal: bool,
    scale: float,
) -> Tensor:
    """softmax(q K^T * scale) V of each query over the blocks ``selected`` (B, H, Nq, R) gives it (real keys
    only; ``real`` (B, Nk) bool or None; Nk a multiple of ``block_size``); when ``causal``, query i at position
    ``offset + i`` sees keys up to that position."""
    # b: batch, h: heads, n: positions, d: head dim
    batch, heads = q.shape[:2]
    layout = routed_layout(selected, block_size, k.shape[-2] // block_size, offset, causal)
    flat = lambda t: rearrange(t, "b h n d -> 1 1 (b h n) d")
    key_padding = None if real is None else repeat(real, "b n -> 1 (b h n)", h=heads)
    out = tiled_attention(flat(q), flat(k), flat(v), layout, key_padding, scale)
    return rearrange(out, "1 1 (b h n) d -> b h n d", b=batch, h=heads)


def dense_routed_attention(
    q: Tensor, k: Tensor, v: Tensor, selected: Tensor, real: Tensor | None, block_size: int, causal: bool, scale: float
) -> Tensor:
    """:func:`routed_attention` of a whole sequence (queries at positions 0..N-1) as a masked softmax over the
    dense (N, N) mask of the selection."""
    # b: batch, h: heads, i: query, j: key, g: block, r: rank, d: head dim
    n = q.shape[-2]
    chosen = torch.zeros(*selected.shape[:3], n // block_size + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, selected.masked_fill(selected < 0, n // block_size), True)  # -1 lands in a spare column
    allowed = repeat(chosen[..., :-1], "b h i g -> b h i (g j)", j=block_size)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return masked_attention(q, k, v, allowed, real, scale)


def routed_layout(
    selected: Tensor, block_size: int, key_blocks: int, offset: int, causal: bool
) -> tuple[TileGroup, ...]:
    """One tile group per rank of ``selected``: the (query, block) pairs of that rank sorted by block and cut
    into tiles of T queries, each against its block's keys. Rows index the flattened (b h i) queries, key
    slots the flattened (b h j) keys; the row past the last query pads tiles and sees nothing."""
    batch, heads, nq, _ = selected.shape
    device = selected.device
    total = batch * heads * nq
    query = torch.arange(total, device=device)
    sequence = query // nq  # the (b, h) of each flattened query
    slots = torch.arange(block_size, device=device)
    groups = []
    for rank, blocks in enumerate(rearrange(selected, "b h i r -> r (b h i)")):
        routed = blocks >= 0
        route, order = (sequence[routed] * key_blocks + blocks[routed]).sort(stable=True)
        if len(route) == 0:
            continue
        queries = query[routed][order]
        counts = torch.bincount(route, minlength=batch * heads * key_blocks)
        tile = _tile_rows(len(route), int(counts.count_nonzero()))
        tiles = -(-counts // tile)
        within = torch.arange(len(route), device=device) - (counts.cumsum(0) - counts)[route]
        rows = torch.full((int(tiles.sum()), tile), total, dtype=torch.long, device=device)
        rows[(tiles.cumsum(0) - tiles)[route] + within // tile, within % tile] = queries
        tile_route = torch.repeat_interleave(torch.arange(len(tiles), device=device), tiles)
        blocked = rearrange(rows == total, "t i -> t i 1")
        if causal and rank == 0:  # only the own block reaches past its queries
            key_position = (tile_route % key_blocks)[:, None] * block_size + slots
            blocked = blocked | (key_position[:, None, :] > (rows % nq + offset)[:, :, None])
        key_index = tile_route[:, None] * block_size + slots
        groups.append(TileGroup(rows=rows, key_index=key_index, blocked=blocked.expand(-1, -1, block_size)))
    return tuple(groups)


def _gate_step(batch: int, heads: int, blocks: int, device: torch.device) -> int:
    """Queries per chunk of the gate: ``chunk_elements(device, _GATE_SCORES)`` scores against every block."""
    return max(1, chunking.chunk_elements(device, _GATE_SCORES) // (batch * heads * blocks))


def _tile_rows(pairs: int, routes: int) -> int:
    """Query rows per tile: a power of two near a quarter of the mean pairs per block (so that padding the
    last tile of each block wastes about 1/8), at most ``_MAX_TILE``."""
    quarter = max(1, pairs // (4 * max(routes, 1)))
    return min(_MAX_TILE, 1 << (quarter.bit_length() - 1))
