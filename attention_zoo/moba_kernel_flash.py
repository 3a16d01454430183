"""MoBA's attention kernel on the CPU: the own blocks and each key block's gathered queries handed to torch's
flash-attention kernel, the pieces of a query merged by their log-sum-exps (the layout and the gate are those
of :mod:`attention_zoo.moba_layout` and :mod:`attention_zoo.moba`).

Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs", arXiv:2502.13189, Sec. 2: a query
q attends to the union I of its own block and its gated blocks I_i,

    MoBA(q, K, V) = Softmax(q K[I]^T / sqrt(d)) V[I],      I = I_own U (U_{g_i > 0} I_i)

with the causal mask j <= pos(q) inside the own block when causal. torch's CPU flash-attention op returns, for
one block b of a query's keys, the block's normalised output O_b and its log-sum-exp L_b = log sum_{j in b}
exp(q k_j^T / sqrt(d)). Since the blocks of I are disjoint, the attention over I is their merge

    L = log sum_b exp(L_b),      O = sum_b exp(L_b - L) O_b,

taken against a reference R per query: the own blocks in one call (causal when causal) give O = O_own,
R = L_own, W = 1; then every key block once, against all the queries that selected it (batches of
:func:`attention_zoo.moba_layout.gated_layout`), adds w_b = exp(L_b - R) to W and w_b O_b to O, and at the end
O / W and L = R + log W. A row whose w_b would pass exp(30) first has its R raised to L_b (O and W scaled by
exp(R_old - R_new)), so no sum overflows; the rest never read O back. (FlashAttention-4 rescales its output
likewise only when the running maximum has grown enough to matter; described in "We reverse-engineered Flash
Attention 4", https://modal.com/blog/reverse-engineer-flash-attention-4.)

Backward: with the final O and L, each block's share of the gradient is the flash backward of that block
alone: P_b = exp(S_b - L), dS_b = P_b * (dO V_b^T - rowsum(dO * O)), dq += dS_b K_b / sqrt(d),
dK_b = dS_b^T q / sqrt(d), dV_b = P_b^T dO. So the op's backward is called with the final O and L in place of
the block's own, once for the own blocks and once per batch; dq of gathered rows is summed with ``index_add_``.
Rows are gathered for a group of consecutive batches at once (q forward; q, dO and O backward; a fixed number
of rows, so the gathered copies take bounded memory whatever N).

The flash op's conventions handled here: a row whose keys are all masked comes back with O_b = 0 and L_b = 0,
so such rows (own blocks of padding, fully padded gated blocks, the layout's padded rows) are set to L_b = -inf
before the merge (w_b = 0; an own block that sees nothing starts the row at W = 0 and the lowest finite R); a
row that sees no key at all ends with W = 0, gets zeros, and L = +inf in the backward, which makes every P_b
(hence its gradients) zero. The layout's padded rows read a real query (their result is
dropped), so no tensor needs a spare row.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from einops import rearrange
from torch import Tensor
from torch.autograd.function import once_differentiable

from attention_zoo.masks import SDPA_CPU_NAN_MIN_KEYS
from attention_zoo.moba_layout import GatedBatch, add_block, block_bias, block_keys

#: log-weight exp(L_b - R) above which a row's reference R is raised before its piece is added
_RAISE_ABOVE = 30.0
#: gathered rows held at once: of q forward, of q, dO and O backward (4 MiB each at d = 64 in float32)
_GROUP_ROWS = 1 << 14

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


def _all_rows(
    layout: tuple[GatedBatch, ...], seqs: int, n: int, block_size: int, device: torch.device
) -> tuple[Tensor, list[int], list[Tensor | None]]:
    """The rows of :func:`_rows` of every batch, concatenated; where each batch starts in them (and where the last
    ends); and each batch's padded rows (None without)."""
    rows, padded = zip(*(_rows(batch, seqs, n, block_size) for batch in layout), strict=True) if layout else ((), ())
    starts = [0]
    for part in rows:
        starts.append(starts[-1] + len(part))
    return (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=device)), starts, list(padded)


def _groups(starts: list[int]) -> Iterator[tuple[slice, list[tuple[int, slice]]]]:
    """Runs of consecutive batches holding at most ``_GROUP_ROWS`` rows (or one batch): each run's rows in the
    concatenated rows, and its batches' indices with their rows in the run's."""
    first = 0
    for last in range(1, len(starts)):
        if last == len(starts) - 1 or starts[last + 1] - starts[first] > _GROUP_ROWS:
            base = starts[first]
            yield (
                slice(base, starts[last]),
                [(index, slice(starts[index] - base, starts[index + 1] - base)) for index in range(first, last)],
            )
            first = last


