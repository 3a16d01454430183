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
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from attention_zoo.core import Geometry, zero_padded
from attention_zoo.kernel.attention import KernelAttention
from attention_zoo.kernel.causal_favor import CausalFavor
from attention_zoo.kernel.products import FavorAttention, feature_chunk
from attention_zoo.precision import full_precision
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
    ) -> None:
        """``nb_features`` m; ``kernel`` softmax (FAVOR+) or relu (generalized attention); ``redraw_interval``
        training passes per draw (None: never redraw); ``seed`` (>= 0); ``chunk_size`` c of the causal form."""
        super().__init__(geometry, chunk_size=chunk_size)
        if nb_features < 1:
            raise ValueError(f"nb_features must be >= 1, got {nb_features}")
        if redraw_interval is not None and redraw_interval < 1:
            raise ValueError(f"redraw_interval must be >= 1 or None (never redraw), got {redraw_interval}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.nb_features, self.kernel, self.redraw_interval, self.seed = nb_features, kernel, redraw_interval, seed
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
        if causal:
            return self.causal_attend(q, k, v, mask)
        # non-causal: the features exist one chunk of positions at a time, in forward and backward
        with full_precision(q) as compute:
            if mask is not None and q.shape[-2] == k.shape[-2]:
                q = zero_padded(q, mask)
            w, chunk = self.projection(q.device, compute), feature_chunk(q, self.nb_features)
            hidden = None if mask is None else ~rearrange(mask, "b j -> b 1 j 1")
            x, y, values, relu = q.to(compute), k.to(compute), v.to(compute), self.kernel == "relu"
            return FavorAttention.apply(x, y, values, w, self.dim_head**-0.25, hidden, relu, chunk).to(q.dtype)

    def causal_attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        # the features exist one span of positions at a time, in forward and backward (CausalFavor);
        # query i sits at key position i + nk - nq (the ends aligned), the last chunk is completed with hidden keys
        nq, nk = q.shape[-2], k.shape[-2]
        length = max(nq, nk)
        chunk = min(self.chunk_size, length)
        span = max(1, feature_chunk(q, self.nb_features) // chunk) * chunk
        tail = -(-length // chunk) * chunk - length
        q_front, k_front = length - nq, length - nk
        with full_precision(q) as compute:
            if mask is not None and nq == nk:
                q = zero_padded(q, mask)
            real = torch.ones(k.shape[0], nk, dtype=torch.bool, device=k.device) if mask is None else mask
            keys = F.pad(real, (k_front, tail), value=False)
            hidden = None if bool(keys.all()) else ~rearrange(keys, "b j -> b 1 j 1")
            x, y, values = (
                F.pad(t.to(compute), (0, 0, front, tail)) for t, front in ((q, q_front), (k, k_front), (v, k_front))
            )
            w, relu = self.projection(q.device, compute), self.kernel == "relu"
            out = CausalFavor.apply(x, y, values, w, self.dim_head**-0.25, hidden, relu, chunk, span)
            return out[:, :, q_front : q_front + nq].to(q.dtype)

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
