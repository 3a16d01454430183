"""Sparse attention, exact on its pattern: ``"local"``, ``"sparse"`` and the aliases ``"longformer"``, ``"bigbird"``.

Child et al. 2019, "Generating Long Sequences with Sparse Transformers", arXiv:1904.10509, eqs. (2)-(4):

    Attend(X, S) = (a(x_i, S_i))_{i in 1..n},   a(x_i, S_i) = softmax((W_q x_i) K_{S_i}^T / sqrt(d)) V_{S_i},
    K_{S_i} = (W_k x_j)_{j in S_i},   V_{S_i} = (W_v x_j)_{j in S_i}

i.e. full softmax attention in which query i sees only the keys of its connectivity set S_i. The sets
come from mask functions (:mod:`attention_zoo.sparse_patterns`, where each pattern is defined precisely
with its paper): sliding window (Beltagy et al. 2020, Longformer, arXiv:2004.05150), strided and fixed
(Child et al.), blockwise (Qiu et al. 2019, BlockBERT, arXiv:1911.02972), window + global tokens
(Longformer) and window + global + random blocks (Zaheer et al. 2020, BigBird, arXiv:2007.14062).
Causal attention uses S_i AND {j <= i}; key padding removes padded keys from every S_i; a query whose
S_i is then empty gives zeros.

``"local"``: ``window`` = w is Longformer's: w/2 keys on each side plus the token itself, so w = 256 sees
257 keys (the "Longformer-257" of the Nystromformer comparison; a causal query sees w/2 + 1).

Exactness: every core equals full attention restricted to its pattern (``approximation = "fixed sparsity"``),
in every implementation (option ``impl``):
- ``"auto"`` (default): ``"flex"`` when the inputs are on CUDA (in float32, bfloat16 or float16, head dim
  >= 16), ``"blocked"`` otherwise: each device gets the fastest path that can also train there.
- ``"flex"``: :mod:`attention_zoo.sparse_flex`, FlexAttention with a block mask from the same mask function,
  cached; on CUDA a compiled kernel that skips the tiles the pattern leaves empty. On the CPU only torch's
  eager fallback runs (dense, forward only): training with it there is refused in favour of ``"blocked"``.
- ``"blocked"``: :mod:`attention_zoo.block_sparse`, tiles of queries against only the keys
  they touch, O(n K) time and memory, trainable on CPU. ``local`` finds its key band directly; the other
  patterns find their tiles' key sets by evaluating the mask function once per (length, causal), an
  O(n^2) boolean pass, cached. The strided pattern is split into its window |i - j| <= l (a band) and
  the disjoint rest of its columns (queries and keys of one residue mod l, tiled together), so it
  computes about 2 l + 64 + n / l keys per query, not the n that a tile of consecutive queries touches.
- ``"dense"``: the reference: the (n, n) mask from the same mask function, masked softmax.

Self-attention only: the patterns are positions within one sequence.

Decoding cache (:meth:`PatternAttention.decode`, :class:`attention_zoo.decoding_cache.PatternState`): the
keys, values and positions that a later query may still attend
(:func:`attention_zoo.sparse_patterns.still_reachable`, which states the bound of each pattern: ``local``
w/2 keys per sequence and head; blockwise < b; longformer g + w/2; fixed n mod l + c floor(n / l);
strided and bigbird with random blocks every key). A step's queries attend the cached keys their pattern
allows, found with the same mask function as the forward, so decoding equals the causal forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal, TypeVar

import torch
from einops import einsum, rearrange
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, and_masks

from attention_zoo import sparse_flex as flex
from attention_zoo.block_sparse import TileGroup, band_layout, layout_from_mask, residue_layout, tiled_attention
from attention_zoo.core import Approximation, AttentionCore, BuildContext, DecodingState
from attention_zoo.decoding_cache import PatternState, pattern_decoding_step
from attention_zoo.masks import masked_softmax
from attention_zoo.registry import register_attention
from attention_zoo.sparse_patterns import (
    GlobalPlacement,
    MaskMod,
    causal_mask,
    dense_mask,
    generate_bigbird,
    generate_blockwise,
    generate_fixed,
    generate_longformer,
    generate_sliding_window,
    generate_strided,
    generate_strided_columns,
    still_reachable,
)

T = TypeVar("T")
Pattern = Literal["strided", "fixed", "blockwise", "longformer", "bigbird"]
Impl = Literal["auto", "flex", "blocked", "dense"]

#: the options each pattern reads, with their defaults (None: derived from the others). Child et al. Sec. 4.3
#: found c in {8, 16, 32} good for l in {128, 256}: stride 128 and 8 summary columns; blockwise 128 (ours;
#: BlockBERT splits a sequence into 2-3 blocks); longformer as ``local``; bigbird's ``global_tokens``
#: defaults to two blocks (2 * block_size), placed as the authors' ITC does: the first and the last block
PATTERN_OPTIONS: dict[str, dict[str, int | str | None]] = {
    "strided": {"stride": 128},
    "fixed": {"stride": 128, "summary_columns": 8},
    "blockwise": {"block_size": 128},
    "longformer": {"window": 256, "global_tokens": 1},
    "bigbird": {
        "block_size": 64,
        "window_blocks": 3,
        "global_tokens": None,
        "random_blocks": 3,
        "seed": 0,
        "global_placement": "ends",
    },
}
_GENERATORS = {
    "strided": generate_strided,
    "fixed": generate_fixed,
    "blockwise": generate_blockwise,
    "longformer": generate_longformer,
}
_CACHED_LAYOUTS = 8  # per core: tile layouts, and as many FlexAttention block masks
_RESIDUE_TILE = 64


class PatternAttention(AttentionCore):
    """Softmax attention restricted to a mask function (Child et al. eqs. (2)-(4)); subclasses give the
    pattern (:meth:`pattern`) and the tiles of the blocked path (:meth:`tile_layout`)."""

    supports_cross_attention: ClassVar[bool] = False
    approximation: ClassVar[Approximation] = "fixed sparsity"
    has_decoding_cache: ClassVar[bool] = True

    def __init__(
        self,
        *,
        dim_head: int,
        heads: int,
        max_seq_len: int | None = None,
        context: BuildContext | None = None,
        impl: Impl = "auto",
    ) -> None:
        super().__init__(dim_head=dim_head, heads=heads, max_seq_len=max_seq_len, context=context)
        if impl == "flex":
            flex.check_flex_dim_head(dim_head)
        self.impl = impl
        self._layouts: dict[tuple[int, bool, torch.device], tuple[TileGroup, ...]] = {}
        self._block_masks: dict[tuple[int, bool, torch.device], BlockMask] = {}

    def pattern(self, n: int, causal: bool) -> MaskMod:
        """The bidirectional mask function for sequences of length ``n``."""
        raise NotImplementedError

    def tile_layout(self, mask_mod: MaskMod, n: int, causal: bool, device: torch.device) -> tuple[TileGroup, ...]:
        raise NotImplementedError

    def mask_mod(self, n: int, causal: bool) -> MaskMod:
        """The pattern, AND j <= i when ``causal``."""
        return with_causal(self.pattern(n, causal), causal)

    def flex_mask_mod(self, n: int, causal: bool, device: torch.device) -> MaskMod:
        """:meth:`mask_mod` in the pointwise form FlexAttention's compiled kernel needs (the same, by default)."""
        return self.mask_mod(n, causal)

    def still_reachable(self, positions: Tensor, n: int) -> Tensor:
        """Which cached keys at ``positions`` a causal query at a position >= n may still attend."""
        raise NotImplementedError

    def decoding_mask_mod(self, n: int) -> MaskMod:
        """The causal pattern, valid for every position < n (causal patterns never depend on the length)."""
        return self.mask_mod(n, causal=True)

    def start_decoding(self) -> PatternState:
        self.check_decodable()
        return PatternState()

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None) -> Tensor:
        assert isinstance(state, PatternState)
        mask_mod = self.decoding_mask_mod(state.length + q.shape[-2])
        return pattern_decoding_step(q, k, v, state, mask, mask_mod, self.still_reachable, self.scale)

    def resolved_impl(self, q: Tensor) -> str:
        """The implementation a call with these queries runs: ``impl``, or for ``"auto"`` flex on CUDA where
        FlexAttention takes the dtype and head dim, else blocked."""
        if self.impl != "auto":
            return self.impl
        return "flex" if q.is_cuda and flex.flex_refusal(q) is None else "blocked"

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        # b: batch, h: heads, i: query positions, j: key positions, d: head dim
        n, impl, key = q.shape[-2], self.resolved_impl(q), (q.shape[-2], causal, q.device)
        if impl == "flex":
            flex.check_flex_inputs(q, k, v)
            block_mask = _cached(
                self._block_masks, key, lambda: flex.build_block_mask(self.flex_mask_mod(*key), n, q.device)
            )
            return flex.flex_pattern_attention(q, k, v, block_mask, mask, self.scale)
        if impl == "dense":
            allowed = rearrange(dense_mask(self.mask_mod(n, causal), n, q.device), "i j -> 1 1 i j")
            if mask is not None:
                allowed = allowed & rearrange(mask, "b j -> b 1 1 j")
            scores = einsum(q * self.scale, k, "b h i d, b h j d -> b h i j")  # before: q . k may overflow fp16
            return einsum(masked_softmax(scores, allowed), v, "b h i j, b h j d -> b h i d")
        layout = _cached(self._layouts, key, lambda: self.tile_layout(self.mask_mod(n, causal), n, causal, q.device))
        return tiled_attention(q, k, v, layout, mask, self.scale)


