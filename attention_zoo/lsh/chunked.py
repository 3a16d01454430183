"""The chunked CPU kernel of Reformer's LSH attention (:mod:`attention_zoo.lsh.attention`): forward and custom backward.

Kitaev, Kaiser, Levskaya 2020, arXiv:2001.04451, eqs. (13)-(16), in blocks of (batch x head rows, one round,
consecutive chunks). Input: per round the sorted order of the tokens and each token's interval [lo_i, hi_i] of
sorted places, its key set A_i^(r) (built by :func:`attention_zoo.lsh.attention.sorted_windows`). With the combined
normaliser z_i = z(i, P_i), eq. (14) is one softmax over the pairs (r, j):

    o_i = sum_r sum_{j in A_i^(r)} P_ij^(r) v_j,   P_ij^(r) = exp(q_i . k_j - log N_ij - z_i)

Those P (n_hashes x n x 2m per row) are kept for backward, which is FlashAttention's:
dS = P * (dO v^T - rowsum(dO * O)). Pairs outside A_i^(r) are set to -MASKED (never added to, so a
non-finite key outside the set cannot reach o_i). A real token whose sets are all empty attends to itself
alone, o_i = exp(s_ii - s_ii) v_i (eq. 16 with m_ii -> inf): v_i, or NaN when its score is not finite;
padded tokens give 0. Block temporaries live in reused buffers (``out=``): on CPU a fresh multi-MB
tensor per block costs page faults comparable to its arithmetic. Blocks hold ``BLOCK_PAIRS`` pairs on the
CPU and the far larger budget of :mod:`attention_zoo.chunking` on an accelerator, where each block costs
the same number of kernel launches whatever its size.
"""

from __future__ import annotations

import math

import torch
from einops import einsum, rearrange
from torch import Tensor

from attention_zoo import chunking

MASKED = 1e20  # pairs outside a key set score -MASKED: far below any real score, far above -finfo.max
# query-key pairs per block on the CPU: 2 MB of float32 scores, the L2 cache of these CPUs (other devices:
# attention_zoo.chunking)
BLOCK_PAIRS = 2**19


class LSHFunction(torch.autograd.Function):
    """``(q, keys, v, order, place, lo, hi, real, m)`` -> o, all per row ``g`` (batch x head); ``keys`` are the
    unit keys k_j = q_j / ||q_j||, ``order``, ``place``, ``lo``, ``hi`` are ``(g, r, n)`` long, ``real``
    ``(g, n)`` bool. Gradients for q, keys and v."""

    @staticmethod
    def forward(ctx, q, keys, v, order, place, lo, hi, real, m: int):  # type: ignore[override]
        # g: rows (batch x head), r: rounds, n: places, c: chunks, i: query in chunk, j: key in window, d: head dim
        rounds, (n_rows, n, dim) = order.shape[1], q.shape
        # interval tests of _outside in float32 (exact below 2^23): per query lo + hi, hi - lo, hi - lo + 2;
        # per key 2 s_j
        query_info = rearrange(torch.stack([lo + hi, hi - lo, hi - lo + 2]).float(), "t g s n -> (g n) (t s)")
        key_info = rearrange((2 * place).float(), "g s n -> (g n) s")
        o_sorted, lse_sorted = q.new_empty(rounds, n_rows, n, dim), q.new_empty(rounds, n_rows, n, 1)
        probs, pool = q.new_empty(n_rows * rounds * n * 2 * m), {}
        blocks, row_max = _blocks(order, m, dim), []
        block_probs = _split(probs, blocks, m)
        for (rows, r, chunks, query, window), p in zip(blocks, block_probs, strict=True):
            places = slice(chunks.start * m, chunks.stop * m)
            k_w, v_w = _take(keys, window, pool, "k"), _take(v, window, pool, "v")
            scores = torch.matmul(_take(q, query, pool, "q"), k_w.mT, out=p)
            scores.masked_fill_(_outside(query_info, key_info, r, query, window, chunks.start == 0, pool), -MASKED)
            row_max.append(scores.amax(dim=-1, keepdim=True))
            total = _exp(scores.sub_(row_max[-1])).sum(dim=-1, keepdim=True).clamp_min_(torch.finfo(q.dtype).tiny)
            o_block = o_sorted[r, rows, places].view(*query.shape, dim)  # contiguous: g = 1 or all chunks
            torch.matmul(scores, v_w, out=o_block).div_(total)
            torch.add(row_max[-1], total.log_(), out=lse_sorted[r, rows, places].view(*query.shape, 1))
        lse_r = rearrange(_unsort(lse_sorted, place), "r g n 1 -> g r n")
        lse = lse_r.logsumexp(dim=1)
        out = einsum((lse_r - lse[:, None]).exp(), _unsort(o_sorted, place), "g r n, r g n d -> g n d")
        for (*_, query, _), p, p_max in zip(blocks, block_probs, row_max, strict=True):
            # P^(r) normalised by z_i (eq. 14) instead of z(i, P_i^(r)) (eq. 15)
            p.mul_(p_max.sub_(_take(lse[..., None], query, pool, "lse")).exp_())
        # empty sets leave lse near -MASKED; a NaN lse (a non-finite score in the set) is not "empty"
        alone = (lse <= -MASKED / 2) & real
        self_score = (q * keys).sum(dim=-1, keepdim=True)
        alone_weight = (self_score - self_score).exp()  # softmax over {i}: 1, or NaN for a non-finite q_i
        out = torch.where(alone[..., None], v * alone_weight, torch.where(real[..., None], out, 0.0))
        ctx.save_for_backward(q, keys, v, order, out, alone, alone_weight, real, probs)
        ctx.m = m
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, keys, v, order, out, alone, alone_weight, real, probs = ctx.saved_tensors
        m, pool = ctx.m, {}
        # contiguous: the loop below adds into a flat view of each gradient, which a strided layout (zeros_like of a
        # permuted input) would turn into a copy, losing the sums
        grad_q, grad_keys = q.new_zeros(q.shape), keys.new_zeros(keys.shape)
        alone_grad = torch.where(alone[..., None], grad_out * alone_weight, 0.0)  # tokens alone with themselves
        grad_v = alone_grad.contiguous()
        grad_out = grad_out * (real & ~alone)[..., None]
        delta = (grad_out * out).sum(-1, keepdim=True)
        blocks = _blocks(order, m, q.shape[-1])
        for (*_, query, window), p in zip(blocks, _split(probs, blocks, m), strict=True):
            q_s, do_s, delta_s = (
                _take(t, query, pool, name) for t, name in ((q, "q"), (grad_out, "do"), (delta, "dl"))
            )
            k_w, v_w = _take(keys, window, pool, "k"), _take(v, window, pool, "v")
            dscores = torch.matmul(do_s, v_w.mT, out=_buffer(pool, "ds", p.shape, p)).sub_(delta_s).mul_(p)
            sorted_grads = (
                (grad_q, query, torch.matmul(dscores, k_w, out=_buffer(pool, "dq", q_s.shape, q_s))),
                (grad_keys, window, torch.matmul(dscores.mT, q_s, out=_buffer(pool, "dk", k_w.shape, k_w))),
                (grad_v, window, torch.matmul(p.mT, do_s, out=_buffer(pool, "dv", v_w.shape, v_w))),
            )
            for grad, index, sorted_grad in sorted_grads:  # index_add_ into a view of grad
                flat_index, flat_grad = (
                    rearrange(index, "g c j -> (g c j)"),
                    rearrange(sorted_grad, "g c j d -> (g c j) d"),
                )
                rearrange(grad, "g n d -> (g n) d").index_add_(0, flat_index, flat_grad)
        return grad_q, grad_keys, grad_v, None, None, None, None, None, None


