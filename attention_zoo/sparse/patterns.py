"""The sparse family's patterns as small objects: one frozen dataclass per pattern.

Child et al. 2019, "Generating Long Sequences with Sparse Transformers", arXiv:1904.10509, eqs. (2)-(4):
query i attends only its connectivity set S_i, a(x_i, S_i) = softmax((W_q x_i) K_{S_i}^T / sqrt(d)) V_{S_i}.
A pattern object is one rule for S_i with its options; the sets are defined precisely, with their papers,
in :mod:`attention_zoo.sparse.mask_mods` (sliding window, Longformer arXiv:2004.05150; strided and fixed,
Child et al. §4.3; blockwise, BlockBERT arXiv:1911.02972; window + global tokens, Longformer; window +
global + random blocks, BigBird arXiv:2007.14062). Each object holds:

- its options, as typed fields with their defaults, checked when it is made (a ``ValueError`` names the
  option). Child et al. §4.3 found c in {8, 16, 32} good for l in {128, 256}: stride 128 and 8 summary
  columns; blockwise 128 (ours; BlockBERT splits a sequence into 2-3 blocks); the window w = 256 of
  ``local`` and ``longformer`` (Longformer-257 of the Nystromformer comparison) with one global token;
  BigBird block 64, 3 window blocks, 3 random blocks, and g = two blocks (2 b) placed as the authors' ITC
  does, at the first and the last block.
- :meth:`SparsePattern.mask_mod`: the per-element rule, S_i AND j <= i when causal, which every path
  evaluates: the dense reference, the blocked kernel's tiles, FlexAttention's block mask and its compiled
  kernel, and a decoding step.
- :meth:`SparsePattern.tiles`: how the blocked kernel (:mod:`attention_zoo.sparse.tiled`) cuts the pattern.
- :meth:`SparsePattern.still_reachable`: which cached keys a causal query at a position >= n may still
  attend, so a decoding cache keeps only those (:func:`attention_zoo.decoding.cache.pattern_decoding_step`).
  Per sequence and head, after n positions: window w/2 keys; strided every key; fixed (n mod l) +
  c floor(n / l); blockwise < b; longformer g + w/2; bigbird every key with random blocks, else at most
  lead + (w_b // 2 + 1) b.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from attention_zoo.masks import MaskMod
from attention_zoo.sparse.band import Band
from attention_zoo.sparse.flex import DEFAULT_TILE, MIN_AUTOTUNED_TILE, FlexPart, at_positions
from attention_zoo.sparse.mask_mods import (
    GlobalPlacement,
    bigbird_global_spans,
    generate_bigbird,
    generate_blockwise,
    generate_fixed,
    generate_longformer,
    generate_sliding_window,
    generate_strided,
    generate_strided_columns,
    with_causal,
)
from attention_zoo.sparse.tiled import TileGroup, band_layout, layout_from_mask, residue_layout

#: the patterns of ``"sparse"``, by the name its ``pattern`` option takes
PatternName = Literal["strided", "fixed", "blockwise", "longformer", "bigbird"]
_RESIDUE_TILE = 64


@dataclass(frozen=True)
class SparsePattern:
    """A connectivity pattern; its options are the dataclass fields, in the order its ``generate`` takes them."""

    #: the factory of the rule (:mod:`attention_zoo.sparse.mask_mods`), called with the options
    generate: ClassVar[Callable[..., MaskMod]]

    def __post_init__(self) -> None:
        for f in fields(self):
            minimum, value = f.metadata.get("minimum"), getattr(self, f.name)
            if minimum is not None and value < minimum:
                raise ValueError(f"{f.name} must be >= {minimum}, got {value}")
        self.check()

    def check(self) -> None:
        """Refuse option values beyond the minimums (``ValueError`` naming the option)."""

    def rule(self, n: int, causal: bool, device: torch.device | str | None) -> MaskMod:
        """S_i alone, for positions < ``n`` (only BigBird's depends on ``n``, ``causal`` and ``device``)."""
        return self.generate(*(getattr(self, f.name) for f in fields(self)))

    def tile_rows(self) -> int:
        """Queries per tile of the blocked kernel when the key sets come from the mask function."""
        raise NotImplementedError

    def still_reachable(self, positions: Tensor, n: int) -> Tensor:
        """Which keys at ``positions`` (all < n) a causal query at a position >= n may still attend."""
        raise NotImplementedError

    def mask_mod(self, n: int, causal: bool, device: torch.device | str | None = None) -> MaskMod:
        """Query i may attend key j: j in S_i, and j <= i when ``causal``; constants on ``device``."""
        return with_causal(self.rule(n, causal, device), causal)

    def band(self, causal: bool) -> Band | None:
        """The band i - before <= j <= i + after, for a pattern that is exactly one; None for the others."""
        return None

    def tiles(self, mask_mod: MaskMod, n: int, causal: bool, device: torch.device) -> tuple[TileGroup, ...]:
        """The blocked kernel's layout of ``mask_mod`` (this pattern's :meth:`mask_mod`) over ``n`` positions."""
        return layout_from_mask(mask_mod, n, self.tile_rows(), device)

    def banded(self, causal: bool) -> Band | None:
        """The band the blocked kernel runs on :mod:`attention_zoo.sparse.band`: :meth:`band` for a pattern that
        is exactly one; for a pattern that is a band plus other keys, that band, with :meth:`rest_tiles` on the
        tiled kernel and one softmax over both (:mod:`attention_zoo.sparse.band_and_tiles`); None for the others."""
        return self.band(causal)

    def rest_tiles(self, n: int, causal: bool, device: torch.device) -> tuple[TileGroup, ...]:
        """The tiled kernel's layout of the pattern's pairs outside :meth:`banded`'s band (empty: none, as for a
        pattern that is exactly a band)."""
        return ()

    def flex_parts(self, n: int, causal: bool, device: torch.device) -> tuple[FlexPart, ...]:
        """The FlexAttention calls of the pattern over ``n`` positions (:mod:`attention_zoo.sparse.flex`): one call
        on 128 x 128 tiles in position order, unless the pattern's tiles are sparser otherwise."""
        return (FlexPart(self.mask_mod(n, causal, device)),)

    def length_bounds(self) -> list[tuple[str, int, int, int]]:
        """(option, value, default, keys per position) of each size along the sequence."""
        return [
            (f.name, getattr(self, f.name), f.default, f.metadata["per_position"])
            for f in fields(self)
            if f.metadata.get("per_position") is not None
        ]


def option(default: Any, *, minimum: int | None = None, per_position: int | None = None) -> Any:
    """A pattern option: its default, the smallest value it takes, and for a size along the sequence the
    keys per position it spans (a window w: w/2 on each side), so that a sequence length bounds it."""
    return field(default=default, metadata={"minimum": minimum, "per_position": per_position})


@dataclass(frozen=True)
class LocalPattern(SparsePattern):
    """Sliding window: |i - j| <= w/2 (Longformer's w: w/2 keys on each side and the token itself)."""

    window: int = option(256, per_position=2)
    generate = staticmethod(generate_sliding_window)

    def check(self) -> None:
        _check_window(self.window)

    def band(self, causal: bool) -> Band | None:
        half = self.window // 2
        return Band(before=half, after=0 if causal else half, tile=_band_tile(self.window))

    def still_reachable(self, positions: Tensor, n: int) -> Tensor:
        return positions >= n - self.window // 2  # at most w/2 keys


@dataclass(frozen=True)
class StridedPattern(SparsePattern):
    """Child et al. strided: the l neighbours on each side, and every l-th position."""

    stride: int = option(128, minimum=1, per_position=1)
    generate = staticmethod(generate_strided)

    def tiles(self, mask_mod: MaskMod, n: int, causal: bool, device: torch.device) -> tuple[TileGroup, ...]:
        # the window |i - j| <= l as a band and, disjoint from it, the columns by residue mod l: about
        # 2 l + 64 + n / l keys per query, not the n that a tile of consecutive queries touches
        stride = self.stride
        window = with_causal(generate_sliding_window(2 * stride), causal)
        band = band_layout(window, n, _window_tile(2 * stride), stride, 0 if causal else stride, device)
        return band + self.rest_tiles(n, causal, device)

    def banded(self, causal: bool) -> Band | None:
        return Band(before=self.stride, after=0 if causal else self.stride, tile=_band_tile(2 * self.stride))

    def rest_tiles(self, n: int, causal: bool, device: torch.device) -> tuple[TileGroup, ...]:
        columns = with_causal(generate_strided_columns(self.stride), causal)
        return residue_layout(columns, n, self.stride, _RESIDUE_TILE, device)

    def flex_parts(self, n: int, causal: bool, device: torch.device) -> tuple[FlexPart, ...]:
        # in position order the columns touch every tile; in residue order, positions sorted by (i mod l, i div l),
        # they pair only positions of one residue: blocks of about n / l on the diagonal. The window stays in
        # position order, a band; the two parts are disjoint
        stride = self.stride
        window = FlexPart(with_causal(generate_sliding_window(2 * stride), causal))
        if n <= 2 * stride:  # no column lies beyond the window
            return (window,)
        positions = torch.arange(n, device=device)
        order = torch.argsort(positions % stride * n + positions)
        columns = at_positions(with_causal(generate_strided_columns(stride), causal), order, order)
        return window, FlexPart(columns, queries=order, keys=order)

    def still_reachable(self, positions: Tensor, n: int) -> Tensor:
        # query i sees the earlier keys with (i - j) mod l = 0, and later queries cover every residue
        return torch.ones_like(positions, dtype=torch.bool)


@dataclass(frozen=True)
class FixedPattern(SparsePattern):
    """Child et al. fixed: the own block of length l, and the last c positions of every block."""

    stride: int = option(128, minimum=1, per_position=1)
    summary_columns: int = option(8, minimum=1)
    generate = staticmethod(generate_fixed)

    def check(self) -> None:
        if self.summary_columns > self.stride:
            raise ValueError(f"summary_columns must be <= stride, got {self.summary_columns} > {self.stride}")

    def tile_rows(self) -> int:
        return _aligned_tile(self.stride)

    def flex_parts(self, n: int, causal: bool, device: torch.device) -> tuple[FlexPart, ...]:
        # the summary columns lie in every block, so in position order every tile row touches every tile; gathered
        # (c ceil(n / l) keys) they are a narrow call of their own, the own block another, disjoint from it
        stride, summary = self.stride, self.summary_columns
        own_block = FlexPart(with_causal(generate_blockwise(stride), causal))
        blocks = -(-n // stride)
        if blocks == 1:  # the one block holds every summary column
            return (own_block,)
        starts = stride * torch.arange(blocks, device=device)[:, None]
        columns = (starts + torch.arange(stride - summary, stride, device=device)).flatten()
        columns = columns[: (blocks - 1) * summary + max(0, n - (blocks - 1) * stride - (stride - summary))]  # < n

        def other_blocks(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return q_idx // stride != kv_idx // stride

        rule = at_positions(with_causal(other_blocks, causal), None, columns)
        return own_block, FlexPart(rule, keys=columns)

    def still_reachable(self, positions: Tensor, n: int) -> Tensor:
        # the current block and the summary columns of the earlier ones
        stride = self.stride
        return (positions >= n // stride * stride) | (positions % stride >= stride - self.summary_columns)


@dataclass(frozen=True)
class BlockwisePattern(SparsePattern):
    """BlockBERT (identity permutation): block-diagonal blocks of ``block_size``."""

    block_size: int = option(128, minimum=1, per_position=1)
    generate = staticmethod(generate_blockwise)

    def tile_rows(self) -> int:
        return _aligned_tile(self.block_size)

    def still_reachable(self, positions: Tensor, n: int) -> Tensor:
        return positions >= n // self.block_size * self.block_size  # the current block: < b keys


@dataclass(frozen=True)
class LongformerPattern(SparsePattern):
    """Longformer: the sliding window of ``window`` (w/2 each side) + the first ``global_tokens`` global."""

    window: int = option(256, per_position=2)
    global_tokens: int = option(1, minimum=0)
    generate = staticmethod(generate_longformer)

    def check(self) -> None:
        _check_window(self.window)

    def tile_rows(self) -> int:
        return _window_tile(self.window)

    def banded(self, causal: bool) -> Band | None:
        half = self.window // 2
        return Band(before=half, after=0 if causal else half, tile=_band_tile(self.window))

    def rest_tiles(self, n: int, causal: bool, device: torch.device) -> tuple[TileGroup, ...]:
        # the global rows and columns outside the window
        if self.global_tokens == 0:
            return ()
        window, lead = generate_sliding_window(self.window), self.global_tokens

        def global_part(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return ((q_idx < lead) | (kv_idx < lead)) & ~window(b, h, q_idx, kv_idx)

        return layout_from_mask(with_causal(global_part, causal), n, self.tile_rows(), device)

    def still_reachable(self, positions: Tensor, n: int) -> Tensor:
        # everything while a later query may be global; then the g global keys and the last w/2
        lead = self.global_tokens
        if n < lead:
            return torch.ones_like(positions, dtype=torch.bool)
        return (positions < lead) | (positions >= n - self.window // 2)


@dataclass(frozen=True)
class BigBirdPattern(SparsePattern):
    """BigBird-ITC on blocks: ``window_blocks`` around the query block, ``global_tokens`` placed as
    ``global_placement`` says (None: two blocks, 2 ``block_size``), ``random_blocks`` drawn with ``seed``."""

    block_size: int = option(64, minimum=1, per_position=1)
    window_blocks: int = option(3, minimum=1)
    global_tokens: int | None = option(None, minimum=0)
    random_blocks: int = option(3, minimum=0)
    seed: int = option(0, minimum=0)
    global_placement: GlobalPlacement = "ends"
    generate = staticmethod(generate_bigbird)

    def __post_init__(self) -> None:
        if self.global_tokens is None:  # frozen: the default depends on another field, so it is set here
            object.__setattr__(self, "global_tokens", 2 * self.block_size)
        super().__post_init__()

    def check(self) -> None:
        if self.global_placement == "ends" and self.global_tokens % 2:
            raise ValueError(
                f"global_placement='ends' puts global_tokens/2 at each end, so global_tokens must be even, "
                f"got {self.global_tokens}; or use global_placement='start'"
            )
        if self.window_blocks % 2 == 0:
            raise ValueError(
                f"window_blocks must be odd (the query block and as many on each side), got {self.window_blocks}"
            )
        if self.seed >= 1 << 32:
            raise ValueError(f"seed must be < 2**32, got {self.seed}")

    def rule(self, n: int, causal: bool, device: torch.device | str | None) -> MaskMod:
        options = (getattr(self, f.name) for f in fields(self))
        return self.generate(*options, seq_len=n, causal=causal, device=device)

    def tile_rows(self) -> int:
        return _aligned_tile(self.block_size)

    def flex_parts(self, n: int, causal: bool, device: torch.device) -> tuple[FlexPart, ...]:
        # every rule is on blocks of b: at tiles of b the block mask is as sparse as the blocks (at 128 a tile row
        # of two 64-blocks holds both blocks' random draws). Tiles of 64 are the smallest torch's CUDA kernels take,
        # and a multiple of 128 already fits the blocks at the default tile
        b = self.block_size
        fits = b % MIN_AUTOTUNED_TILE == 0 and b % DEFAULT_TILE != 0
        return (FlexPart(self.mask_mod(n, causal, device), tile=(b, b) if fits else (DEFAULT_TILE, DEFAULT_TILE)),)

    def still_reachable(self, positions: Tensor, n: int) -> Tensor:
        # with random blocks a later query block may draw any earlier middle block; without, everything
        # while a later query may be global, then the leading global keys and the window blocks
        b = self.block_size
        lead, _ = bigbird_global_spans(self.global_tokens, self.global_placement, b, n, causal=True)
        if self.random_blocks > 0 or n < lead:
            return torch.ones_like(positions, dtype=torch.bool)
        return (positions < lead) | (positions // b >= n // b - self.window_blocks // 2)


SPARSE_PATTERNS: dict[str, type[SparsePattern]] = {
    "strided": StridedPattern,
    "fixed": FixedPattern,
    "blockwise": BlockwisePattern,
    "longformer": LongformerPattern,
    "bigbird": BigBirdPattern,
}


def pattern_named(name: PatternName, **options: object) -> SparsePattern:
    """The pattern ``name`` of ``"sparse"`` with the options given; None means not given (the pattern's
    default), and an option the pattern does not read raises."""
    cls = SPARSE_PATTERNS[name]
    reads = [f.name for f in fields(cls)]
    unused = [key for key, value in options.items() if value is not None and key not in reads]
    if unused:
        raise ValueError(f"pattern {name!r} reads only {', '.join(reads)}; it does not use {', '.join(unused)}")
    return cls(**{key: value for key, value in options.items() if value is not None})


def _check_window(window: int) -> None:
    if window < 2 or window % 2:
        raise ValueError(f"window must be an even int >= 2 (w/2 keys on each side plus the token itself), got {window}")


def _window_tile(window: int) -> int:
    """Query tile for a band of w/2 each side: w/2 rows, within [8, 64] (a wide band amortises a larger tile)."""
    return min(64, max(8, window // 2))


def _band_tile(window: int) -> int:
    """Query tile of the band kernel (L = T + w key slots per tile): 64 rows from w = 384 on, 32 from w = 128,
    w/4 (at least 8) below. A larger tile runs larger products but executes more of the band's edge columns,
    which a wide band makes a small share of its work (``zoo bench`` profiles the choice)."""
    return 64 if window >= 384 else min(32, max(8, window // 4))


def _aligned_tile(period: int) -> int:
    """A query tile that divides the pattern's block length, so a tile never straddles two blocks."""
    if period <= 64:
        return period
    return max((t for t in range(8, 65) if period % t == 0), default=64)
