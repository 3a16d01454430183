"""Kernelized linear attention: the machinery that ``performer``, ``linear`` and ``cosformer`` share.

Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive Transformers with Linear
Attention", arXiv:2006.16236 (https://arxiv.org/abs/2006.16236), Sec. 3.2-3.3. With a feature map
phi: R^D -> R^m (m features; phi(x)^T phi(y) replaces exp(x^T y / sqrt(D))), query i's output is

    non-causal   V'_i = phi(Q_i)^T sum_j phi(K_j) V_j^T / phi(Q_i)^T sum_j phi(K_j)
    causal       V'_i = phi(Q_i)^T S_i / phi(Q_i)^T Z_i,   S_i = sum_{j<=i} phi(K_j) V_j^T,  Z_i = sum_{j<=i} phi(K_j)

S and Z travel together as one m x (D + 1) state, sum_j phi(K_j) [V_j, 1]^T (the Performer paper's
Algorithm 1 with C = [V 1_L]), so one product gives numerator and denominator.

Causal form, exact, by chunked prefix sums: the positions are cut into chunks of c = ``chunk_size``;
inside each chunk the c x c block tril(phi(Q_g) phi(K_g)^T) [V_g 1] is computed directly (all chunks in
one batched product), and the earlier chunks reach chunk g through one m x (D + 1) state carried from
chunk to chunk (the Performer paper's App. B.3 "non-parallel aggregation"). Neither the (n, m, D) tensor
of cumulative outer products that public code builds nor one state per chunk ever exists. Backward
(:class:`CausalProduct`) follows Katharopoulos Sec. 3.3.1: the gradients are themselves causal products,
grad phi(Q) = causal(G, [V 1], phi(K)), and grad phi(K), grad [V 1] are anti-causal products of
([V 1], G, phi(Q)) and (phi(K), phi(Q), G), run as causal products of the reversed sequence; each again
carries one state.

Cost per (batch, head): time O(n c (m + D) + n m D); memory O(n (m + D + c) + m D): the features of
every position are kept for backward, as autograd keeps any activation (App. B.3's O(m d + L d + m L)),
and the in-chunk blocks, n c in all, live during one product.

Conventions of this implementation (the papers leave them open):
- Precision (:mod:`attention_zoo.precision`): features, state and normaliser are float32 for bf16/fp16
  inputs (float64 for float64), with autocast off inside; the output is cast back. Half-precision sums of
  n positive terms overflow fp16 at a few thousand tokens, the known failure of public linear-attention code.
- Padding: padded keys' features are zeroed (phi(0) is not 0 for elu + 1 or exp features), so they join
  neither S nor Z. Padded queries (self-attention) are zeroed before their feature map, so NaN or inf
  there never becomes a NaN output or gradient.
- A query whose denominator is 0 (no visible real key, or ReLU features that are all 0) gives zeros.
- Positions (cosFormer's re-weighting uses them): key j is at j; query i at i + Nk - Nq when causal (the
  contract's end alignment: it sees keys j <= i + Nk - Nq), at i otherwise; when decoding, at state.length + t.
- Log-domain key features (``log_key_features``, Performer's exponential features): the feature map hands
  back log phi(K_j). Each key is normalised by its own largest feature, phi(K_j) = exp(kappa_j) phi~(K_j)
  with kappa_j = max_l log phi(K_j)_l, and exp(kappa_j) is applied relative to a reference that cancels
  between numerator and denominator: non-causal, the maximum of kappa over real keys (the authors'
  global key maximum); causal, query i's own sigma_i = max_{j <= i} kappa_j, the running maximum over the
  keys it sees. So pair (i, j) is weighted exp(kappa_j - sigma_i) <= 1: no key feature exceeds 1, the
  largest visible key has weight 1 (a later, larger key cannot push query i's terms into underflow), and
  nothing about query i depends on later keys, even in rounding. The carried state is kept relative to
  the running maximum at its end and rescaled by exp(sigma_old - sigma_new) <= 1 when that grows. The
  weights get no gradient: the output does not depend on them.
- Decoding (:class:`KernelState`): the state and its reference; each step is one chunk of the same scan,
  O(m D) per sequence whatever the length.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from torch import Tensor

from attention_zoo.core import AttentionCore, DecodingState, Geometry, zero_padded
from attention_zoo.decoding_cache import builds_graph
from attention_zoo.precision import full_precision

LOW = -1e30  # log-scale of a padded key: exp(LOW - anything real) = 0, and LOW - LOW = 0 (never NaN)


class KernelState(DecodingState):
    """``sums``: sum_j phi(K_j) [V_j, 1]^T so far, ``(B, H, m, D + 1)``; ``reference``: for log-domain key
    features, the running maximum ``sums`` is relative to, ``(B, H, 1)``. None before the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: Tensor | None = None
        self.reference: Tensor | None = None


