"""Kernelized linear attention: the machinery that ``performer``, ``linear`` and ``cosformer`` share.

Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive Transformers with Linear
Attention", arXiv:2006.16236 (https://arxiv.org/abs/2006.16236), Sec. 3.2-3.3. With a feature map
phi: R^D -> R^m (m features; phi(x)^T phi(y) replaces exp(x^T y / sqrt(D))), query i's output is

    non-causal   V'_i = phi(Q_i)^T sum_j phi(K_j) V_j^T / phi(Q_i)^T sum_j phi(K_j)
    causal       V'_i = phi(Q_i)^T S_i / phi(Q_i)^T Z_i,   S_i = sum_{j<=i} phi(K_j) V_j^T,  Z_i = sum_{j<=i} phi(K_j)

S and Z travel together as one m x (D + 1) state, sum_j phi(K_j) [V_j, 1]^T (the Performer paper's
Algorithm 1 with C = [V 1_L]), so one product gives numerator and denominator.

Causal form, exact, by chunked prefix sums: the positions are cut into chunks of c = ``chunk_size``; inside a
chunk the c x c block tril(phi(Q_g) phi(K_g)^T) [V_g 1] is computed directly (all chunks in one batched
product), and the earlier chunks reach chunk g through one m x (D + 1) state carried from chunk to chunk (the
Performer paper's App. B.3 "non-parallel aggregation"): neither an (n, m, D) tensor of cumulative outer
products nor one state per chunk ever exists. The backward (Sec. 3.3.1) is made of causal and anti-causal
products of the same kind (:class:`~attention_zoo.kernel.products.CausalProduct`); the non-causal form, one
product with its gradients written out, is :mod:`attention_zoo.kernel.bidirectional`.

Cost per (batch, head): time O(n c (m + D) + n m D); memory O(n (m + D + c) + m D) (App. B.3's
O(m d + L d + m L)): the features are kept for backward, the in-chunk blocks live during one product. Performer
keeps no feature map at all (:class:`~attention_zoo.kernel.products.FavorAttention`,
:class:`~attention_zoo.kernel.causal_favor.CausalFavor`).

Conventions of this implementation (the papers leave them open):
- Precision (:mod:`attention_zoo.precision`): features, state and normaliser are float32 for bf16/fp16 inputs
  (float64 for float64), autocast off inside, the output cast back: half-precision sums of n positive terms
  overflow fp16 at a few thousand tokens.
- Padding: padded keys' features are zeroed (phi(0) is not 0 for elu + 1 or exp features), so they join neither
  S nor Z; padded queries are zeroed before their feature map, so NaN or inf there never reaches an output.
- A query whose denominator is 0 (no visible real key, or ReLU features that are all 0) gives zeros.
- Positions (cosFormer's re-weighting uses them): key j is at j; query i at i + Nk - Nq when causal (the
  contract's end alignment), at i otherwise; when decoding, at state.length + t.
- Log-domain key features (:attr:`KernelAttention.log_key_features`, Performer's exponential features): every
  key weight is exp(kappa_j - sigma_i) <= 1 against a reference sigma_i that cancels, so nothing overflows and
  nothing about query i depends on later keys.
- Decoding (:class:`KernelState`): the state and its reference; each step is one chunk of the same scan,
  O(m D) per sequence whatever the length.
- Packed rows (``segments``): sums restart at each boundary (:meth:`KernelAttention.attend_segments`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from torch import Tensor

from attention_zoo.core import AttentionCore, DecodingState, Geometry, zero_padded
from attention_zoo.kernel.bidirectional import bidirectional
from attention_zoo.kernel.products import LOW, CausalProduct, causal_scan, finite_or_zero, normalised
from attention_zoo.packing import gathered, scattered
from attention_zoo.precision import full_precision


class KernelState(DecodingState):
    """``sums``: sum_j phi(K_j) [V_j, 1]^T so far, ``(B, H, m, D + 1)``; ``reference``: for log-domain key
    features, the running maximum ``sums`` is relative to, ``(B, H, 1)``. None before the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: Tensor | None = None
        self.reference: Tensor | None = None


