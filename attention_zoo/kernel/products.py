"""The products of the kernelized cores (:mod:`attention_zoo.kernel.attention`), with their backward.

- :func:`causal_scan` and :class:`CausalProduct`: the exact causal product by chunked prefix sums and
  Katharopoulos et al. Sec. 3.3.1's backward (see :mod:`attention_zoo.kernel.attention`).
- :class:`FavorAttention`: Performer's non-causal attention D^-1 (Q' ((K')^T V)) (Choromanski et al. 2021,
  eq. 4) computed from Q, K, V and W, position chunk by position chunk. An (n, m) feature map is m / d times
  the size of q (four times at m = 256, d = 64); the allocator maps such large tensors fresh for every use,
  and each page faults on first touch. Here only one chunk's features exist at a time, in forward and
  backward, where they are recomputed from Q, K and W: the backward keeps Q, K, V, W, the output, its
  denominators, the sums S (m x D) and z (m) and the key reference, all O(n D + m D).
- :func:`normalised`: numerator over denominator, with a backward of few temporaries.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attention_zoo.chunking import chunk_elements
from attention_zoo.core import recomputed_gradients
from attention_zoo.decoding.cache import builds_graph

LOW = -1e30  # log-scale of a padded key: exp(LOW - anything real) = 0, and LOW - LOW = 0 (never NaN)

#: CPU elements of one chunk's feature map (all batches and heads): 2 MiB in float32, within L2 and far below
#: the allocator's fresh-mapping threshold
FEATURE_ELEMENTS = 1 << 19


def feature_chunk(q: Tensor, m: int) -> int:
    """Positions per chunk of :class:`FavorAttention` (and per span of
    :class:`~attention_zoo.kernel.causal_favor.CausalFavor`) for ``q`` (B, H, N, d) and m features."""
    return max(1, chunk_elements(q.device, FEATURE_ELEMENTS) // (q.shape[0] * q.shape[1] * m))


def normalised(sums: Tensor) -> Tensor:
    """Numerator over denominator (the last column); 0 where the denominator is <= 0, with finite gradients.
    A NaN denominator (NaN or inf in q or k) stays NaN: non-finite input must not turn into zeros."""
    return Normalised.apply(sums)


def quotient(sums: Tensor) -> Tensor:
    """:func:`normalised` without a graph: numerator over denominator (the last column), 0 where it is <= 0."""
    none = sums[..., -1:] <= 0  # False for NaN: a NaN denominator stays NaN
    return (sums[..., :-1] / sums[..., -1:].masked_fill(none, 1.0)).masked_fill_(none, 0.0)


def inverse(denominator: Tensor) -> Tensor:
    """1 / denominator, 0 where it is <= 0 (with finite gradients there); NaN stays NaN."""
    some = ~(denominator <= 0)  # not `> 0`: that is False for NaN, which would hide the NaN as a 0
    return torch.where(some, 1.0 / torch.where(some, denominator, 1.0), 0.0)


class Normalised(torch.autograd.Function):
    """:func:`normalised` with a backward that writes the gradient in place, where autograd's of the where /
    divide / slices makes several (n, D)-sized temporaries; differentiable, so double backward stays exact."""

    @staticmethod
    def forward(ctx, sums: Tensor) -> Tensor:
        out = quotient(sums)
        ctx.save_for_backward(sums, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        sums, out = ctx.saved_tensors
        # d out / d numerator = 1 / den, d out / d den = -out / den
        if torch.is_grad_enabled():  # create_graph=True: out= is not differentiable
            grad = grad * inverse(sums[..., -1:])
            return torch.cat([grad, (grad * out).sum(dim=-1, keepdim=True).neg_()], dim=-1)
        grad_sums = torch.empty_like(sums)
        grad = torch.mul(grad, inverse(sums[..., -1:]), out=grad_sums[..., :-1])
        grad_sums[..., -1] = torch.linalg.vecdot(grad, out).neg_()
        return grad_sums


def differentiable_backward(dense, inputs: tuple[Tensor, ...], needs: tuple[bool, ...], grad: Tensor, extra: int):
    """A custom backward asked for a graph (create_graph=True): the gradients of ``dense(*inputs)``, the same
    product by autograd-visible operations, for the ``inputs`` that ``needs`` marks, then ``extra`` Nones (the other
    inputs). :func:`~attention_zoo.core.recomputed_gradients`: one tensor may be passed as several inputs."""
    return (*recomputed_gradients(dense, inputs, needs, grad), *(None,) * extra)


def flat(t: Tensor) -> Tensor:
    return rearrange(t, "b h n e -> (b h) n e")


def unflat(t: Tensor | None, batch: int) -> Tensor | None:
    """The inverse of :func:`flat` for ``batch`` batch entries; None stays None (an input that needs no gradient)."""
    return None if t is None else rearrange(t, "(b h) n e -> b h n e", b=batch)


def hidden_rows(hidden: Tensor | None, heads: int) -> Tensor | None:
    """Padded keys ``hidden`` (B, 1, Nk, 1) as (B H, Nk, 1), the rows of :func:`flat` tensors."""
    return None if hidden is None else rearrange(hidden.expand(-1, heads, -1, -1), "b h j 1 -> (b h) j 1")


def matrix_vector(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for ``a`` (X, r, c) and ``b`` (X, c, 1) or (c, 1). On CPU one ``torch.mm`` per batch entry: a
    single-column ``torch.bmm`` there takes about as long as a full (r, c) x (c, c) product."""
    if a.device.type != "cpu":
        return a @ b
    out = a.new_empty(a.shape[0], a.shape[1], 1)
    for x in range(a.shape[0]):
        torch.mm(a[x], b if b.dim() == 2 else b[x], out=out[x])
    return out


