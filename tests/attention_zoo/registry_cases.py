"""Shared helpers for the conformance suite: every registered mechanism, every example config."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import attention_zoo as az

HEADS, DIM_HEAD, MAX_SEQ_LEN = 2, 8, 64


def cases() -> list[tuple[str, dict]]:
    return [
        (name, options) for name in az.list_attentions() for options in az.get_attention_class(name).example_configs
    ]


def case_id(case: tuple[str, dict]) -> str:
    name, options = case
    return name + ("" if not options else "[" + ",".join(f"{k}={v}" for k, v in options.items()) + "]")


def build(name: str, options: dict, dtype: torch.dtype = torch.float64) -> az.AttentionCore:
    torch.manual_seed(0)
    core = az.create_attention(name, dim_head=DIM_HEAD, heads=HEADS, max_seq_len=MAX_SEQ_LEN, **options)
    return core.to(dtype).eval()


def qkv(
    core: az.AttentionCore, b: int, n: int, *, nk: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    nk = n if nk is None else nk
    q = torch.randn(b, HEADS, n, DIM_HEAD, generator=generator, dtype=dtype)
    k = torch.randn(b, HEADS, nk, DIM_HEAD, generator=generator, dtype=dtype)
    v = torch.randn(b, HEADS, nk, DIM_HEAD, generator=generator, dtype=dtype)
    if core.needs_shared_qk:
        k = q
    return q, k, v


def perturbed(core: az.AttentionCore, q: Tensor, k: Tensor, v: Tensor, where: Tensor, seed: int = 1):
    """Copies of q, k, v with fresh random content at sequence positions where ``where`` (B, N) is True."""
    generator = torch.Generator().manual_seed(seed)
    select = where[:, None, :, None]

    def noise(t: Tensor) -> Tensor:
        return torch.where(select, 10 * torch.randn(t.shape, generator=generator, dtype=t.dtype), t)

    q2, v2 = noise(q), noise(v)
    k2 = q2 if core.needs_shared_qk else noise(k)
    return q2, k2, v2


def as_dtype(core: az.AttentionCore, dtype: torch.dtype) -> az.AttentionCore:
    return copy.deepcopy(core).to(dtype)


def as_function(
    core: az.AttentionCore, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool
) -> tuple[Callable[..., Tensor], tuple[Tensor, ...]]:
    """``core`` as a function of its independent inputs, made leaves that require grad: (q, k, v), or (q, v)
    for a shared-QK core (whose k is q), for ``gradgradcheck`` and ``torch.utils.checkpoint``."""
    inputs = tuple(t.detach().requires_grad_(True) for t in ((q, v) if core.needs_shared_qk else (q, k, v)))

    def attention(*tensors: Tensor) -> Tensor:
        q, k, v = (tensors[0], tensors[0], tensors[1]) if core.needs_shared_qk else tensors
        return core(q, k, v, mask=mask, causal=causal)

    return attention, inputs


def causal_modes(name: str) -> list[bool]:
    """The values of ``causal`` a core takes: both, ``[False]`` without ``supports_causal``, ``[True]`` when
    ``causal_only``."""
    cls = az.get_attention_class(name)
    return [True] if cls.causal_only else [False, True] if cls.supports_causal else [False]


def plain_causal(name: str) -> bool:
    """``causal`` for a test that is about something else: False, or True for a causal-only core."""
    return az.get_attention_class(name).causal_only


def skip_unless_takes(name: str, causal: bool) -> None:
    """Skip a test parametrised over ``causal`` for the value this core refuses (checked by the refusal tests)."""
    if causal not in causal_modes(name):
        pytest.skip(f"{name} takes causal={causal_modes(name)[0]} only (its refusal is tested separately)")