def _exp(x: Tensor) -> Tensor:
    """In place, exp(x) for -80 <= x <= 0 and exactly 0 where x < -80 (pairs outside a key set sit at -MASKED):
    exp(clamp(x, -80, 0)) - exp(-80) keeps CPU exp out of its underflow path, which is far slower. NaN stays NaN."""
    return x.clamp_(-80.0, 0.0).exp_().sub_(math.exp(-80.0))


def _plan(n_rows: int, n_chunks: int, m: int, dim: int, device: torch.device) -> tuple[list[slice], list[slice]]:
    """Row groups and chunk groups of the blocks of one round, within ``chunk_elements(device, BLOCK_PAIRS)``
    (:mod:`attention_zoo.chunking`), or one chunk of one row; a block of several rows holds all their chunks,
    so that its sorted places are contiguous. A chunk holds 2 m^2 query-key pairs and gathers 2 m d keys and
    as many values: the CPU budget counts the pairs alone, an accelerator's the larger of
    the two, so that the gathers stay within it when d > m (small buckets)."""
    per_chunk = 2 * m * (m if torch.device(device).type == "cpu" else max(m, dim))
    per_block = max(1, chunking.chunk_elements(device, BLOCK_PAIRS) // per_chunk)
    if per_block < n_chunks:
        row_groups = [slice(row, row + 1) for row in range(n_rows)]
        chunk_groups = [slice(c, min(c + per_block, n_chunks)) for c in range(0, n_chunks, per_block)]
    else:
        row_groups = [slice(row, row + per_block // n_chunks) for row in range(0, n_rows, per_block // n_chunks)]
        chunk_groups = [slice(0, n_chunks)]
    return row_groups, chunk_groups


def _blocks(order: Tensor, m: int, dim: int) -> list[tuple[slice, int, slice, Tensor, Tensor]]:
    """The blocks of :func:`_plan`, per round: (rows, round, chunks, and the flat ``(g n)`` indices of the
    block's sorted queries ``(g, c, m)`` and key windows ``(g, c, 2m)``, chunk c - 1 then chunk c; chunk 0
    looks back at itself, masked by :func:`_outside`)."""
    n_rows, rounds, n = order.shape
    offset = rearrange(torch.arange(n_rows, device=order.device) * n, "g -> g 1 1")
    queries = rearrange(order + offset, "g r (c i) -> g r c i", i=m)
    windows = torch.cat([torch.cat([queries[:, :, :1], queries[:, :, :-1]], dim=2), queries], dim=-1)
    row_groups, chunk_groups = _plan(n_rows, n // m, m, dim, order.device)
    return [
        (rows, r, chunks, queries[rows, r, chunks], windows[rows, r, chunks])
        for rows in row_groups
        for r in range(rounds)
        for chunks in chunk_groups
    ]


def _split(probs: Tensor, blocks: list[tuple[slice, int, slice, Tensor, Tensor]], m: int) -> list[Tensor]:
    """One flat buffer -> each block's ``(g, c, m, 2m)`` share of it, in the order of ``blocks``
    (:func:`_blocks`)."""
    shapes = [(*query.shape, 2 * m) for *_, query, _ in blocks]
    return [flat.view(shape) for flat, shape in zip(probs.split([math.prod(s) for s in shapes]), shapes, strict=True)]


def _buffer(pool: dict[str, Tensor], name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A ``shape`` view of the reused buffer ``name`` of ``pool`` (grown when too small)."""
    size = math.prod(shape)
    if name not in pool or pool[name].numel() < size:
        pool[name] = like.new_empty(size)
    return pool[name][:size].view(shape)


def _take(x: Tensor, index: Tensor, pool: dict[str, Tensor], name: str) -> Tensor:
    """Rows of ``(g, n, x)`` at flat ``(g n)`` indices ``(g, c, j)`` -> ``(g, c, j, x)``, in buffer ``name``."""
    taken = _buffer(pool, name, (*index.shape, x.shape[-1]), x)
    flat_taken = rearrange(taken, "g c j x -> (g c j) x")
    torch.index_select(rearrange(x, "g n x -> (g n) x"), 0, rearrange(index, "g c j -> (g c j)"), out=flat_taken)
    return taken


def _unsort(x: Tensor, place: Tensor) -> Tensor:
    """Each round's sorted ``(r, g, n, x)`` -> token order ``(r, g, n, x)``; ``place`` is ``(g, r, n)``."""
    g, r, n = place.shape
    offset = rearrange(torch.arange(r * g, device=x.device) * n, "(r g) -> g r 1", r=r)
    flat = rearrange(place + offset, "g r n -> (r g n)")
    return rearrange(rearrange(x, "r g n x -> (r g n) x").index_select(0, flat), "(r g n) x -> r g n x", r=r, g=g)


def _outside(query_info, key_info, r: int, query: Tensor, window: Tensor, first: bool, pool) -> Tensor:
    """True where j is not in A_i^(r), or is also in some A_i^(s), s < r, over round r's windows ``(g, c, m, 2m)``.
    Eq. (13) weighs each of the N_ij copies of a pair by 1/N_ij; keeping the first copy gives the same o_i with
    n_hashes (n_hashes + 1) / 2 membership tests instead of n_hashes^2. ``first``: the block holds chunk 0."""
    # g: rows, t: (lo + hi, hi - lo, hi - lo + 2), s: rounds, c: chunks, i: query in chunk, j: key in window.
    # j in A_i^(s) <=> lo_i <= s_j <= hi_i <=> |x| <= w with x = 2 s_j - (lo_i + hi_i) and w = hi_i - lo_i, of
    # equal parity: |x| - w is <= 0 inside and >= 2 outside.
    (g, _, m), shape = query.shape, (*query.shape, window.shape[-1])
    per_query = query_info.index_select(0, rearrange(query, "g c i -> (g c i)"))
    centre, width, width_2 = rearrange(per_query, "(g c i) (t s) -> t s g c i 1", g=g, i=m, t=3).unbind(0)
    per_key = key_info.index_select(0, rearrange(window, "g c j -> (g c j)"))
    key_place = rearrange(per_key, "(g c j) s -> s g c 1 j", g=g, j=2 * m).contiguous()
    penalty, gap = _buffer(pool, "penalty", shape, key_info), _buffer(pool, "gap", shape, key_info)
    torch.sub(key_place[r], centre[r], out=penalty).abs_().sub_(width[r])  # <= 0 inside A_i^(r)
    for s in range(r):  # w + 2 - |x| <= 0 outside A_i^(s)
        torch.sub(key_place[s], centre[s], out=gap).abs_()
        torch.maximum(penalty, torch.sub(width_2[s], gap, out=gap), out=penalty)
    torch.diagonal(penalty, offset=m, dim1=-2, dim2=-1).fill_(2.0)  # i = j sits at slot m + i of its window
    if first:
        penalty[:, 0, :, :m] = 2.0  # chunk 0 has no chunk before it
    outside = pool.get("outside")
    if outside is None or outside.numel() < penalty.numel():
        outside = pool["outside"] = torch.empty(penalty.numel(), dtype=torch.bool, device=penalty.device)
    return torch.gt(penalty, 0.0, out=outside[: penalty.numel()].view(shape))
