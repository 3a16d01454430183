"""The sparse family through FlexAttention: ``impl="flex"`` of :class:`attention_zoo.sparse.attention.PatternAttention`.

Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized Attention Kernels",
arXiv:2412.05496 (``torch.nn.attention.flex_attention``). A pattern's ``mask_mod`` (the same function that
gives the dense reference and the blocked path's tiles) becomes a ``BlockMask``: per 128 x 128 tile of the
score matrix, whether it is empty, full or partial. The compiled kernel skips empty tiles, computes full tiles
without evaluating the mask, and applies ``mask_mod`` elementwise inside partial ones, so the work follows the
pattern's tiles, forward and backward.

- The block mask depends only on (length, causal, device), so the core builds it once and caches it
  (:meth:`~attention_zoo.sparse.attention.PatternAttention.attend`), one evaluation of the mask function on
  the dense (n, n) grid. Key padding is a ``score_mod`` closing over the ``(B, Nk)`` mask, an input of the
  compiled graph: a batch with new padding reuses the cached block mask and the compiled kernel.
- Packed rows (:func:`build_document_block_mask`): the pattern's mask function evaluated at the positions
  within each document, AND the document mask (query and key in the same document; padding after the last
  document attends nothing). It depends on the segments, so it is built per call, one row at a time: the
  mask function runs on one (n, n) grid per row, never on (B, n, n) at once.
- A query with no allowed key gives zeros, the library convention (its log-sum-exp is -inf). A learned sink
  (:mod:`attention_zoo.sinks`) multiplies the output by sigmoid(L - σ_h), L the log-sum-exp it returns (differentiable).
- The compiled kernel evaluates the mask function elementwise, so it must be pointwise in (q_idx, kv_idx): no
  reduction and no buffer or device copy inside it. Every rule of :mod:`attention_zoo.sparse.mask_mods` is;
  BigBird's random blocks are a lookup in a block-level bool matrix made on the device beforehand.
- On CUDA the call goes through ``torch.compile(flex_attention)`` (:func:`_compiled_flex_attention`); called
  eagerly, as on the CPU, flex_attention is torch's unfused fallback, which materializes the whole (n, n)
  score matrix: correct but neither fast nor small.

Limits (:func:`flex_refusal`, :func:`check_flex_inputs`: ``impl="auto"`` falls back to the blocked kernel, an
explicit ``impl="flex"`` fails with a message that says why): the compiled kernel takes float32, bfloat16 and
float16 and head dims >= 16 (``tl.dot`` needs 16); torch implements no FlexAttention backward on the CPU, so
training with ``impl="flex"`` there is refused before autograd would fail deep inside torch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from einops import rearrange
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


def flex_refusal(q: Tensor) -> str | None:
    """Why FlexAttention cannot run on these queries (None: it can); training on the CPU is
    :func:`check_flex_inputs`'s concern."""
    if q.shape[-1] < MIN_FLEX_DIM_HEAD:
        return f"a head dim >= {MIN_FLEX_DIM_HEAD} (FlexAttention's compiled kernel), got {q.shape[-1]}"
    if q.is_cuda and q.dtype not in FLEX_DTYPES:
        allowed = ", ".join(str(dtype).removeprefix("torch.") for dtype in FLEX_DTYPES)
        return f"one of {allowed} on CUDA, got {str(q.dtype).removeprefix('torch.')}"
    return None


def check_flex_dim_head(dim_head: int) -> None:
    """At construction: an explicit ``impl="flex"`` with a head dim the compiled kernel refuses fails early."""
    if dim_head < MIN_FLEX_DIM_HEAD:
        raise ValueError(
            f"impl='flex' needs dim_head >= {MIN_FLEX_DIM_HEAD} (FlexAttention's compiled kernel), got {dim_head}; "
            "use impl='auto' or 'blocked'"
        )


def check_flex_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Per call: the dtype, and no training where torch has no FlexAttention backward (CPU, MPS), named here
    rather than inside autograd."""
    refusal = flex_refusal(q)
    if refusal is not None:
        raise ValueError(f"impl='flex' needs {refusal}; use impl='auto' or 'blocked'")
    if q.device.type in ("cpu", "mps") and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(
            f"impl='flex' cannot train on {q.device.type}: torch has no FlexAttention backward there; use "
            "impl='blocked' (or 'auto', which picks it off CUDA), or run the forward under torch.no_grad()"
        )


def build_block_mask(mask_mod: MaskMod, n: int, device: torch.device) -> BlockMask:
    """The pattern's tiles for self-attention over ``n`` positions (no batch or head dependence)."""
    return create_block_mask(mask_mod, None, None, n, n, device=device)


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
    score_mod = None if mask is None else _key_padding(mask)
    if not torch.is_grad_enabled():  # torch refuses inputs that require grad on the CPU even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    attention = _compiled_flex_attention() if q.is_cuda else flex_attention
    lse_request = {"return_lse": True} if AuxRequest is None else {"return_aux": AuxRequest(lse=True)}
    out, aux = attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, **lse_request)
    lse = aux if AuxRequest is None else aux.lse
    empty = rearrange(torch.isneginf(lse), "b h i -> b h i 1")  # no allowed key: lse = log 0
    out = torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)
    if sinks is None:
        return out
    gate = torch.sigmoid(lse - per_head(sinks.to(lse.dtype), lse.ndim))  # exp(L - L'); 0 where L = -inf
    return (out * rearrange(gate, "b h i -> b h i 1")).to(out.dtype)


def _key_padding(mask: Tensor) -> Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]:
    def key_padding(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.where(mask[b, kv_idx], score, -float("inf"))

    return key_padding


@cache
def _compiled_flex_attention() -> Callable[..., object]:
    """``torch.compile(flex_attention)``, made once per process on first use. Each pattern configuration (the
    constants its mask function closes over), dtype, and padded or unpadded call compiles once; a new length may
    recompile once more (then shapes are dynamic). Past torch's recompile limit
    (``torch._dynamo.config.recompile_limit``) further variants run eagerly."""
    return torch.compile(flex_attention)
