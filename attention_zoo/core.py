"""The attention-core contract every mechanism follows.

A core maps ``q: (B, H, Nq, D)``, ``k, v: (B, H, Nk, D)`` to ``(B, H, Nq, D)`` in the dtype of ``q``.
q, k and v share one floating dtype, one device and one head width D (a different width for v is
refused). ``mask`` is ``(B, Nk)`` bool with **True = real token** (attend) and False = padding;
``causal=True`` lets query ``i`` see keys ``j <= i + (Nk - Nq)`` (aligned to the end, as in decoding with a
cache). Padded keys and values are zeroed before the mechanism sees them, so whatever padding holds (NaN and
inf included) never reaches a real output. An empty input (B = 0, Nq = 0 or Nk = 0) gives the all-zero output
without calling the mechanism, still a function of q, k, v and the core's parameters with derivative zero, so
backward through an empty batch gives zero gradients to every input and parameter (as DistributedDataParallel
needs), to any order.

Step-by-step causal decoding (:meth:`AttentionCore.decode`): feed the next T positions' q, k, v with a
:class:`DecodingState` from :meth:`AttentionCore.start_decoding`; the outputs equal those of the causal forward
over the whole sequence at those positions. A core with ``has_decoding_cache`` keeps its own state (a key/value
cache, a rolling window, a recurrent summary); any other causal core recomputes the causal forward over the
prefix at every step (correct, O(prefix) work per step; ``zoo list`` shows which).

Writing a core: subclass :class:`AttentionCore`, declare its capabilities (:data:`CAPABILITIES`, documented on
:class:`AttentionCore`) in the class statement, and implement :meth:`AttentionCore.attend`::

    class Windowed(AttentionCore, approximation="fixed sparsity", supports_cross_attention=False):
        def __init__(self, geometry: Geometry, *, window: int = 256, impl: Literal["auto", "dense"] = "auto") -> None:
            super().__init__(geometry)  # validates it; sets dim_head, heads, max_seq_len, context and scale

``__init__`` takes the :class:`Geometry` (made by the registry from :func:`~attention_zoo.create_attention`'s
keywords of those names) and then only the core's own options, typed, keyword-only, with defaults: the registry
validates them and ``zoo list`` shows them. :meth:`AttentionCore.forward` validates every call first.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from einops import rearrange
from torch import Tensor, nn

from attention_zoo import packing

Approximation = Literal[
    "none",
    "fixed sparsity",
    "content-selected sparsity",
    "hierarchical sparsity",
    "low rank",
    "kernel",
    "hashing",
    "recurrent state",
]
APPROXIMATIONS: tuple[str, ...] = Approximation.__args__

#: what a core declares in its class statement (``class C(AttentionCore, supports_causal=False)``); each is a class
#: attribute of :class:`AttentionCore`, which documents it and holds its default
CAPABILITIES: tuple[str, ...] = (
    "approximation",
    "supports_causal",
    "causal_only",
    "supports_mask",
    "supports_cross_attention",
    "needs_shared_qk",
    "requires_max_seq_len",
    "has_decoding_cache",
    "position_free_queries",
    "supports_double_backward",
    "mixes_positions",
    "supports_segments",
)


@dataclass
class BuildContext:
    """Where a core sits in a model, and the state that cores of one model may share.

    ``shared`` is owned by the model (an ``nn.ModuleDict`` registered on it), so a module stored there
    once, e.g. Linformer's layerwise projection, is one parameter tensor for every layer.
    """

    layer_index: int = 0
    num_layers: int = 1
    shared: nn.ModuleDict = field(default_factory=nn.ModuleDict)


@dataclass(frozen=True)
class Geometry:
    """What a core is built for, apart from its own options: ``heads`` heads of width ``dim_head``, sequences of at
    most ``max_seq_len`` (None: no bound; a core with ``requires_max_seq_len`` refuses it), and its place in a model
    (``context``; None: a lone core). :func:`~attention_zoo.create_attention` makes it from its keywords of these
    names and passes it as the core's one positional argument; :class:`AttentionCore` validates it."""

    dim_head: int
    heads: int
    max_seq_len: int | None = None
    context: BuildContext | None = None


