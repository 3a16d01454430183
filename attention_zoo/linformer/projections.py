"""Linformer's sequence projections E, F: (B, H, m, D) keys or values -> (B, H, k, D) projected rows.

Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity", arXiv:2006.04768, section 4:
E_i K W_i^K and F_i V W_i^V with E_i, F_i in R^{k x n} (eq. 7), and the "General projections" paragraph
(mean / max pooling and convolution with kernel = stride = n / k). Shared by ``linformer`` (n =
max_seq_len) and ``linformer_causal`` (n = block size).

Every projection takes an input of length m <= n and a real-token mask, and returns the projected rows
and which slots received at least one real token (``None`` when every slot did):

- ``linear`` (learned) and ``random`` (fixed): slicing, E[:, :m] K[:m] (the WMT14 report's rule for
  shorter inputs). Padded rows are zeroed first, so E[:, :m] K equals E[:, real] K[real] exactly.
- ``mean_pool``, ``max_pool``, ``conv``: windows [r s, (r + 1) s) of the n-grid, s = n / k, restricted
  to the real positions < m: a window that starts at or beyond m does not exist (ceil(m / s) slots), a
  partial window pools only its real positions (mean divides by their count, max ignores the others,
  conv uses the kernel taps that land on them), and a window with no real token is an invalid slot.
  Nothing is zero-padded into a result.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, reduce, repeat
from torch import Tensor, nn

from attention_zoo.core import BuildContext

Projection = Literal["linear", "mean_pool", "max_pool", "conv", "random"]
Sharing = Literal["none", "headwise", "kv", "layerwise"]
POOLED: tuple[Projection, ...] = ("mean_pool", "max_pool", "conv")


def scaled_xavier_(weight: Tensor, fan_in: int, fan_out: int) -> Tensor:
    """U(-b, b) with b = sqrt(3 / (fan_in + fan_out)): Xavier-uniform with gain 1/sqrt(2), variance
    1 / (fan_in + fan_out). This is the authors' init of E and F (fairseq ``examples/linformer``,
    ``xavier_uniform_(compress_k.weight, gain=1 / math.sqrt(2))``): a projected row sums about fan_in
    inputs, so it keeps roughly the scale of one key, whatever n / k, and the initial softmax
    temperature does not depend on n."""
    bound = math.sqrt(3.0 / (fan_in + fan_out))
    with torch.no_grad():
        return weight.uniform_(-bound, bound)


class SequenceProjection(nn.Module):
    """Maps ``x: (B, H, m, D)`` with ``real: (B, m) bool | None`` (True = real token), m <= n, to
    ``(B, H, k', D)`` and the ``(B, k')`` bool of slots that received a real token (``None``: all)."""

    def __init__(self, kind: Projection, k: int, n: int) -> None:
        super().__init__()
        self.kind, self.k, self.n = kind, k, n

    def signature(self) -> tuple[str, int, int]:
        """What must match for two layers to share this module (layerwise sharing)."""
        return self.kind, self.k, self.n


class MatrixProjection(SequenceProjection):
    """E in R^{k x n} (or one per head, (H, k, n)): ``linear`` is a learned parameter initialised by
    :func:`scaled_xavier_`; ``random`` is the fixed JL matrix R with i.i.d. N(0, 1/k) entries of the
    proofs of Theorems 1-2, a buffer drawn once at construction from torch's global generator (so
    ``torch.manual_seed`` reproduces it, and it never depends on the batch)."""

    def __init__(self, kind: Literal["linear", "random"], k: int, n: int, heads: int | None) -> None:
        super().__init__(kind, k, n)
        shape = (k, n) if heads is None else (heads, k, n)
        if kind == "linear":
            self.weight = nn.Parameter(scaled_xavier_(torch.empty(shape), fan_in=n, fan_out=k))
        else:
            self.register_buffer("weight", torch.randn(shape) / math.sqrt(k))

    def forward(self, x: Tensor, real: Tensor | None) -> tuple[Tensor, Tensor | None]:
        # b: batch, h: heads, j: key positions, r: projected slots, d: head dim
        weight = self.weight[..., : x.shape[-2]]
        if real is not None:
            x = x.masked_fill(~rearrange(real, "b j -> b 1 j 1"), 0.0)
        pattern = "r j, b h j d -> b h r d" if weight.ndim == 2 else "h r j, b h j d -> b h r d"
        projected = einsum(weight, x, pattern)
        # E is dense: every slot mixes every real token, so a row's slots are all valid or all empty
        slots = None if real is None else repeat(real.any(dim=-1), "b -> b r", r=self.k)
        return projected, slots


class WindowProjection(SequenceProjection):
    """Kernel = stride = s = n / k windows: ``mean_pool``, ``max_pool``, or ``conv``, a learned kernel
    w in R^s (one per head with ``heads``) shared across the D features, i.e. the banded E with
    E[r, r s + t] = w[t]: like E, it mixes positions only, never features (W^K and W^V do that)."""

    def __init__(self, kind: Literal["mean_pool", "max_pool", "conv"], k: int, n: int, heads: int | None) -> None:
        super().__init__(kind, k, n)
        self.window = n // k
        if kind == "conv":
            shape = (self.window,) if heads is None else (heads, self.window)
            self.weight = nn.Parameter(scaled_xavier_(torch.empty(shape), fan_in=self.window, fan_out=1))

    def forward(self, x: Tensor, real: Tensor | None) -> tuple[Tensor, Tensor | None]:
        # b: batch, h: heads, r: windows (projected slots), s: position in window, d: head dim
        m, s = x.shape[-2], self.window
        overhang = -m % s  # positions of the last window at or beyond m: not part of the input
        if overhang:
            present = torch.ones(x.shape[0], m, dtype=torch.bool, device=x.device) if real is None else real
            real = F.pad(present, (0, overhang), value=False)
            x = F.pad(x, (0, 0, 0, overhang))
        windows = rearrange(x, "b h (r s) d -> b h r s d", s=s)
        present = None if real is None else rearrange(real, "b (r s) -> b 1 r s 1", s=s)
        if self.kind == "max_pool":
            if present is not None:
                windows = windows.masked_fill(~present, float("-inf"))
            projected = reduce(windows, "b h r s d -> b h r d", "max")
        else:
            if present is not None:
                windows = windows.masked_fill(~present, 0.0)
            if self.kind == "conv":
                pattern = "b h r s d, s -> b h r d" if self.weight.ndim == 1 else "b h r s d, h s -> b h r d"
                projected = einsum(windows, self.weight, pattern)
            else:
                count = s if present is None else reduce(present, "b 1 r s 1 -> b 1 r 1", "sum").clamp(min=1)
                projected = reduce(windows, "b h r s d -> b h r d", "sum") / count
        if present is None:
            return projected, None
        slots = reduce(present, "b 1 r s 1 -> b r", "any")
        # an empty max-pool window is -inf; zero it so that masked slots never turn into NaN
        return projected.masked_fill(~rearrange(slots, "b r -> b 1 r 1"), 0.0), slots


def check_projected_length(projection: Projection, k: int, n: int, k_name: str, n_name: str) -> None:
    """ValueError unless 1 <= k <= n, and, for windowed projections, k divides n."""
    if not 1 <= k <= n:
        raise ValueError(f"{k_name}={k} must be in [1, {n_name}={n}] (Linformer projects n positions to k <= n)")
    if projection in POOLED and n % k:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        nearest = sorted(divisors, key=lambda d: abs(d - k))[:3]
        raise ValueError(
            f"projection={projection!r} uses windows of kernel = stride = {n_name} / {k_name}, so {k_name} must "
            f"divide {n_name}={n}; got {k_name}={k} (nearest divisors: {sorted(nearest)}); "
            "projection='linear' or 'random' take any k"
        )


def make_projection(projection: Projection, k: int, n: int, heads: int | None) -> SequenceProjection:
    if projection in ("linear", "random"):
        return MatrixProjection(projection, k, n, heads)
    return WindowProjection(projection, k, n, heads)


def build_projections(
    projection: Projection, sharing: Sharing, k: int, n: int, heads: int, context: BuildContext, shared_key: str
) -> tuple[SequenceProjection, SequenceProjection]:
    """(E, F) for one layer, following section 4's "Parameter sharing between projections": ``none``
    one E_i and F_i per head, ``headwise`` one E and one F for all heads, ``kv`` one E = F,
    ``layerwise`` one E = F for the whole model, kept in ``context.shared[shared_key]``. Shared means
    the same module object, hence the same parameter tensor."""
    if sharing == "none":
        return make_projection(projection, k, n, heads), make_projection(projection, k, n, heads)
    if sharing == "headwise":
        return make_projection(projection, k, n, None), make_projection(projection, k, n, None)
    if sharing == "kv":
        key_projection = make_projection(projection, k, n, None)
        return key_projection, key_projection
    if shared_key not in context.shared:
        context.shared[shared_key] = make_projection(projection, k, n, None)
    key_projection = context.shared[shared_key]
    wanted = (projection, k, n)
    if not isinstance(key_projection, SequenceProjection) or key_projection.signature() != wanted:
        found = key_projection.signature() if isinstance(key_projection, SequenceProjection) else key_projection
        raise ValueError(
            f"sharing='layerwise': context.shared[{shared_key!r}] holds (projection, k, n) = {found}, but layer "
            f"{context.layer_index} asks for {wanted}; every layer must use the same projection, k and length "
            "to share one matrix"
        )
    return key_projection, key_projection