def _pieces(t: Tensor, batch: GatedBatch) -> Tensor:
    """(G, 1, M, ...) view of a batch's rows of ``t`` (G M, ...), the op's layout of a batch's queries."""
    return t.view(*batch.rows.shape, 1, *t.shape[1:]).transpose(1, 2)


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
        out, reference = _flash(by_block(q), by_block(k), by_block(v), 0.0, causal, attn_mask=own_mask, scale=scale)[:2]
        out, reference = out.view(total, dim), reference.view(total)
        weight = torch.ones_like(reference)
        if key_bias is not None:
            unseen = _own_unseen(key_bias, block_size, causal)
            out.masked_fill_(unseen[:, None], 0.0)
            reference.masked_fill_(unseen, torch.finfo(reference.dtype).min)
            weight.masked_fill_(unseen, 0.0)
        all_rows, starts, padded_rows = _all_rows(layout, seqs, n, block_size, q.device)
        queries = q.view(total, dim)
        blocks_k, blocks_v = (rearrange(t, "s (g j) d -> s g j d", j=block_size) for t in (k, v))
        for group, members in _groups(starts):
            group_rows = all_rows[group]
            group_q = queries.index_select(0, group_rows)
            for index, here in members:
                batch, padded, rows = layout[index], padded_rows[index], group_rows[here]
                mask = _block_mask(key_bias, batch, block_size)
                keys, values = (block_keys(t, batch)[:, None] for t in (blocks_k, blocks_v))
                piece, piece_lse = _flash(_pieces(group_q[here], batch), keys, values, 0.0, False, attn_mask=mask,
                                          scale=scale)[:2]  # fmt: skip
                piece_lse = piece_lse.flatten()
                unseen = _unseen(batch, padded, mask)
                if unseen is not None:
                    piece_lse = piece_lse.masked_fill(unseen, -torch.inf)
                row_reference = reference.index_select(0, rows)
                log_weight = piece_lse - row_reference
                if bool((log_weight > _RAISE_ABOVE).any()):
                    raised = torch.maximum(row_reference, piece_lse)
                    factor = (row_reference - raised).exp_()
                    # distinct rows, but for the padded ones, which all read one row and write it back unchanged
                    out.index_copy_(0, rows, out.index_select(0, rows).mul_(factor[:, None]))
                    weight.index_copy_(0, rows, weight.index_select(0, rows).mul_(factor))
                    reference.index_copy_(0, rows, raised)
                    log_weight = piece_lse - raised
                piece_weight = log_weight.exp_()
                out.index_add_(0, rows, piece.flatten(0, 2).mul_(piece_weight[:, None]))
                weight.index_add_(0, rows, piece_weight)
        sees = weight > 0  # a row that sees a key has W >= 1: the piece that set its R adds exp(0)
        out.div_(weight.masked_fill(~sees, 1.0)[:, None])
        # +inf on rows that see no key, so that the backward's exp(S - L) is 0 there
        lse = torch.where(sees, reference + weight.log(), torch.inf)
        out = out.view(seqs, n, dim)
        ctx.save_for_backward(q, k, v, out, lse, key_bias, all_rows)
        ctx.layout, ctx.starts, ctx.padded_rows = layout, starts, padded_rows
        ctx.block_size, ctx.causal, ctx.scale = block_size, causal, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, key_bias, all_rows = ctx.saved_tensors
        layout, block_size, scale = ctx.layout, ctx.block_size, ctx.scale
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
        for group, members in _groups(ctx.starts):
            group_rows = all_rows[group]
            group_grad_out, group_q, group_out = (rows_of(t).index_select(0, group_rows) for t in (grad_out, q, out))
            group_lse = lse.index_select(0, group_rows)
            for index, here in members:
                batch, padded = layout[index], ctx.padded_rows[index]
                if padded is not None:
                    group_lse[here].masked_fill_(padded, torch.inf)  # P = 0 on a padded row: it passes no gradient
                mask = _block_mask(key_bias, batch, block_size)
                keys, values = (block_keys(t, batch)[:, None] for t in (blocks_k, blocks_v))
                grad_rows, grad_keys, grad_values = _flash_backward(
                    *(_pieces(t[here], batch) for t in (group_grad_out, group_q)), keys, values,
                    *(_pieces(t[here], batch) for t in (group_out, group_lse)), 0.0, False, attn_mask=mask, scale=scale,
                )  # fmt: skip
                rows_of(grad_q).index_add_(0, group_rows[here], grad_rows.flatten(0, 2))
                add_block(blocks_dv, batch, grad_values[:, 0])
                add_block(blocks_dk, batch, grad_keys[:, 0])
        return grad_q, grad_k, grad_v, None, None, None, None, None
