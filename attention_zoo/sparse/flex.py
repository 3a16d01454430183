"""The sparse family through FlexAttention: ``impl="flex"`` of :class:`attention_zoo.sparse.attention.PatternAttention`.

Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized Attention Kernels",
arXiv:2412.05496 (``torch.nn.attention.flex_attention``). A pattern's ``mask_mod`` (the same function that gives
the dense reference and the blocked path's tiles) becomes a ``BlockMask``: per tile of the score matrix (128 x 128
by default), whether it is empty, full or partial. The compiled kernel skips empty tiles, computes full ones without
the mask and applies ``mask_mod`` inside partial ones, so the work follows the tiles (:func:`tile_density`).

- Parts (:class:`FlexPart`, a pattern's ``flex_parts``): a pattern whose tiles are dense in natural order runs as
  disjoint parts, one call each, in the tile size and position order that make each sparse (BigBird at tiles of its
  block; strided's columns in residue order, where they are block-diagonal; fixed's summary columns gathered), merged
  exactly by their log-sum-exps: O = Σ_p exp(L_p - L) O_p, L = log(Σ_p exp(L_p) [+ exp(σ_h), a learned sink]).
- The block masks depend only on (length, causal, device): the core builds them once and caches them. Key padding
  is a ``score_mod`` closing over the ``(B, Nk)`` mask, an input of the compiled graph, so new padding reuses both.
- Packed rows (:func:`build_document_block_mask`, one call): the pattern at positions within each document, AND the
  document mask; built per call (it depends on the segments), one row at a time (an (n, n) grid per row).
- A query with no allowed key gives zeros (its log-sum-exp is -inf); a learned sink (:mod:`attention_zoo.sinks`)
  enters the merged L once.
- The compiled kernel evaluates the mask function elementwise, so it is pointwise in (q_idx, kv_idx): no reduction,
  buffer or device copy inside; BigBird's random blocks and a part's position order are lookups in tables made on
  the device beforehand.
- On CUDA the call goes through ``torch.compile(flex_attention)`` (:func:`_compiled_flex_attention`); called eagerly,
  as on the CPU, flex_attention is torch's unfused fallback, which materializes the (n, n) scores.

Limits (:func:`flex_refusal`, :func:`check_flex_inputs`: ``impl="auto"`` falls back to the blocked kernel, an
explicit ``impl="flex"`` fails saying why): the compiled kernel takes float32, bfloat16 and float16 and head dims
>= 16 (``tl.dot`` needs 16); torch has no FlexAttention backward on the CPU, so training with ``impl="flex"`` there
is refused before autograd would fail deep inside torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Protocol

import torch
from einops import rearrange, reduce
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from attention_zoo import packing
from attention_zoo.masks import MaskMod
from attention_zoo.sinks import per_head

try:  # torch >= 2.9; return_lse is deprecated there
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older torch
    AuxRequest = None

#: dtypes the compiled (Triton) kernel takes
FLEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: smallest head dim the compiled kernel takes
MIN_FLEX_DIM_HEAD = 16
#: FlexAttention's default tile (rows and columns of the score matrix per block-mask entry)
DEFAULT_TILE = 128
#: tiles torch's CUDA kernels take at their default configuration (multiples of it); other multiples of
#: ``MIN_AUTOTUNED_TILE`` need the autotuned compile (:func:`_compiled_flex_attention`)
_KERNEL_TILE, MIN_AUTOTUNED_TILE = 128, 64


def flex_refusal(q: Tensor) -> str | None:
    """Why FlexAttention cannot run on these queries (None: it can); training on the CPU is
    :func:`check_flex_inputs`'s concern."""
    if q.shape[-1] < MIN_FLEX_DIM_HEAD:
        return f"a head dim >= {MIN_FLEX_DIM_HEAD} (FlexAttention's compiled kernel), got {q.shape[-1]}"
    if q.is_cuda and q.dtype not in FLEX_DTYPES:
        allowed = ", ".join(str(dtype).removeprefix("torch.") for dtype in FLEX_DTYPES)
        return f"one of {allowed} on CUDA, got {str(q.dtype).removeprefix('torch.')}"
    return None


