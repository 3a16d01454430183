"""MoBA's attention kernel on the CPU: the own blocks and each key block's gathered queries handed to torch's
flash-attention kernel, the pieces of a query merged by their log-sum-exps (the layout and the gate are those
of :mod:`attention_zoo.moba.layout` and :mod:`attention_zoo.moba.attention`).

Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs", arXiv:2502.13189, Sec. 2: a query
q attends to the union I of its own block and its gated blocks I_i,

    MoBA(q, K, V) = Softmax(q K[I]^T / sqrt(d)) V[I],      I = I_own U (U_{g_i > 0} I_i)

with the causal mask j <= pos(q) inside the own block when causal. torch's CPU flash-attention op returns, for
one block b of a query's keys, the block's normalised output O_b and its log-sum-exp L_b = log sum_{j in b}
exp(q k_j^T / sqrt(d)). Since the blocks of I are disjoint, the attention over I is their merge

    L = log sum_b exp(L_b),      O = sum_b exp(L_b - L) O_b,

kept as a running (O, L) per query: the own blocks in one call (causal when causal), then every key block once,
against all the queries that selected it (batches of :func:`attention_zoo.moba.layout.gated_layout`).

Backward: with the final O and L, each block's share of the gradient is the flash backward of that block
alone: P_b = exp(S_b - L), dS_b = P_b * (dO V_b^T - rowsum(dO * O)), dq += dS_b K_b / sqrt(d),
dK_b = dS_b^T q / sqrt(d), dV_b = P_b^T dO. So the op's backward is called with the final O and L in place of
the block's own, once for the own blocks and once per batch; dq of gathered rows is summed with ``index_add_``.

The flash op's conventions handled here: a row whose keys are all masked comes back with O_b = 0 and L_b = 0,
so such rows (own blocks of padding, fully padded gated blocks, the layout's padded rows) are set to L_b = -inf
before the merge; a row that sees no key at all keeps L = -inf, gets zeros, and L = +inf in the backward, which
makes every P_b (hence its gradients) zero. The layout's padded rows read a real query (their result is
dropped), so no tensor needs a spare row.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor
from torch.autograd.function import once_differentiable

from attention_zoo.masks import SDPA_CPU_NAN_MIN_KEYS
from attention_zoo.moba.layout import GatedBatch, add_block, block_bias, block_keys

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _block_mask(key_bias: Tensor | None, batch: GatedBatch, block_size: int) -> Tensor | None:
    """(G, 1, 1, B) additive mask (0 / -inf) of a batch's key block, or None without padding."""
    bias = block_bias(key_bias, batch, block_size)
    return None if bias is None else bias[:, None, None, :]


def _own_mask(key_bias: Tensor | None, block_size: int) -> Tensor | None:
    """(S N / B, 1, 1, B) additive mask of every own block, or None without padding."""
    return None if key_bias is None else rearrange(key_bias, "s (g j) -> (s g) 1 1 j", j=block_size)


def _rows(batch: GatedBatch, seqs: int, n: int, block_size: int) -> tuple[Tensor, Tensor | None]:
    """(G M,) rows of a batch's queries, its padded rows sent to one query that never selects the batch's key
    block (the first query of that block: its own), so that they read a real query and their exact zero is
    added to (and their unchanged L copied back to) a row outside the batch; and (G M,) True on padded rows."""
    rows = batch.rows.flatten()
    padded = rows == seqs * n
    if not bool(padded.any()):
        return rows, None
    return rows.masked_fill(padded, batch.block * block_size), padded


def _unseen(batch: GatedBatch, padded: Tensor | None, mask: Tensor | None) -> Tensor | None:
    """(G M,) True on a batch's rows that see no key of its block (padded rows, or a fully padded block)."""
    unseen = torch.zeros_like(batch.rows, dtype=torch.bool) if padded is None else padded.view_as(batch.rows)
    if mask is not None:
        unseen = unseen | (mask[:, 0, 0] == -torch.inf).all(dim=-1, keepdim=True)
    unseen = unseen.flatten()
    return unseen if bool(unseen.any()) else None


def _own_unseen(key_bias: Tensor, block_size: int, causal: bool) -> Tensor:
    """(S N,) True on rows that see no key of their own block: every key padded (up to the row when causal)."""
    real = rearrange(key_bias == 0, "s (g j) -> (s g) j", j=block_size)
    sees = real.cummax(dim=-1).values if causal else real.any(dim=-1, keepdim=True).expand_as(real)
    return ~sees.flatten()


class FlashMobaAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, key_bias, block_size, causal, scale):
        # s: flattened (b h) sequences, g: blocks, j: position in a block, d: head dim
        seqs, n, dim = q.shape
        total = seqs * n
        if key_bias is None and block_size < SDPA_CPU_NAN_MIN_KEYS:
            key_bias = q.new_zeros(seqs, n)  # over fewer keys, the op hides a NaN query unless given a mask
        by_block = lambda t: t.view(-1, 1, block_size, dim)
        own_mask = _own_mask(key_bias, block_size)
        out, lse = _flash(by_block(q), by_block(k), by_block(v), 0.0, causal, attn_mask=own_mask, scale=scale)[:2]
        out, lse = out.view(total, dim), lse.view(total)
        if key_bias is not None:
            unseen = _own_unseen(key_bias, block_size, causal)
            out.masked_fill_(unseen[:, None], 0.0)
            lse.masked_fill_(unseen, -torch.inf)
        queries = q.view(total, dim)
        blocks_k, blocks_v = (rearrange(t, "s (g j) d -> s g j d", j=block_size) for t in (k, v))
        for batch in layout:
            rows, padded = _rows(batch, seqs, n, block_size)
            mask = _block_mask(key_bias, batch, block_size)
            gathered = queries.index_select(0, rows).view(*batch.rows.shape, 1, dim).transpose(1, 2)
            keys, values = (block_keys(t, batch)[:, None] for t in (blocks_k, blocks_v))
            piece, piece_lse = _flash(gathered, keys, values, 0.0, False, attn_mask=mask, scale=scale)[:2]
            piece_lse = piece_lse.flatten()
            unseen = _unseen(batch, padded, mask)
            if unseen is not None:
                piece_lse = piece_lse.masked_fill(unseen, -torch.inf)
            old = lse.index_select(0, rows)
            new = torch.logaddexp(old, piece_lse)
            # -inf - -inf: a row that has seen no key yet and sees none here keeps its zeros
            keep = (old - new).exp_().nan_to_num_(nan=1.0)[:, None]
            take = (piece_lse - new).exp_().nan_to_num_(nan=0.0)[:, None]
            # an add of O * (keep - 1) + O_b * take: index_add_ is faster than index_copy_ on the CPU
            change = out.index_select(0, rows).mul_(keep.sub_(1.0)).addcmul_(piece.flatten(0, 2), take)
            out.index_add_(0, rows, change)
            lse.index_copy_(0, rows, new)
        # +inf on rows that see no key, so that the backward's exp(S - L) is 0 there
        lse.masked_fill_(lse == -torch.inf, torch.inf)
        out = out.view(seqs, n, dim)
        ctx.save_for_backward(q, k, v, out, lse, key_bias)
        ctx.layout, ctx.block_size, ctx.causal, ctx.scale = layout, block_size, causal, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, key_bias = ctx.saved_tensors
        block_size, scale = ctx.block_size, ctx.scale
        seqs, n, dim = q.shape
        total = seqs * n
        grad_out = grad_out.contiguous()
        by_block = lambda t: t.view(-1, 1, block_size, dim)
        own_mask = _own_mask(key_bias, block_size)
        grads = _flash_backward(
            by_block(grad_out), by_block(q), by_block(k), by_block(v), by_block(out),
            lse.view(-1, 1, block_size), 0.0, ctx.causal, attn_mask=own_mask, scale=scale,
        )  # fmt: skip
        grad_q, grad_k, grad_v = (t.view(seqs, n, dim) for t in grads)
        rows_of = lambda t: t.view(total, dim)
        blocks_k, blocks_v, blocks_dk, blocks_dv = (
            rearrange(t, "s (g j) d -> s g j d", j=block_size) for t in (k, v, grad_k, grad_v)
        )
        for batch in ctx.layout:
            rows, padded = _rows(batch, seqs, n, block_size)
            mask = _block_mask(key_bias, batch, block_size)
            gathered = [rows_of(t).index_select(0, rows).view(*batch.rows.shape, 1, dim).transpose(1, 2) for t in
                        (grad_out, q, out)]  # fmt: skip
            lses = lse.index_select(0, rows)
            if padded is not None:
                lses.masked_fill_(padded, torch.inf)  # P = 0 on a padded row: it passes no gradient
            keys, values = (block_keys(t, batch)[:, None] for t in (blocks_k, blocks_v))
            grad_rows, grad_keys, grad_values = _flash_backward(
                gathered[0], gathered[1], keys, values, gathered[2], lses.view(*batch.rows.shape, 1).transpose(1, 2),
                0.0, False, attn_mask=mask, scale=scale,
            )  # fmt: skip
            rows_of(grad_q).index_add_(0, rows, grad_rows.flatten(0, 2))
            add_block(blocks_dv, batch, grad_values[:, 0])
            add_block(blocks_dk, batch, grad_keys[:, 0])
        return grad_q, grad_k, grad_v, None, None, None, None, None
