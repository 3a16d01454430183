"""cosFormer: ReLU linear attention with a cos-based re-weighting that favours nearby tokens.

Qin et al. 2022, "cosFormer: Rethinking Softmax in Attention", ICLR 2022, arXiv:2202.08791
(https://arxiv.org/abs/2202.08791), Sec. 3. With Q' = ReLU(Q), K' = ReLU(K) and M >= every position:

    s(Q'_i, K'_j) = Q'_i K'_j^T cos(pi/2 * (i - j) / M)
                  = Q_i^cos (K_j^cos)^T + Q_i^sin (K_j^sin)^T,   (cos(a - b) = cos a cos b + sin a sin b)
    Q_i^cos = Q'_i cos(pi i / 2M),  Q_i^sin = Q'_i sin(pi i / 2M),  K_j^cos, K_j^sin likewise
    O_i = sum_j s(Q'_i, K'_j) V_j / sum_j s(Q'_i, K'_j)

so phi(x_i) = [ReLU(x_i) cos(pi i / 2M), ReLU(x_i) sin(pi i / 2M)] (m = 2d features) and the attention is
linear: O_i = (Q_i^cos sum_j K_j^cos^T V_j + Q_i^sin sum_j K_j^sin^T V_j) / (the same with V_j = 1); causal:
sums over j <= i (the paper's causal form, by exact chunked prefix sums here, :mod:`attention_zoo.kernel.attention`).
Every pair a query can see has |i - j| < M, so the re-weighting is in (0, 1] and every term is >= 0.

M and positions (the paper leaves M to the implementation; the authors' code takes M = max(Nq, Nk) of
the call, positions 1..N from the start of both sequences):
- M = ``max_seq_len`` (required), in both modes. A causal output must not depend on how long the whole
  sequence is (the prefix property, and decoding), so M cannot be the current length; taking the same
  M non-causally keeps the two modes' weights identical and makes a sequence's outputs independent of
  how far its batch is padded. Only differences i - j enter, so positions may start anywhere. Cost of
  the choice: for sequences much shorter than max_seq_len the re-weighting is close to 1 (weak locality
  bias); set max_seq_len near the lengths trained on.
- Cross-attention (Nq != Nk): keys at 0..Nk-1; causal queries at i + Nk - Nq (the contract's end alignment,
  as in decoding: query i sees keys j <= i + Nk - Nq); non-causal queries at 0..Nq-1 (from the start of
  both sequences, as the authors' code). Nk <= max_seq_len is checked by the base class; non-causal
  Nq > max_seq_len is refused (the re-weighting would turn negative).
- Padding keeps positions (a hole between two tokens counts as distance); left or right padding changes
  nothing, since only differences count.

A query with no positive feature (all of q <= 0), or no real key with an overlapping positive support,
has a zero denominator and gives zeros; the authors' code clamps the denominator at 1e-6 instead.

Complexity: O(n d^2) time non-causal, O(n c d + n d^2) causal (c = ``chunk_size``); memory O(n (d + c) +
d^2) per head; decoding keeps a 2d x (d + 1) state per head. Non-causal on the CPU, the (n, 2d) feature maps are made
one chunk of positions at a time, in the forward and again in the backward (:class:`ChunkedCosformer`): no (n, 2d)
map exists (allocations that large are mapped fresh and each page faults on first touch), and the backward keeps
q, k, v, the output and O(d^2) sums.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attention_zoo.core import zero_padded
from attention_zoo.kernel.attention import KernelAttention
from attention_zoo.kernel.bidirectional import dense_bidirectional
from attention_zoo.kernel.products import (
    differentiable_backward,
    feature_chunk,
    flat,
    hidden_rows,
    inverse,
    matrix_vector,
    unflat,
)
from attention_zoo.precision import full_precision
from attention_zoo.registry import register_attention


@register_attention("cosformer")
class CosFormerAttention(KernelAttention, requires_max_seq_len=True, position_free_queries=False):
    """Packed rows (``segments``): each document is its own sequence: the sums and the causal prefix state restart
    at each boundary and the re-weighting cos(pi i / 2M) counts i from the document's start. M stays
    ``max_seq_len``, as for a document alone (never a sequence's own length: module docstring), so packing changes
    no weight. Non-causal in one pass over the packed rows, causal by unpacking the documents
    (:meth:`~attention_zoo.kernel.attention.KernelAttention.attend_segments`)."""

    # not position-free: the re-weighting reads each query's index in the call, which a decoder's step-by-step
    # cross-attention cannot give (its one query sits at index 0): cross-attention is for whole-sequence use only
    example_configs = ({"chunk_size": 8}, {"chunk_size": 6})
    notes: ClassVar[str] = (
        "ReLU kernel times cos(pi/2 (i-j)/M) with M = max_seq_len (not the call's length, so causal outputs and "
        "decoding do not depend on the total length); causal by exact chunked prefix sums"
    )

    def attend_segments(self, q: Tensor, k: Tensor, v: Tensor, *, segments: Tensor, key_segments: Tensor,
                        causal: bool) -> Tensor:  # fmt: skip
        if not causal:  # the causal form checks each document in attend
            self.check_query_length(int((segments[:, 1:] - segments[:, :-1]).max()), "query document")
        return super().attend_segments(q, k, v, segments=segments, key_segments=key_segments, causal=causal)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        if not causal:
            self.check_query_length(q.shape[-2], "query length")
        if causal or q.device.type != "cpu":  # an accelerator makes the whole maps in one product
            return super().attend(q, k, v, mask=mask, causal=causal)
        with full_precision(q) as compute:
            if mask is not None and q.shape[-2] == k.shape[-2]:
                q = zero_padded(q, mask)
            weights = [self.position_weights(torch.arange(t.shape[-2], device=q.device), compute) for t in (q, k)]
            hidden = None if mask is None else ~rearrange(mask, "b j -> b 1 j 1")
            chunk = feature_chunk(q, 2 * q.shape[-1])
            x, y, values = q.to(compute), k.to(compute), v.to(compute)
            return ChunkedCosformer.apply(x, y, values, *weights, hidden, chunk).to(q.dtype)

    def check_query_length(self, length: int, what: str) -> None:
        """Non-causal queries sit at 0 .. length - 1: refused past M, where the re-weighting would turn negative."""
        if length > self.max_seq_len:
            raise ValueError(
                f"cosformer: {what} {length} exceeds max_seq_len={self.max_seq_len} (= M of the re-weighting, which "
                "needs every position < M); rebuild it with a larger max_seq_len"
            )

    def features(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
        return reweighted(x, self.position_weights(positions, x.dtype))

    def position_weights(self, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """[cos(pi i / 2M), sin(pi i / 2M)] of each position i, ``(..., N, 2)`` for ``positions`` (..., N)."""
        angle = positions.to(dtype) * (math.pi / (2 * self.max_seq_len))
        return torch.stack([angle.cos(), angle.sin()], dim=-1)


def reweighted(x: Tensor, weights: Tensor) -> Tensor:
    """phi(x_i) = [ReLU(x_i) cos_i, ReLU(x_i) sin_i] (the order of the docstring's phi) for ``x`` (..., N, d) and
    ``weights`` (N, 2) = [cos_i, sin_i]: one broadcast product writes both halves in one pass."""
    return rearrange(F.relu(x).unsqueeze(-2) * weights.unsqueeze(-1), "... n t d -> ... n (t d)")


def reweighted_backward(grad: Tensor, x: Tensor, weights: Tensor) -> Tensor:
    """The gradient of x from that of phi(x): (grad_cos cos_i + grad_sin sin_i) where x > 0."""
    grad = rearrange(grad, "x n (t d) -> x n t d", t=2)
    return torch.linalg.vecdot(grad, weights.unsqueeze(-1), dim=-2).masked_fill_(x <= 0, 0.0)


class ChunkedCosformer(torch.autograd.Function):
    """cosFormer's non-causal output, ``(B, H, Nq, D)``, with the (n, 2d) feature maps made one chunk of positions at a
    time, in forward and backward: S = sum_j phi(K_j) V_j^T and z = sum_j phi(K_j) (2d x D and 2d) are summed chunk by
    chunk, then each chunk of queries is read against them (the equations of :mod:`attention_zoo.kernel.bidirectional`;
    its backward likewise, with each chunk's maps made again from q or k). ``wq``, ``wk``: (N, 2) [cos, sin] of each
    position; ``hidden`` (B, 1, Nk, 1) True at padded keys (or None). With create_graph=True the backward differentiates
    the unchunked product, so second-order gradients are exact."""

    @staticmethod
    def forward(ctx, q, k, v, wq, wk, hidden, chunk: int) -> Tensor:
        # x: batch x heads, f: features (2d), e: value width
        batch, inputs = q.shape[0], (q, k, v)
        q, k, v = (flat(t) for t in inputs)
        keys_hidden = hidden_rows(hidden, q.shape[0] // batch)
        features = 2 * q.shape[-1]
        sums, normaliser = v.new_zeros(q.shape[0], features, v.shape[-1]), v.new_zeros(q.shape[0], features, 1)
        ones = v.new_ones(chunk, 1)
        for j in range(0, k.shape[1], chunk):
            fk = reweighted(k[:, j : j + chunk], wk[j : j + chunk])
            if keys_hidden is not None:
                fk.masked_fill_(keys_hidden[:, j : j + chunk], 0.0)
            torch.baddbmm(sums, fk.transpose(1, 2), v[:, j : j + chunk], out=sums)
            normaliser.add_(matrix_vector(fk.transpose(1, 2), ones[: fk.shape[1]]))
        out, denominator = q.new_empty(q.shape[:2] + v.shape[-1:]), q.new_empty(q.shape[:2] + (1,))
        for i in range(0, q.shape[1], chunk):
            fq = reweighted(q[:, i : i + chunk], wq[i : i + chunk])
            den = torch.bmm(fq, normaliser, out=denominator[:, i : i + chunk])
            none = den <= 0  # False for NaN: a NaN denominator stays NaN
            torch.bmm(fq, sums, out=out[:, i : i + chunk]).div_(den.masked_fill(none, 1.0)).masked_fill_(none, 0.0)
        ctx.save_for_backward(*inputs, wq, wk, hidden, sums, normaliser, out, denominator)
        ctx.chunk, ctx.batch = chunk, batch
        return out.view(*inputs[0].shape[:-1], v.shape[-1])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        *inputs, wq, wk, hidden, sums, normaliser, out, denominator = ctx.saved_tensors
        chunk, needs = ctx.chunk, ctx.needs_input_grad[:3]
        none = (None,) * 4
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward

            def dense(*qkv: Tensor) -> Tensor:
                q, k, v = (flat(t) for t in qkv)
                fk = reweighted(k, wk)
                fk = fk if hidden is None else fk.masked_fill(hidden_rows(hidden, q.shape[0] // ctx.batch), 0.0)
                return unflat(dense_bidirectional(reweighted(q, wq), fk, v), ctx.batch)

            return differentiable_backward(dense, inputs, needs, grad, len(none))
        (q, k, v), grad = (flat(t) for t in inputs), flat(grad)
        hidden = hidden_rows(hidden, q.shape[0] // ctx.batch)
        grad_q, grad_k, grad_v = (
            torch.empty_like(t) if need else None for t, need in zip((q, k, v), needs, strict=True)
        )
        grad_sums, grad_normaliser = torch.zeros_like(sums), torch.zeros_like(normaliser)
        for i in range(0, q.shape[1], chunk):
            fq = reweighted(q[:, i : i + chunk], wq[i : i + chunk])
            # through the normalisation: d out / d numerator = 1 / den, d out / d den = -out / den
            g = grad[:, i : i + chunk] * inverse(denominator[:, i : i + chunk])
            g_den = torch.linalg.vecdot(g, out[:, i : i + chunk]).neg_().unsqueeze(-1)
            torch.baddbmm(grad_sums, fq.transpose(1, 2), g, out=grad_sums)
            grad_normaliser.add_(matrix_vector(fq.transpose(1, 2), g_den))
            if needs[0]:
                grad_fq = torch.bmm(g, sums.transpose(1, 2)).addcmul_(g_den, normaliser.transpose(1, 2))
                grad_q[:, i : i + chunk] = reweighted_backward(grad_fq, q[:, i : i + chunk], wq[i : i + chunk])
        for j in range(0, k.shape[1], chunk):
            if needs[2]:
                fk = reweighted(k[:, j : j + chunk], wk[j : j + chunk])
                if hidden is not None:
                    fk.masked_fill_(hidden[:, j : j + chunk], 0.0)
                torch.bmm(fk, grad_sums, out=grad_v[:, j : j + chunk])
            if needs[1]:
                grad_fk = torch.bmm(v[:, j : j + chunk], grad_sums.transpose(1, 2)).add_(
                    grad_normaliser.transpose(1, 2)
                )
                if hidden is not None:
                    grad_fk.masked_fill_(hidden[:, j : j + chunk], 0.0)
                grad_k[:, j : j + chunk] = reweighted_backward(grad_fk, k[:, j : j + chunk], wk[j : j + chunk])
        return *(unflat(t, ctx.batch) for t in (grad_q, grad_k, grad_v)), *none