def check_flex_dim_head(dim_head: int, fallback: str = "blocked") -> None:
    """At construction: an explicit ``impl="flex"`` with a head dim the compiled kernel refuses fails early, naming
    the core's own CPU implementation ``fallback``."""
    if dim_head < MIN_FLEX_DIM_HEAD:
        raise ValueError(
            f"impl='flex' needs dim_head >= {MIN_FLEX_DIM_HEAD} (FlexAttention's compiled kernel), got {dim_head}; "
            f"use impl='auto' or '{fallback}'"
        )


def check_flex_inputs(q: Tensor, k: Tensor, v: Tensor, fallback: str = "blocked") -> None:
    """Per call: the dtype, and no training where torch has no FlexAttention backward (CPU, MPS), named here
    rather than inside autograd, with the core's own CPU implementation ``fallback``."""
    refusal = flex_refusal(q)
    if refusal is not None:
        raise ValueError(f"impl='flex' needs {refusal}; use impl='auto' or '{fallback}'")
    if q.device.type in ("cpu", "mps") and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(
            f"impl='flex' cannot train on {q.device.type}: torch has no FlexAttention backward there; use "
            f"impl='{fallback}' (or 'auto', which picks it off CUDA), or run the forward under torch.no_grad()"
        )


def build_block_mask(mask_mod: MaskMod, n: int, device: torch.device, nk: int | None = None,
                     block_size: int | tuple[int, int] = DEFAULT_TILE) -> BlockMask:  # fmt: skip
    """The pattern's tiles over ``n`` queries and ``nk`` keys (None: ``n``, self-attention), tiles of ``block_size``
    (rows, columns; default 128) (no batch or head dependence)."""
    return create_block_mask(mask_mod, None, None, n, n if nk is None else nk, device=device, BLOCK_SIZE=block_size)


def build_document_block_mask(mask_mod: MaskMod, segments: Tensor, key_segments: Tensor, nq: int, nk: int,
                              device: torch.device) -> BlockMask:  # fmt: skip
    """Packed rows (:mod:`attention_zoo.packing`): query i may attend key j when both lie in the same document
    (query document s, key document s of ``key_segments``) and ``mask_mod`` allows their positions within
    it, (i - start, j - start). A padding query attends nothing. ``mask_mod`` must not depend on the length
    of the sequence it is evaluated on (it sees positions of documents of every length)."""
    # (B, N) lookups: each position's document (-1: padding) and its offset from the document's start
    tables = (
        packing.document_ids(segments, nq),
        packing.document_ids(key_segments, nk),
        packing.positions_in_documents(segments, nq),
        packing.positions_in_documents(key_segments, nk),
    )
    rows = [
        create_block_mask(
            _within_documents(mask_mod, *(t[row : row + 1] for t in tables)), 1, None, nq, nk, device=device
        )
        for row in range(segments.shape[0])
    ]
    stacked = (torch.cat([getattr(m, name) for m in rows]) for name in _BLOCK_TABLES)
    packed = _within_documents(mask_mod, *tables)
    return BlockMask.from_kv_blocks(*stacked, BLOCK_SIZE=rows[0].BLOCK_SIZE, mask_mod=packed, seq_lengths=(nq, nk))


