"""MoBA's attention kernel: exact softmax over each query's own block and the blocks its gate selected, in
key-block-major tiles (the gate itself is in :mod:`attention_zoo.moba.attention`, the tiles' layout in
:mod:`attention_zoo.moba.layout`). On the CPU, :func:`moba_attention` hands the same blocks to torch's
flash-attention op instead (:mod:`attention_zoo.moba.flash`); the products and passes below serve the
other devices.

Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs", arXiv:2502.13189, Sec. 2: a query
q attends to the union I of its own block and its gated blocks I_i (B = block size),

    MoBA(q, K, V) = Softmax(q K[I]^T / sqrt(d)) V[I],      I = I_own U (U_{g_i > 0} I_i)

with the causal mask j <= pos(q) inside the own block when causal (gated blocks then end before it).

Own block. Query block i and key block i are contiguous, so rank 0 is plain batched attention over
(B H N / B) blocks of B x B scores, computed once: no gather at all. When causal, in four slabs of rows,
each against only the keys up to its last row, the diagonal masked: 5/8 of the block's scores, not all.

Gated blocks. Every key block j is read once per batch of the layout and scored against all the queries (of
every query block) that selected it, as one (M, D) x (D, B) product. The rows of a batch are distinct, so each
batch updates its rows' running max m, sum l and output with one read-modify-write (online softmax, as
FlashAttention does).

Backward: only O and the row log-sum-exp are kept; P = exp(S - lse) is recomputed per tile, with
dS = P * (dP - rowsum(dO * O)), dP = dO V^T. dK and dV of a key block are summed straight into its (contiguous)
rows, dQ of gathered rows with ``index_add_``. Rows that see no key give zeros, never NaN.
"""

from __future__ import annotations

import torch
from einops import rearrange, repeat
from torch import Tensor
from torch.autograd.function import once_differentiable

from attention_zoo import chunking
from attention_zoo.moba.flash import FlashMobaAttention
from attention_zoo.moba.layout import GatedBatch, add_block, block_bias, block_keys, gated_layout
from attention_zoo.precision import compute_dtype

#: elements of the largest per-chunk score tile on the CPU (~2 MB in float32, reused by the allocator rather
#: than faulted in fresh); other devices take the larger budget of :mod:`attention_zoo.chunking`
_CHUNK_ELEMENTS = 1 << 19
#: slabs of a causal own block (see :func:`_slabs`)
_CAUSAL_SLABS = 4
#: devices on which the blocks go to torch's flash-attention op (:mod:`attention_zoo.moba.flash`)
#: instead of the products and softmax passes below
_FLASH_DEVICES = ("cpu",)


def moba_attention(
    q: Tensor, k: Tensor, v: Tensor, selected: Tensor, real: Tensor | None, block_size: int, causal: bool, scale: float
) -> Tensor:
    """softmax(q K^T * scale) V of each query of a whole sequence (positions 0..N-1, N a multiple of
    ``block_size``) over its own block and the blocks ``selected`` (B, H, N, R) gives it at ranks 1.. (-1 = none);
    real keys only (``real`` (B, N) bool or None); causal inside the own block when ``causal``.
    Half-precision inputs are computed in float32 (running sums of exponentials need its range)."""
    batch, heads, n, _ = q.shape
    dtype, work = q.dtype, compute_dtype(q.dtype)
    flat = lambda t: rearrange(t.to(work), "b h n d -> (b h) n d").contiguous()
    layout = gated_layout(selected[..., 1:], block_size, chunking.chunk_elements(q.device, _CHUNK_ELEMENTS))
    key_bias = None  # 0 on real keys, -inf on padded ones
    if real is not None:
        key_bias = repeat(torch.zeros_like(real, dtype=work).masked_fill_(~real, -torch.inf), "b n -> (b h) n", h=heads)
    kernel = FlashMobaAttention if q.device.type in _FLASH_DEVICES else MobaAttention
    out = kernel.apply(flat(q), flat(k), flat(v), layout, key_bias, block_size, causal, scale)
    return rearrange(out, "(b h) n d -> b h n d", b=batch).to(dtype)