class KernelAttention(
    AttentionCore,
    approximation="kernel",
    has_decoding_cache=True,
    supports_double_backward=True,
    supports_segments=True,
):
    """Base of the kernelized cores: subclasses define :meth:`features` (see the module docstring)."""

    #: :meth:`features` returns log phi(K_j) for keys. Each key is normalised by its own largest feature,
    #: phi(K_j) = exp(kappa_j) phi~(K_j) with kappa_j = max_l log phi(K_j)_l, and exp(kappa_j) is applied relative
    #: to a reference that cancels between numerator and denominator: non-causal, the maximum of kappa over real
    #: keys (the authors' global key maximum; Performer computes that form itself, in FavorAttention); causal,
    #: query i's own sigma_i = max_{j <= i} kappa_j. So pair (i, j) is weighted exp(kappa_j - sigma_i) <= 1: the
    #: largest visible key has weight 1 (a later, larger key cannot push query i's terms into underflow), and
    #: nothing about query i depends on later keys, even in rounding. The carried state is kept relative to the
    #: running maximum at its end and rescaled by exp(sigma_old - sigma_new) <= 1 when that grows. The weights
    #: get no gradient: the output does not depend on them.
    log_key_features: bool = False

    def __init__(self, geometry: Geometry, *, chunk_size: int = 32) -> None:
        """``chunk_size`` c: positions per chunk of the causal form (quadratic inside a chunk: a larger chunk
        runs fewer, larger products, a smaller one fewer wasted scores; 32 balances the two on a CPU); the only
        option of a subclass without an ``__init__`` of its own."""
        super().__init__(geometry)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size

    def features(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
        """phi of ``x`` (B, H, N, D) at ``positions`` (N,), or (B, 1, N) when each sequence has positions of its own
        (packed documents), ``(B, H, N, m)`` in ``x``'s dtype (float32 or 64)."""
        raise NotImplementedError

    def begin_pass(self) -> None:
        """Called once at the start of each forward that does not go through :meth:`attend` (the packed
        non-causal form): what a core does there besides attending. Nothing here."""

    def attend_segments(self, q: Tensor, k: Tensor, v: Tensor, *, segments: Tensor, key_segments: Tensor,
                        causal: bool) -> Tensor:  # fmt: skip
        """Packed rows: every document is its own sequence, so the sums phi(K)^T [V 1] restart at each boundary
        and the features' positions (cosFormer's re-weighting) count from the document's start.

        Non-causal, in one pass with no padding to the longest document: each document is cut into pieces of
        at most ``chunk_size`` positions (:func:`document_pieces`; a document wastes less than one piece), each
        key piece's phi(K)^T [V 1] is added into its document's sums, and each query piece reads the sums of its
        own document (cross-attention: query document s reads key document s). Log-domain key features
        (Performer's exponential features) are weighted relative to the largest key of their own document, as
        for the document alone, so a document of small keys next to one of large keys does not underflow. Plain
        autograd, so gradients of any order; memory O(n (m + D) + P m D) per head for P pieces (the sums read
        by each query piece are kept for the backward), no (n, n) tensor.

        Causal: each document through the causal form on its own (the base class's
        :func:`~attention_zoo.packing.unpacked_attention`, one call on the documents padded to the longest):
        the chunked prefix scan carries one state along the whole row and has no reset at a boundary."""
        if causal:
            return super().attend_segments(q, k, v, segments=segments, key_segments=key_segments, causal=causal)
        self.begin_pass()
        # p: pieces, h: heads, c: positions in a piece, f: features, e: value width + 1
        with full_precision(q) as compute:
            q_row, q_position, q_real, q_offset, q_document = document_pieces(segments, self.chunk_size)
            k_row, k_position, k_real, k_offset, k_document = document_pieces(key_segments, self.chunk_size)
            x = gathered(q, q_row, q_position, q_real).to(compute)
            y = gathered(k, k_row, k_position, k_real).to(compute)
            fq = self.features(x, q_offset.unsqueeze(1), is_query=True)
            fk = self.features(y, k_offset.unsqueeze(1), is_query=False)
            fk = fk.masked_fill(~rearrange(k_real, "p c -> p 1 c 1"), -math.inf if self.log_key_features else 0.0)
            documents = segments.shape[0] * (segments.shape[1] - 1)
            if self.log_key_features:
                fk = torch.exp(fk - rearrange(document_maxima(fk, k_document, documents), "p h -> p h 1 1"))
            values = F.pad(gathered(v, k_row, k_position, k_real).to(compute), (0, 1), value=1.0)  # [V, 1]
            sums = fk.new_zeros(documents, q.shape[1], fk.shape[-1], values.shape[-1])
            sums = sums.index_add(0, k_document, fk.transpose(-1, -2) @ values)  # (documents, h, f, e)
            out = normalised(fq @ sums[q_document])
            return scattered(out, q_row, q_position, q_real, q.shape).to(q.dtype)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        # b: batch, h: heads, i / j: query / key positions, f: features, e: value width + 1 (the normaliser)
        nq, nk = q.shape[-2], k.shape[-2]
        with full_precision(q) as compute:
            if mask is not None and nq == nk:
                q = zero_padded(q, mask)
            q_positions = torch.arange(nq, device=q.device) + (nk - nq if causal else 0)
            fq = self.features(q.to(compute), q_positions, is_query=True)
            fk = self.features(k.to(compute), torch.arange(nk, device=q.device), is_query=False)
            fk = self.masked_keys(fk, mask)
            if not causal:
                if self.log_key_features:
                    raise NotImplementedError(
                        f"{type(self).__name__} has log-domain key features: its non-causal form must exponentiate "
                        "them itself (as Performer's FavorAttention does)"
                    )
                return bidirectional(fq, fk, v.to(compute)).to(q.dtype)
            values = F.pad(v.to(compute), (0, 1), value=1.0)  # [V, 1]
            return normalised(self.causal_sums(fq, fk, values)).to(q.dtype)

    def masked_keys(self, fk: Tensor, mask: Tensor | None) -> Tensor:
        if mask is None:
            return fk
        return fk.masked_fill(~rearrange(mask, "b j -> b 1 j 1"), -math.inf if self.log_key_features else 0.0)

    def causal_sums(self, fq: Tensor, fk: Tensor, values: Tensor) -> Tensor:
        """tril(phi(Q) phi(K)^T) [V 1] with the ends aligned, ``(B, H, Nq, D + 1)``, chunk by chunk."""
        nq, nk = fq.shape[-2], fk.shape[-2]
        length = max(nq, nk)
        chunk = min(self.chunk_size, length)
        tail = -(-length // chunk) * chunk - length  # completes the last chunk
        q_front, k_front = length - nq, length - nk  # puts query i at key position i + nk - nq
        fq, values = padded(fq, q_front, tail), padded(values, k_front, tail)
        fk = padded(fk, k_front, tail, -math.inf if self.log_key_features else 0.0)
        fk, scale = self.normalised_keys(fk)
        return CausalProduct.apply(fq, fk, values, scale, chunk)[:, :, q_front : q_front + nq]

    def normalised_keys(self, fk: Tensor) -> tuple[Tensor, Tensor | None]:
        """For log-domain features: (exp(log phi(K_j) - kappa_j), kappa_j) with kappa_j the key's largest log
        feature (``LOW`` for a padded key); otherwise (fk, None)."""
        if not self.log_key_features:
            return fk, None
        scale = reduce(fk.detach(), "b h n f -> b h n", "max")
        scale = torch.where(torch.isfinite(scale), scale, LOW)
        # in place: fk is the feature map's own output, which no backward keeps
        return fk.sub_(rearrange(scale, "b h n -> b h n 1")).exp_(), scale

    def start_decoding(self) -> KernelState:
        self.check_decodable()
        return KernelState()

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None) -> Tensor:
        # b: batch, h: heads, t: new positions, f: features, e: value width + 1
        assert isinstance(state, KernelState)
        with full_precision(q) as compute:
            if mask is not None:
                q = zero_padded(q, mask)
            positions = torch.arange(state.length, state.length + q.shape[-2], device=q.device)
            fq = self.features(q.to(compute), positions, is_query=True)
            fk = self.masked_keys(self.features(k.to(compute), positions, is_query=False), mask)
            values = F.pad(v.to(compute), (0, 1), value=1.0)
            # a prefill of T positions is cut into chunks like the forward's: one T x T block would cost T^2
            steps = q.shape[-2]
            chunk = min(self.chunk_size, steps)
            tail = -(-steps // chunk) * chunk - steps  # padded positions add nothing to the state
            fq, values = padded(fq, 0, tail), padded(values, 0, tail)
            fk = padded(fk, 0, tail, -math.inf if self.log_key_features else 0.0)
            fk, scale = self.normalised_keys(fk)
            sums, state.sums, state.reference = causal_scan(
                fq, fk, values, scale, None, chunk, state.sums, state.reference
            )
            return normalised(sums[:, :, :steps]).to(q.dtype)


def document_pieces(segments: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The documents of packed rows cut into P pieces of at most ``size`` positions, in row order: each piece's
    row ``(P,)``; for each of its slots the position in the row (0 where unused), whether it is used and the
    offset from the document's start (0 where unused), ``(P, size)`` each; each piece's document ``(P,)``,
    numbered ``row * S + s`` (S documents per row). Empty documents have no piece."""
    b, documents = segments.shape[0], segments.shape[1] - 1
    starts, lengths = segments[:, :-1].reshape(-1), (segments[:, 1:] - segments[:, :-1]).reshape(-1)
    counts = -(-lengths // size)  # pieces per document
    document = torch.arange(b * documents, device=segments.device).repeat_interleave(counts)
    first = (counts.cumsum(0) - counts)[document]  # the document's first piece
    rank = torch.arange(document.shape[0], device=segments.device) - first
    offset = rank[:, None] * size + torch.arange(size, device=segments.device)
    real = offset < lengths[document, None]
    position = (starts[document, None] + offset).masked_fill(~real, 0)
    return document // documents, position, real, offset.masked_fill(~real, 0), document


def document_maxima(log_features: Tensor, document: Tensor, documents: int) -> Tensor:
    """For log-domain key features ``log_features`` (P, H, c, m) of the pieces of :func:`document_pieces`, each
    piece's reference ``(P, H)``: the largest log feature of its document's real keys (unused slots are -inf),
    0 where that is not finite (NaN stays in the features). Detached: the output does not depend on it."""
    piece_maxima = log_features.detach().amax(dim=(-2, -1))  # (p, h)
    maxima = piece_maxima.new_full((documents, piece_maxima.shape[1]), -math.inf)
    maxima = maxima.scatter_reduce(0, document[:, None].expand_as(piece_maxima), piece_maxima, "amax")
    return finite_or_zero(maxima)[document]


def padded(t: Tensor, front: int, back: int, value: float = 0.0) -> Tensor:
    """``t`` with positions added before and after (F.pad copies even when it adds none)."""
    return t if front == back == 0 else F.pad(t, (0, 0, front, back), value=value)