#: a BlockMask's per-row tables (B, H, query blocks[, key blocks]): the partial and the full tiles of each row
_BLOCK_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _within_documents(mask_mod: MaskMod, query_docs: Tensor, key_docs: Tensor, query_at: Tensor,
                      key_at: Tensor) -> MaskMod:  # fmt: skip
    """``mask_mod`` at positions within the documents, AND the document mask; the tables are (B, N) lookups,
    so the rule stays pointwise."""

    def within_documents(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        query_doc = query_docs[b, q_idx]
        same = (query_doc == key_docs[b, kv_idx]) & (query_doc >= 0)
        return same & mask_mod(b, h, query_at[b, q_idx], key_at[b, kv_idx])

    return within_documents


def flex_pattern_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_mask: BlockMask,
    mask: Tensor | None,
    scale: float,
    sinks: Tensor | None = None,
) -> Tensor:
    """Softmax attention over the keys ``block_mask`` allows, minus the padded keys of ``mask`` ((B, Nk) bool,
    True = attend); rows with no allowed key are zeros. q, k, v: (B, H, N, D); ``sinks`` (H,): one more logit per
    head in the denominator."""
    out, lse = flex_call(q, k, v, block_mask, mask, scale)
    if sinks is None:
        return out
    gate = torch.sigmoid(lse - per_head(sinks.to(lse.dtype), lse.ndim))  # exp(L - L'); 0 where L = -inf
    return (out * rearrange(gate, "b h i -> b h i 1")).to(out.dtype)


@dataclass(frozen=True)
class FlexPart:
    """One FlexAttention call of a pattern run as parts disjoint in (query, key) pairs. ``mask_mod`` is over the
    call's own indices: its query i is the position ``queries[i]`` (None: i; else a permutation of the positions),
    its key j the position ``keys[j]`` (None: j; any positions, e.g. a gathered subset). ``tile``: (rows, columns)
    of its block mask (default 128 x 128)."""

    mask_mod: MaskMod
    tile: tuple[int, int] = (DEFAULT_TILE, DEFAULT_TILE)
    queries: Tensor | None = None
    keys: Tensor | None = None


@dataclass(frozen=True)
class FlexCall:
    """A part ready to run: its block mask, and where each position's row sits in the call (the inverse of the
    part's query order; None: natural order)."""

    part: FlexPart
    block_mask: BlockMask
    rows: Tensor | None


class HasFlexParts(Protocol):
    """A pattern (:class:`~attention_zoo.sparse.patterns.SparsePattern`): its FlexAttention parts."""

    def flex_parts(self, n: int, causal: bool, device: torch.device) -> tuple[FlexPart, ...]: ...


def at_positions(mask_mod: MaskMod, queries: Tensor | None, keys: Tensor | None) -> MaskMod:
    """``mask_mod`` over positions, seen from a call whose query i is ``queries[i]`` and key j ``keys[j]`` (None:
    itself); the tables are lookups on the device, so the rule stays pointwise."""

    def at(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        query_at = q_idx if queries is None else queries[q_idx]
        return mask_mod(b, h, query_at, kv_idx if keys is None else keys[kv_idx])

    return at


def plan_flex_calls(parts: Sequence[FlexPart], n: int, device: torch.device) -> tuple[FlexCall, ...]:
    """The block mask of each part over ``n`` positions (built once per pattern, length, causal and device)."""
    calls = []
    for part in parts:
        nk = n if part.keys is None else len(part.keys)
        rows = None if part.queries is None else torch.argsort(part.queries)
        calls.append(FlexCall(part, build_block_mask(part.mask_mod, n, device, nk, part.tile), rows))
    return tuple(calls)


def flex_parts_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    calls: Sequence[FlexCall],
    mask: Tensor | None,
    scale: float,
    sinks: Tensor | None = None,
) -> Tensor:
    """:func:`flex_pattern_attention` over a pattern run as disjoint parts: each part's call on its queries and keys
    (gathered in its order), its output and log-sum-exp put back in position order, and the softmaxes merged
    exactly, O = Σ_p exp(L_p - L) O_p with L = log(Σ_p exp(L_p) + exp(σ_h)) (the sink term only with ``sinks``)."""
    if len(calls) == 1 and calls[0].part.queries is None and calls[0].part.keys is None:
        return flex_pattern_attention(q, k, v, calls[0].block_mask, mask, scale, sinks)
    outs, lses = [], []
    for call in calls:
        queries, keys = call.part.queries, call.part.keys
        part_q = q if queries is None else q.index_select(-2, queries)
        part_k, part_v = (k, v) if keys is None else (k.index_select(-2, keys), v.index_select(-2, keys))
        part_mask = mask if mask is None or keys is None else mask.index_select(-1, keys)
        out, lse = flex_call(part_q, part_k, part_v, call.block_mask, part_mask, scale)
        if call.rows is not None:  # back to position order
            out, lse = out.index_select(-2, call.rows), lse.index_select(-1, call.rows)
        outs.append(out)
        lses.append(lse)
    return merged(outs, lses, sinks).to(q.dtype)


