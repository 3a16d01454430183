"""Reformer's LSH attention: shared-QK attention within hash buckets, chunked after sorting.

Kitaev, Kaiser, Levskaya 2020, "Reformer: The Efficient Transformer", arXiv:2001.04451
(https://arxiv.org/abs/2001.04451), Section 2 and Appendix A, in the paper's notation and equation numbers
(the paper drops the 1/sqrt(d_k) scale "for clarity"; it is applied here):

    k_j = q_j / ||q_j||  (shared-QK, so h(k_j) = h(q_j));  h(x) = argmax([xR; -xR]),  R: d_k x b/2 random
    (4), (6)  P_i^(r) = {j : h^(r)(q_i) = h^(r)(q_j)},  P_i = U_r P_i^(r)
    (5), (11) P~_i^(r) = {j : floor(s_i^(r) / m) - 1 <= floor(s_j^(r) / m) <= floor(s_i^(r) / m)}
    (14)      o_i = sum_r exp(z(i, P_i^(r)) - z(i, P_i)) o_i^(r)
    (15)      o_i^(r) = sum_{j in P~_i^(r)} exp(q_i . k_j - m_ij^(r) - z(i, P_i^(r))) v_j
    (16)      m_ij^(r) = inf if j not in P_i^(r); 1e5 if i = j; log N_ij otherwise; N_ij = |{r' : j in P_i^(r')}|

s_i^(r) is i's place after sorting round r by (bucket, position); m is ``chunk_size``. The keys query i
sums over in round r, A_i^(r), are exactly:

- non-causal: A_i^(r) = P_i^(r) n P~_i^(r) minus i: its bucket, within its chunk and one chunk back, (4) n (11).
- causal: A_i^(r) = {j in P_i^(r) : 0 < s_i - s_j <= m}, the m most recent earlier tokens of i's bucket.
  Why not (11) n {j < i}: floor(s_i / m) counts the tokens hashed into lower buckets, later ones included,
  so a later token can shift the chunk boundaries and move an earlier key in or out of i's chunk (a leak
  of the future). (11) always holds the m places before s_i, plus up to m - 1 more that depend on that
  alignment; A_i keeps the former only. A token's rank inside its bucket depends only on earlier tokens,
  so query i's output depends only on tokens at positions <= i.
- Duplicates: eq. (13) sums each of a pair's N_ij copies with weight 1/N_ij. Here N_ij counts the rounds
  whose A_i^(r') holds j (the sets actually summed) and only the first copy is kept, with weight 1: the same
  o_i, exactly softmax attention over U_r A_i^(r) with every key once, for n_hashes (n_hashes + 1) / 2
  pairwise interval tests instead of n_hashes^2. The paper counts the bucket sets P_i^(r'); the two agree
  under its assumption P_i^(r) in P~_i^(r), otherwise its literal N under-weights keys a chunk cut off.
- Self: a token attends to itself (o_i = v_i) exactly when U_r A_i^(r) is empty, the 1e5 -> inf limit of
  (16) with no constant that overflows half precision.
- Buckets: ``n_buckets``, or ``bucket_size`` (default 64 when neither is given): n_buckets =
  max(2, 2 floor(N' / (2 bucket_size))) with N' the length padded to a multiple of m, so the average bucket
  holds about bucket_size tokens. ``chunk_size`` defaults to bucket_size, else to the paper's
  m = min(N, 2 ceil(N / n_buckets)). ``n_buckets=1`` skips hashing (one bucket): with chunk_size >= N that is full
  shared-QK attention with the self-mask, the reference the tests check the chunking against.
- Rotations R: one per head and round, drawn in float64 from a CPU generator seeded by ``seed``, then cast;
  they depend on (seed, n_buckets) only, never on the batch, dtype or call. The paper redraws them per
  step; fixed rotations keep evaluation reproducible (a new ``seed`` gives new ones).
- Padding: padded tokens (mask False, and the internal padding to a multiple of m) go to a sentinel bucket
  n_buckets that sorts after every real bucket, so real tokens' order, chunks and key sets do not depend
  on padded content; padded outputs are zero. Self-attention only (Nq == Nk): queries and keys share
  buckets. Buckets come from q; the multi-head block passes k = q.

Complexity: time O(B H n_hashes N (2m d + n_buckets d / 2)) plus a sort per round; memory O(B H n_hashes N 2m):
the probabilities of each round's windows, kept for the custom backward (FlashAttention's formulas), while
every other pairwise temporary lives in blocks of BLOCK_PAIRS pairs, reused across blocks.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, repeat
from torch import Tensor

from attention_zoo.core import AttentionCore, BuildContext
from attention_zoo.registry import register_attention

MASKED = 1e20  # masked pairs score below -MASKED: far below any real score, far above -finfo.max
BLOCK_PAIRS = 2**19  # query-key pairs per block: 2 MB of float32 scores, the L2 cache of these CPUs


@register_attention("lsh")
class LSHAttention(AttentionCore):
    supports_cross_attention: ClassVar[bool] = False
    needs_shared_qk: ClassVar[bool] = True
    example_configs = (
        {"n_hashes": 2, "bucket_size": 4},
        {"n_hashes": 3, "n_buckets": 4, "chunk_size": 6, "seed": 1},
    )
    notes = (
        "causal form: each query sees the chunk_size most recent earlier tokens of its own bucket (a subset of "
        "the paper's chunk window that later tokens cannot move); duplicates across rounds counted once"
    )

    def __init__(
        self,
        *,
        dim_head: int,
        heads: int,
        max_seq_len: int | None = None,
        context: BuildContext | None = None,
        n_hashes: int = 4,
        bucket_size: int | None = None,
        n_buckets: int | None = None,
        chunk_size: int | None = None,
        seed: int = 0,
    ) -> None:
        """``n_hashes`` rounds; ``bucket_size`` or ``n_buckets`` (1 or even), not both; see the module docstring."""
        super().__init__(dim_head=dim_head, heads=heads, max_seq_len=max_seq_len, context=context)
        if bucket_size is not None and n_buckets is not None:
            raise ValueError(f"give bucket_size or n_buckets, not both (got {bucket_size} and {n_buckets})")
        if n_buckets is None and bucket_size is None:
            bucket_size = 64
        if n_hashes < 1:
            raise ValueError(f"n_hashes must be >= 1, got {n_hashes}")
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
        if n_buckets is not None and (n_buckets < 1 or (n_buckets > 1 and n_buckets % 2)):
            raise ValueError(f"n_buckets must be 1 or even (argmax over [xR; -xR]), got {n_buckets}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.n_hashes, self.bucket_size, self.n_buckets_option, self.seed = n_hashes, bucket_size, n_buckets, seed
        self.chunk_size = bucket_size if chunk_size is None else chunk_size

    def chunk_and_buckets(self, n: int) -> tuple[int, int]:
        """The chunk length m and bucket count for sequences of length ``n``."""
        m = self.chunk_size or max(1, min(n, 2 * -(-n // self.n_buckets_option)))
        if self.n_buckets_option is not None:
            return m, self.n_buckets_option
        return m, max(2, 2 * ((-(-n // m) * m) // (2 * self.bucket_size)))

    def rotations(self, n_buckets: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """R of Sec. 2, ``(H, n_hashes, d, n_buckets / 2)``: a function of (seed, n_buckets) only."""
        generator = torch.Generator().manual_seed(self.seed)
        shape = (self.heads, self.n_hashes, self.dim_head, n_buckets // 2)
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)

    def buckets(self, q: Tensor, real: Tensor, n_buckets: int) -> Tensor:
        """h^(r)(q_i) = argmax([q_i R; -q_i R]), ``(B, H, n_hashes, N)``; padded tokens get ``n_buckets``."""
        # b: batch, h: heads, r: hash rounds, n: positions, d: head dim, k: half the buckets
        if n_buckets == 1:
            ids = q.new_zeros((*q.shape[:2], self.n_hashes, q.shape[2]), dtype=torch.long)
        else:
            rotated = einsum(q, self.rotations(n_buckets, q.device, q.dtype), "b h n d, h r d k -> b h r n k")
            top, top_id = rotated.max(dim=-1)
            bottom, bottom_id = rotated.min(dim=-1)
            # argmax over [xR; -xR] without building it; a tie goes to the first half, as argmax does
            ids = torch.where(top >= -bottom, top_id, bottom_id + n_buckets // 2)
        return ids.masked_fill(~rearrange(real, "b n -> b 1 1 n"), n_buckets)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        # b: batch, h: heads, n: positions (padded to a multiple of m), d: head dim
        b, h, n, _ = q.shape
        dtype = q.dtype
        m, n_buckets = self.chunk_and_buckets(n)
        pad = -(-n // m) * m - n
        compute = torch.promote_types(q.dtype, torch.float32)
        q, k, v = (F.pad(t.to(compute), (0, 0, 0, pad)) if pad else t.to(compute) for t in (q, k, v))
        real = torch.ones(b, n, dtype=torch.bool, device=q.device) if mask is None else mask
        real = F.pad(real, (0, pad), value=False)
        with torch.no_grad():
            order, place, lo, hi = sorted_windows(self.buckets(q, real, n_buckets), n_buckets, m, causal)
        rows = "b h ... -> (b h) ..."
        inputs = (q * self.scale, F.normalize(k, dim=-1), v, order, place, lo, hi)
        out = _LSHFunction.apply(*(rearrange(t, rows) for t in inputs), repeat(real, "b n -> (b h) n", h=h), m)
        return rearrange(out, "(b h) n d -> b h n d", b=b)[:, :, :n].to(dtype)


def sorted_windows(buckets: Tensor, n_buckets: int, m: int, causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per round, sort by (bucket, position) and give each token i the interval [lo_i, hi_i] of sorted places
    s_j of its key set A_i (module docstring); all ``(..., r, n)`` long: ``order`` (place -> token),
    ``place`` s_i (token -> place), ``lo``, ``hi`` (an empty interval has lo > hi)."""
    n = buckets.shape[-1]
    positions = torch.arange(n, device=buckets.device)
    order = (buckets * n + positions).argsort(dim=-1)
    place = torch.empty_like(order).scatter_(-1, order, positions.expand_as(order))
    counts = torch.zeros((*buckets.shape[:-1], n_buckets + 1), dtype=torch.long, device=buckets.device)
    counts.scatter_add_(-1, buckets, torch.ones_like(buckets))
    start = (counts.cumsum(-1) - counts).gather(-1, buckets)  # first place of each token's bucket
    if causal:
        return order, place, torch.maximum(start, place - m), place - 1
    end = start + counts.gather(-1, buckets)
    chunk = torch.div(place, m, rounding_mode="floor")
    return order, place, torch.maximum(start, (chunk - 1) * m), torch.minimum(end, (chunk + 1) * m) - 1