def finite_or_zero(t: Tensor) -> Tensor:
    return torch.where(torch.isfinite(t), t, 0.0)


def query_features(q: Tensor, w: Tensor, relu: bool) -> Tensor:
    """phi(x) of queries ``q`` (X, c, d) for x = s q and ``w`` = s W^T (X, d, m), up to a positive factor per
    query that cancels in D^-1 A: relu(W x), or exp(W x - max_l w_l^T x) (the row maximum: largest feature 1)."""
    p = torch.bmm(q, w)
    return p.relu_() if relu else p.sub_(p.amax(dim=-1, keepdim=True)).exp_()


def key_features(k: Tensor, w: Tensor, s: float, relu: bool, hidden: Tensor | None, reference: Tensor | None):
    """phi(y) of keys ``k`` (X, c, d), y = s k, up to one factor per (batch, head): relu(W y), or
    exp(W y - |y|^2 / 2 - reference); 0 where ``hidden`` (X, c, 1) (padded keys). ``reference`` (X, 1, 1)
    None: log phi(y) (-inf where hidden)."""
    p = torch.bmm(k, w)
    if relu:
        return p.relu_() if hidden is None else p.relu_().masked_fill_(hidden, 0.0)
    p.sub_((k * k).sum(dim=-1, keepdim=True), alpha=s * s / 2)
    if hidden is not None:
        p.masked_fill_(hidden, -math.inf)
    return p if reference is None else p.sub_(reference).exp_()


def dense_favor(q, k, v, w, s: float, hidden, relu: bool, reference: Tensor | None) -> Tensor:
    """:class:`FavorAttention` with autograd, unchunked: what its backward differentiates when asked for a graph."""
    pq, pk = q @ w, k @ w
    if relu:
        fq, fk = pq.relu(), pk.relu()
    else:
        fq = torch.exp(pq - pq.detach().amax(dim=-1, keepdim=True))
        fk = torch.exp(pk - s * s / 2 * (k * k).sum(dim=-1, keepdim=True) - reference)
    if hidden is not None:
        fk = fk.masked_fill(hidden, 0.0)
    return normalised(fq @ (fk.transpose(-1, -2) @ F.pad(v, (0, 1), value=1.0)))


