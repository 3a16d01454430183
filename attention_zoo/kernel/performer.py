"""Performer: softmax attention estimated with positive orthogonal random features (FAVOR+).

Choromanski et al. 2021, "Rethinking Attention with Performers", ICLR 2021, arXiv:2009.14794
(https://arxiv.org/abs/2009.14794). In the paper's notation (L positions, head width d, m features):

    (1)  Att(Q, K, V) = D^-1 A V,  A = exp(Q K^T / sqrt(d)),  D = diag(A 1_L);   (2) causal: tril(A)
    (4)  Att^(Q, K, V) = D^-1 (Q' ((K')^T V)),  D = diag(Q' ((K')^T 1_L)),  rows of Q', K': phi(q_i), phi(k_j)
    (5)  phi(x) = h(x) / sqrt(m) (f(w_1^T x), ..., f(w_m^T x))
    (7)  Lemma 1: exp(x^T y) = E_{w ~ N(0, I_d)}[exp(w^T x - |x|^2 / 2) exp(w^T y - |y|^2 / 2)]

- ``kernel="softmax"`` (FAVOR+): h(x) = exp(-|x|^2 / 2), f = exp, so phi(x) = exp(W x - |x|^2 / 2) / sqrt(m)
  and E[phi(x)^T phi(y)] = exp(x^T y), an unbiased estimate of each entry of A, with x = q d^-1/4, y = k d^-1/4.
- ``kernel="relu"`` (generalized attention, Sec. 2.2, f = ReLU, h = 1): phi(x) = ReLU(W x) / sqrt(m), a
  different kernel, not an estimate of softmax (the paper's "Performer-RELU" of Sec. 4.4). No kernel_epsilon:
  a query whose features are all 0 gives zeros instead of the mean of V.
- W (m x d): orthogonal random features (Sec. 2.4, App. B.2, R-ORFs; :func:`orthogonal_gaussian_features`),
  drawn from (``seed``, the layer index, the draw number) only: independent of batch, device and dtype.
- ``nb_features`` m, default 256: the paper's default for both kernels (App. A.3, A.4), in line with its
  Theta(d log d) (Sec. 3, App. B.3).
- Redrawing: new features every ``redraw_interval`` training forward passes (Sec. 4.2, Fig. 5; the authors'
  code redraws at every call, the default 1 here); never in eval, and not in activation checkpointing's
  recompute (:meth:`PerformerAttention.attend`). The count of passes is a buffer, so a checkpoint resumes
  with the same features.
- Stabiliser: each query's features are divided by their largest, each key's weighted relative to a reference
  that cancels in D^-1 A: the global key maximum non-causally, as the authors' code; causally, the running
  maximum over the keys a query sees, so nothing about query i depends on later keys
  (:attr:`~attention_zoo.kernel.attention.KernelAttention.log_key_features`; :meth:`PerformerAttention.features`).

Complexity: O(L m d) time (causal chunks add O(L c (m + d))); memory O(L d + m d) per head, causal or not: the
features exist one span of positions at a time and are recomputed in backward
(:class:`~attention_zoo.kernel.products.FavorAttention`, :class:`~attention_zoo.kernel.causal_favor.CausalFavor`).
Decoding keeps an m x (d + 1) state per head: O(m d) per token.

Limits: an estimate, not softmax attention. Its variance grows as exp(|x + y|^2) / m (Lemma 2), so the error
depends on the size of q and k as much as on m: with unit-scale entries of q and k the estimate is no better
than noise at any m, and an untrained model with unit-scale activations is far from softmax; training (and
redrawing) is what the paper relies on.

``impl="compiled"`` (CUDA's default) runs the same function, :func:`performer_attention`, as one torch.compile'd graph.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attention_zoo import compiled
from attention_zoo.core import Geometry, zero_padded
from attention_zoo.kernel.attention import KernelAttention
from attention_zoo.kernel.causal_favor import CausalFavor
from attention_zoo.kernel.products import LOW, FavorAttention, feature_chunk, finite_or_zero, inverse
from attention_zoo.precision import compute_dtype, full_precision
from attention_zoo.registry import register_attention

Kernel = Literal["softmax", "relu"]

DEFAULT_FEATURES = 256  # App. A.3 / A.4
SEED_BASE = 1_000_003  # (seed, layer, draw) -> one generator seed


def orthogonal_gaussian_features(m: int, d: int, generator: torch.Generator) -> Tensor:
    """W (m x d, float64), the authors' R-ORFs with ``ortho_scaling=0``: ceil(m / d) independent d x d blocks with
    orthonormal rows (QR of a Gaussian matrix, signs fixed by diag(R) so the block is Haar-distributed), each row
    scaled by the norm of an independent N(0, I_d) vector, so every w_i is marginally N(0, I_d) (the estimate stays
    unbiased) while the rows of a block are exactly orthogonal (lower variance, Theorem 2)."""
    blocks = []
    for _ in range(-(-m // d)):
        q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
        blocks.append((q * torch.sign(torch.diagonal(r))).T)  # Haar (Mezzadri 2007): fix QR's sign ambiguity
    lengths = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return torch.cat(blocks)[:m] * lengths


@register_attention("performer")
class PerformerAttention(KernelAttention):
    """Packed rows (``segments``): the sums phi(K)^T [V 1] (and the causal prefix state) restart at each document
    boundary, with the layer's one feature draw for every document and each document's keys stabilised against
    its own largest; non-causal in one pass over the packed rows (:meth:`KernelAttention.attend_segments`), causal
    by unpacking the documents (:func:`~attention_zoo.packing.unpacked_attention`)."""

    example_configs = (
        {"nb_features": 16, "chunk_size": 8},
        {"nb_features": 12, "chunk_size": 5, "redraw_interval": 2, "seed": 3},
        {"nb_features": 24, "kernel": "relu", "chunk_size": 8},
    )
    notes: ClassVar[str] = (
        "FAVOR+: unbiased random-feature estimate of softmax (error ~ 1/sqrt(nb_features)); causal by exact chunked "
        "prefix sums with a running-max key stabiliser; features redrawn every redraw_interval training passes"
    )

    def __init__(
        self,
        geometry: Geometry,
        *,
        nb_features: int = DEFAULT_FEATURES,
        kernel: Kernel = "softmax",
        redraw_interval: int | None = 1,
        seed: int = 0,
        chunk_size: int = 32,
        impl: compiled.Impl = "auto",
    ) -> None:
        """``nb_features`` m; ``kernel`` softmax (FAVOR+) or relu (generalized attention); ``redraw_interval``
        training passes per draw (None: never redraw); ``seed`` (>= 0); ``chunk_size`` c of the eager causal form;
        ``impl``: ``"eager"`` (the reference: features one span at a time, hand-written backward, what the CPU
        runs), ``"compiled"`` (the same math as one torch.compile'd function, :func:`performer_attention`, its
        causal chunk chosen by :func:`balanced_chunk`; no second-order gradients), ``"auto"`` (the default:
        compiled on CUDA from ``compiled.AUTO_MIN_LENGTH`` positions on, else eager). The features are drawn
        outside the compiled function."""
        super().__init__(geometry, chunk_size=chunk_size)
        compiled.check_impl(impl)
        if nb_features < 1:
            raise ValueError(f"nb_features must be >= 1, got {nb_features}")
        if redraw_interval is not None and redraw_interval < 1:
            raise ValueError(f"redraw_interval must be >= 1 or None (never redraw), got {redraw_interval}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.nb_features, self.kernel, self.redraw_interval, self.seed = nb_features, kernel, redraw_interval, seed
        self.impl = impl
        self.log_key_features = kernel == "softmax"
        self.register_buffer("training_passes", torch.zeros((), dtype=torch.long))
        self._cache: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}

    def draw(self) -> int:
        """The draw in use: that of the last training pass (0 before any)."""
        if self.redraw_interval is None:
            return 0
        return max(int(self.training_passes) - 1, 0) // self.redraw_interval

    def projection(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """W of the current draw, ``(m, d)``: a function of (seed, layer index, draw) only."""
        key = (self.draw(), device, dtype)
        if key not in self._cache:
            self._cache = {k: w for k, w in self._cache.items() if k[0] == key[0]}
            # drawn in float64 on a CPU generator, then cast: the same W on every device and in every dtype
            seed = (self.seed * SEED_BASE + self.context.layer_index) * SEED_BASE + key[0]
            generator = torch.Generator().manual_seed(seed % 2**64)
            weights = orthogonal_gaussian_features(self.nb_features, self.dim_head, generator)
            self._cache[key] = weights.to(device=device, dtype=dtype)
        return self._cache[key]

    def begin_pass(self) -> None:
        """Counts a training pass (see :meth:`attend`); the packed form calls it too."""
        if self.training and torch._C._current_graph_task_id() == -1:
            self.training_passes += 1  # this pass uses draw (passes - 1) // redraw_interval

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        """Counts a training pass, then attends with the current draw's features. Activation checkpointing runs
        the forward again inside the backward pass to recompute what it did not keep: that is not a training
        pass, so a forward that runs while autograd executes a backward leaves the count alone and uses the
        features of the forward it recomputes (else the gradient would be that of another random map). This holds
        when each forward's backward runs before the next training forward of the same core, as in any ordinary
        loop (gradient accumulation included); a schedule that runs several forwards of one core before their
        backwards (pipeline parallelism) with redrawing would recompute with the latest features."""
        self.begin_pass()
        w, relu = self.projection(q.device, compute_dtype(q.dtype)), self.kernel == "relu"
        if compiled.resolved(self.impl, q) == "eager":
            return performer_attention(q, k, v, w, mask, relu=relu, causal=causal, chunk=self.chunk_size, fused=False)
        # the non-causal form has no chunks: a fixed value keeps one compiled function for every length
        chunk = balanced_chunk(max(q.shape[-2], k.shape[-2]), self.nb_features, v.shape[-1] + 1) if causal else 1
        fused = compiled.compiled(performer_attention, relu=relu, causal=causal, chunk=chunk, fused=True)
        return fused(q, k, v, w, mask)

    def features(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
        """phi(x) up to factors that cancel in D^-1 A. The authors' code subtracts, inside the exponent, the row
        maximum max_l w_l^T x from each query and one global maximum over all keys and features from the keys.
        Here a query's whole exponent w_l^T x - |x|^2 / 2 is shifted by its row maximum, so its largest feature
        is exactly 1; keys are returned as log phi(k) and weighted by the engine relative to a reference
        (:attr:`~attention_zoo.kernel.attention.KernelAttention.log_key_features`), which non-causally is the
        global maximum over real keys and features, as the authors'. The 1 / sqrt(m) of eq. (5) is left out (it
        cancels), and so is the reference's additive ``numerical_stabilizer`` (a small bias): a zero denominator
        gives zeros instead. The references carry no gradient: the output does not depend on them. So float32
        agrees with float64 even where every unstabilised feature underflows."""
        # b: batch, h: heads, n: positions, f: features. Up to factors that cancel in D^-1 A (docstring):
        # 1 / sqrt(m) always, and a query's |x|^2 / 2; each dropped factor is an (n, m) pass saved, and the
        # passes run in place (the product's backward keeps its inputs, not its output): one (n, m) tensor
        scale = self.dim_head**-0.25
        projected = x @ (self.projection(x.device, x.dtype).T * scale)  # w_l^T (x d^-1/4): (b, h, n, f)
        if self.kernel == "relu":
            return projected.relu_()
        if not is_query:  # log phi(k), exponentiated by the engine
            return projected.sub_((0.5 * scale**2) * (x * x).sum(dim=-1, keepdim=True))
        return projected.sub_(projected.detach().amax(dim=-1, keepdim=True)).exp_()


def performer_attention(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, mask: Tensor | None, *, relu: bool, causal: bool, chunk: int,
    fused: bool,
) -> Tensor:  # fmt: skip
    """FAVOR+ (or the ReLU kernel, ``relu``) for q, k, v (B, H, N, D), the features' W ``w`` (m, d) in the compute
    dtype, ``mask`` (B, Nk) or None: the one function of both implementations of :class:`PerformerAttention`.
    ``chunk``: positions per chunk of the causal form. ``fused`` False (``impl="eager"``): the products by
    :class:`~attention_zoo.kernel.products.FavorAttention` and
    :class:`~attention_zoo.kernel.causal_favor.CausalFavor`, which make the features one span of positions at a
    time, in forward and backward; True (``impl="compiled"``, traced whole by torch.compile): by autograd
    expressions that Inductor fuses and differentiates (:func:`fused_favor`, :func:`fused_causal_favor`), and no
    host synchronisation."""
    nq, nk, s = q.shape[-2], k.shape[-2], q.shape[-1] ** -0.25
    with full_precision(q) as compute:
        if mask is not None and nq == nk:
            q = zero_padded(q, mask)
        if not causal:
            hidden = None if mask is None else ~rearrange(mask, "b j -> b 1 j 1")
            x, y, values = q.to(compute), k.to(compute), v.to(compute)
            if fused:
                return fused_favor(x, y, values, w, s, hidden, relu).to(q.dtype)
            return FavorAttention.apply(x, y, values, w, s, hidden, relu, feature_chunk(q, w.shape[0])).to(q.dtype)
        # query i sits at key position i + nk - nq (the ends aligned), the last chunk is completed with hidden keys
        length = max(nq, nk)
        chunk = min(chunk, length)
        tail = -(-length // chunk) * chunk - length
        q_front, k_front = length - nq, length - nk
        real = torch.ones(k.shape[0], nk, dtype=torch.bool, device=k.device) if mask is None else mask
        keys = F.pad(real, (k_front, tail), value=False)
        # fused: whether every key is real only from what is known without asking the device
        every_key = mask is None and k_front == tail == 0 if fused else bool(keys.all())
        hidden = None if every_key else ~rearrange(keys, "b j -> b 1 j 1")
        x, y, values = (
            F.pad(t.to(compute), (0, 0, front, tail)) for t, front in ((q, q_front), (k, k_front), (v, k_front))
        )
        if fused:
            out = fused_causal_favor(x, y, values, w, s, hidden, relu, chunk)
        else:
            span = max(1, feature_chunk(q, w.shape[0]) // chunk) * chunk
            out = CausalFavor.apply(x, y, values, w, s, hidden, relu, chunk, span)
        return out[:, :, q_front : q_front + nq].to(q.dtype)


def balanced_chunk(length: int, features: int, width: int) -> int:
    """Positions per chunk of :func:`fused_causal_favor` for sequences of ``length``, m = ``features`` and values of
    ``width`` (D + 1): per head its in-chunk blocks cost about 2 n c (m + e) and its carried states 2 (n / c)^2 m e,
    least at c^3 = 2 n m e / (m + e); the power of two nearest that."""
    return 2 ** max(0, round(math.log2(2 * length * features * width / (features + width)) / 3))


def fused_features(
    q: Tensor, k: Tensor, w: Tensor, s: float, hidden: Tensor | None, relu: bool
) -> tuple[Tensor, Tensor]:
    """phi(Q) and phi(K) (B, H, N, m) of every position for x = s q, y = s k, as
    :func:`~attention_zoo.kernel.products.query_features` and :func:`~attention_zoo.kernel.products.key_features`
    make them: queries relu(W x) or exp(W x - max_l w_l^T x); keys relu(W y) (0 where ``hidden``) or, for the
    softmax kernel, log phi(y) = W y - |y|^2 / 2 (-inf where ``hidden``), to be weighted against a reference."""
    w = w.T * s
    pq, pk = q @ w, k @ w
    if relu:
        fk = pk.relu()
        return pq.relu(), fk if hidden is None else fk.masked_fill(hidden, 0.0)
    log_fk = pk - (s * s / 2) * (k * k).sum(dim=-1, keepdim=True)
    fq = torch.exp(pq - pq.detach().amax(dim=-1, keepdim=True))
    return fq, log_fk if hidden is None else log_fk.masked_fill(hidden, -math.inf)


def ratio(sums: Tensor) -> Tensor:
    """:func:`~attention_zoo.kernel.products.normalised` by autograd expressions: numerator over denominator (the
    last column), 0 where it is <= 0 with finite gradients."""
    return sums[..., :-1] * inverse(sums[..., -1:])


def fused_favor(q: Tensor, k: Tensor, v: Tensor, w: Tensor, s: float, hidden: Tensor | None, relu: bool) -> Tensor:
    """:class:`~attention_zoo.kernel.products.FavorAttention`'s output by autograd expressions: the feature maps of
    every position at once, the keys' exponential relative to the largest log feature of any real key (the
    authors' global key maximum)."""
    fq, fk = fused_features(q, k, w, s, hidden, relu)
    if not relu:
        fk = torch.exp(fk - finite_or_zero(fk.detach().amax(dim=(-2, -1), keepdim=True)))
    return ratio(fq @ (fk.transpose(-1, -2) @ F.pad(v, (0, 1), value=1.0)))