class DecodingState:
    """What a core keeps between decoding steps of one batch of sequences.

    ``length`` counts the positions consumed so far (the absolute position of the next one). Subclasses
    add tensor attributes whose first dimension is the batch, so :meth:`reorder` (beam search keeps,
    repeats or drops sequences) applies to all of them; lists and tuples of such tensors are reordered
    element by element.
    """

    def __init__(self) -> None:
        self.length = 0
        #: sequences per step, fixed by the first step and changed only by :meth:`reorder`; None before
        self.batch: int | None = None

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (a 1-d long tensor; rows may repeat), in that order."""
        for name, value in vars(self).items():
            setattr(self, name, _reorder(value, index))
        self.batch = index.numel()


def _reorder(value: Any, index: Tensor) -> Any:
    if isinstance(value, Tensor):
        return value.index_select(0, index.to(value.device))
    if isinstance(value, (list, tuple)):
        return type(value)(_reorder(v, index) for v in value)
    return value


class PrefixState(DecodingState):
    """The fallback of cores without a cache of their own: the whole prefix, recomputed at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.q: Tensor | None = None
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.mask: Tensor | None = None


class AttentionCore(nn.Module):
    """Base class of every registered attention mechanism (see the module docstring)."""

    #: registry name, set by :func:`attention_zoo.register_attention`
    name: ClassVar[str] = ""
    supports_causal: ClassVar[bool] = True
    #: defined over the past only (a recurrence, a selection among earlier blocks): refuses ``causal=False``
    causal_only: ClassVar[bool] = False
    supports_mask: ClassVar[bool] = True
    supports_cross_attention: ClassVar[bool] = True
    #: the multi-head block must use one projection for queries and keys (Reformer's shared-QK)
    needs_shared_qk: ClassVar[bool] = False
    #: construction fails without ``max_seq_len`` (e.g. learned ``k x n`` projections)
    requires_max_seq_len: ClassVar[bool] = False
    #: what the core computes in place of softmax over every key (``zoo list``, column ``approximation``):
    #: ``"none"`` (it is full attention), ``"fixed sparsity"`` (exact softmax over a fixed pattern of keys),
    #: ``"content-selected sparsity"`` (exact softmax over keys its own scores select), ``"low rank"``,
    #: ``"kernel"`` (a feature map in place of exp), ``"hashing"`` (softmax over keys that share a hash bucket),
    #: ``"hierarchical sparsity"`` (a gated sum of softmaxes over learned summaries of blocks, the blocks those
    #: select and a window, as NSA), ``"recurrent state"`` (no softmax: a fixed-size state updated position by
    #: position, e.g. a delta rule).
    #: Every registered core declares it (``register_attention`` checks).
    approximation: ClassVar[Approximation]
    #: small option sets (for n of a few dozen tokens, ``max_seq_len=64``) under which the
    #: mechanism's approximate or chunked path really runs; the conformance suite and the demo use them
    example_configs: ClassVar[tuple[dict[str, Any], ...]] = ({},)
    #: caveats that ``zoo list`` shows next to the capabilities (e.g. a causal form that is not exact)
    notes: ClassVar[str] = ""
    #: :meth:`decode` keeps a state of its own (a cache) instead of recomputing the whole prefix per step
    has_decoding_cache: ClassVar[bool] = False
    #: a query's output depends on no other query and not on its index in the call, so a decoder may feed its
    #: cross-attention queries one step at a time or stacked (beam search); False for position-weighted cores
    position_free_queries: ClassVar[bool] = True
    #: for a core without causal attention: the registered core a decoder uses for causal self-attention
    #: instead (e.g. ``linformer`` -> ``linformer_causal``); None when there is none
    causal_counterpart: ClassVar[str | None] = None
    #: second-order gradients through the core are exact (gradient penalties, Hessian-vector products);
    #: without it, a backward with create_graph=True through the core raises :class:`DoubleBackwardError`
    supports_double_backward: ClassVar[bool] = False
    #: a position's output reads other positions (every attention); False only for the ``self_only`` control,
    #: whose output is the position's own value vector, so queries and keys get zero gradients
    mixes_positions: ClassVar[bool] = True
    #: takes packed rows (``segments``, :mod:`attention_zoo.packing`): every document's output equals the core on
    #: that document alone. A core declares it once the conformance suite's packed-equals-alone tests pass for it;
    #: one without it refuses ``segments``
    supports_segments: ClassVar[bool] = False
    #: why a core without ``supports_segments`` cannot keep the packed-equals-alone equality (``zoo list``)
    segments_refusal: ClassVar[str] = "it does not declare supports_segments"

    def __init_subclass__(cls, **capabilities: Any) -> None:
        """Set the capabilities a subclass declares in its class statement; an unknown name (a typo such as
        ``supports_casual``, which as a plain class attribute would go unnoticed) or a value of the wrong kind
        raises TypeError."""
        super().__init_subclass__()
        for capability, value in capabilities.items():
            if capability not in CAPABILITIES:
                raise TypeError(
                    f"{cls.__qualname__}: unknown capability {capability!r}; known: {', '.join(CAPABILITIES)}"
                )
            if capability == "approximation" and value not in APPROXIMATIONS:
                raise TypeError(
                    f"{cls.__qualname__}: approximation must be one of {', '.join(map(repr, APPROXIMATIONS))}, "
                    f"got {value!r}"
                )
            if capability != "approximation" and not isinstance(value, bool):
                raise TypeError(f"{cls.__qualname__}: {capability} must be True or False, got {value!r}")
            setattr(cls, capability, value)

    def __init__(self, geometry: Geometry) -> None:
        super().__init__()
        name = self.name or type(self).__name__
        if not isinstance(geometry, Geometry):
            raise TypeError(f"attention {name!r}: the first argument must be a Geometry, got {geometry!r}")
        dim_head, heads, max_seq_len = geometry.dim_head, geometry.heads, geometry.max_seq_len
        for arg, value in (("dim_head", dim_head), ("heads", heads), ("max_seq_len", max_seq_len)):
            optional = arg == "max_seq_len" and value is None
            if not optional and (not isinstance(value, int) or isinstance(value, bool)):
                allowed = "an int >= 1" + (" or None" if arg == "max_seq_len" else "")
                raise ValueError(f"attention {name!r}: {arg} must be {allowed}, got {value!r}")
        if dim_head < 1 or heads < 1:
            raise ValueError(f"dim_head and heads must be >= 1, got dim_head={dim_head}, heads={heads}")
        if max_seq_len is not None and max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1 or None, got {max_seq_len}")
        if self.requires_max_seq_len and max_seq_len is None:
            raise ValueError(f"attention {self.name!r} needs max_seq_len (the longest sequence it will see)")
        self.dim_head = dim_head
        self.heads = heads
        self.max_seq_len = max_seq_len
        self.context = geometry.context if geometry.context is not None else BuildContext()
        self.scale = dim_head**-0.5
        #: options whose size a sequence length bounds (see :meth:`bound_by_length`)
        self._length_bounds: dict[str, tuple[int, int, int, int]] = {}

    def bound_by_length(
        self, option: str, value: int, *, default: int | None = None, per_position: int = 1, minimum: int = 1
    ) -> None:
        """Declare that option ``option`` (``value``; ``default`` when not given, else the default of the
        ``__init__`` parameter of that name) is a size a sequence length n bounds: at most ``per_position * n``
        (e.g. 2 for Longformer's window, w/2 keys on each side), or the default when that is larger (a default
        is never refused), and at least ``minimum`` (refused now). Checked now against ``max_seq_len``; a core
        built without one checks each forward call against its key length, with the same message, before
        anything is allocated for the option (not a decoding step: the length it will reach is not known yet)."""
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{option} must be an int >= {minimum}, got {value!r}")
        if default is None:
            default = inspect.signature(type(self).__init__).parameters[option].default
        self._length_bounds[option] = (value, default, per_position, minimum)
        if self.max_seq_len is not None:
            self.check_length_bounds(self.max_seq_len, "max_seq_len")

    def check_length_bounds(self, n: int, source: str) -> None:
        """Refuse a declared option larger than a length ``n`` (``max_seq_len``, or a call's key length) allows."""
        for option, (value, default, per_position, minimum) in self._length_bounds.items():
            limit = per_position * n
            if value <= max(limit, default):
                continue
            length = f"{per_position} x {source}={n}" if per_position != 1 else f"{source}={n}"
            why = f"{length}" if limit >= default else f"its default; {length} allows less"
            hint = "" if source == "max_seq_len" else "; build the core with max_seq_len to have it checked when built"
            raise ValueError(
                f"attention {self.name or type(self).__name__!r}: {option}={value} must be in "
                f"[{minimum}, {max(limit, default)}] ({why}){hint}"
            )

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None = None,
        causal: bool = False,
        segments: Tensor | None = None,
        key_segments: Tensor | None = None,
    ) -> Tensor:
        """``segments`` (B, S + 1): the queries' document boundaries for packed rows (:mod:`attention_zoo.packing`);
        ``key_segments``: the keys' (default ``segments``; needed for cross-attention), with the same S."""
        self.check_inputs(q, k, v, mask, causal)
        if self.max_seq_len is None:
            self.check_length_bounds(k.shape[-2], "the key length")
        if segments is None and key_segments is not None:
            raise ValueError(
                f"{self.name or type(self).__name__}: key_segments needs segments (the queries' boundaries)"
            )
        if segments is not None:
            segments, key_segments = self.check_segments(q, k, mask, segments, key_segments)
        if q.numel() == 0 or k.shape[-2] == 0:
            return self.guard_double_backward(self.no_attention(q, k, v))
        if mask is not None:
            shared = self.needs_shared_qk and q is k
            k, v = zero_padded(k, mask), zero_padded(v, mask)
            q = k if shared else q
        if segments is not None:
            assert key_segments is not None
            out = self.attend_segments(q, k, v, segments=segments, key_segments=key_segments, causal=causal)
            return self.guard_double_backward(out)
        return self.guard_double_backward(self.attend(q, k, v, mask=mask, causal=causal))

    def check_segments(
        self, q: Tensor, k: Tensor, mask: Tensor | None, segments: Tensor, key_segments: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """The validated (segments, key_segments) of a packed call, or one-line ValueError."""
        name = self.name or type(self).__name__
        if not self.supports_segments:
            raise ValueError(f"{name} does not take packed rows (segments): {self.segments_refusal}")
        b, nq, nk = q.shape[0], q.shape[-2], k.shape[-2]
        if key_segments is None and nq != nk:
            raise ValueError(f"{name}: cross-attention with segments needs key_segments (the keys' boundaries)")
        segments = packing.check_segments(segments, nq, b, name=name, device=q.device,
                                          mask=mask if key_segments is None else None)  # fmt: skip
        if key_segments is None:
            return segments, segments
        key_segments = packing.check_segments(key_segments, nk, b, name=f"{name} (key_segments)", mask=mask,
                                              device=q.device)  # fmt: skip
        if key_segments.shape != segments.shape:
            raise ValueError(
                f"{name}: segments {tuple(segments.shape)} and key_segments {tuple(key_segments.shape)} must hold the "
                "same number of documents per row (query document s reads key document s)"
            )
        return segments, key_segments

    def attend_segments(self, q: Tensor, k: Tensor, v: Tensor, *, segments: Tensor, key_segments: Tensor,
                        causal: bool) -> Tensor:  # fmt: skip
        """The mechanism on packed rows, called with validated input: by default each document on its own through
        :func:`~attention_zoo.packing.unpacked_attention` (one padded call; exact when the core's output on a
        padded sequence equals its output on the sequence alone). Cores override it with a packed form."""
        return packing.unpacked_attention(self.attend, q, k, v, segments, key_segments, causal=causal)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        """The mechanism itself, called with validated input."""
        raise NotImplementedError

    def start_decoding(self) -> DecodingState:
        """A fresh state for :meth:`decode`: no position consumed yet."""
        self.check_decodable()
        return PrefixState()

    def decode(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None = None) -> Tensor:
        """Causal attention for the next T positions of each sequence, given everything fed before.

        ``q, k, v``: (B, H, T, D) for positions ``state.length .. state.length + T - 1``; ``mask``: (B, T)
        bool, True = real token (a padded position is never seen by later queries). Returns (B, H, T, D),
        equal to the causal forward over the whole sequence at those positions, and advances ``state``.
        """
        self.check_decodable()
        t, total = q.shape[-2], state.length + q.shape[-2]
        self.check_inputs(q, k, v, mask, causal=True)
        if k.shape[-2] != t:
            raise ValueError(
                f"{self.name}.decode: q and k must cover the same new positions; got {t} and {k.shape[-2]}"
            )
        if self.max_seq_len is not None and total > self.max_seq_len:
            raise ValueError(
                f"{self.name}.decode: position {total} exceeds max_seq_len={self.max_seq_len} it was built for"
            )
        if state.batch is not None and q.shape[0] != state.batch:
            # a state's cache rows are the sequences it was fed; other rows would read (or miss) their caches
            raise ValueError(
                f"{self.name}.decode: a step of {q.shape[0]} sequences, but the state holds {state.batch}; "
                "when sequences are dropped, repeated or reordered (beam search), call state.reorder(index) first"
            )
        state.batch = q.shape[0]
        if q.shape[0] == 0 or t == 0:
            state.length = total
            return self.guard_double_backward(self.no_attention(q, k, v))
        if mask is not None:
            shared = self.needs_shared_qk and q is k
            k, v = zero_padded(k, mask), zero_padded(v, mask)
            q = k if shared else q
        out = self.decode_attend(q, k, v, state, mask=mask)
        state.length = total
        return self.guard_double_backward(out)

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None) -> Tensor:
        """The mechanism's decoding step on validated input; ``state.length`` is still the old length.

        This fallback recomputes the causal forward over the whole prefix; cores with a cache of their own
        override it (and :meth:`start_decoding`) and set ``has_decoding_cache``."""
        assert isinstance(state, PrefixState)
        real = torch.ones(q.shape[0], q.shape[-2], dtype=torch.bool, device=q.device) if mask is None else mask
        grow = lambda old, new: new if old is None else torch.cat([old, new], dim=-2 if new.ndim == 4 else -1)
        state.q, state.k, state.v, state.mask = (
            grow(state.q, q),
            grow(state.k, k),
            grow(state.v, v),
            grow(state.mask, real),
        )
        full_mask = None if bool(state.mask.all()) else state.mask
        return self.attend(state.q, state.k, state.v, mask=full_mask, causal=True)[:, :, -q.shape[-2] :]

    def no_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Zeros shaped like ``q``, the output for an empty input, in the graph of q, k, v and the core's parameters
        with derivative zero (see the module docstring), so that backward reaches all of them."""
        tensors = [t for t in dict.fromkeys((q, k, v, *self.parameters())) if t.requires_grad]
        if not (torch.is_grad_enabled() and tensors):
            return q.new_zeros(q.shape)
        return _Zeros.apply(q.shape, q.dtype, *tensors)

    def guard_double_backward(self, out: Tensor) -> Tensor:
        """``out``, behind a node that refuses create_graph=True when the core does not declare
        ``supports_double_backward``: its own backward would drop the second-order term silently, or fail
        inside torch with a message that names no attention."""
        return out if self.supports_double_backward else refuse_double_backward(out, self.name or type(self).__name__)

    def check_decodable(self) -> None:
        if not self.supports_causal:
            raise ValueError(f"{self.name} cannot decode step by step: it is not causal. {self.causal_alternative()}")

    def check_inputs(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> None:
        name = self.name or type(self).__name__
        if not isinstance(causal, bool):
            # 1, "yes" or a tensor would be taken as truthy (and "no" too): only the two bools are accepted
            raise ValueError(f"{name}: causal must be True or False (a bool), got {causal!r}")
        for label, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor):
                raise ValueError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}")
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise ValueError(
                f"{name}: q, k, v must be (B, H, N, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        (b, h, nq, d), (bk, hk, nk, dk) = q.shape, k.shape
        if (bk, hk, dk) != (b, h, d) or v.shape != k.shape:
            raise ValueError(
                f"{name}: shapes do not fit together: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
                "k and v must be (B, H, Nk, D) with q's B, H and D (one head width for q, k and v)"
            )
        if h != self.heads or d != self.dim_head:
            raise ValueError(f"{name}: built for heads={self.heads}, dim_head={self.dim_head}; got H={h}, D={d}")
        if not q.is_floating_point():
            raise ValueError(
                f"{name}: q, k, v must be floating point (float32, float64, bfloat16, float16); got {q.dtype}"
            )
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"{name}: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        devices = {t.device for t in (q, k, v)} | ({mask.device} if isinstance(mask, Tensor) else set())
        if len(devices) > 1:
            raise ValueError(f"{name}: q, k, v and mask must be on one device; got {', '.join(map(str, devices))}")
        if causal and not self.supports_causal:
            raise ValueError(f"{name} does not support causal=True. {self.causal_alternative()}")
        if not causal and self.causal_only:
            raise ValueError(f"{name} is causal only: call it with causal=True (it has no bidirectional form)")
        if nq != nk and not self.supports_cross_attention:
            raise ValueError(
                f"{name} supports self-attention only (Nq == Nk); got Nq={nq}, Nk={nk}. "
                "Use 'full' (or another core with supports_cross_attention) for cross-attention."
            )
        if mask is not None:
            if not self.supports_mask:
                raise ValueError(f"{name} does not support padding masks; pass mask=None")
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != (b, nk):
                raise ValueError(
                    f"{name}: mask must be bool (B, Nk) = ({b}, {nk}) with True = real token; "
                    f"got {getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}"
                )
        if self.max_seq_len is not None and nk > self.max_seq_len:
            # bounds the key side: what max_seq_len sizes (e.g. Linformer's k x n projections)
            raise ValueError(
                f"{name}: key length {nk} exceeds max_seq_len={self.max_seq_len} "
                "it was built for; rebuild it with a larger max_seq_len"
            )
        weights = next((t for t in (*self.parameters(), *self.buffers()) if t.is_floating_point()), None)
        if weights is not None and weights.device != q.device:
            raise ValueError(
                f"{name}: the core's parameters are on {weights.device}, the inputs on {q.device}; "
                f"move one of them (core.to({str(q.device)!r}))"
            )
        if weights is not None and weights.dtype != q.dtype and not torch.is_autocast_enabled(q.device.type):
            raise ValueError(
                f"{name}: inputs are {q.dtype} but the core's parameters are {weights.dtype}; build the core in the "
                f"inputs' dtype (core.to({q.dtype})) or run it under torch.autocast"
            )
        if self.needs_shared_qk and not _same_tensor(q, k):
            raise ValueError(
                f"{name} shares one projection for queries and keys (needs_shared_qk): pass k = q (the same "
                "tensor), got a k with other values; MultiHeadAttention does this for you"
            )

    @classmethod
    def causal_alternative(cls) -> str:
        """What to use instead when causal attention is asked of a core that lacks it."""
        return "Causal cores: " + ", ".join(_causal_cores()) + "."


class DoubleBackwardError(RuntimeError):
    """A backward with create_graph=True through a core without ``supports_double_backward``."""


def refuse_double_backward(out: Tensor, name: str) -> Tensor:
    """``out``, whose backward raises :class:`DoubleBackwardError` naming attention ``name`` when a graph of the
    gradient is asked for (create_graph=True)."""
    if not (torch.is_grad_enabled() and out.requires_grad):
        return out
    return _RefuseDoubleBackward.apply(out, name)


class _RefuseDoubleBackward(torch.autograd.Function):
    """Identity on a core's output. In backward, grad mode is on exactly when the caller asked for
    create_graph=True, i.e. for a graph of the gradient (second order): that is refused here, before any
    node of the core runs."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, name: str) -> Tensor:
        ctx.name = name
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if torch.is_grad_enabled():
            raise DoubleBackwardError(
                f"attention {ctx.name!r} does not support double backward (create_graph=True: a gradient penalty, "
                f"a Hessian-vector product); cores that do: {', '.join(_double_backward_cores())}"
            )
        return grad, None


