"""The attention-core contract every mechanism follows.

A core maps ``q: (B, H, Nq, D)``, ``k, v: (B, H, Nk, D)`` to ``(B, H, Nq, D)`` in the dtype of ``q``.
``mask`` is ``(B, Nk)`` bool with **True = real token** (attend) and False = padding; ``causal=True``
lets query ``i`` see keys ``j <= i + (Nk - Nq)`` (aligned to the end, as in decoding with a cache).

Subclasses declare what they can do as class attributes, take their options as typed keyword-only
``__init__`` parameters (the registry validates names, ``Literal`` choices and types from them), and
implement :meth:`AttentionCore.attend`. :meth:`AttentionCore.forward` validates every call first,
so a core only ever sees well-formed input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn


@dataclass
class BuildContext:
    """Where a core sits in a model, and the state that cores of one model may share.

    ``shared`` is owned by the model (an ``nn.ModuleDict`` registered on it), so a module stored there
    once, e.g. Linformer's layerwise projection, is one parameter tensor for every layer.
    """

    layer_index: int = 0
    num_layers: int = 1
    shared: nn.ModuleDict = field(default_factory=nn.ModuleDict)


class AttentionCore(nn.Module):
    """Base class of every registered attention mechanism (see the module docstring)."""

    #: registry name, set by :func:`attention_zoo.register_attention`
    name: ClassVar[str] = ""
    supports_causal: ClassVar[bool] = True
    supports_mask: ClassVar[bool] = True
    supports_cross_attention: ClassVar[bool] = True
    #: the multi-head block must use one projection for queries and keys (Reformer's shared-QK)
    needs_shared_qk: ClassVar[bool] = False
    #: construction fails without ``max_seq_len`` (e.g. learned ``k x n`` projections)
    requires_max_seq_len: ClassVar[bool] = False
    #: no approximation: softmax attention computed exactly over the keys the core lets each query see
    #: (all keys for ``full``; the declared pattern for the sparse family)
    exact: ClassVar[bool] = False
    #: small option sets (for n of a few dozen tokens, ``max_seq_len=64``) under which the
    #: mechanism's approximate or chunked path really runs; the conformance suite and the demo use them
    example_configs: ClassVar[tuple[dict[str, Any], ...]] = ({},)
    #: caveats that ``zoo list`` shows next to the capabilities (e.g. a causal form that is not exact)
    notes: ClassVar[str] = ""

    def __init__(
        self,
        *,
        dim_head: int,
        heads: int,
        max_seq_len: int | None = None,
        context: BuildContext | None = None,
    ) -> None:
        super().__init__()
        if dim_head < 1 or heads < 1:
            raise ValueError(f"dim_head and heads must be >= 1, got dim_head={dim_head}, heads={heads}")
        if max_seq_len is not None and max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1 or None, got {max_seq_len}")
        if self.requires_max_seq_len and max_seq_len is None:
            raise ValueError(f"attention {self.name!r} needs max_seq_len (the longest sequence it will see)")
        self.dim_head = dim_head
        self.heads = heads
        self.max_seq_len = max_seq_len
        self.context = context if context is not None else BuildContext()
        self.scale = dim_head**-0.5

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        self.check_inputs(q, k, v, mask, causal)
        return self.attend(q, k, v, mask=mask, causal=causal)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        """The mechanism itself, called with validated input."""
        raise NotImplementedError

    def check_inputs(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> None:
        name = self.name or type(self).__name__
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise ValueError(
                f"{name}: q, k, v must be (B, H, N, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        (b, h, nq, d), (bk, hk, nk, dk) = q.shape, k.shape
        if (bk, hk, dk) != (b, h, d) or v.shape[:3] != k.shape[:3]:
            raise ValueError(
                f"{name}: shapes do not fit together: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if h != self.heads or d != self.dim_head:
            raise ValueError(f"{name}: built for heads={self.heads}, dim_head={self.dim_head}; got H={h}, D={d}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"{name}: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        if causal and not self.supports_causal:
            raise ValueError(f"{name} does not support causal=True. {self.causal_alternative()}")
        if nq != nk and not self.supports_cross_attention:
            raise ValueError(
                f"{name} supports self-attention only (Nq == Nk); got Nq={nq}, Nk={nk}. "
                "Use 'full' (or another core with supports_cross_attention) for cross-attention."
            )
        if mask is not None:
            if not self.supports_mask:
                raise ValueError(f"{name} does not support padding masks; pass mask=None")
            if mask.dtype != torch.bool or mask.shape != (b, nk):
                raise ValueError(
                    f"{name}: mask must be bool (B, Nk) = ({b}, {nk}) with True = real token; "
                    f"got {mask.dtype} {tuple(mask.shape)}"
                )
        if self.max_seq_len is not None and nk > self.max_seq_len:
            # bounds the key side: what max_seq_len sizes (e.g. Linformer's k x n projections)
            raise ValueError(
                f"{name}: key length {nk} exceeds max_seq_len={self.max_seq_len} "
                "it was built for; rebuild it with a larger max_seq_len"
            )

    @classmethod
    def causal_alternative(cls) -> str:
        """What to use instead when causal attention is asked of a core that lacks it."""
        return "Causal cores: " + ", ".join(_causal_cores()) + "."


def _causal_cores() -> list[str]:
    from attention_zoo.registry import get_attention_class, list_attentions

    return [n for n in list_attentions() if get_attention_class(n).supports_causal]