def merged(outs: Sequence[Tensor], lses: Sequence[Tensor], sinks: Tensor | None = None) -> Tensor:
    """Softmax attention over the union of disjoint key sets, from each set's output O_p (B, H, N, D) and
    log-sum-exp L_p (B, H, N; -inf: no key): O = Σ_p exp(L_p - L) O_p, L = log(Σ_p exp(L_p) [+ exp(σ_h)]), the sink
    term only with ``sinks`` (H,). In float32 at least; every exponent is shifted by the row's largest term (a
    constant of the row, so detached), which keeps a row with no key (all L_p = -inf) at zeros, with no NaN in the
    value or the gradient."""
    work = torch.promote_types(outs[0].dtype, torch.float32)
    lse = torch.stack(list(lses)).to(work)  # (P, B, H, N)
    top = lse.amax(dim=0)
    sink = None if sinks is None else per_head(sinks.to(lse.dtype), top.ndim)
    if sink is not None:
        top = torch.maximum(top, sink)
    shift = torch.where(torch.isfinite(top), top, 0.0).detach()
    weights = (lse - shift).exp()
    total = weights.sum(dim=0) if sink is None else weights.sum(dim=0) + (sink - shift).exp()
    weights = weights / total.clamp_min(torch.finfo(total.dtype).tiny)  # total 0: no key, weights 0
    return sum(out.to(work) * rearrange(w, "b h i -> b h i 1") for out, w in zip(outs, weights, strict=True))


