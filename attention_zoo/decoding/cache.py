"""Key/value caches for step-by-step causal decoding (:meth:`attention_zoo.core.AttentionCore.decode`).

A decoding step feeds the next T positions of every sequence; attention for them needs the keys and
values of earlier positions. The states here keep those in buffers whose first dimension is the batch,
so :meth:`~attention_zoo.core.DecodingState.reorder` (beam search) applies to them:

- :class:`KeyValueState`: keys, values (B, H, capacity, D) and the real-token mask (B, capacity) of the
  first ``size`` slots. Appending grows the buffers by doubling, so T new positions cost O(T) amortised
  copies, not a copy of the whole cache at every step.
- :class:`BlockState`: keys, values and real-token flags in slots of whole blocks, written in place at their
  positions (:meth:`BlockState.reserve` doubles the capacity): the block-selecting cores (MoBA, NSA), whose
  selection reads whole blocks.
- :class:`PatternState`: :class:`KeyValueState` plus the absolute position of each slot, for the sparse
  patterns, which drop the keys that no later query can reach (:func:`pattern_decoding_step`, which asks the
  pattern, a :class:`DecodingPattern`, which keys each query attends and which keys stay reachable).
  A learned sink (:mod:`attention_zoo.sinks`) is a logit, not a key: it takes no slot.

Once a step builds an autograd graph (:func:`builds_graph`: gradients enabled and an input or parameter
that requires them), a state stops writing in place and concatenates instead, so that the views an
earlier step saved for its backward are never overwritten; decode under ``torch.no_grad()`` (or with
inputs and parameters that need no gradient) for the amortised appends.
"""

from __future__ import annotations

from typing import Protocol

import torch
from einops import einsum, rearrange
from torch import Tensor

from attention_zoo.core import DecodingState
from attention_zoo.masks import MaskMod, masked_softmax
from attention_zoo.precision import compute_dtype
from attention_zoo.sinks import sink_softmax

#: slots allocated at the first step, at least: short decodes never reallocate
_FIRST_CAPACITY = 16


class BlockState(DecodingState):
    """Keys, values (B, H, capacity, D) and real-token flags (B, capacity) at their absolute positions, in whole
    blocks; slots past ``length`` are empty and not real. Written in place: decoding with it is for inference."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.real: Tensor | None = None

    def reserve(self, like: Tensor, slots: int) -> int:
        """Room for ``slots`` positions (a multiple of the block), doubling the capacity when it grows, in ``like``'s
        dtype and device; returns the number of slots added (0: there was room)."""
        have = 0 if self.keys is None else self.keys.shape[-2]
        if slots <= have:
            return 0
        extra = max(slots, 2 * have) - have
        batch, heads, _, dim = like.shape
        self.keys = grown(self.keys, (batch, heads, extra, dim), like.dtype, like.device)
        self.values = grown(self.values, (batch, heads, extra, dim), like.dtype, like.device)
        self.real = grown(self.real, (batch, extra), torch.bool, like.device)
        return extra


def grown(old: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``old`` with ``shape``'s zeros appended on its position axis (2 for (B, H, N, ...), else 1); the zeros
    alone when ``old`` is None."""
    new = torch.zeros(shape, dtype=dtype, device=device)
    return new if old is None else torch.cat([old, new], dim=2 if len(shape) == 4 else 1)


