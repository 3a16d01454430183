"""Compiled paths: a core's math as one ``torch.compile``d function, so that Inductor fuses it.

A core with ``impl="compiled"`` (``"auto"``'s choice on CUDA: :func:`resolved`) calls :func:`compiled` on the
same Python function its eager path calls, with static options that select autograd-visible products (the eager
path's hand-written autograd Functions loop over blocks in Python and write into preallocated outputs, which
torch.compile cannot trace whole) and no host synchronisation. Tensors are the function's arguments, options
are bound once (:func:`compiled`'s cache), and everything stateful (a random feature redraw, a Python-side
cache) stays outside: the compiled function has no side effects.

Choices:
- ``"auto"`` compiles on CUDA for sequences of at least :data:`AUTO_MIN_LENGTH` positions: a shorter call is quick
  whatever its path, while each new configuration, dtype or mask compiles anew (seconds to minutes), a cost that
  workloads of many small calls (tests, demos, short contexts) would pay again and again.
- Shapes: torch's default (``dynamic=None``). The first compile specialises every kernel to its shapes, as
  ``dynamic=False`` would, so a loop at fixed shapes runs static kernels; a call with another length or batch
  compiles once more with those sizes symbolic, and later sizes reuse that (with dynamic=False every new length
  would compile, up to torch's recompile limit). Repeated calls compile nothing (torch's guards).
- ``isolate_recompiles=True`` where torch.compile takes it (torch 2.13 does): each configuration counts its own
  recompiles, instead of all configurations of a function sharing one limit (torch's cache is per code object).
- ``fullgraph`` left False: the tests check that each function is one graph; were a torch version to break
  one, it would run split rather than fail, and fullgraph=True would also turn the recompile limit into an error.
- No CUDA graphs (``mode="reduce-overhead"``): a core is one call inside a model, and CUDA graphs reuse their
  output buffers at the next replay, which breaks loops that keep an output across steps or run a layer twice
  (activation checkpointing) unless the loop marks its steps; compiling the whole model that way stays the
  user's choice, and a compiled core then joins the model's graph (:func:`compiled`).
- No second-order gradients: torch.compile's backward is not differentiable (``create_graph=True`` fails).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from functools import cache, partial
from typing import Literal, get_args

import torch
from torch import Tensor

Impl = Literal["auto", "eager", "compiled"]

#: the shortest sequence (of queries) that ``"auto"`` compiles for on CUDA (see the module docstring)
AUTO_MIN_LENGTH = 1024

#: a recompile budget per torch.compile call where torch has one (2.13 does; else one per function)
ISOLATION = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


def check_impl(impl: str) -> None:
    """Refuses an ``impl`` that is not one of :data:`Impl`."""
    if impl not in get_args(Impl):
        raise ValueError(f"impl must be one of {', '.join(map(repr, get_args(Impl)))}, got {impl!r}")


def resolved(impl: Impl, q: Tensor) -> Literal["eager", "compiled"]:
    """The implementation a call with queries ``q`` runs: ``impl``, or for ``"auto"`` compiled on CUDA from
    :data:`AUTO_MIN_LENGTH` positions on, where torch can compile (:func:`compilable`), eager elsewhere (the CPU
    keeps its hand-written kernels)."""
    if impl != "auto":
        return impl
    return "compiled" if q.is_cuda and q.shape[-2] >= AUTO_MIN_LENGTH and compilable() else "eager"


@cache
def compilable() -> bool:
    """Whether torch.compile can build CUDA kernels here: Dynamo supports this Python, and Triton (Inductor's
    GPU code generator, absent from some platforms' CUDA builds) is installed."""
    import torch._dynamo  # seconds to import: only once a CUDA call asks
    from torch.utils._triton import has_triton

    return torch._dynamo.is_dynamo_supported() and has_triton()


def compiled(fn: Callable[..., Tensor], **static: Hashable) -> Callable[..., Tensor]:
    """``fn`` with the keyword arguments ``static`` bound, under ``torch.compile`` (see the module docstring), made
    once per process for each (``fn``, ``static``); its remaining arguments are tensors (or None). Inside a caller's
    own torch.compile (a whole model compiled), ``fn`` as it is: the caller's graph takes it in."""
    if torch.compiler.is_compiling():
        return partial(fn, **static)
    return _compiled(fn, tuple(sorted(static.items())))


@cache
def _compiled(fn: Callable[..., Tensor], static: tuple[tuple[str, Hashable], ...]) -> Callable[..., Tensor]:
    return torch.compile(partial(fn, **dict(static)), **ISOLATION)