class _Zeros(torch.autograd.Function):
    """Zeros of a given shape and dtype as a function of ``tensors`` (on their device), with derivative zero to
    every order: the gradient it returns is again this function, of the incoming gradient and the same tensors."""

    @staticmethod
    def forward(ctx: Any, shape: torch.Size, dtype: torch.dtype, *tensors: Tensor) -> Tensor:
        ctx.save_for_backward(*tensors)
        return torch.zeros(shape, dtype=dtype, device=tensors[0].device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        tensors, needs = ctx.saved_tensors, ctx.needs_input_grad[2:]
        graph = torch.is_grad_enabled()  # create_graph=True: the gradient must be part of the graph again
        return (
            None,
            None,
            *(
                None if not need else _Zeros.apply(t.shape, t.dtype, grad, *tensors) if graph else torch.zeros_like(t)
                for t, need in zip(tensors, needs, strict=True)
            ),
        )


def recomputed_gradients(
    function: Callable[..., Tensor], inputs: Sequence[Tensor], needs: Sequence[bool], grad: Tensor
) -> list[Tensor | None]:
    """The gradients of ``function(*inputs)`` for the output gradient ``grad`` by autograd (None where ``needs`` is
    False): what a custom backward returns when it recomputes its forward, for a graph of the gradient
    (create_graph=True, when grad mode is on) or for a second backward of a retained graph.

    ``function`` runs on an alias of each input, and autograd differentiates with respect to the aliases. With
    respect to the saved inputs themselves it would return total derivatives: every path from one input to another
    outside ``function`` (one tensor passed as both q and k; Nystrom's values computed from its queries) would be
    counted in that input's gradient, and then once more by the caller's graph."""
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        aliases = [t.view_as(t) for t in inputs]
        out = function(*aliases)
    wanted = [a for a, need in zip(aliases, needs, strict=True) if need]
    grads = iter(torch.autograd.grad(out, wanted, grad, create_graph=create_graph))
    return [next(grads) if need else None for need in needs]


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` are one tensor: the same object, a view of the same memory (torch.utils.checkpoint with
    use_reentrant=True detaches each argument separately), or else equal values (NaN where the other has NaN;
    only this last, rare case reads the values, a device synchronisation)."""
    if a is b:
        return True
    if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
        return False
    if (
        a.stride() == b.stride()
        and a.numel() > 0
        and (a.data_ptr(), a.storage_offset()) == (b.data_ptr(), b.storage_offset())
    ):
        return True
    with torch.no_grad():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())


def zero_padded(t: Tensor, mask: Tensor) -> Tensor:
    """``t`` (B, H, N, D) with padded positions (mask False) set to 0, so 0 * NaN never happens downstream."""
    return t.masked_fill(~rearrange(mask, "b n -> b 1 n 1"), 0.0)


def _double_backward_cores() -> list[str]:
    from attention_zoo import registry  # the registry is built on this contract: imported when an error names cores

    return registry.names_with(supports_double_backward=True)


def _causal_cores() -> list[str]:
    from attention_zoo import registry

    return registry.names_with(supports_causal=True)
