"""The gated delta rule in its chunkwise parallel form (Yang et al. 2024, arXiv:2412.06464, Sec. 3), and its
recurrent form for decoding steps.

The state is kept as M_t = S_tᵀ (d_k x d_v, keys first), so the rule reads M_t = α_t (I − β_t k_t k_tᵀ) M_{t−1}
+ β_t k_t v_tᵀ and o_tᵀ = q_tᵀ M_t. Within a chunk [t0 + 1, t0 + C], with γ_r = α_{t0+1} ⋯ α_{t0+r} and M_0 the
state at the chunk's start, the rule is M_t = α_t M_{t−1} + k_t u_tᵀ with u_t = β_t (v_t − α_t M_{t−1}ᵀ k_t), so

    M_r = γ_r M_0 + Σ_{i≤r} (γ_r / γ_i) k_i u_iᵀ
    (I + A) U = diag(β) V − diag(β γ) K M_0,     A_ri = β_r (γ_r / γ_i) k_rᵀ k_i  (i < r, else 0)

and with T = (I + A)⁻¹ (the UT transform; A is strictly lower triangular) the WY form with the gates folded in:

    U = Ũ − W M_0,            Ũ = T diag(β) V,   W = T diag(β γ) K
    O = diag(γ) Q M_0 + (Q Kᵀ ⊙ Γ) U,            Γ_ri = γ_r / γ_i for i ≤ r, else 0
    M_C = (γ_C I − K̃ᵀ W) M_0 + K̃ᵀ Ũ,           K̃ = diag(γ_C / γ) K

(the paper prints the intra-chunk term with the plain causal mask M where the decay mask Γ is meant, as
NVlabs/GatedDeltaNet issue 15 points out; the tests check this form against the loop over positions).

Everything but M_0 is computed for all chunks at once (batched matmuls and one batched triangular solve); the
only sequential part is the last line, one d_k x d_k by d_k x d_v product per chunk (N / C of them). Ratios of
γ are taken as exp of differences of cumulative log-gates, never as quotients, so no gate underflow divides.
Cost per head: O(N C d + N d²) time, O(N C + (N / C) d²) memory; backward by autograd through these operations,
which keeps intermediates of the same sizes (no N x N tensor anywhere).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import Tensor

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule"]


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor, chunk_size: int, initial: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Outputs (B, H, N, d_v) and the final state M_N (B, H, d_k, d_v) of the gated delta rule, by the chunkwise
    form of the module docstring. ``q``, ``k``: (B, H, N, d_k), already normalised and scaled; ``v``: (B, H, N,
    d_v); ``log_alpha`` (<= 0) and ``beta``: (B, H, N); ``initial``: M before the first position (zero if None).
    All in one dtype, the compute dtype. Chunks of ``min(chunk_size, N)`` positions; the last is completed with
    positions that change nothing (β = 0, α = 1, zero q, k, v)."""
    # b: batch, h: heads, g: chunk, r/i: positions in a chunk, d: key width, e: value width
    n = q.shape[-2]
    c = min(chunk_size, n)
    extra = -n % c
    if extra:
        q, k, v = (F.pad(t, (0, 0, 0, extra)) for t in (q, k, v))
        log_alpha, beta = F.pad(log_alpha, (0, extra)), F.pad(beta, (0, extra))
    q, k, v = (rearrange(t, "b h (g r) d -> b h g r d", r=c) for t in (q, k, v))
    log_alpha, beta = (rearrange(t, "b h (g r) -> b h g r", r=c) for t in (log_alpha, beta))
    log_gamma = log_alpha.cumsum(-1)
    later = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    # Γ_ri = γ_r / γ_i (i <= r): the exponent is <= 0 there; above the diagonal it is set to -inf before exp
    decay = (log_gamma[..., :, None] - log_gamma[..., None, :]).masked_fill(later, float("-inf")).exp()
    a = (einsum(k, k, "b h g r d, b h g i d -> b h g r i") * decay * beta[..., None]).tril(-1)
    gamma = log_gamma.exp()
    rhs = torch.cat([beta[..., None] * v, (beta * gamma)[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # (I + A)⁻¹ rhs
    u_tilde, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    k_tail = k * (log_gamma[..., -1:] - log_gamma).exp()[..., None]  # K̃: each key decayed to its chunk's end
    eye = torch.eye(k.shape[-1], dtype=q.dtype, device=q.device)
    transition = gamma[..., -1, None, None] * eye - einsum(k_tail, w, "b h g r d, b h g r f -> b h g d f")
    inject = einsum(k_tail, u_tilde, "b h g r d, b h g r e -> b h g d e")

    state = q.new_zeros(*q.shape[:2], k.shape[-1], v.shape[-1]) if initial is None else initial
    starts = []
    # unbind, not indexing per chunk: the backward of g selections would write g full-size gradients (O(g^2))
    chunks = zip(rearrange(inject, "b h g d e -> g (b h) d e").unbind(0),
                 rearrange(transition, "b h g d f -> g (b h) d f").unbind(0), strict=True)  # fmt: skip
    for inject_chunk, transition_chunk in chunks:  # the only sequential part: M_0 of the next chunk from this one's
        starts.append(state)
        state = torch.baddbmm(inject_chunk, transition_chunk, state.flatten(0, 1)).view_as(state)
    starts = torch.stack(starts, dim=2)  # (b h g d e): M_0 of every chunk

    u = u_tilde - w @ starts
    scores = einsum(q, k, "b h g r d, b h g i d -> b h g r i") * decay
    out = (gamma[..., None] * q) @ starts + scores @ u
    return rearrange(out, "b h g r e -> b h (g r) e")[:, :, :n], state


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The same outputs and final state position by position (T steps of the rule, for short decoding steps):
    M_t = α_t (M_{t−1} − β_t k_t (k_tᵀ M_{t−1})) + β_t k_t v_tᵀ, o_t = M_tᵀ q_t. Shapes as in
    :func:`chunk_gated_delta_rule`, with N = T and ``state`` the M before the first of them."""
    # b: batch, h: heads, d: key width, e: value width
    alpha = log_alpha.exp()
    outs = []
    for t in range(q.shape[-2]):
        kt, vt, bt = k[:, :, t], v[:, :, t], beta[:, :, t, None]
        predicted = einsum(kt, state, "b h d, b h d e -> b h e")
        written = einsum(kt, bt * (vt - alpha[:, :, t, None] * predicted), "b h d, b h e -> b h d e")
        state = alpha[:, :, t, None, None] * state + written
        outs.append(einsum(q[:, :, t], state, "b h d, b h d e -> b h e"))
    return torch.stack(outs, dim=2), state