def flex_call(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, mask: Tensor | None,
              scale: float) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One FlexAttention call (compiled on CUDA): O (rows with no allowed key: zeros) and the log-sum-exp L
    (B, H, Nq), float32; ``mask`` (B, Nk) bool (True = attend) or None."""
    score_mod = None if mask is None else _key_padding(mask)
    if not torch.is_grad_enabled():  # torch refuses inputs that require grad on the CPU even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    attention = flex_attention
    if q.is_cuda:  # tiles the default kernel configuration does not divide: the autotuned compile
        attention = _compiled_flex_attention(True) if _needs_autotune(block_mask) else _compiled_flex_attention()
    lse_request = {"return_lse": True} if AuxRequest is None else {"return_aux": AuxRequest(lse=True)}
    out, aux = attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, **lse_request)
    lse = aux if AuxRequest is None else aux.lse
    empty = rearrange(torch.isneginf(lse), "b h i -> b h i 1")  # no allowed key: lse = log 0
    return torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out), lse


def _needs_autotune(block_mask: BlockMask) -> bool:
    return any(tile % _KERNEL_TILE for tile in block_mask.BLOCK_SIZE)


def _key_padding(mask: Tensor) -> Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]:
    def key_padding(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.where(mask[b, kv_idx], score, -float("inf"))

    return key_padding


@cache
def _compiled_flex_attention(autotune: bool = False) -> Callable[..., object]:
    """``torch.compile(flex_attention)``, made once per process on first use. Each pattern configuration (the
    constants its mask function closes over), dtype, and padded or unpadded call compiles once; a new length may
    recompile once more (then shapes are dynamic). Past torch's recompile limit
    (``torch._dynamo.config.recompile_limit``) further variants run eagerly.

    ``autotune``: for block masks whose tiles are not multiples of 128. Torch's default kernel configuration on
    some GPUs (e.g. the backward on sm90 for head dims 64-128) has 128-wide blocks, which must divide the tiles;
    under ``max_autotune`` Inductor chooses among its configurations those that fit (tiles of 64 and up), at the
    cost of benchmarking them at the first compile."""
    return torch.compile(flex_attention, options={"max_autotune": True}) if autotune else torch.compile(flex_attention)


# --- how much of the score matrix a pattern's calls compute -------------------------------------------------


@dataclass(frozen=True)
class TileDensity:
    """The area of the tiles FlexAttention computes, partial (the mask function evaluated inside) and full, as
    fractions of the area a dense call computes; ``density`` = partial + full, its work relative to dense."""

    partial: float
    full: float

    @property
    def density(self) -> float:
        return self.partial + self.full


def tile_density(block_mask: BlockMask) -> TileDensity:
    """Of one block mask: its partial and full tiles as fractions of all its tiles (over its batch and heads)."""
    nq, nk = block_mask.seq_lengths
    rows, columns = block_mask.BLOCK_SIZE
    tiles = block_mask.kv_num_blocks.numel() * -(-nk // columns)  # (B, H, query tiles) x key tiles
    full = 0 if block_mask.full_kv_num_blocks is None else int(block_mask.full_kv_num_blocks.sum())
    return TileDensity(partial=int(block_mask.kv_num_blocks.sum()) / tiles, full=full / tiles)


def pattern_tile_density(pattern: HasFlexParts, n: int, causal: bool,
                         device: torch.device | str = "cpu") -> TileDensity:  # fmt: skip
    """What the flex path of ``pattern`` computes over ``n`` positions: the tiles of all its parts, as fractions of
    a dense call's ceil(n / 128)^2 tiles of 128 x 128. Counted from each part's mask function evaluated on its tile
    grid a few rows of tiles at a time (the tile counts ``create_block_mask`` gives, without its (n, n) tensors, so
    long sequences fit on the CPU)."""
    device = torch.device(device)
    dense = (-(-n // DEFAULT_TILE) * DEFAULT_TILE) ** 2
    partial = full = 0
    for part in pattern.flex_parts(n, causal, device):
        nk = n if part.keys is None else len(part.keys)
        part_partial, part_full = _tile_counts(part.mask_mod, n, nk, part.tile, device)
        area = part.tile[0] * part.tile[1]
        partial, full = partial + part_partial * area, full + part_full * area
    return TileDensity(partial=partial / dense, full=full / dense)


def _tile_counts(mask_mod: MaskMod, nq: int, nk: int, tile: tuple[int, int], device: torch.device) -> tuple[int, int]:
    """(partial, full) tiles of ``mask_mod`` over (nq, nk), tiles of ``tile``; positions past the ends count as
    masked, as ``create_block_mask`` pads them."""
    rows, columns = tile
    query_tiles, keys = -(-nq // rows), torch.arange(-(-nk // columns) * columns, device=device)
    zero = torch.zeros((), dtype=torch.long, device=device)
    step = max(1, (1 << 22) // (rows * len(keys)))  # tiles of queries per pass: about 4M pairs
    partial = full = 0
    for first in range(0, query_tiles, step):
        queries = torch.arange(first * rows, min(query_tiles, first + step) * rows, device=device)
        allowed = mask_mod(zero, zero, queries.clamp(max=nq - 1)[:, None], keys.clamp(max=nk - 1)[None, :])
        allowed = allowed & (queries < nq)[:, None] & (keys < nk)[None, :]
        count = reduce(allowed.to(torch.int32), "(r i) (c j) -> r c", "sum", i=rows, j=columns)
        full += int((count == rows * columns).sum())
        partial += int(((count > 0) & (count < rows * columns)).sum())
    return partial, full