class _LSHFunction(torch.autograd.Function):
    """Eqs. (13)-(16) in blocks of (batch x head rows, one round, consecutive chunks).

    With the combined normaliser z_i = z(i, P_i), eq. (14) is one softmax over the pairs (r, j): o_i =
    sum_r sum_{j in A_i^(r)} P_ij^(r) v_j with P_ij^(r) = exp(q_i . k_j - log N_ij - z_i). Those P (n_hashes x n x
    2m per row) are kept for backward, which is FlashAttention's: dS = P * (dO v^T - rowsum(dO * O)). A token
    whose sets are all empty attends to itself alone (eq. 16, i = j); padded tokens give 0. ``q`` comes
    pre-scaled by 1/sqrt(d). Block temporaries live in reused buffers (``out=``): on CPU a fresh multi-MB
    tensor per block costs page faults comparable to its arithmetic."""

    @staticmethod
    def forward(ctx, q, keys, v, order, place, lo, hi, real, m: int):  # type: ignore[override]
        # g: rows (batch x head), r: rounds, n: places, c: chunks, i: query in chunk, j: key in window, d: head dim
        rounds, (n_rows, n, dim) = order.shape[1], q.shape
        # interval tests of _mask_penalty in float32 (exact below 2^23): per query lo + hi, hi - lo, hi - lo + 2;
        # per key 2 s_j
        query_info = rearrange(torch.stack([lo + hi, hi - lo, hi - lo + 2]).float(), "t g s n -> (g n) (t s)")
        key_info = rearrange((2 * place).float(), "g s n -> (g n) s")
        o_sorted, lse_sorted = q.new_empty(rounds, n_rows, n, dim), q.new_empty(rounds, n_rows, n, 1)
        probs, pool = q.new_empty(n_rows * rounds * n * 2 * m), {}
        blocks, row_max = _blocks(order, m), []
        for (rows, r, chunks, query, window), p in zip(blocks, _split(probs, order, m), strict=True):
            places = slice(chunks.start * m, chunks.stop * m)
            k_w, v_w = _take(keys, window, pool, "k"), _take(v, window, pool, "v")
            scores = torch.matmul(_take(q, query, pool, "q"), k_w.mT, out=p)
            penalty = _mask_penalty(query_info, key_info, r, query, window, chunks.start == 0, pool)
            row_max.append(scores.add_(penalty, alpha=-MASKED).amax(dim=-1, keepdim=True))
            total = _exp(scores.sub_(row_max[-1])).sum(dim=-1, keepdim=True).clamp_min_(torch.finfo(q.dtype).tiny)
            o_block = o_sorted[r, rows, places].view(*query.shape, dim)  # contiguous: g = 1 or all chunks
            torch.matmul(scores, v_w, out=o_block).div_(total)
            torch.add(row_max[-1], total.log_(), out=lse_sorted[r, rows, places].view(*query.shape, 1))
        lse_r = rearrange(_unsort(lse_sorted, place), "r g n 1 -> g r n")
        lse = lse_r.logsumexp(dim=1)
        out = einsum((lse_r - lse[:, None]).exp(), _unsort(o_sorted, place), "g r n, r g n d -> g n d")
        for (*_, query, _), p, p_max in zip(blocks, _split(probs, order, m), row_max, strict=True):
            # P^(r) normalised by z_i (eq. 14) instead of z(i, P_i^(r)) (eq. 15)
            p.mul_(p_max.sub_(_take(lse[..., None], query, pool, "lse")).exp_())
        attended = (lse > -MASKED / 2) & real
        out = torch.where(attended[..., None], out, v * real[..., None])
        ctx.save_for_backward(q, keys, v, order, out, attended, real, probs)
        ctx.m = m
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, keys, v, order, out, attended, real, probs = ctx.saved_tensors
        m, pool = ctx.m, {}
        grad_q, grad_keys = torch.zeros_like(q), torch.zeros_like(keys)
        grad_v = grad_out * (real & ~attended)[..., None]  # the tokens that attend to themselves alone
        grad_out = grad_out * attended[..., None]
        delta = (grad_out * out).sum(-1, keepdim=True)
        for (*_, query, window), p in zip(_blocks(order, m), _split(probs, order, m), strict=True):
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
    """In place, exp(x) for -80 <= x <= 0 and exactly 0 where x < -80 (masked pairs sit below -MASKED):
    exp(clamp(x, -80, 0)) - exp(-80) keeps CPU exp out of its underflow path, ~50x slower."""
    return x.clamp_(-80.0, 0.0).exp_().sub_(math.exp(-80.0))


