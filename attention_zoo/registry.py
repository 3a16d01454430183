"""The attention registry: one decorator, one factory, one listing.

Options of a mechanism are the keyword-only parameters of its ``__init__``, after the
:class:`~attention_zoo.core.Geometry` every core takes, which :func:`create_attention` makes from its keywords
:data:`COMMON_PARAMETERS`; their type hints are the validation, so there is no parallel config.
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar, Union

from attention_zoo.core import APPROXIMATIONS, AttentionCore, BuildContext, Geometry

__all__ = [
    "COMMON_PARAMETERS",
    "OptionSpec",
    "attention_options",
    "check_options",
    "create_attention",
    "get_attention_class",
    "list_attentions",
    "register_attention",
]

#: the keywords of :func:`create_attention` that make a core's :class:`~attention_zoo.core.Geometry`, not options
COMMON_PARAMETERS = tuple(f.name for f in fields(Geometry))

#: registered name -> core class, filled by :func:`register_attention`
_REGISTRY: dict[str, type[AttentionCore]] = {}


def names_with(**capabilities: Any) -> list[str]:
    """Registered names, sorted, of the classes whose attributes have the given values
    (``names_with(supports_causal=True)``)."""
    return sorted(name for name, cls in _REGISTRY.items() if all(getattr(cls, a) == v for a, v in capabilities.items()))


CoreT = TypeVar("CoreT", bound=type[AttentionCore])


def register_attention(name: str) -> Callable[[CoreT], CoreT]:
    """Class decorator: make an :class:`AttentionCore` subclass available under ``name``."""

    def wrap(cls: CoreT) -> CoreT:
        if name in _REGISTRY:
            raise ValueError(f"attention {name!r} is already registered (by {_REGISTRY[name].__qualname__})")
        if not (isinstance(cls, type) and issubclass(cls, AttentionCore)):
            raise TypeError(f"@register_attention({name!r}) needs an AttentionCore subclass, got {cls!r}")
        if getattr(cls, "approximation", None) not in APPROXIMATIONS:
            raise TypeError(
                f"{cls.__qualname__}: declare approximation = one of {', '.join(map(repr, APPROXIMATIONS))}; "
                f"got {getattr(cls, 'approximation', None)!r}"
            )
        for option in attention_options(cls):
            if option.kind != inspect.Parameter.KEYWORD_ONLY:
                raise TypeError(f"{cls.__qualname__}: option {option.name!r} must be keyword-only")
            if option.name in COMMON_PARAMETERS:
                raise TypeError(
                    f"{cls.__qualname__}: {option.name!r} is part of the Geometry every core takes as its first "
                    "argument (def __init__(self, geometry: Geometry, *, <options>)), not an option"
                )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


#: the filters of :func:`list_attentions` and the capability each one reads
CAPABILITY_FILTERS = {
    "causal": "supports_causal",
    "causal_only": "causal_only",
    "mask": "supports_mask",
    "cross": "supports_cross_attention",
    "decoding": "has_decoding_cache",
    "double_backward": "supports_double_backward",
    "position_free_queries": "position_free_queries",
    "segments": "supports_segments",
}


def list_attentions(
    *,
    causal: bool | None = None,
    causal_only: bool | None = None,
    mask: bool | None = None,
    cross: bool | None = None,
    decoding: bool | None = None,
    double_backward: bool | None = None,
    position_free_queries: bool | None = None,
    segments: bool | None = None,
) -> list[str]:
    """Registered mechanism names, sorted; each filter given (not None) keeps the mechanisms whose capability has
    that value (as timm's ``list_models(filter=...)``): ``causal`` reads ``supports_causal``, ``causal_only``
    the attribute of that name (cores that refuse ``causal=False``), ``mask``
    ``supports_mask``, ``cross`` ``supports_cross_attention``, ``decoding`` ``has_decoding_cache`` (a step-by-step
    cache of its own; every causal core can decode by recomputing), ``double_backward`` ``supports_double_backward``,
    ``position_free_queries`` the attribute of that name, ``segments`` ``supports_segments`` (packed rows).
    ``list_attentions(causal=True, decoding=False)``: the causal cores that decode by recomputation."""
    given = (("causal", causal), ("causal_only", causal_only), ("mask", mask), ("cross", cross), ("decoding", decoding),
             ("double_backward", double_backward), ("position_free_queries", position_free_queries),
             ("segments", segments))  # fmt: skip
    for name, value in given:
        if value is not None and not isinstance(value, bool):
            # 'yes', 1 or 'false' would compare unequal to every capability and list nothing
            raise ValueError(f"list_attentions: {name} must be True, False or None, got {value!r}")
    return names_with(**{CAPABILITY_FILTERS[name]: value for name, value in given if value is not None})


def get_attention_class(name: str) -> type[AttentionCore]:
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown attention {name!r}; known: {', '.join(list_attentions())}{hint}") from None


@dataclass(frozen=True)
class OptionSpec:
    name: str
    annotation: Any
    default: Any
    kind: inspect._ParameterKind

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty

    def type_name(self) -> str:
        return _type_name(self.annotation)


def attention_options(cls: type[AttentionCore]) -> list[OptionSpec]:
    """The options a mechanism accepts (its ``__init__`` parameters after ``self`` and ``geometry``), in signature
    order, with their resolved type hints."""
    hints = typing.get_type_hints(cls.__init__)
    params = inspect.signature(cls.__init__).parameters.values()
    return [
        OptionSpec(p.name, hints.get(p.name, Any), p.default, p.kind)
        for p in params
        if p.name not in ("self", "geometry") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


def create_attention(
    name: str,
    *,
    dim_head: int,
    heads: int,
    max_seq_len: int | None = None,
    context: BuildContext | None = None,
    **options: Any,
) -> AttentionCore:
    """Build the core registered as ``name``; unknown or ill-typed options raise ``ValueError``."""
    check_options(name, options)
    return get_attention_class(name)(Geometry(dim_head, heads, max_seq_len, context), **options)


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """``ValueError`` naming the problem unless ``name`` is registered and ``options`` are its options, each of
    its type, with every required one given."""
    cls = get_attention_class(name)
    specs = {spec.name: spec for spec in attention_options(cls)}
    unknown = sorted(set(options) - set(specs))
    if unknown:
        raise ValueError(f"attention {name!r} has no option {', '.join(map(repr, unknown))}; {describe_options(cls)}")
    for key, value in options.items():
        spec = specs[key]
        if not _matches(value, spec.annotation):
            raise ValueError(
                f"attention {name!r}: option {key}={value!r} is not a valid {spec.type_name()}; {describe_options(cls)}"
            )
    missing = [s.name for s in specs.values() if s.required and s.name not in options]
    if missing:
        raise ValueError(f"attention {name!r} needs option(s) {', '.join(missing)}; {describe_options(cls)}")


def describe_options(cls: type[AttentionCore]) -> str:
    specs = attention_options(cls)
    if not specs:
        return "it takes no options"
    return "valid options: " + ", ".join(
        f"{s.name}: {s.type_name()}" + ("" if s.required else f" = {s.default!r}") for s in specs
    )


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the type hint (Literal, unions, containers, plain classes)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if hint is type(None):
        return "None"
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(hint, "__name__", str(hint))
