"""NSA's naive reference: the equations of :mod:`attention_zoo.nsa.attention` one query at a time, in the dtype of
its inputs (the tests use float64), sharing no code with the fast path.

Per compression block i (keys i d .. i d + l - 1, 0-based), phi by its formula; per (sequence, position t): the
compressed keys of the blocks that end at or before t and hold no padded key, p^cmp per head (eq. 8), p^slc by the
double sum of eq. 9 (as read in the module docstring of the fast path), summed over heads (eq. 10), the forced
blocks (initial, own, the one before) and the best-scoring positive candidates, sorted, up to n blocks in all
(eq. 11); then three explicit softmaxes over real keys (selected keys up to t, the last w keys) and the gates
sigmoid(q_t W_h + b_h) (eq. 5). A branch with no key gives zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attention_zoo.core import AttentionCore


def phi(block: Tensor, compressor: torch.nn.Module) -> Tensor:
    """phi of one block (..., l, D): mean + W_2 GELU(W_1 vec(block + E) + b_1)."""
    shifted = block + compressor.position
    flat = shifted.reshape(*block.shape[:-2], -1)
    hidden = F.gelu(flat @ compressor.hidden.weight.T + compressor.hidden.bias)
    return block.mean(dim=-2) + hidden @ compressor.out.weight.T


def softmax_attention(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(output, probabilities) of one query (D,) over keys (K, D); zeros when K = 0."""
    if keys.shape[0] == 0:
        return torch.zeros_like(q), keys.new_zeros(0)
    probs = torch.softmax(keys @ q * scale, dim=0)
    return probs @ values, probs


def nsa_reference(
    core: AttentionCore, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None
) -> tuple[Tensor, list[list[set[int]]]]:
    """The causal output (B, H, N, D) of ``core`` (an ``nsa`` core: its options and parameters) and, per
    (sequence, position), the set of selected blocks. Padded keys and values are zeroed first, as the core's
    forward does."""
    batch, heads, n, _ = q.shape
    size, d, lp = core.compress_block, core.compress_stride, core.select_block
    count, w, scale = core.select_count, core.window, core.scale
    real = torch.ones(batch, n, dtype=torch.bool) if mask is None else mask
    k, v = k * real[:, None, :, None], v * real[:, None, :, None]
    blocks = [i for i in range(n) if i * d + size <= n]
    ck = [phi(k[:, :, i * d : i * d + size], core.compress_key) for i in blocks]  # each (B, H, D)
    cv = [phi(v[:, :, i * d : i * d + size], core.compress_value) for i in blocks]
    outs, selections = [], []
    for b in range(batch):
        rows, chosen_rows = [], []
        for t in range(n):
            seen = [i for i in blocks if i * d + size - 1 <= t and bool(real[b, i * d : i * d + size].all())]
            own = t // lp
            score = [0.0] * (own + 1)
            compressed = []
            for h in range(heads):
                keys = torch.stack([ck[i][b, h] for i in seen]) if seen else q.new_zeros(0, q.shape[-1])
                values = torch.stack([cv[i][b, h] for i in seen]) if seen else keys
                out, probs = softmax_attention(q[b, h, t], keys, values, scale)
                compressed.append(out)
                p_cmp = dict(zip(seen, probs.detach().tolist(), strict=True))
                for j in range(own + 1):  # eq. 9
                    score[j] += sum(
                        p_cmp.get((lp // d) * j + m - r, 0.0) for m in range(lp // d) for r in range(size // d)
                    )
            forced = {j for j in (0, own - 1, own) if j >= 0}
            candidates = sorted((j for j in range(1, own - 1) if score[j] > 0), key=lambda j: -score[j])
            chosen = forced | set(candidates[: count - len(forced)])
            chosen_rows.append(chosen)
            selected = [j for j in range(t + 1) if j // lp in chosen and bool(real[b, j])]
            windowed = [j for j in range(max(0, t - w + 1), t + 1) if bool(real[b, j])]
            for h in range(heads):
                slc, _ = softmax_attention(q[b, h, t], k[b, h, selected], v[b, h, selected], scale)
                win, _ = softmax_attention(q[b, h, t], k[b, h, windowed], v[b, h, windowed], scale)
                gate = torch.sigmoid(q[b, h, t] @ core.gate_weight[h] + core.gate_bias[h])
                rows.append(gate[0] * compressed[h] + gate[1] * slc + gate[2] * win)
        outs.append(torch.stack(rows).reshape(n, heads, -1).transpose(0, 1))
        selections.append(chosen_rows)
    return torch.stack(outs), selections
