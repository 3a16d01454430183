"""Nystrom attention: softmax attention through m landmarks and a Moore-Penrose pseudo-inverse.

Xiong et al. 2021, "Nystromformer: A Nystrom-Based Algorithm for Approximating Self-Attention", AAAI 2021,
arXiv:2102.03902 (https://arxiv.org/abs/2102.03902). Notation of the paper's Algorithm 1; the labels (N1)-(N5)
are this file's:

    (N1) landmarks by Segment-means: q~_j = mean of the queries in segment j, k~_j likewise (j = 1..m)
    (N2) F~ = softmax(Q K~^T / sqrt(d_q))  (n x m),  A~ = softmax(Q~ K~^T / sqrt(d_q))  (m x m),
         B~ = softmax(Q~ K^T / sqrt(d_q))  (m x n)
    (N3) S^ V = F~ A~^+ (B~ V)  approximates  softmax(Q K^T / sqrt(d_q)) V
    (N4) A~^+ by the iteration of Razavi et al. 2014 that the paper adopts,
         Z_{j+1} = 1/4 Z_j (13 I - A~ Z_j (15 I - A~ Z_j (7 I - A~ Z_j))),
    (N5) started from Z_0 = A~^T / (||A~||_1 ||A~||_inf).

Complexity O(n m d + m^3) time and O(n m + n d) memory: F~ is n x m, B~ is m x n, A~^+ is m x m, and B~ V
is formed before A~^+ touches it, so nothing n x n ever exists (F~ and B~ a block of heads at a time,
:class:`SoftmaxProduct`). ``pinv="exact"`` replaces (N4)-(N5) with ``torch.linalg.pinv`` (an SVD), the
reference for the iteration.

Choices where the paper is silent (it assumes n divisible by m and no padding):
- Segments over real tokens (:func:`segment_layout`): for n = l m without padding exactly the paper's l-token
  segments; otherwise sizes differ by at most one. Padded tokens take part in no landmark and no softmax, so a
  sequence's output depends neither on its padding nor on the rest of the batch. m > L real tokens: each real
  token is its own landmark, and with m = n and the exact pseudo-inverse the output is full attention exactly.
- The scale of (N5) is per matrix (per batch element and head): the reference code's largest column sum over
  the whole batch makes one sequence's output depend on the others in its batch.
- Precision (:mod:`attention_zoo.precision`): landmark means, A~, its pseudo-inverse and F~ (A~^+ B~ V) run in
  float32 for bf16/fp16 input (float64 for float64), autocast off inside; B~ V runs in the input dtype.
- Not causal: every landmark averages a whole segment, so a query would see its segment's future, and the paper
  has no causal variant. A decoder built from ``nystrom`` alone uses ``full`` (``causal_counterpart``) for its
  causal self-attention. Self-attention only: the padding mask also marks which queries build landmarks, and
  the convolution skip maps V onto the query positions, both of which need Nq == Nk.

Accuracy: the error falls with m and is near round-off only at m = n, where the 6-step iteration stops short
(A~ = S is ill-conditioned). The exact pseudo-inverse is *not* a better approximation: with near-singular A~
(close landmarks) it amplifies the mismatch between F~, A~ and B~, where the truncated iteration acts as a
regularised inverse. ``"exact"`` is a reference, not a setting to train.

``impl="compiled"`` (CUDA's default) runs the same function, :func:`nystrom_attention`, as one torch.compile'd graph.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import Tensor, nn

from attention_zoo import chunking, compiled
from attention_zoo.core import AttentionCore, Geometry, recomputed_gradients
from attention_zoo.masks import masked_softmax
from attention_zoo.precision import full_precision
from attention_zoo.registry import register_attention

#: the iterations of (N4) the paper uses: the default, and what ``pinv="exact"`` leaves unchanged
PAPER_PINV_ITERATIONS = 6
PinvMethod = Literal["iterative", "exact"]


def iterative_pinv(a: Tensor, iterations: int) -> Tensor:
    """Moore-Penrose pseudo-inverse of each ``(..., m, m)`` matrix by (N4), started from (N5).

    ||A||_1 ||A||_inf is taken per matrix, so a matrix gets the same result alone as in a batch. Runs in
    ``a``'s dtype; callers pass float32 or float64.
    """
    norms = torch.linalg.matrix_norm(a, ord=1) * torch.linalg.matrix_norm(a, ord=float("inf"))
    z = a.transpose(-1, -2) / rearrange(norms, "... -> ... 1 1")
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for _ in range(iterations):
        az = a @ z
        z = z @ (3.25 * eye - 0.25 * az @ (15 * eye - az @ (7 * eye - az)))  # the 1/4 moved into the bracket
    return z


def exact_pinv(a: Tensor) -> Tensor:
    """``torch.linalg.pinv`` of each ``(..., m, m)`` matrix; NaN for a matrix holding NaN or inf (the SVD
    refuses those with a raw LinAlgError), so non-finite input gives NaN out, as in every other core."""
    finite = torch.isfinite(a).all(dim=-1, keepdim=True).all(dim=-2, keepdim=True)
    return torch.linalg.pinv(torch.where(finite, a, 0.0)).masked_fill(~finite, float("nan"))


def segment_layout(mask: Tensor | None, n: int, m: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Which landmark segment each position belongs to. Segment j of a sequence with L real tokens holds the real
    tokens of rank r = 0..L-1 (in position order) with floor(r m / L) = j, and its landmark is their plain mean,
    each mean divided by its own count. Padding n up to a multiple of m instead would leave segments empty
    (n = 17, m = 8: segments of 3 leave two of eight empty). With m > L (or no real token) the empty segments
    are left out of F~ and A~ (masked columns, and an identity block in A~ that F~ never reads, so the
    pseudo-inverse of the real block is unchanged).

    Returns ``segment`` (B | 1, n) in 0..m, where m marks a padded token that joins no segment, and
    ``counts`` (B | 1, m), the number of real tokens in each segment.
    """
    real = torch.ones(1, n, dtype=torch.bool, device=device) if mask is None else mask
    rank = real.cumsum(dim=-1) - 1
    length = real.sum(dim=-1, keepdim=True).clamp(min=1)
    segment = torch.where(real, rank * m // length, m)
    counts = torch.zeros(real.shape[0], m + 1, dtype=torch.long, device=device).scatter_add_(1, segment, real.long())
    return segment, counts[:, :m]


# scores per block of heads on the CPU: 2^18 float32 = 1 MiB, so scores, probabilities and their gradient
# stay in L2; other devices take the larger budget of attention_zoo.chunking
BLOCK_ELEMENTS = 1 << 18


def head_blocks(batch: int, heads: int, per_head: int, device: torch.device) -> list[tuple[slice, slice]]:
    """(batch, head) slices with about ``budget / per_head`` heads each, the budget being ``BLOCK_ELEMENTS``
    on the CPU (:func:`attention_zoo.chunking.chunk_elements`): whole batch elements when they fit, else a
    run of heads within one batch element (so every slice of a contiguous tensor is too)."""
    count = max(1, chunking.chunk_elements(device, BLOCK_ELEMENTS) // per_head)
    if count >= heads:
        step = count // heads
        return [(slice(b, b + step), slice(None)) for b in range(0, batch, step)]
    return [(slice(b, b + 1), slice(h, h + count)) for b in range(batch) for h in range(0, heads, count)]


def softmax_product(x: Tensor, y: Tensor, u: Tensor, allowed: Tensor | None) -> Tensor:
    """What :class:`SoftmaxProduct` computes, by autograd-differentiable operations."""
    return masked_softmax(x @ y.transpose(-1, -2), allowed) @ u


class SoftmaxProduct(torch.autograd.Function):
    """``masked_softmax(x y^T, allowed) u`` for ``x: (B, H, r, d)``, ``y: (B, H, c, d)``, ``u: (B, H, c, e)``,
    ``allowed`` broadcastable to ``(B, 1, r, c)``; rows with nothing allowed give zeros.

    Autograd on the same expression batches all heads at once, so every r x c temporary (scores,
    probabilities, their gradients) goes through main memory; here a block of heads at a time keeps them in
    cache (on the CPU; see :func:`head_blocks`), and only the probabilities are kept for backward. A backward
    with create_graph=True (second order) recomputes the product with autograd instead, so that its
    gradient is differentiable again (:func:`~attention_zoo.core.recomputed_gradients`: Nystrom's second
    product takes values computed from its own queries, whose path the caller's graph already counts).
    """

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, u: Tensor, allowed: Tensor | None) -> Tensor:
        (batch, heads, rows, _), cols = x.shape, y.shape[-2]
        probs = x.new_empty(batch, heads, rows, cols)
        out = x.new_empty(batch, heads, rows, u.shape[-1])
        for block in head_blocks(batch, heads, rows * cols, x.device):
            block_allowed = allowed if allowed is None or allowed.shape[0] == 1 else allowed[block[0]]
            probs[block] = masked_softmax(x[block] @ y[block].transpose(-1, -2), block_allowed)
            torch.matmul(probs[block], u[block], out=out[block])
        ctx.save_for_backward(x, y, u, probs, out)
        ctx.allowed = allowed
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, y, u, probs, out = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the probabilities must carry their graph of x and y
            product = partial(softmax_product, allowed=ctx.allowed)
            return (*recomputed_gradients(product, (x, y, u), ctx.needs_input_grad[:3], grad), None)
        dx, dy, du = x.new_empty(x.shape), y.new_empty(y.shape), u.new_empty(u.shape)
        for block in head_blocks(x.shape[0], x.shape[1], probs.shape[-2] * probs.shape[-1], x.device):
            p, g = probs[block], grad[block]
            # softmax backward dS = P (dP - rowsum(dP P)), with rowsum(dP P) = rowsum(grad out)
            d_scores = (g @ u[block].transpose(-1, -2)).sub_((g * out[block]).sum(-1, keepdim=True)).mul_(p)
            torch.matmul(d_scores, y[block], out=dx[block])
            torch.matmul(d_scores.transpose(-1, -2), x[block], out=dy[block])
            torch.matmul(p.transpose(-1, -2), g, out=du[block])
        return dx, dy, du, None


@register_attention("nystrom")
class NystromAttention(
    AttentionCore, approximation="low rank", supports_causal=False, supports_double_backward=True,
    supports_cross_attention=False, supports_segments=True,
):  # fmt: skip
    """Packed rows (``segments``): landmarks are segment means within each document (a document shorter than the
    landmark count uses its own tokens as landmarks, as for a short sequence), so no landmark mixes two documents
    (computed by unpacking the documents, :func:`~attention_zoo.packing.unpacked_attention`)."""

    #: no causal Nystrom exists (see the module doc): decoders use exact full attention instead
    causal_counterpart: ClassVar[str | None] = "full"
    example_configs = (
        {"num_landmarks": 4},
        {"num_landmarks": 8},
        {"num_landmarks": 8, "conv_kernel_size": 3},
        {"num_landmarks": 8, "pinv": "exact"},
    )
    notes: ClassVar[str] = (
        "not causal (landmarks average whole segments; decoders use full); self-attention only; "
        "pinv='exact' is a reference: on near-singular A~ it amplifies errors, the 6-step iteration regularises"
    )

    def __init__(
        self,
        geometry: Geometry,
        *,
        num_landmarks: int = 64,
        pinv_iterations: int = PAPER_PINV_ITERATIONS,
        pinv: PinvMethod = "iterative",
        conv_kernel_size: int | None = None,
        impl: compiled.Impl = "auto",
    ) -> None:
        """``num_landmarks``: m in (N1); ``pinv_iterations``: steps of (N4) (``pinv="iterative"`` only; the
        paper uses 6); ``pinv``: ``"iterative"`` (N4)-(N5) or ``"exact"`` (``torch.linalg.pinv``);
        ``conv_kernel_size``: odd kernel of the paper's depthwise convolution skip on V (kernel 33 in its
        experiments), along the sequence, one filter per head, V's padded tokens zeroed first; None: off;
        ``impl``: ``"eager"`` (the reference: blocked products with a hand-written backward, what the CPU runs),
        ``"compiled"`` (the same math as one torch.compile'd function, :func:`nystrom_attention`; no second-order
        gradients), ``"auto"`` (the default: compiled on CUDA from ``compiled.AUTO_MIN_LENGTH`` positions on, else
        eager)."""
        super().__init__(geometry)
        compiled.check_impl(impl)
        self.bound_by_length("num_landmarks", num_landmarks)
        if pinv_iterations < 1:
            raise ValueError(f"pinv_iterations must be >= 1, got {pinv_iterations}")
        if pinv == "exact" and pinv_iterations != PAPER_PINV_ITERATIONS:
            raise ValueError(
                f"pinv_iterations={pinv_iterations} has no effect with pinv='exact' (torch.linalg.pinv); "
                "drop it, or use pinv='iterative'"
            )
        if conv_kernel_size is not None and (conv_kernel_size < 1 or conv_kernel_size % 2 == 0):
            raise ValueError(
                f"conv_kernel_size must be a positive odd int (the paper uses 33) or None, got {conv_kernel_size}"
            )
        self.num_landmarks = num_landmarks
        self.pinv_iterations = pinv_iterations
        self.pinv = pinv
        self.impl = impl
        self.conv = None
        if conv_kernel_size is not None:
            h = self.heads
            self.conv = nn.Conv2d(h, h, (conv_kernel_size, 1), padding=(conv_kernel_size // 2, 0), groups=h, bias=False)

    @classmethod
    def causal_alternative(cls) -> str:
        return (
            "Its landmarks average whole segments of the sequence, so every query would see later tokens. "
            + super().causal_alternative()
        )

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        weight = None if self.conv is None else self.conv.weight
        options = {"num_landmarks": self.num_landmarks, "pinv_iterations": self.pinv_iterations, "pinv": self.pinv}
        if compiled.resolved(self.impl, q) == "eager":
            return nystrom_attention(q, k, v, mask, weight, **options, fused=False)
        return compiled.compiled(nystrom_attention, **options, fused=True)(q, k, v, mask, weight)

    def landmarks(
        self, q: Tensor, k: Tensor, mask: Tensor | None, work: torch.dtype
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The eager path's :func:`segment_means` of q and k."""
        return segment_means(q, k, mask, self.num_landmarks, work, fused=False)


def nystrom_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, conv_weight: Tensor | None, *, num_landmarks: int,
    pinv_iterations: int, pinv: PinvMethod, fused: bool,
) -> Tensor:  # fmt: skip
    """(N1)-(N5) and the convolution skip (``conv_weight`` (H, 1, kernel, 1), or None) for q, k, v (B, H, N, D) and
    ``mask`` (B, N) or None: the one function of both implementations of :class:`NystromAttention`. ``fused``
    False (``impl="eager"``): the softmax products by :class:`SoftmaxProduct`, and the landmark mask left out when
    every landmark holds a real token; True (``impl="compiled"``, traced whole by torch.compile): the products as
    autograd expressions, which Inductor fuses and differentiates, and no host synchronisation."""
    # b: batch, h: heads, n: positions, i/j: landmarks, d: head dim
    scale = q.shape[-1] ** -0.5
    product = softmax_product if fused else SoftmaxProduct.apply
    with full_precision(q) as work:
        q_land, k_land, present = segment_means(q, k, mask, num_landmarks, work, fused=fused)
        keys = None if mask is None else rearrange(mask, "b n -> b 1 1 n")
        landmarks = None if present is None else rearrange(present, "b j -> b 1 1 j")
        # the 1/sqrt(d) goes on the m x d landmarks, never on an n x d or n x m tensor
        bv = product((q_land * scale).to(q.dtype), k, v, keys)  # B~ V
        a = masked_softmax(einsum(q_land * scale, k_land, "b h i d, b h j d -> b h i j"), landmarks)
        if present is not None:  # empty landmarks: zero rows, and an identity block that F~ never reads
            a = a * rearrange(present, "b i -> b 1 i 1") + torch.diag_embed(rearrange(~present, "b i -> b 1 i"))
        z = iterative_pinv(a, pinv_iterations) if pinv == "iterative" else exact_pinv(a)
        out = product(q.to(work), k_land * scale, z @ bv.to(work), landmarks)  # F~ (A~^+ B~ V)
        out = out.to(q.dtype)
    if conv_weight is not None:
        heads, kernel = conv_weight.shape[0], conv_weight.shape[-2]
        skip = v if mask is None else v * rearrange(mask, "b n -> b 1 n 1")
        out = out + F.conv2d(skip, conv_weight, padding=(kernel // 2, 0), groups=heads)
    return out


def segment_means(
    q: Tensor, k: Tensor, mask: Tensor | None, m: int, work: torch.dtype, *, fused: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Segment means (N1) of q and k, ``(B, H, m, D)`` in ``work`` precision (A~ is ill-conditioned: means
    rounded to bf16 move the output by several times bf16's unit roundoff), and which segments hold a real
    token (``None``: all of them; ``fused``: a tensor whenever there is a mask, since asking whether all are
    occupied is a host synchronisation)."""
    n = q.shape[-2]
    if mask is None and n % m == 0:
        # sum, then divide the small result: einops' "mean" makes autograd write a permuted n x d gradient
        # and copy it again
        means = [rearrange(t, "b h (j l) d -> b h j l d", j=m).sum(3, dtype=work) * (m / n) for t in (q, k)]
        return means[0], means[1], None
    segment, counts = segment_layout(mask, n, m, q.device)
    index = rearrange(segment, "b n -> b 1 n 1").expand(q.shape[0], q.shape[1], n, q.shape[3])
    sizes = rearrange(counts.clamp(min=1), "b j -> b 1 j 1")
    means = [
        t.new_zeros(*t.shape[:2], m + 1, t.shape[3], dtype=work).scatter_add(2, index, t.to(work))[:, :, :m] / sizes
        for t in (q, k)
    ]
    present = counts > 0
    return means[0], means[1], present if fused or not bool(present.all()) else None
