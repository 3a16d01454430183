"""Gated DeltaNet (``"gated_deltanet"``): no softmax; each head keeps a d_v x d_k state S, written position by
position by the gated delta rule and read by the query.

Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule", arXiv:2412.06464
(https://arxiv.org/abs/2412.06464), Sec. 3 (the gated delta rule and its chunkwise form), with the
parameterisation of the authors' code (NVlabs/GatedDeltaNet ``lit_gpt/gated_delta_net.py``; fla
``fla/layers/gated_deltanet.py``):

    S_t = α_t S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,        o_t = S_t q_t · d^{−1/2}
    k_t ← k_t / ‖k_t‖,  q_t ← q_t / ‖q_t‖                       (L2 norm per head, as the paper; ‖x‖ = √(xᵀx + 1e-6))
    β_t = sigmoid(w_β · x_t + b_β) ∈ (0, 1)                      (the write strength)
    α_t = exp(−exp(A_log) · softplus(w_α · x_t + dt_bias)) ∈ (0, 1)   (Mamba2's decay; the paper: "we use
                                                                  Mamba2's parameterization for α")

Per head: w_β, w_α ∈ R^{2d}, b_β, dt_bias, A_log ∈ R, the core's own parameters. Initialised as the authors do:
A ~ U(0, 16], A_log = log A; dt = exp(U(log 0.001, log 0.1)) clamped at 1e-4, dt_bias = softplus⁻¹(dt); w_β,
w_α and b_β by PyTorch's Linear default (U(±1/√(2d))), as the authors' projections. The query scale d^{−1/2}
on the normalised q is the authors' kernel default (fla ``chunk_gated_delta_rule``, scale = d_k^{−1/2}).

Deviation (the core sees q, k, v only): the paper projects β_t and α_t from the layer input x_t; here x_t is
the head's [k_t; v_t] before normalisation: what is written (both are linear maps of the layer input), and not
q_t, so that an output depends on its own query only (a cache may hand the core placeholder earlier queries).
The paper's short convolutions, output gate and norm belong to the layer around the core, not here.
Causal only (a recurrence has no bidirectional form).

Padding: a padded position leaves the state unchanged (β_t = 0, α_t = 1) and outputs 0, whatever it holds.
Training (:mod:`attention_zoo.gated_deltanet.chunked`): the chunkwise WY / UT-transform form with the gates
folded in, chunk C = ``chunk_size`` (default 64, the authors' kernels'), O(N C d + N d²) per head, a Python
loop over the N / C chunks only, backward by autograd; float32 for half inputs (autocast off inside).
Decoding (:class:`DeltaState`): the state S (kept as Sᵀ, d_k x d_v per head, float32 for half inputs), the
recurrent form for steps shorter than C and the chunked form from the state for longer ones (a prefill):
O(d²) memory and time per position, for any length.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import Tensor, nn

from attention_zoo.core import AttentionCore, DecodingState, Geometry, zero_padded
from attention_zoo.gated_deltanet.chunked import chunk_gated_delta_rule, recurrent_gated_delta_rule
from attention_zoo.precision import full_precision
from attention_zoo.registry import register_attention

#: added to ‖x‖² before the square root of the L2 norm (the authors' kernels' epsilon): a zero key stays zero
NORM_EPS = 1e-6


@register_attention("gated_deltanet")
class GatedDeltaNet(
    AttentionCore, approximation="recurrent state", causal_only=True, supports_cross_attention=False,
    has_decoding_cache=True, position_free_queries=False, supports_segments=True, supports_double_backward=True,
):  # fmt: skip
    """Packed rows (``segments``): the state restarts at each document (each one unpacked into a row of its own,
    :func:`~attention_zoo.packing.unpacked_attention`)."""

    example_configs = ({"chunk_size": 4}, {"chunk_size": 8}, {"chunk_size": 64})
    notes: ClassVar[str] = (
        "no softmax: a d x d state per head written by the gated delta rule; q, k L2-normalised; gates β, α from "
        "the head's [k; v] (the paper: from the layer input)"
    )

    def __init__(self, geometry: Geometry, *, chunk_size: int = 64) -> None:
        """``chunk_size`` C: positions per chunk of the chunkwise form (>= 1; default 64, the authors' kernels'):
        the forward costs O(N C d + N d²) per head; a sequence shorter than C is one chunk."""
        super().__init__(geometry)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        self.chunk_size = chunk_size
        heads, width = self.heads, 2 * self.dim_head
        bound = 1 / math.sqrt(width)  # nn.Linear's default initialisation, as the authors' projections
        self.w_beta = nn.Parameter(torch.empty(heads, width).uniform_(-bound, bound))
        self.b_beta = nn.Parameter(torch.empty(heads).uniform_(-bound, bound))
        self.w_alpha = nn.Parameter(torch.empty(heads, width).uniform_(-bound, bound))
        # 16 (1 - U[0, 1)) is U(0, 16]: the authors' A ~ U(0, 16) without the log(0) of a zero draw
        self.A_log = nn.Parameter(torch.log(16 * (1 - torch.rand(heads))))
        dt = torch.exp(torch.rand(heads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt

    def gates(self, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """(log α, β), each (B, H, N), from the head's [k; v] (in their dtype); at padded positions log α = 0
        and β = 0, so the state passes them unchanged."""
        # b: batch, h: heads, n: positions, e: 2 x head dim
        x = torch.cat([k, v], dim=-1)
        w_beta, b_beta, w_alpha, dt_bias, a_log = (
            p.to(x.dtype) for p in (self.w_beta, self.b_beta, self.w_alpha, self.dt_bias, self.A_log)
        )
        beta = torch.sigmoid(einsum(x, w_beta, "b h n e, h e -> b h n") + b_beta[:, None])
        dt = F.softplus(einsum(x, w_alpha, "b h n e, h e -> b h n") + dt_bias[:, None])
        log_alpha = -a_log.exp()[:, None] * dt
        if mask is not None:
            real = rearrange(mask, "b n -> b 1 n").to(x.dtype)
            beta, log_alpha = beta * real, log_alpha * real
        return log_alpha, beta

    def prepared(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, work: torch.dtype) -> tuple[Tensor, ...]:
        """q (normalised, scaled), k (normalised), v, log α, β in the compute dtype ``work``; a padded q is zeroed
        (forward zeroes k and v already), so a padded position outputs 0."""
        if mask is not None:
            q = zero_padded(q, mask)
        q, k, v = q.to(work), k.to(work), v.to(work)
        log_alpha, beta = self.gates(k, v, mask)
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + NORM_EPS) * self.scale
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + NORM_EPS)
        return q, k, v, log_alpha, beta

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        with full_precision(q) as work:
            out, _ = chunk_gated_delta_rule(*self.prepared(q, k, v, mask, work), self.chunk_size)
        return out.to(q.dtype)

    def start_decoding(self) -> DecodingState:
        self.check_decodable()
        return DeltaState()

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None) -> Tensor:
        assert isinstance(state, DeltaState)
        with full_precision(q) as work:
            inputs = self.prepared(q, k, v, mask, work)
            if state.memory is None:
                state.memory = q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1], dtype=work)
            if q.shape[-2] >= self.chunk_size:  # a prefill: the chunked form, from the state
                out, state.memory = chunk_gated_delta_rule(*inputs, self.chunk_size, initial=state.memory)
            else:
                out, state.memory = recurrent_gated_delta_rule(*inputs, state=state.memory)
        return out.to(q.dtype)


class DeltaState(DecodingState):
    """Gated DeltaNet's decoding state: ``memory`` = S_tᵀ after the positions fed so far, (B, H, d_k, d_v), in the
    compute dtype (float32 for half inputs); None before the first step. Steps extend autograd's graph through
    it (a step's output backpropagates into earlier steps' inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.memory: Tensor | None = None