class KernelAttention(AttentionCore):
    """Base of the kernelized cores: subclasses define :meth:`features` (see the module docstring)."""

    has_decoding_cache: ClassVar[bool] = True
    supports_double_backward: ClassVar[bool] = True
    #: :meth:`features` returns log phi(K) for keys (exponentiated here, relative to a running maximum)
    log_key_features: bool = False

    def __init__(self, geometry: Geometry, *, chunk_size: int = 64) -> None:
        """``chunk_size`` c: positions per chunk of the causal form (quadratic inside a chunk); the only option of a
        subclass without an ``__init__`` of its own."""
        super().__init__(geometry)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size

    def features(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
        """phi of ``x`` (B, H, N, D) at ``positions`` (N,), ``(B, H, N, m)`` in ``x``'s dtype (float32 or 64)."""
        raise NotImplementedError

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
            values = F.pad(v.to(compute), (0, 1), value=1.0)  # [V, 1]
            sums = self.causal_sums(fq, fk, values) if causal else self.bidirectional_sums(fq, fk, values)
            return normalised(sums).to(q.dtype)

    def masked_keys(self, fk: Tensor, mask: Tensor | None) -> Tensor:
        if mask is None:
            return fk
        return fk.masked_fill(~rearrange(mask, "b j -> b 1 j 1"), -math.inf if self.log_key_features else 0.0)

    def bidirectional_sums(self, fq: Tensor, fk: Tensor, values: Tensor) -> Tensor:
        """phi(Q) (phi(K)^T [V 1]), ``(B, H, Nq, D + 1)``."""
        if self.log_key_features:
            reference = reduce(fk.detach(), "b h j f -> b h 1 1", "max")
            fk = torch.exp(fk - torch.where(torch.isfinite(reference), reference, 0.0))
        return fq @ (fk.transpose(-1, -2) @ values)

    def causal_sums(self, fq: Tensor, fk: Tensor, values: Tensor) -> Tensor:
        """tril(phi(Q) phi(K)^T) [V 1] with the ends aligned, ``(B, H, Nq, D + 1)``, chunk by chunk."""
        nq, nk = fq.shape[-2], fk.shape[-2]
        length = max(nq, nk)
        chunk = min(self.chunk_size, length)
        tail = -(-length // chunk) * chunk - length  # completes the last chunk
        q_front, k_front = length - nq, length - nk  # puts query i at key position i + nk - nq
        fq = F.pad(fq, (0, 0, q_front, tail))
        fk = F.pad(fk, (0, 0, k_front, tail), value=-math.inf if self.log_key_features else 0.0)
        values = F.pad(values, (0, 0, k_front, tail))
        fk, scale = self.normalised_keys(fk)
        return CausalProduct.apply(fq, fk, values, scale, chunk)[:, :, q_front : q_front + nq]

    def normalised_keys(self, fk: Tensor) -> tuple[Tensor, Tensor | None]:
        """For log-domain features: (exp(log phi(K_j) - kappa_j), kappa_j) with kappa_j the key's largest log
        feature (``LOW`` for a padded key); otherwise (fk, None)."""
        if not self.log_key_features:
            return fk, None
        scale = reduce(fk.detach(), "b h n f -> b h n", "max")
        scale = torch.where(torch.isfinite(scale), scale, LOW)
        return torch.exp(fk - rearrange(scale, "b h n -> b h n 1")), scale

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
            fq, values = F.pad(fq, (0, 0, 0, tail)), F.pad(values, (0, 0, 0, tail))
            fk = F.pad(fk, (0, 0, 0, tail), value=-math.inf if self.log_key_features else 0.0)
            fk, scale = self.normalised_keys(fk)
            sums, state.sums, state.reference = causal_scan(
                fq, fk, values, scale, None, chunk, state.sums, state.reference
            )
            return normalised(sums[:, :, :steps]).to(q.dtype)


def normalised(sums: Tensor) -> Tensor:
    """Numerator over denominator (the last column); 0 where the denominator is 0, with finite gradients.
    A NaN denominator (NaN or inf in q or k) stays NaN: non-finite input must not turn into zeros."""
    numerator, denominator = sums[..., :-1], sums[..., -1:]
    some = ~(denominator <= 0)  # not `> 0`: that is False for NaN, which would hide the NaN as a 0
    return torch.where(some, numerator / torch.where(some, denominator, 1.0), 0.0)


def causal_scan(
    a: Tensor,
    b: Tensor,
    c: Tensor,
    scale: Tensor | None,
    rows: Tensor | None,
    chunk: int,
    state: Tensor | None = None,
    reference: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """out_i = rows_i sum_{j <= i} exp(scale_j - sigma_i) (a_i . b_j) c_j with sigma_i = max_{j <= i} scale_j,
    for ``a, b: (B, H, L, r)``, ``c: (B, H, L, e)``, ``scale, rows: (B, H, L)`` (None: all 1), L a multiple
    of ``chunk``. The blocks inside the chunks are computed for all chunks at once; the earlier chunks reach
    a chunk through one carried state, sum_j exp(scale_j - sigma_end) b_j c_j^T, updated chunk by chunk.
    ``state`` (B, H, r, e) and its ``reference`` sigma (B, H, 1) continue a previous scan (decoding).
    Returns the outputs and the final state and reference."""
    # x: batch x heads, g: chunk, i / j: query / key position in a chunk
    (batch, heads, n, r), e = a.shape, c.shape[-1]
    blocks = lambda t: rearrange(t, "b h (g i) ... -> (b h) g i ...", i=chunk)
    a, b, c = blocks(a), blocks(b), blocks(c)
    scores = a @ b.transpose(-1, -2)  # (x, g, i, j)
    state = a.new_zeros(batch * heads, r, e) if state is None else rearrange(state, "b h r e -> (b h) r e")
    if scale is None:
        keys, scores, carried_factor, decay = b, scores.tril(), None, None
    else:
        start = a.new_full((batch * heads, 1), LOW) if reference is None else rearrange(reference, "b h 1 -> (b h) 1")
        level = torch.maximum(blocks(scale).flatten(1).cummax(dim=-1).values, start)
        level, scale = rearrange(level, "x (g i) -> x g i", i=chunk), blocks(scale)
        above = torch.ones(chunk, chunk, dtype=torch.bool, device=a.device).triu(1)
        scores = scores * torch.exp((scale.unsqueeze(-2) - level.unsqueeze(-1)).masked_fill(above, -math.inf))
        end = level[..., -1]  # sigma at the end of each chunk: the reference of the state after it
        before = torch.cat([start, end[:, :-1]], dim=-1)  # the reference of the state entering each chunk
        keys = b * torch.exp(scale - end.unsqueeze(-1)).unsqueeze(-1)
        carried_factor, decay = torch.exp(before.unsqueeze(-1) - level), torch.exp(before - end)
    out = scores @ c
    # out= into one buffer saves a copy, but autograd refuses it: a double backward differentiates this scan
    graph = builds_graph(a, b, c, state)
    carried = [] if graph else a.new_empty(n // chunk, batch * heads, chunk, e)
    for g in range(n // chunk):
        if graph:
            carried.append(torch.bmm(a[:, g], state))
        else:
            torch.bmm(a[:, g], state, out=carried[g])
        if decay is not None:
            state = state * decay[:, g, None, None]
        state = torch.baddbmm(state, keys[:, g].transpose(1, 2), c[:, g])
    carried = rearrange(torch.stack(carried) if graph else carried, "g x i e -> x g i e")
    out = out + (carried if carried_factor is None else carried * carried_factor.unsqueeze(-1))
    if rows is not None:
        out = out * blocks(rows).unsqueeze(-1)
    unblocks = lambda t: rearrange(t, "(b h) g i e -> b h (g i) e", b=batch)
    end_reference = None if scale is None else rearrange(end[:, -1:], "(b h) 1 -> b h 1", b=batch)
    return unblocks(out), rearrange(state, "(b h) r e -> b h r e", b=batch), end_reference


class CausalProduct(torch.autograd.Function):
    """``causal_scan(fq, fk, values, scale, None, chunk)`` with Katharopoulos Sec. 3.3.1's backward (module
    docstring): one carried state per scan, no per-chunk states kept. ``scale`` gets no gradient (the
    reference it sets cancels). The backward is itself made of causal scans, so with create_graph=True
    autograd differentiates it again: second-order gradients are exact."""

    @staticmethod
    def forward(ctx, fq: Tensor, fk: Tensor, values: Tensor, scale: Tensor | None, chunk: int) -> Tensor:
        ctx.save_for_backward(fq, fk, values, scale)
        ctx.chunk = chunk
        return causal_scan(fq, fk, values, scale, None, chunk)[0]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        fq, fk, values, scale = ctx.saved_tensors
        chunk, needs = ctx.chunk, ctx.needs_input_grad
        flip = lambda t: None if t is None else t.flip(-2 if t.ndim == 4 else -1)
        # anti-causal sums over i >= j of exp(scale_j - sigma_i): reversed, the "keys" i carry -sigma_i (whose
        # running maximum from the end is -sigma_j) and the rows j a factor exp(scale_j - sigma_j) <= 1
        level = None if scale is None else scale.cummax(dim=-1).values
        back_scale = None if scale is None else flip(-level)
        back_rows = None if scale is None else flip(torch.exp(scale - level))
        grad_fq = causal_scan(grad, values, fk, scale, None, chunk)[0] if needs[0] else None
        grad_fk = grad_values = None
        if needs[1]:
            grad_fk = flip(causal_scan(flip(values), flip(grad), flip(fq), back_scale, back_rows, chunk)[0])
        if needs[2]:
            grad_values = flip(causal_scan(flip(fk), flip(fq), flip(grad), back_scale, back_rows, chunk)[0])
        return grad_fq, grad_fk, grad_values, None, None