class KeyValueState(DecodingState):
    """Cached keys and values of one batch of sequences; slots ``[0, size)`` are in use."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: Tensor | None = None  # (B, H, capacity, D)
        self.values: Tensor | None = None  # (B, H, capacity, D)
        self.real: Tensor | None = None  # (B, capacity) bool, True = real token
        self.size = 0
        #: no padded position was ever appended (kept through reorder: a subset of rows has none either)
        self.all_real = True
        #: buffers may be written in place: no step has built an autograd graph yet
        self.in_place = True

    def append(self, k: Tensor, v: Tensor, real: Tensor | None) -> None:
        """Add T positions: ``k, v`` (B, H, T, D), ``real`` (B, T) bool or None (all real)."""
        if real is None:
            real = torch.ones(k.shape[0], k.shape[-2], dtype=torch.bool, device=k.device)
        else:
            self.all_real = self.all_real and bool(real.all())
        used, self.size = self.size, self.size + k.shape[-2]
        self.keys = appended(self.keys, used, k, dim=2, in_place=self.in_place)
        self.values = appended(self.values, used, v, dim=2, in_place=self.in_place)
        self.real = appended(self.real, used, real, dim=1, in_place=self.in_place)

    def cached(self) -> tuple[Tensor, Tensor, Tensor]:
        """Views of the slots in use: keys, values (B, H, size, D) and real (B, size)."""
        assert self.keys is not None and self.values is not None and self.real is not None
        return self.keys[:, :, : self.size], self.values[:, :, : self.size], self.real[:, : self.size]


class DecodingPattern(Protocol):
    """What a sparse pattern tells its decoding cache (:class:`attention_zoo.sparse.patterns.SparsePattern`)."""

    def mask_mod(self, n: int, causal: bool, device: torch.device | str | None = None) -> MaskMod:
        """Which keys each query may attend, for positions < ``n``."""
        ...

    def still_reachable(self, positions: Tensor, n: int) -> Tensor:
        """Which keys at ``positions`` (all < n) a causal query at a position >= n may still attend."""
        ...


class PatternState(KeyValueState):
    """:class:`KeyValueState` whose slots also record their absolute positions, so that a sparse pattern
    can keep only the keys that later queries may still attend. ``positions`` (capacity,) is one vector
    for the whole batch (every sequence advances by the same T per step), so :meth:`reorder` leaves it."""

    def __init__(self) -> None:
        super().__init__()
        self.positions: Tensor | None = None  # (capacity,) long
        self.rule: MaskMod | None = None  # the causal pattern, valid for positions < rule_length
        self.rule_length = 0

    def append_positions(self, k: Tensor, v: Tensor, real: Tensor | None, positions: Tensor) -> None:
        used = self.size
        self.append(k, v, real)
        self.positions = appended(self.positions, used, positions, dim=0, in_place=self.in_place)

    def cached_positions(self) -> Tensor:
        assert self.positions is not None
        return self.positions[: self.size]

    def keep(self, kept: Tensor) -> None:
        """Keep the slots where ``kept`` (size,) bool is True, in order; drop the others."""
        if bool(kept.all()):
            return
        index = kept.nonzero().squeeze(1)
        self.keys = _kept(self.keys, index, dim=2, in_place=self.in_place)
        self.values = _kept(self.values, index, dim=2, in_place=self.in_place)
        self.real = _kept(self.real, index, dim=1, in_place=self.in_place)
        self.positions = _kept(self.positions, index, dim=0, in_place=self.in_place)
        self.size = len(index)

    def reorder(self, index: Tensor) -> None:
        positions, self.positions = self.positions, None
        super().reorder(index)
        self.positions = positions


def attend_to_cache(
    q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, scale: float, sinks: Tensor | None = None
) -> Tensor:
    """softmax(q K^T * scale) V over the allowed keys; ``allowed`` (B | 1, 1 | H, T, S) bool; ``sinks`` (H,): one
    more logit per head in the denominator. A query with no allowed key gives zeros. Half-precision inputs are
    computed in float32, as the tiled forward computes them."""
    # b: batch, h: heads, i: new positions, j: cached keys, d: head dim
    dtype = q.dtype
    work = compute_dtype(dtype)
    scores = einsum(q.to(work), keys.to(work), "b h i d, b h j d -> b h i j") * scale
    probs = masked_softmax(scores, allowed) if sinks is None else sink_softmax(scores, allowed, sinks)
    return einsum(probs, values.to(work), "b h i j, b h j d -> b h i d").to(dtype)


def pattern_decoding_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: PatternState,
    mask: Tensor | None,
    pattern: DecodingPattern,
    scale: float,
    sinks: Tensor | None = None,
) -> Tensor:
    """One decoding step of a causal sparse pattern: append the T new positions, attend them to the cached
    keys that the pattern's causal ``mask_mod`` allows (and the learned ``sinks`` (H,), if any), then drop the keys
    that its ``still_reachable`` says no later query may attend."""
    state.in_place = state.in_place and not builds_graph(q, k, v, *([] if sinks is None else [sinks]))
    start, end = state.length, state.length + q.shape[-2]
    if state.rule is None or state.rule_length < end:
        # a rule may be made for a length (BigBird's random-block table, prefix-consistent when causal):
        # made for twice the length when outgrown, so a decode of n positions makes it O(log n) times
        state.rule_length = max(end, 2 * state.rule_length)
        state.rule = pattern.mask_mod(state.rule_length, True, q.device)
    new_positions = torch.arange(start, end, device=q.device)
    state.append_positions(k, v, mask, new_positions)
    keys, values, real = state.cached()
    positions = state.cached_positions()
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    allows = state.rule(zero, zero, new_positions[:, None], positions[None, :]).expand(end - start, len(positions))
    seen = allows.any(dim=0)
    if not bool(seen.all()):  # attend only the keys some new query may see (strided: about l + n / l of n)
        index = seen.nonzero().squeeze(1)
        keys, values, real, allows = keys[:, :, index], values[:, :, index], real[:, index], allows[:, index]
    allowed = rearrange(allows, "i j -> 1 1 i j") & rearrange(real, "b j -> b 1 1 j")
    out = attend_to_cache(q, keys, values, allowed, scale, sinks)
    state.keep(pattern.still_reachable(positions, end))
    return out


def builds_graph(*tensors: Tensor) -> bool:
    """Whether a computation on ``tensors`` (inputs, parameters) is recorded by autograd."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def appended(buffer: Tensor | None, used: int, new: Tensor, dim: int, in_place: bool) -> Tensor:
    """``buffer`` whose slots ``[used, used + T)`` along ``dim`` now hold ``new`` (T slots); reallocated to
    twice what is needed when it is full, so appends cost O(T) amortised. Not ``in_place``: a new tensor,
    ``buffer[:used]`` and ``new`` concatenated."""
    need = used + new.shape[dim]
    if not in_place:
        return new if buffer is None else torch.cat([buffer.narrow(dim, 0, used), new], dim=dim)
    if buffer is None or buffer.shape[dim] < need:
        shape = list(new.shape)
        shape[dim] = max(2 * need, _FIRST_CAPACITY)
        grown = new.new_zeros(shape)
        if buffer is not None:
            grown.narrow(dim, 0, used).copy_(buffer.narrow(dim, 0, used))
        buffer = grown
    buffer.narrow(dim, used, new.shape[dim]).copy_(new)
    return buffer


def _kept(buffer: Tensor | None, index: Tensor, dim: int, in_place: bool) -> Tensor:
    """``buffer`` with the slots ``index`` (sorted) moved to the front, capacity unchanged when in place."""
    assert buffer is not None
    picked = buffer.index_select(dim, index.to(buffer.device))
    if not in_place:
        return picked
    buffer.narrow(dim, 0, len(index)).copy_(picked)
    return buffer