def fused_causal_favor(
    q: Tensor, k: Tensor, values: Tensor, w: Tensor, s: float, hidden: Tensor | None, relu: bool, chunk: int
) -> Tensor:
    """:class:`~attention_zoo.kernel.causal_favor.CausalFavor`'s output by autograd expressions, with no loop: L a
    multiple of ``chunk``. Query i's terms are weighted exp(kappa_j - sigma_i) (each key's own log-scale kappa_j,
    sigma_i the running maximum). Inside a chunk the blocks tril(phi(Q) phi(K)^T) [V 1] of all chunks at once; the
    earlier chunks reach chunk g through the state sum_{p < g} exp(end_p - end_{g - 1}) T_p, with T_p chunk p's
    sum phi(K_j) [V 1]_j^T relative to the running maximum end_p at its end: one (g x g) product over the chunks
    instead of the eager scan's loop, every factor <= 1 (end is non-decreasing)."""
    # b: batch, h: heads, g / p: chunks, i / j: query / key positions in a chunk, f: features, e: value width + 1
    fq, fk = fused_features(q, k, w, s, hidden, relu)
    chunks = q.shape[-2] // chunk
    inside = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    earlier = torch.ones(chunks, chunks, dtype=torch.bool, device=q.device).tril(-1)
    values = F.pad(values, (0, 1), value=1.0)
    fq, values = (rearrange(t, "b h (g i) e -> b h g i e", i=chunk) for t in (fq, values))
    if relu:
        fk = rearrange(fk, "b h (g j) f -> b h g j f", j=chunk)
        blocks = (fq @ fk.transpose(-1, -2)).masked_fill(~inside, 0.0)
        weights, rows = earlier.to(fq.dtype), None
    else:
        kappa = fk.detach().amax(dim=-1)
        kappa = torch.where(torch.isfinite(kappa), kappa, LOW)
        fk = torch.exp(fk - kappa.unsqueeze(-1))
        level = rearrange(kappa.cummax(dim=-1).values, "b h (g i) -> b h g i", i=chunk)  # sigma_i
        kappa = rearrange(kappa, "b h (g j) -> b h g j", j=chunk)
        end = level[..., -1]
        before = F.pad(end[..., :-1], (1, 0), value=LOW)  # the reference of the state chunk g gets
        pairs = (kappa.unsqueeze(-2) - level.unsqueeze(-1)).masked_fill(~inside, -math.inf)
        fk = rearrange(fk, "b h (g j) f -> b h g j f", j=chunk)
        blocks = (fq @ fk.transpose(-1, -2)) * torch.exp(pairs)
        fk = fk * torch.exp(kappa - end.unsqueeze(-1)).unsqueeze(-1)  # relative to its chunk's end
        weights = torch.exp((end.unsqueeze(-2) - before.unsqueeze(-1)).masked_fill(~earlier, -math.inf))
        rows = torch.exp(before.unsqueeze(-1) - level).unsqueeze(-1)
    totals = rearrange(fk.transpose(-1, -2) @ values, "b h p f e -> b h p (f e)")
    states = rearrange(weights @ totals, "b h g (f e) -> b h g f e", f=fq.shape[-1])
    carried = fq @ states if rows is None else (fq @ states) * rows
    return ratio(rearrange(blocks @ values + carried, "b h g i e -> b h (g i) e"))
