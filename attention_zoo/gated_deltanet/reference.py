"""Gated DeltaNet's naive reference: the paper's recurrence, one position at a time, in float64.

Yang, Kautz, Hatamizadeh 2024, arXiv:2412.06464, Sec. 3 (the gated delta rule), with S_t of shape d_v x d_k
as in the paper:

    S_t = α_t S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,        o_t = S_t q_t

:func:`gated_delta_rule` is that loop for given gates and vectors; :func:`gated_deltanet_reference` adds what the
core (:mod:`attention_zoo.gated_deltanet.attention`) puts around it: the gates from the head's [k; v], the L2
norm of q and k, the query scale and the padding rule. Written from the equations, sharing no code with the
chunked form, so that the tests of the fast path compare two independent computations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["gated_delta_rule", "gated_deltanet_reference"]


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
    """o_t = S_t q_t for t = 1..N with S_0 = 0, by the loop of the module docstring, in float64 (results too).
    ``q``, ``k``: (B, H, N, d_k); ``v``: (B, H, N, d_v); ``alpha``, ``beta``: (B, H, N). Returns (B, H, N, d_v)."""
    q, k, v, alpha, beta = (t.double() for t in (q, k, v, alpha, beta))
    batch, heads, n, d_k = k.shape
    eye = torch.eye(d_k, dtype=torch.float64)
    state = torch.zeros(batch, heads, v.shape[-1], d_k, dtype=torch.float64)
    outs = []
    for t in range(n):
        kt, vt = k[:, :, t, :, None], v[:, :, t, :, None]  # column vectors
        a, b = alpha[:, :, t, None, None], beta[:, :, t, None, None]
        state = a * state @ (eye - b * kt @ kt.mT) + b * vt @ kt.mT
        outs.append((state @ q[:, :, t, :, None])[..., 0])
    return torch.stack(outs, dim=2)


def gated_deltanet_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w_beta: Tensor,
    b_beta: Tensor,
    w_alpha: Tensor,
    dt_bias: Tensor,
    a_log: Tensor,
    mask: Tensor | None = None,
) -> Tensor:
    """The core's causal output in float64: x_t = [k_t; v_t] of each head (padded q, k, v zeroed);
    β_t = sigmoid(w_β·x_t + b_β), α_t = exp(−exp(A_log) softplus(w_α·x_t + dt_bias)); at a padded position
    (``mask`` (B, N) False) β_t = 0 and α_t = 1; q_t/‖q_t‖ · d^{−1/2} and k_t/‖k_t‖ with ‖x‖ = √(xᵀx + 1e-6)."""
    q, k, v = (t.double() for t in (q, k, v))
    w_beta, b_beta, w_alpha, dt_bias, a_log = (t.double() for t in (w_beta, b_beta, w_alpha, dt_bias, a_log))
    real = torch.ones(q.shape[0], q.shape[2], dtype=torch.float64) if mask is None else mask.double()
    keep = real[:, None, :, None]
    q, k, v = q * keep, k * keep, v * keep
    x = torch.cat([k, v], dim=-1)
    beta = torch.sigmoid(torch.einsum("bhne,he->bhn", x, w_beta) + b_beta[:, None])
    alpha = torch.exp(-a_log.exp()[:, None] * F.softplus(torch.einsum("bhne,he->bhn", x, w_alpha) + dt_bias[:, None]))
    beta = beta * real[:, None, :]
    alpha = torch.where(real[:, None, :] > 0, alpha, torch.ones_like(alpha))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return gated_delta_rule(q, k, v, alpha, beta)