def causal_scan(
    a: Tensor,
    b: Tensor,
    c: Tensor,
    scale: Tensor | None,
    rows: Tensor | None,
    chunk: int,
    state: Tensor | None = None,
    reference: Tensor | None = None,
    *,
    reverse: bool = False,
    scores: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """out_i = rows_i sum_{j <= i} exp(scale_j - sigma_i) (a_i . b_j) c_j with sigma_i = max_{j <= i} scale_j,
    for ``a, b: (B, H, L, r)``, ``c: (B, H, L, e)``, ``scale, rows: (B, H, L)`` (None: all 1), L a multiple
    of ``chunk``; ``reverse``: the anti-causal sums over j >= i (sigma_i = max_{j >= i} scale_j), scanned from
    the end, so that no sequence is ever flipped. The blocks inside the chunks are computed for all chunks at
    once; the earlier chunks reach a chunk through one carried state, sum_j exp(scale_j - sigma_end) b_j c_j^T,
    updated chunk by chunk. ``state`` (B, H, r, e) and its ``reference`` sigma (B, H, 1) continue a previous
    scan (decoding). ``scores``: the in-chunk blocks of :func:`chunk_scores` when the caller has them (only
    without ``scale``); the backward's two scans of one pair share them, one as the other's transpose.
    Returns the outputs and the final state and reference."""
    # x: batch x heads, g: chunk, i / j: query / key position in a chunk
    (batch, heads, n, r), e = a.shape, c.shape[-1]
    a, b, c = (chunked(t, chunk) for t in (a, b, c))
    order = range(n // chunk - 1, -1, -1) if reverse else range(n // chunk)
    state = a.new_zeros(batch * heads, r, e) if state is None else rearrange(state, "b h r e -> (b h) r e")
    if scores is not None and scale is not None:
        raise ValueError("causal_scan takes precomputed scores only without scale")
    if scale is None:
        keys, carried_factor, decay = b, None, None
        if scores is None:
            scores = masked_blocks(a @ b.transpose(-1, -2), reverse)
    else:
        scores = a @ b.transpose(-1, -2)  # (x, g, i, j)
        start = a.new_full((batch * heads, 1), LOW) if reference is None else rearrange(reference, "b h 1 -> (b h) 1")
        scale = chunked(scale, chunk).flatten(1)
        level = scale.flip(-1).cummax(dim=-1).values.flip(-1) if reverse else scale.cummax(dim=-1).values
        level = torch.maximum(level, start)
        level, scale = rearrange(level, "x (g i) -> x g i", i=chunk), rearrange(scale, "x (g i) -> x g i", i=chunk)
        hidden = torch.ones(chunk, chunk, dtype=torch.bool, device=a.device)
        hidden = hidden.tril_(-1) if reverse else hidden.triu_(1)
        scores.mul_(torch.exp((scale.unsqueeze(-2) - level.unsqueeze(-1)).masked_fill_(hidden, -math.inf)))
        # sigma after each chunk (the reference of the state it leaves) and before it (of the state it gets)
        end = level[..., 0] if reverse else level[..., -1]
        before = torch.cat([end[:, 1:], start], dim=-1) if reverse else torch.cat([start, end[:, :-1]], dim=-1)
        keys = b * torch.exp(scale - end.unsqueeze(-1)).unsqueeze(-1)
        carried_factor, decay = torch.exp(before.unsqueeze(-1) - level).unsqueeze(-1), torch.exp(before - end)
    out = scores @ c
    # in place into the outputs where no graph is recorded (a double backward differentiates this scan)
    graph = builds_graph(a, b, c, state)
    carried = {} if graph else out.new_empty(batch * heads, chunk, e)
    for g in order:
        # the factor is one per query row: it scales the (c, e) product, not the (c, r) block of a
        if graph:
            product = torch.bmm(a[:, g], state)
            carried[g] = product if carried_factor is None else product * carried_factor[:, g]
        else:  # a chunk of out has a batch stride of n e: a product into it would loop over the batch
            product = torch.bmm(a[:, g], state, out=carried)
            if carried_factor is None:
                out[:, g].add_(product)
            else:
                out[:, g].addcmul_(product, carried_factor[:, g])
        if decay is not None:
            state = state * decay[:, g, None, None]
        state = torch.baddbmm(state, keys[:, g].transpose(1, 2), c[:, g])
    if graph:
        out = out + torch.stack([carried[g] for g in range(n // chunk)], dim=1)
    if rows is not None:
        rows = chunked(rows, chunk).unsqueeze(-1)
        out = out * rows if graph else out.mul_(rows)
    end_reference = None if scale is None else rearrange(end[:, order[-1], None], "(b h) 1 -> b h 1", b=batch)
    return unchunked(out, batch), rearrange(state, "(b h) r e -> b h r e", b=batch), end_reference


def chunked(t: Tensor, chunk: int) -> Tensor:
    """``t`` (B, H, L, ...) as (B H, L / chunk, chunk, ...): the chunks of each sequence."""
    return rearrange(t, "b h (g i) ... -> (b h) g i ...", i=chunk)


def unchunked(t: Tensor, batch: int) -> Tensor:
    """The inverse of :func:`chunked` for (B H, L / chunk, chunk, e)."""
    return rearrange(t, "(b h) g i e -> b h (g i) e", b=batch)


def masked_blocks(scores: Tensor, reverse: bool) -> Tensor:
    """The in-chunk blocks (x, g, i, j) with the pairs j > i (j < i when ``reverse``) zeroed, in place."""
    return scores.triu_() if reverse else scores.tril_()


def chunk_scores(a: Tensor, b: Tensor, chunk: int) -> Tensor:
    """tril(a_g b_g^T) for every chunk g of ``a, b`` (B, H, L, r), ``(B H, L / chunk, chunk, chunk)``: the
    blocks :func:`causal_scan` computes first; transposed, the blocks of the reverse scan of (b, a)."""
    return masked_blocks(chunked(a, chunk) @ chunked(b, chunk).transpose(-1, -2), reverse=False)


def anticausal_pair(
    values: Tensor, grad: Tensor, fq: Tensor, fk: Tensor, chunk: int, shared: Tensor, forward_scores: Tensor
) -> tuple[Tensor, Tensor]:
    """grad phi(K)_j = sum_{i >= j} ([V 1]_j . G_i) phi(Q)_i and grad [V 1]_j = sum_{i >= j} (phi(K)_j . phi(Q)_i)
    G_i in one reverse scan: both carry the same state, sum_i G_i phi(Q)_i^T over the later chunks (one the
    other's transpose), so it is updated once per chunk. ``shared`` = :func:`chunk_scores` (G, [V 1]) and
    ``forward_scores`` = :func:`chunk_scores` (phi(Q), phi(K)): transposed, the in-chunk blocks of the two. No
    graph is recorded (the caller's double backward takes two :func:`causal_scan` instead)."""
    batch = values.shape[0]
    values, grad, fq, fk = (chunked(t, chunk) for t in (values, grad, fq, fk))
    grad_fk, grad_values = shared.transpose(-1, -2) @ fq, forward_scores.transpose(-1, -2) @ grad
    state = grad.new_zeros(grad.shape[0], grad.shape[-1], fq.shape[-1])  # (x, e, r)
    carried_fk, carried_values = grad_fk.new_empty(grad_fk[:, 0].shape), grad_values.new_empty(grad_values[:, 0].shape)
    for g in range(values.shape[1] - 1, -1, -1):
        grad_fk[:, g].add_(torch.bmm(values[:, g], state, out=carried_fk))
        grad_values[:, g].add_(torch.bmm(fk[:, g], state.transpose(1, 2), out=carried_values))
        state = torch.baddbmm(state, grad[:, g].transpose(1, 2), fq[:, g])
    return unchunked(grad_fk, batch), unchunked(grad_values, batch)


class CausalProduct(torch.autograd.Function):
    """``causal_scan(fq, fk, values, scale, None, chunk)`` with Katharopoulos Sec. 3.3.1's backward
    (:mod:`attention_zoo.kernel.attention`): the gradients are themselves causal products, grad phi(Q) =
    causal(G, [V 1], phi(K)), and grad phi(K), grad [V 1] are anti-causal products of ([V 1], G, phi(Q)) and
    (phi(K), phi(Q), G), scanned from the last chunk to the first (no sequence is flipped); the two anti-causal
    ones share their state (sum_i G_i phi(Q_i)^T, one the other's transpose) and their in-chunk blocks. One
    carried state per scan, no per-chunk states kept. ``scale`` gets no gradient
    (the reference it sets cancels). The backward is itself made of causal scans, so with create_graph=True
    autograd differentiates it again: second-order gradients are exact. Without ``scale``, the forward's
    in-chunk blocks (n c numbers per head) are kept for the backward, and grad phi(K) and grad [V 1] share one
    reverse scan (:func:`anticausal_pair`)."""

    @staticmethod
    def forward(ctx, fq: Tensor, fk: Tensor, values: Tensor, scale: Tensor | None, chunk: int) -> Tensor:
        scores = chunk_scores(fq, fk, chunk) if scale is None else None
        ctx.save_for_backward(fq, fk, values, scale, scores)
        ctx.chunk = chunk
        return causal_scan(fq, fk, values, scale, None, chunk, scores=scores)[0]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        fq, fk, values, scale, scores = ctx.saved_tensors
        chunk, needs = ctx.chunk, ctx.needs_input_grad
        grad = grad.contiguous()
        plain = scale is None
        # grad phi(Q)'s blocks tril(G [V 1]^T) are, transposed, those of grad phi(K)
        shared = chunk_scores(grad, values, chunk) if plain and needs[1] else None
        grad_fq = causal_scan(grad, values, fk, scale, None, chunk, scores=shared)[0] if needs[0] else None
        if plain and needs[1] and needs[2] and not torch.is_grad_enabled():
            return grad_fq, *anticausal_pair(values, grad, fq, fk, chunk, shared, scores), None, None
        # anti-causal sums over i >= j of exp(scale_j - sigma_i) = exp(scale_j - sigma_j) exp(sigma_j - sigma_i):
        # pairs weighted by "scale" -sigma_i (whose maximum over i >= j is -sigma_j), rows j by exp(scale_j - sigma_j)
        level = None if plain else scale.cummax(dim=-1).values
        back_scale = None if plain else -level
        back_rows = None if plain else torch.exp(scale - level)
        back = lambda a, b, c, blocks=None: causal_scan(
            a, b, c, back_scale, back_rows, chunk, reverse=True, scores=blocks
        )[0]
        grad_fk = back(values, grad, fq, None if shared is None else shared.transpose(-1, -2)) if needs[1] else None
        # with create_graph=True the kept blocks (made without a graph) are recomputed, so they get gradients
        reuse = plain and not torch.is_grad_enabled()
        grad_values = back(fk, fq, grad, scores.transpose(-1, -2) if reuse else None) if needs[2] else None
        return grad_fq, grad_fk, grad_values, None, None


class FavorAttention(torch.autograd.Function):
    """Performer's non-causal output D^-1 (Q' ((K')^T V)), ``(B, H, Nq, D)``, for ``q, k`` (B, H, N, d), ``v``
    (B, H, Nk, D), ``w`` W (m, d), ``s`` = d^-1/4 (x = s q, y = s k), ``hidden`` (B, 1, Nk, 1) True at padded
    keys (or None), ``relu`` the kernel, ``chunk`` positions per chunk. Stabilisers: the query row maximum
    (:func:`query_features`) and, for keys, the maximum of log phi(K) over real keys (the authors' global key
    maximum), kept as a running maximum, with the sums S = sum_j phi(K_j) V_j^T and z = sum_j phi(K_j)
    rescaled by exp(old - new) <= 1 when it grows; NaN in a real key stays NaN. Normalised as
    :func:`normalised`. W gets no gradient (it is drawn, not learned). The backward recomputes each chunk's
    features; with create_graph=True it differentiates :func:`dense_favor` instead, so second-order
    gradients are exact."""

    @staticmethod
    def forward(ctx, q, k, v, w, s: float, hidden, relu: bool, chunk: int) -> Tensor:
        # x: batch x heads, i / j: query / key positions, f: features, e: value width
        shape, (batch, heads) = q.shape[:-1] + v.shape[-1:], q.shape[:2]
        inputs = q, k, v
        q, k, v = (flat(t) for t in inputs)
        w = (w.T * s).expand(q.shape[0], -1, -1)
        hidden = hidden_rows(hidden, heads)
        sums, normaliser = v.new_zeros(q.shape[0], w.shape[-1], v.shape[-1]), v.new_zeros(q.shape[0], w.shape[-1], 1)
        top = v.new_full((q.shape[0], 1, 1), -math.inf)  # running maximum of log phi(K)
        ones = v.new_ones(chunk, 1)
        for j in range(0, k.shape[1], chunk):
            fk = key_features(
                k[:, j : j + chunk], w, s, relu, None if hidden is None else hidden[:, j : j + chunk], None
            )
            if not relu:
                new_top = torch.maximum(top, fk.amax(dim=(-2, -1), keepdim=True))
                reference = finite_or_zero(new_top)
                # a NaN or -inf running maximum leaves the sums as they are: NaN stays NaN, and 0 stays 0
                factor = torch.where(torch.isfinite(top), torch.exp(top - reference), 1.0)
                sums.mul_(factor)
                normaliser.mul_(factor)
                fk, top = fk.sub_(reference).exp_(), new_top
            torch.baddbmm(sums, fk.transpose(1, 2), v[:, j : j + chunk], out=sums)
            # a product with ones rather than a sum: the same work, and the FLOP counter sees phi(K)^T [V 1]
            normaliser.add_(matrix_vector(fk.transpose(1, 2), ones[: fk.shape[1]]))
        out, denominator = q.new_empty(q.shape[:2] + v.shape[-1:]), q.new_empty(q.shape[:2] + (1,))
        for i in range(0, q.shape[1], chunk):
            fq = query_features(q[:, i : i + chunk], w, relu)
            denominator[:, i : i + chunk] = matrix_vector(fq, normaliser)
            out[:, i : i + chunk] = normalised(torch.cat([torch.bmm(fq, sums), denominator[:, i : i + chunk]], -1))
        reference = None if relu else finite_or_zero(top)
        ctx.save_for_backward(*inputs, w, hidden, sums, normaliser, reference, out, denominator)
        ctx.s, ctx.relu, ctx.chunk, ctx.batch = s, relu, chunk, batch
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        *inputs, w, hidden, sums, normaliser, reference, out, denominator = ctx.saved_tensors
        s, relu, chunk, needs = ctx.s, ctx.relu, ctx.chunk, ctx.needs_input_grad[:3]
        none = (None,) * 5
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
            dense = lambda *qkv: unflat(dense_favor(*(flat(t) for t in qkv), w, s, hidden, relu, reference), ctx.batch)
            return differentiable_backward(dense, inputs, needs, grad, len(none))
        (q, k, v), grad = (flat(t) for t in inputs), flat(grad)
        grad_q, grad_k, grad_v = (
            torch.empty_like(t) if need else None for t, need in zip((q, k, v), needs, strict=True)
        )
        grad_sums, grad_normaliser = torch.zeros_like(sums), torch.zeros_like(normaliser)
        for i in range(0, q.shape[1], chunk):
            fq = query_features(q[:, i : i + chunk], w, relu)
            # through normalised: d out / d numerator = 1 / den, d out / d den = -out / den (0 where den <= 0)
            g = grad[:, i : i + chunk] * inverse(denominator[:, i : i + chunk])
            g_den = (g * out[:, i : i + chunk]).sum(dim=-1, keepdim=True).neg_()
            torch.baddbmm(grad_sums, fq.transpose(1, 2), g, out=grad_sums)
            grad_normaliser.add_(matrix_vector(fq.transpose(1, 2), g_den))
            if needs[0]:
                # the normaliser's rank-1 term apart: baddbmm broadcasting its input loops over the batch
                grad_fq = torch.bmm(g, sums.transpose(1, 2)).addcmul_(g_den, normaliser.transpose(1, 2))
                grad_fq = grad_fq.masked_fill_(fq <= 0, 0.0) if relu else grad_fq.mul_(fq)
                torch.bmm(grad_fq, w.transpose(1, 2), out=grad_q[:, i : i + chunk])
        for j in range(0, k.shape[1], chunk):
            part = None if hidden is None else hidden[:, j : j + chunk]
            fk = key_features(k[:, j : j + chunk], w, s, relu, part, reference)
            if needs[2]:
                torch.bmm(fk, grad_sums, out=grad_v[:, j : j + chunk])
            if needs[1]:
                grad_fk = torch.bmm(v[:, j : j + chunk], grad_sums.transpose(1, 2)).add_(
                    grad_normaliser.transpose(1, 2)
                )
                if relu:
                    torch.bmm(grad_fk.masked_fill_(fk <= 0, 0.0), w.transpose(1, 2), out=grad_k[:, j : j + chunk])
                    continue
                grad_fk.mul_(fk)  # d phi / d k = phi (s w - s^2 k): the |y|^2 / 2 of every key
                part = k[:, j : j + chunk] * grad_fk.sum(dim=-1, keepdim=True)
                torch.baddbmm(part, grad_fk, w.transpose(1, 2), alpha=1.0, beta=-s * s, out=grad_k[:, j : j + chunk])
        return *(unflat(t, ctx.batch) for t in (grad_q, grad_k, grad_v)), *none
