"""Sparse attention, exact on its pattern: ``"local"``, ``"sparse"`` and the aliases ``"longformer"``, ``"bigbird"``.

Child et al. 2019, "Generating Long Sequences with Sparse Transformers", arXiv:1904.10509, eqs. (2)-(4):

    Attend(X, S) = (a(x_i, S_i))_{i in 1..n},   a(x_i, S_i) = softmax((W_q x_i) K_{S_i}^T / sqrt(d)) V_{S_i},
    K_{S_i} = (W_k x_j)_{j in S_i},   V_{S_i} = (W_v x_j)_{j in S_i}

i.e. full softmax attention in which query i sees only the keys of its connectivity set S_i. The sets
come from mask functions (:mod:`attention_zoo.sparse.mask_mods`, where each pattern is defined precisely
with its paper): sliding window (Beltagy et al. 2020, Longformer, arXiv:2004.05150), strided and fixed
(Child et al.), blockwise (Qiu et al. 2019, BlockBERT, arXiv:1911.02972), window + global tokens
(Longformer) and window + global + random blocks (Zaheer et al. 2020, BigBird, arXiv:2007.14062).
Causal attention uses S_i AND {j <= i}; key padding removes padded keys from every S_i; a query whose
S_i is then empty gives zeros. Self-attention only: the patterns are positions within one sequence.

``"local"``: ``window`` = w is Longformer's: w/2 keys on each side plus the token itself, so w = 256 sees
257 keys (the "Longformer-257" of the Nystromformer comparison; a causal query sees w/2 + 1). Each registered
core binds one pattern object (:mod:`attention_zoo.sparse.patterns`: its options and defaults, mask function,
tiles and decoding rule); ``"sparse"`` makes the one its ``pattern`` option names.

Every implementation (option ``impl``) equals full attention restricted to the pattern:
- ``"auto"`` (default): ``"flex"`` when the inputs are on CUDA (in float32, bfloat16 or float16, head dim
  >= 16), ``"blocked"`` otherwise: each device gets the fastest path that can also train there.
- ``"flex"``: :mod:`attention_zoo.sparse.flex`, FlexAttention with cached block masks from the same mask function; on
  CUDA a compiled kernel that skips empty tiles (BigBird at tiles of its block; strided, fixed: two calls, merged). On
  the CPU torch's eager fallback runs (dense, forward only): training there is refused in favour of ``"blocked"``.
- ``"blocked"``: tiles of queries against only the keys they touch, O(n K) time and memory, trainable on CPU:
  a band of keys per query (``local``) by :mod:`attention_zoo.sparse.band`, a band plus other keys
  (``longformer``, ``strided``) by :mod:`attention_zoo.sparse.band_and_tiles`, the other patterns by
  :mod:`attention_zoo.sparse.tiled`, whose tiles' key sets come from one O(n^2) boolean pass of the mask
  function per (length, causal), cached.
- ``"dense"``: the reference: the (n, n) mask from the same mask function, masked softmax.

Decoding cache (:meth:`PatternAttention.decode`, :class:`attention_zoo.decoding.cache.PatternState`): the
keys, values and positions that a later query may still attend (the pattern's ``still_reachable``, which
states its bound: ``local`` w/2 keys per sequence and head; blockwise < b; longformer g + w/2; fixed
n mod l + c floor(n / l); strided and bigbird with random blocks every key). A step's queries attend the
cached keys their pattern allows, found with the same mask function as the forward. ``sink_logit`` (``local``,
``longformer``; default False): GPT-OSS's learned logit per head in the denominator (arXiv:2508.10925,
:mod:`attention_zoo.sinks`), honoured by every implementation, packed rows and the decoding cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal, TypeVar

import torch
from einops import rearrange
from torch import Tensor, nn

from attention_zoo import packing
from attention_zoo.core import AttentionCore, DecodingState, Geometry
from attention_zoo.decoding.cache import PatternState, pattern_decoding_step
from attention_zoo.masks import MaskMod, masked_attention
from attention_zoo.registry import register_attention
from attention_zoo.sparse import flex as flex
from attention_zoo.sparse.band import band_attention
from attention_zoo.sparse.band_and_tiles import band_and_tiled_attention
from attention_zoo.sparse.mask_mods import GlobalPlacement, dense_mask
from attention_zoo.sparse.patterns import (
    BigBirdPattern,
    LocalPattern,
    LongformerPattern,
    PatternName,
    SparsePattern,
    pattern_named,
)
from attention_zoo.sparse.tiled import TileGroup, tiled_attention

T = TypeVar("T")
Impl = Literal["auto", "flex", "blocked", "dense"]
_CACHED_LAYOUTS = 8  # per core: tile layouts, and as many FlexAttention block masks


class PatternAttention(
    AttentionCore, approximation="fixed sparsity", supports_cross_attention=False, has_decoding_cache=True,
    supports_segments=True,
):  # fmt: skip
    """Softmax attention restricted to ``pattern`` (Child et al. eqs. (2)-(4)), a
    :class:`~attention_zoo.sparse.patterns.SparsePattern`; ``sink_logit``: one learned logit per head (parameter
    ``sinks`` (H,), initialised to 0) in the denominator, for the patterns built on a band."""

    def __init__(
        self, geometry: Geometry, *, pattern: SparsePattern, impl: Impl = "auto", sink_logit: bool = False
    ) -> None:
        super().__init__(geometry)
        if sink_logit and pattern.banded(False) is None:
            raise ValueError(
                f"sink_logit=True needs a pattern built on a band (local, longformer, strided), got {pattern!r}"
            )
        if impl == "flex":
            flex.check_flex_dim_head(self.dim_head)
        for option, value, default, per_position in pattern.length_bounds():
            self.bound_by_length(option, value, default=default, per_position=per_position, minimum=per_position)
        self.pattern = pattern
        self.impl = impl
        self._layouts: dict[tuple[int, bool, torch.device], tuple[TileGroup, ...]] = {}
        self._block_masks: dict[tuple[int, bool, torch.device], tuple[flex.FlexCall, ...]] = {}
        self.register_parameter("sinks", nn.Parameter(torch.zeros(self.heads)) if sink_logit else None)

    def mask_mod(self, n: int, causal: bool, device: torch.device | str | None = None) -> MaskMod:
        """The pattern, AND j <= i when ``causal``, for sequences of length ``n``."""
        return self.pattern.mask_mod(n, causal, device)

    def start_decoding(self) -> PatternState:
        self.check_decodable()
        return PatternState()

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None) -> Tensor:
        assert isinstance(state, PatternState)
        return pattern_decoding_step(q, k, v, state, mask, self.pattern, self.scale, self.sinks)

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
            calls = _cached(
                self._block_masks, key, lambda: flex.plan_flex_calls(self.pattern.flex_parts(*key), n, q.device)
            )
            return flex.flex_parts_attention(q, k, v, calls, mask, self.scale, self.sinks)
        if impl == "dense":
            allowed = rearrange(dense_mask(self.mask_mod(*key), n, q.device), "i j -> 1 1 i j")
            return masked_attention(q, k, v, allowed, mask, self.scale, self.sinks)
        band = self.pattern.banded(causal)
        if band is not None:
            rest = _cached(self._layouts, key, lambda: self.pattern.rest_tiles(*key))
            if not rest:
                return band_attention(q, k, v, band, mask, self.scale, self.sinks)
            return band_and_tiled_attention(q, k, v, band, rest, mask, self.scale, self.sinks)
        layout = _cached(self._layouts, key, lambda: self.pattern.tiles(self.mask_mod(*key), *key))
        return tiled_attention(q, k, v, layout, mask, self.scale)

    def attend_segments(self, q: Tensor, k: Tensor, v: Tensor, *, segments: Tensor, key_segments: Tensor,
                        causal: bool) -> Tensor:  # fmt: skip
        """Packed rows: the pattern at positions within each document (a window does not cross a boundary;
        BigBird's blocks, global and random, are the document's own, counted from its start); padding gives 0.

        With ``impl="flex"`` (``"auto"``'s choice on CUDA) local, strided, fixed, blockwise and longformer run
        one FlexAttention call over the packed rows: the pattern's mask function at positions within the
        document, AND the document mask (:func:`~attention_zoo.sparse.flex.build_document_block_mask`, built
        per call, since it depends on the segments). Their rules do not depend on the sequence length, so one
        rule serves documents of every length. BigBird's does (its random blocks, and the trailing global block
        of ``"ends"``, follow the document's length), so BigBird under every implementation runs its documents
        of one length together, unpadded, one call per length; the other patterns under ``"blocked"`` and
        ``"dense"`` run the documents padded to the longest, in one call
        (:func:`~attention_zoo.packing.unpacked_attention`)."""
        by_length = isinstance(self.pattern, BigBirdPattern)
        if self.resolved_impl(q) == "flex" and not by_length:
            flex.check_flex_inputs(q, k, v)
            nq, nk = q.shape[-2], k.shape[-2]  # the rule ignores the length it is made for
            block_mask = flex.build_document_block_mask(self.mask_mod(nq, causal, q.device), segments, key_segments,
                                                        nq, nk, q.device)  # fmt: skip
            return flex.flex_pattern_attention(q, k, v, block_mask, None, self.scale, self.sinks)
        return packing.unpacked_attention(self.attend, q, k, v, segments, key_segments, causal=causal,
                                          group_by_length=by_length)  # fmt: skip


def _cached(cache: dict, key: tuple, build: Callable[[], T]) -> T:
    """``cache[key]``, built on a miss; the oldest entry goes when ``_CACHED_LAYOUTS`` are held."""
    if key not in cache:
        if len(cache) == _CACHED_LAYOUTS:
            cache.pop(next(iter(cache)))
        cache[key] = build()
    return cache[key]


@register_attention("local")
class LocalAttention(PatternAttention):
    example_configs = (
        {"window": 8},
        {"window": 16},
        {"window": 8, "impl": "dense"},
        {"window": 8, "sink_logit": True},
    )
    notes: ClassVar[str] = (
        "exact on its pattern: |i - j| <= window/2 (window + 1 keys; causal: window/2 + 1); self-attention only"
    )

    def __init__(
        self, geometry: Geometry, *, window: int = LocalPattern.window, impl: Impl = "auto", sink_logit: bool = False
    ) -> None:
        """``window``: w, even: each query sees the w/2 keys on each side and itself (Longformer's w; default
        256, the Longformer-257 of the Nystromformer comparison);
        ``impl``: ``"auto"`` (flex on CUDA, blocked elsewhere), ``"flex"`` (FlexAttention), ``"blocked"``
        (O(n w)) or ``"dense"`` (the (n, n) reference); see the module docstring;
        ``sink_logit``: True adds one learned logit per head (parameter ``sinks``, initialised to 0) to the softmax's
        denominator, GPT-OSS's attention sink (no value: it only takes weight away); False (default): plain softmax."""
        pattern = LocalPattern(window=window)
        super().__init__(geometry, pattern=pattern, impl=impl, sink_logit=sink_logit)


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
        geometry: Geometry,
        *,
        pattern: PatternName = "strided",
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
        """``pattern`` picks the connectivity sets (:data:`attention_zoo.sparse.patterns.SPARSE_PATTERNS`); each reads
        only its options, and an option left None takes that pattern's default (passing one it does not
        read raises): ``stride`` l and ``summary_columns`` c (strided, fixed); ``block_size`` (blockwise,
        bigbird); ``window`` (longformer, as in ``"local"``); ``window_blocks`` (odd, bigbird);
        ``global_tokens`` g: positions that attend and are attended everywhere, the first g (longformer) or
        as ``global_placement`` says (bigbird: ``"ends"``, the default, the first and last g/2 as in the
        authors' code; ``"start"`` the first g; default g = 2 block_size); ``random_blocks`` r and ``seed``
        (bigbird). ``impl`` as in ``"local"``: ``"auto"`` (flex on CUDA, blocked elsewhere), ``"flex"``,
        ``"blocked"`` or ``"dense"``."""
        chosen = pattern_named(pattern, stride=stride, summary_columns=summary_columns, block_size=block_size,
                               window=window, window_blocks=window_blocks, global_tokens=global_tokens,
                               random_blocks=random_blocks, seed=seed, global_placement=global_placement)  # fmt: skip
        super().__init__(geometry, pattern=chosen, impl=impl)


@register_attention("longformer")
class LongformerAttention(PatternAttention):
    """``"sparse"`` with ``pattern="longformer"``: sliding window + global tokens (Beltagy et al. 2020)."""

    example_configs = ({"window": 8, "global_tokens": 2}, {"window": 8, "global_tokens": 2, "sink_logit": True})
    notes: ClassVar[str] = "exact on its pattern: window (w/2 each side) + the first global_tokens global"
    #: the pattern the options make (a subclass may give it other defaults)
    pattern_class: ClassVar[type[LongformerPattern]] = LongformerPattern

    def __init__(
        self,
        geometry: Geometry,
        *,
        window: int = LongformerPattern.window,
        global_tokens: int = LongformerPattern.global_tokens,
        impl: Impl = "auto",
        sink_logit: bool = False,
    ) -> None:
        """``window`` w and ``global_tokens`` g: each query sees the w/2 keys on each side, itself and the first g
        positions, which see every position; ``impl`` and ``sink_logit`` as in ``"local"``."""
        pattern = self.pattern_class(window=window, global_tokens=global_tokens)
        super().__init__(geometry, pattern=pattern, impl=impl, sink_logit=sink_logit)


@register_attention("bigbird")
class BigBirdAttention(PatternAttention):
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
        geometry: Geometry,
        *,
        block_size: int = BigBirdPattern.block_size,
        window_blocks: int = BigBirdPattern.window_blocks,
        global_tokens: int | None = None,
        random_blocks: int = BigBirdPattern.random_blocks,
        seed: int = BigBirdPattern.seed,
        global_placement: GlobalPlacement = BigBirdPattern.global_placement,
        impl: Impl = "auto",
    ) -> None:
        """``global_tokens`` g: None = two blocks (2 block_size, ITC's g = 2 counted in blocks);
        ``global_placement``: ``"ends"`` (default), the authors' ITC placement: the first g/2 and the last
        g/2 positions of the sequence padded to whole blocks, i.e. the first and the last block for the
        default g, with random blocks drawn from the middle blocks only (google-research/bigbird,
        ``bigbird/core/attention.py``; Hugging Face ``modeling_big_bird.py``); causal attention keeps only
        the first g/2 (a trailing global block would depend on the total length). ``"start"``: the first g
        positions."""
        pattern = BigBirdPattern(block_size, window_blocks, global_tokens, random_blocks, seed, global_placement)
        super().__init__(geometry, pattern=pattern, impl=impl)