def _cached(cache: dict, key: tuple, build: Callable[[], T]) -> T:
    """``cache[key]``, built on a miss; the oldest entry goes when ``_CACHED_LAYOUTS`` are held."""
    if key not in cache:
        if len(cache) == _CACHED_LAYOUTS:
            cache.pop(next(iter(cache)))
        cache[key] = build()
    return cache[key]


def with_causal(mask_mod: MaskMod, causal: bool) -> MaskMod:
    return and_masks(mask_mod, causal_mask) if causal else mask_mod


def _check_window(window: int) -> None:
    if window < 2 or window % 2:
        raise ValueError(f"window must be an even int >= 2 (w/2 keys on each side plus the token itself), got {window}")


def _window_tile(window: int) -> int:
    """Query tile for a band of w/2 each side: 64 rows when w is large (measured fastest at w = 256)."""
    return min(64, max(8, window // 2))


def _aligned_tile(period: int) -> int:
    """A query tile that divides the pattern's block length, so a tile never straddles two blocks."""
    if period <= 64:
        return period
    return max((t for t in range(8, 65) if period % t == 0), default=64)


@register_attention("local")
class LocalAttention(PatternAttention):
    example_configs = ({"window": 8}, {"window": 16}, {"window": 8, "impl": "dense"})
    notes: ClassVar[str] = (
        "exact on its pattern: |i - j| <= window/2 (window + 1 keys; causal: window/2 + 1); self-attention only"
    )

    def __init__(
        self,
        *,
        dim_head: int,
        heads: int,
        max_seq_len: int | None = None,
        context: BuildContext | None = None,
        window: int = 256,
        impl: Impl = "auto",
    ) -> None:
        """``window``: w, even: each query sees the w/2 keys on each side and itself (Longformer's w; default
        256, the Longformer-257 of the Nystromformer comparison);
        ``impl``: ``"auto"`` (flex on CUDA, blocked elsewhere), ``"flex"`` (FlexAttention), ``"blocked"``
        (O(n w)) or ``"dense"`` (the (n, n) reference); see the module docstring."""
        super().__init__(dim_head=dim_head, heads=heads, max_seq_len=max_seq_len, context=context, impl=impl)
        _check_window(window)
        self.bound_by_length("window", window, per_position=2, minimum=2)
        self.window = window

    def pattern(self, n: int, causal: bool) -> MaskMod:
        return generate_sliding_window(self.window)

    def still_reachable(self, positions: Tensor, n: int) -> Tensor:
        return still_reachable("window", {"window": self.window}, positions, n)

    def tile_layout(self, mask_mod: MaskMod, n: int, causal: bool, device: torch.device) -> tuple[TileGroup, ...]:
        half = self.window // 2
        return band_layout(mask_mod, n, _window_tile(self.window), half, 0 if causal else half, device)


@register_attention("sparse")
class SparseAttention(PatternAttention):
    example_configs = (
        {"pattern": "strided", "stride": 6},
        {"pattern": "fixed", "stride": 8, "summary_columns": 2},
        {"pattern": "blockwise", "block_size": 8},
        {"pattern": "longformer", "window": 8, "global_tokens": 2},
        {"pattern": "bigbird", "block_size": 4, "global_tokens": 4, "random_blocks": 1},
    )
    notes: ClassVar[str] = (
        "exact on its pattern (Child strided/fixed, BlockBERT blockwise, Longformer, BigBird); "
        "self-attention only; bigbird's random blocks are fixed by seed and sequence length"
    )

    def __init__(
        self,
        *,
        dim_head: int,
        heads: int,
        max_seq_len: int | None = None,
        context: BuildContext | None = None,
        pattern: Pattern = "strided",
        stride: int | None = None,
        summary_columns: int | None = None,
        block_size: int | None = None,
        window: int | None = None,
        window_blocks: int | None = None,
        global_tokens: int | None = None,
        random_blocks: int | None = None,
        seed: int | None = None,
        global_placement: GlobalPlacement | None = None,
        impl: Impl = "auto",
    ) -> None:
        """``pattern`` picks the connectivity sets; each reads only its options (see ``PATTERN_OPTIONS``;
        passing another raises): ``stride`` l and ``summary_columns`` c (strided, fixed); ``block_size``
        (blockwise, bigbird); ``window`` (longformer, as in ``"local"``); ``window_blocks`` (odd, bigbird);
        ``global_tokens`` g: positions that attend and are attended everywhere, the first g (longformer) or
        as ``global_placement`` says (bigbird: ``"ends"``, the default, the first and last g/2 as in the
        authors' code; ``"start"`` the first g; default g = 2 block_size); ``random_blocks`` r and ``seed``
        (bigbird). ``impl`` as in ``"local"``: ``"auto"`` (flex on CUDA, blocked elsewhere), ``"flex"``,
        ``"blocked"`` or ``"dense"``."""
        super().__init__(dim_head=dim_head, heads=heads, max_seq_len=max_seq_len, context=context, impl=impl)
        given = dict(
            stride=stride,
            summary_columns=summary_columns,
            block_size=block_size,
            window=window,
            window_blocks=window_blocks,
            global_tokens=global_tokens,
            random_blocks=random_blocks,
            seed=seed,
            global_placement=global_placement,
        )
        reads = PATTERN_OPTIONS[pattern]
        unused = [name for name, value in given.items() if value is not None and name not in reads]
        if unused:
            raise ValueError(f"pattern {pattern!r} reads only {', '.join(reads)}; it does not use {', '.join(unused)}")
        options = {name: reads[name] if given[name] is None else given[name] for name in reads}
        if pattern == "bigbird" and options["global_tokens"] is None:
            options["global_tokens"] = 2 * options["block_size"]
        _check_options(options)
        for size in ("stride", "block_size", "window"):  # sizes along the sequence: a length bounds them
            if size in options:
                per_position = 2 if size == "window" else 1  # a window: w/2 keys on each side
                self.bound_by_length(size, options[size], default=reads[size], per_position=per_position,
                                     minimum=per_position)  # fmt: skip
        self.pattern_name = pattern
        self.options = options
        self._decoding_pattern: tuple[int, MaskMod] | None = None

    def pattern(self, n: int, causal: bool) -> MaskMod:
        if self.pattern_name == "bigbird":
            return generate_bigbird(**self.options, seq_len=n, causal=causal)
        return _GENERATORS[self.pattern_name](**self.options)

    def flex_mask_mod(self, n: int, causal: bool, device: torch.device) -> MaskMod:
        if self.pattern_name != "bigbird":
            return self.mask_mod(n, causal)
        return with_causal(
            flex.generate_bigbird_pointwise(**self.options, seq_len=n, causal=causal, device=device), causal
        )

    def still_reachable(self, positions: Tensor, n: int) -> Tensor:
        return still_reachable(self.pattern_name, self.options, positions, n)

    def decoding_mask_mod(self, n: int) -> MaskMod:
        if self.pattern_name != "bigbird":
            return super().decoding_mask_mod(n)
        # the causal random-block table is prefix-consistent: build it for twice the length when outgrown,
        # so a decode of n positions draws O(n / block_size) rows in all, not per step
        if self._decoding_pattern is None or self._decoding_pattern[0] < n:
            length = max(n, 2 * self._decoding_pattern[0] if self._decoding_pattern else n)
            self._decoding_pattern = (length, self.mask_mod(length, causal=True))
        return self._decoding_pattern[1]

    def tile_layout(self, mask_mod: MaskMod, n: int, causal: bool, device: torch.device) -> tuple[TileGroup, ...]:
        o = self.options
        if self.pattern_name == "strided":  # the window |i - j| <= l and, disjoint from it, the columns
            stride = o["stride"]
            window = with_causal(generate_sliding_window(2 * stride), causal)
            columns = with_causal(generate_strided_columns(stride), causal)
            return band_layout(
                window, n, _window_tile(2 * stride), stride, 0 if causal else stride, device
            ) + residue_layout(columns, n, stride, _RESIDUE_TILE, device)
        if self.pattern_name == "longformer":
            tile = _window_tile(o["window"])
        else:  # block-structured: tiles inside the pattern's blocks
            tile = _aligned_tile(o["block_size"] if "block_size" in o else o["stride"])
        return layout_from_mask(mask_mod, n, tile, device)


def _check_options(options: dict) -> None:
    minimum = dict(stride=1, summary_columns=1, block_size=1, window_blocks=1, global_tokens=0, random_blocks=0, seed=0)
    for name, value in options.items():
        if name in minimum and value < minimum[name]:
            raise ValueError(f"{name} must be >= {minimum[name]}, got {value}")
    if options.get("global_placement") == "ends" and options["global_tokens"] % 2:
        raise ValueError(
            f"global_placement='ends' puts global_tokens/2 at each end, so global_tokens must be even, "
            f"got {options['global_tokens']}; or use global_placement='start'"
        )
    if "window" in options:
        _check_window(options["window"])
    if options.get("summary_columns", 0) > options.get("stride", 0):
        raise ValueError(f"summary_columns must be <= stride, got {options['summary_columns']} > {options['stride']}")
    if options.get("window_blocks", 1) % 2 == 0:
        raise ValueError(
            f"window_blocks must be odd (the query block and as many on each side), got {options['window_blocks']}"
        )
    if options.get("seed", 0) >= 1 << 32:
        raise ValueError(f"seed must be < 2**32, got {options['seed']}")


@register_attention("longformer")
class LongformerAttention(SparseAttention):
    """``"sparse"`` with ``pattern="longformer"``: sliding window + global tokens (Beltagy et al. 2020)."""

    example_configs = ({"window": 8, "global_tokens": 2},)
    notes: ClassVar[str] = "exact on its pattern: window (w/2 each side) + the first global_tokens global"

    def __init__(
        self,
        *,
        dim_head: int,
        heads: int,
        max_seq_len: int | None = None,
        context: BuildContext | None = None,
        window: int = 256,
        global_tokens: int = 1,
        impl: Impl = "auto",
    ) -> None:
        super().__init__(
            dim_head=dim_head,
            heads=heads,
            max_seq_len=max_seq_len,
            context=context,
            pattern="longformer",
            window=window,
            global_tokens=global_tokens,
            impl=impl,
        )


@register_attention("bigbird")
class BigBirdAttention(SparseAttention):
    """``"sparse"`` with ``pattern="bigbird"``: window blocks + global + random blocks (Zaheer et al. 2020)."""

    example_configs = (
        {"block_size": 4, "random_blocks": 1},
        {"block_size": 4, "global_tokens": 4, "random_blocks": 1, "global_placement": "start"},
    )
    notes: ClassVar[str] = (
        "exact on its pattern; global: first and last block (authors' ITC; causal: first only); random "
        "blocks fixed by seed and sequence length (causal: earlier only)"
    )

    def __init__(
        self,
        *,
        dim_head: int,
        heads: int,
        max_seq_len: int | None = None,
        context: BuildContext | None = None,
        block_size: int = 64,
        window_blocks: int = 3,
        global_tokens: int | None = None,
        random_blocks: int = 3,
        seed: int = 0,
        global_placement: GlobalPlacement = "ends",
        impl: Impl = "auto",
    ) -> None:
        """``global_tokens`` g: None = two blocks (2 block_size, ITC's g = 2 counted in blocks);
        ``global_placement``: ``"ends"`` (default), the authors' ITC placement: the first g/2 and the last
        g/2 positions of the sequence padded to whole blocks, i.e. the first and the last block for the
        default g, with random blocks drawn from the middle blocks only (google-research/bigbird,
        ``bigbird/core/attention.py``; Hugging Face ``modeling_big_bird.py``); causal attention keeps only
        the first g/2 (a trailing global block would depend on the total length). ``"start"``: the first g
        positions."""
        super().__init__(
            dim_head=dim_head,
            heads=heads,
            max_seq_len=max_seq_len,
            context=context,
            pattern="bigbird",
            block_size=block_size,
            window_blocks=window_blocks,
            global_tokens=global_tokens,
            random_blocks=random_blocks,
            seed=seed,
            global_placement=global_placement,
            impl=impl,
        )