def _own_chunks(total_blocks: int, block_size: int, dim: int, device: torch.device):
    """Slices of the flattened (b h block) axis holding about the chunk budget of own-block scores."""
    step = max(1, chunking.chunk_elements(device, _CHUNK_ELEMENTS) // (block_size * max(block_size, dim)))
    for first in range(0, total_blocks, step):
        yield slice(first, first + step)


def _slabs(block_size: int, causal: bool, like: Tensor) -> list[tuple[slice, int, Tensor | None]]:
    """Own-block work, widest first: (query rows of a block, how many of the block's keys they see, additive
    causal mask of 0 / -inf or None). Not causal: the whole block. Causal: ``_CAUSAL_SLABS`` slabs of
    B / p rows, slab r seeing the first (r + 1) B / p keys, so that most of the triangle above the diagonal
    is skipped rather than computed and masked ((p + 1) / 2p of the block's scores instead of all)."""
    parts = _CAUSAL_SLABS if causal and block_size % _CAUSAL_SLABS == 0 else 1
    height = block_size // parts
    slabs = []
    for r in reversed(range(parts)):
        width = (r + 1) * height
        bias = like.new_full((1, height, width), -torch.inf).triu_(1 + r * height) if causal else None
        slabs.append((slice(r * height, width), width, bias))
    return slabs


def _own_scores(queries: Tensor, keys: Tensor, bias: Tensor | None, padded: Tensor | None) -> Tensor:
    """S = (Q * scale) K^T of a chunk of own-block slabs, -inf where masked. Masks are added (0 / -inf): several
    times cheaper than ``masked_fill_`` with a broadcast boolean mask, and the causal one folds into the product."""
    scores = torch.bmm(queries, keys.mT) if bias is None else torch.baddbmm(bias, queries, keys.mT)
    return scores if padded is None else scores.add_(padded[..., : keys.shape[1]])


def _gated_scores(queries: Tensor, keys: Tensor, batch: GatedBatch, key_bias: Tensor | None, block_size: int):
    """S = (Q * scale) K^T of a batch, -inf on padded keys."""
    scores = torch.bmm(queries, keys.mT)
    bias = block_bias(key_bias, batch, block_size)
    return scores if bias is None else scores.add_(bias[:, None, :])


def _by_block(t: Tensor, block_size: int) -> Tensor:
    """(blocks, B, D) view of the rows of ``t`` ((S, N, D) or (S N, D), contiguous)."""
    return rearrange(t.flatten(0, -2), "(g i) d -> g i d", i=block_size)


def _with_pad_row(t: Tensor, fill: float, scale: float = 1.0) -> Tensor:
    """(S N, ...) rows of ``t`` (times ``scale``) followed by one row of ``fill``, read by padded tile rows."""
    padded = t.new_empty((t.shape[0] * t.shape[1] + 1, *t.shape[2:]))
    torch.mul(t.flatten(0, 1), scale, out=padded[:-1])
    padded[-1] = fill
    return padded


class MobaAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, key_bias, block_size, causal, scale):
        # s: flattened (b h) sequences, n: positions, d: head dim; g: blocks (or sequences of a batch), i, j: rows
        seqs, n, dim = q.shape
        c = block_size
        queries = _with_pad_row(q, 0.0, scale)
        own_q, own_k, own_v = (_by_block(t, c) for t in (queries[:-1], k, v))
        acc = q.new_empty(seqs * n + 1, dim)
        row_max, row_sum = q.new_empty(seqs * n + 1), q.new_empty(seqs * n + 1)
        padded = None if key_bias is None else rearrange(key_bias, "s (g j) -> (s g) 1 j", j=c)
        for part in _own_chunks(seqs * n // c, c, dim, q.device):
            rows = slice(part.start * c, min(part.stop * c, seqs * n))
            maxes, sums, outs = row_max[rows].view(-1, c), row_sum[rows].view(-1, c), acc[rows].view(-1, c, dim)
            for slab, width, bias in _slabs(c, causal, q):
                keys = own_k[part, :width]
                scores = _own_scores(own_q[part, slab], keys, bias, None if padded is None else padded[part])
                top = scores.amax(dim=-1, keepdim=True)
                probs = scores.sub_(top.nan_to_num(neginf=0.0)).exp_()  # a row that sees no key keeps max -inf
                maxes[:, slab], sums[:, slab] = top[..., 0], probs.sum(dim=-1)
                torch.bmm(probs, own_v[part, :width], out=outs[:, slab])
        row_max[-1], row_sum[-1], acc[-1] = float("-inf"), 0.0, 0.0
        blocks_k, blocks_v = (rearrange(t, "s (g j) d -> s g j d", j=c) for t in (k, v))
        for batch in layout:
            width, flat = batch.rows.shape[1], batch.rows.flatten()
            gathered = queries.index_select(0, flat).view(-1, width, dim)
            scores = _gated_scores(gathered, block_keys(blocks_k, batch), batch, key_bias, c)
            old_max = row_max.index_select(0, flat).view(-1, width, 1)
            new_max = torch.maximum(old_max, scores.amax(dim=-1, keepdim=True))
            shift = new_max.nan_to_num(neginf=0.0)
            probs = scores.sub_(shift).exp_()
            rescale = (old_max - shift).exp_()
            total = row_sum.index_select(0, flat).view(-1, width, 1).mul_(rescale).add_(probs.sum(-1, keepdim=True))
            row_sum.scatter_(0, flat, total.flatten())
            # an add of acc * (rescale - 1) + P V: index_add_ is faster than index_copy_ on the CPU
            change = acc.index_select(0, flat).view(-1, width, dim).mul_(rescale.sub_(1.0))
            acc.index_add_(0, flat, change.baddbmm_(probs, block_keys(blocks_v, batch)).flatten(0, 1))
            row_max.scatter_(0, flat, new_max.flatten())
        # in place: a fresh (B H N, D) output would be faulted in page by page
        out = acc[:-1].div_(row_sum[:-1, None].clamp_min(torch.finfo(q.dtype).tiny)).view(seqs, n, dim)
        # +inf on rows that see no key, so that the backward's exp(S - lse) is 0 there
        lse = (row_sum.log_() + row_max).nan_to_num_(neginf=float("inf"))
        ctx.save_for_backward(queries, k, v, out, lse, key_bias)  # the scaled queries, not q: one copy fewer
        ctx.layout, ctx.block_size, ctx.causal, ctx.scale = layout, block_size, causal, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        queries, k, v, out, lse, key_bias = ctx.saved_tensors
        c, scale = ctx.block_size, ctx.scale
        seqs, n, dim = out.shape
        grad_out = grad_out.contiguous()
        grad_rows = _with_pad_row(grad_out, 0.0)
        delta = _with_pad_row((grad_out * out).sum(dim=-1), 0.0)  # rowsum(dO * O)
        grad_q = torch.empty_like(queries)
        grad_k, grad_v = torch.empty_like(k), torch.empty_like(v)
        own_q, own_k, own_v, own_do = (_by_block(t, c) for t in (queries[:-1], k, v, grad_rows[:-1]))
        own_dq, own_dk, own_dv = (_by_block(t, c) for t in (grad_q[:-1], grad_k, grad_v))
        padded = None if key_bias is None else rearrange(key_bias, "s (g j) -> (s g) 1 j", j=c)
        for part in _own_chunks(seqs * n // c, c, dim, out.device):
            rows = slice(part.start * c, min(part.stop * c, seqs * n))
            lses, deltas = lse[rows].view(-1, c, 1), delta[rows].view(-1, c, 1)
            for slab, width, bias in _slabs(c, ctx.causal, out):
                queries_, keys, grads = own_q[part, slab], own_k[part, :width], own_do[part, slab]
                scores = _own_scores(queries_, keys, bias, None if padded is None else padded[part])
                probs = scores.sub_(lses[:, slab]).exp_()
                grad_scores = torch.bmm(grads, own_v[part, :width].mT).sub_(deltas[:, slab]).mul_(probs)
                torch.bmm(grad_scores, keys, out=own_dq[part, slab])
                if width == c:  # the widest slab comes first and sees every key of the block
                    torch.bmm(probs.mT, grads, out=own_dv[part])
                    torch.bmm(grad_scores.mT, queries_, out=own_dk[part])
                else:  # into a strided view, baddbmm_ loops over the blocks one matrix at a time
                    own_dv[part, :width].add_(torch.bmm(probs.mT, grads))
                    own_dk[part, :width].add_(torch.bmm(grad_scores.mT, queries_))
        grad_q[-1] = 0.0
        blocks_k, blocks_v, blocks_dk, blocks_dv = (
            rearrange(t, "s (g j) d -> s g j d", j=c) for t in (k, v, grad_k, grad_v)
        )
        for batch in ctx.layout:
            width, flat = batch.rows.shape[1], batch.rows.flatten()
            gathered = queries.index_select(0, flat).view(-1, width, dim)
            grads = grad_rows.index_select(0, flat).view(-1, width, dim)
            keys, values = block_keys(blocks_k, batch), block_keys(blocks_v, batch)
            scores = _gated_scores(gathered, keys, batch, key_bias, c)
            probs = scores.sub_(lse.index_select(0, flat).view(-1, width, 1)).exp_()
            add_block(blocks_dv, batch, torch.bmm(probs.mT, grads))
            grad_scores = torch.bmm(grads, values.mT).sub_(delta.index_select(0, flat).view(-1, width, 1))
            grad_scores.mul_(probs)
            grad_q.index_add_(0, flat, torch.bmm(grad_scores, keys).flatten(0, 1))
            add_block(blocks_dk, batch, torch.bmm(grad_scores.mT, gathered))
        return grad_q[:-1].mul_(scale).view(seqs, n, dim), grad_k, grad_v, None, None, None, None, None
