"""StreamingLLM: the first tokens kept as attention sinks, plus a window of recent tokens (``"streaming_llm"``).

Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453, sec. 3.2: the
key/value cache keeps the first s tokens (the attention sinks) and the L most recent ones, so token t attends

    softmax(q_t K_{S_t}^T / sqrt(d)) V_{S_t},   S_t = {j <= t : j < s or j >= t - L}

(the s sinks, the L cached recent tokens and itself). The paper's defaults: s = 4 initial tokens and a cache of
1024 = 4 + 1020 tokens (its Table 1, "4+1020"; the authors' ``StartRecentKVCache(start_size, recent_size)``,
which ``examples/eval_long_ppl.py`` trims back to start + recent after every token).

In the zoo that set is causal ``"longformer"`` with g = s global tokens and window w = 2 L (w/2 keys back): the
defaults are g = 4 and w = 2040. Its decoding cache (:class:`~attention_zoo.decoding.cache.PatternState`) keeps
the g sinks and the last w/2 keys, g + w/2 = 1024 per sequence and head whatever the length (constant memory),
and the training forward runs the same sets on the blocked kernel (band plus sink columns, O(n (w/2 + g))).
Causal only, as the paper's language models are. Positions are the model's concern: the paper numbers them
within the cache (its rolling RoPE), a core sees q and k already encoded. ``sink_logit=True`` adds GPT-OSS's
learned logit per head to the denominator as well (:mod:`attention_zoo.sinks`, arXiv:2508.10925).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attention_zoo.core import Geometry
from attention_zoo.registry import register_attention
from attention_zoo.sparse.attention import Impl, LongformerAttention
from attention_zoo.sparse.patterns import LongformerPattern, option

#: the paper's s (attention sinks) and w = 2 L for its cache of s + L = 4 + 1020
SINK_TOKENS, WINDOW = 4, 2040


@dataclass(frozen=True)
class StreamingLLMPattern(LongformerPattern):
    """Longformer's pattern with the paper's defaults, so that the default window is never refused as too long."""

    window: int = option(WINDOW, per_position=2)
    global_tokens: int = option(SINK_TOKENS, minimum=0)


@register_attention("streaming_llm")
class StreamingLLMAttention(LongformerAttention, causal_only=True):
    """Causal ``"longformer"`` with StreamingLLM's defaults: ``global_tokens`` s sink tokens, ``window`` w = 2 L."""

    example_configs = ({"window": 8, "global_tokens": 2}, {"window": 8, "global_tokens": 4, "sink_logit": True})
    notes: ClassVar[str] = (
        "Xiao et al. 2023: the first global_tokens (sinks) + the last window/2 keys; the decoding cache holds "
        "global_tokens + window/2 keys whatever the length; causal only"
    )
    pattern_class: ClassVar[type[LongformerPattern]] = StreamingLLMPattern

    def __init__(
        self,
        geometry: Geometry,
        *,
        window: int = WINDOW,
        global_tokens: int = SINK_TOKENS,
        impl: Impl = "auto",
        sink_logit: bool = False,
    ) -> None:
        """``global_tokens`` s: the first s positions, the attention sinks (default 4, the paper's); ``window`` w,
        even: w/2 recent keys besides the token itself (default 2040: the paper's cache of 4 + 1020); ``impl`` and
        ``sink_logit`` as in ``"local"``."""
        super().__init__(geometry, window=window, global_tokens=global_tokens, impl=impl, sink_logit=sink_logit)