def _blocks(order: Tensor, m: int) -> list[tuple[slice, int, slice, Tensor, Tensor]]:
    """Blocks of at most BLOCK_PAIRS query-key pairs (or one chunk of one row): (rows, round, chunks, and the
    flat ``(g n)`` indices of the block's sorted queries ``(g, c, m)`` and key windows ``(g, c, 2m)``, chunk c - 1
    then chunk c; chunk 0 looks back at itself, masked by :func:`_mask_penalty`)."""
    n_rows, rounds, n = order.shape
    n_chunks, per_block = n // m, max(1, BLOCK_PAIRS // (2 * m * m))
    offset = rearrange(torch.arange(n_rows, device=order.device) * n, "g -> g 1 1")
    queries = rearrange(order + offset, "g r (c i) -> g r c i", i=m)
    windows = torch.cat([torch.cat([queries[:, :, :1], queries[:, :, :-1]], dim=2), queries], dim=-1)
    if per_block < n_chunks:
        row_groups = [slice(row, row + 1) for row in range(n_rows)]
        chunk_groups = [slice(c, min(c + per_block, n_chunks)) for c in range(0, n_chunks, per_block)]
    else:
        row_groups = [slice(row, row + per_block // n_chunks) for row in range(0, n_rows, per_block // n_chunks)]
        chunk_groups = [slice(0, n_chunks)]
    return [
        (rows, r, chunks, queries[rows, r, chunks], windows[rows, r, chunks])
        for rows in row_groups
        for r in range(rounds)
        for chunks in chunk_groups
    ]


def _split(probs: Tensor, order: Tensor, m: int) -> list[Tensor]:
    """One flat buffer -> each block's ``(g, c, m, 2m)`` share of it, in :func:`_blocks` order."""
    shapes = [(*query.shape, 2 * m) for *_, query, _ in _blocks(order, m)]
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


def _mask_penalty(query_info, key_info, r: int, query: Tensor, window: Tensor, first: bool, pool) -> Tensor:
    """0 where j is in A_i^(r) and in no A_i^(s), s < r, >= 1 elsewhere, over round r's windows ``(g, c, m, 2m)``.
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
    return penalty.clamp_min_(0.0)
