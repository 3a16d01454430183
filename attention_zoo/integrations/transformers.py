"""Every zoo mechanism inside a Hugging Face transformers model: ``use_attention(model, "linformer:k=32")``.

transformers (5.x) dispatches attention through ``AttentionInterface``: every attention layer calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, attention_mask, *, scaling,
dropout, **kwargs)`` on (B, H, N, D) tensors, after its own projections, rotary embedding and KV cache, and
expects a (B, N, H, D) output. Importing this module registers one implementation, ``"attention_zoo"``, and a
mask function for it; :func:`use_attention` gives the model its own copy of its config (transformers may share
one config object between models built from it, and the implementation is a config field), attaches one zoo core
to each self-attention layer (as the layer's submodule ``zoo_core``, so its parameters train and are in
``state_dict()``) and switches the model to that implementation. The registered function runs the core attached
to the layer that calls it.

Cross-attention (BART's ``encoder_attn``, T5's ``EncDecAttention``, BERT's ``crossattention``, any
``*CrossAttention`` or layer with ``is_cross_attention``) keeps the model's own implementation (``sdpa``, or
``eager`` where the model ran eager) unless ``cross_attention=name`` puts a zoo core there, which must support
cross-attention with position-free queries (generation attends one new query at a time to the cached keys).

The core gets transformers' own keys and values (after its KV cache; grouped K/V heads expanded as its sdpa
path does), the layer's scale folded into the queries, and the padding mask and causal flag split out of the
4-D mask, or, for packed rows (``position_ids`` restarting at 0, a block-diagonal mask, ``cu_seq_lens_q``), the
documents' boundaries as ``segments`` (:func:`read_mask`); any other mask, a sliding window, softcap, sinks or a
position bias is refused. A causal layer takes the decoder rule
(:func:`attention_zoo.seq2seq.resolve_decoder_attention`); ``lsh`` is refused (shared QK). docs/huggingface.md
("What the core gets") gives the details.

Reloading: :func:`from_pretrained` builds the model with transformers' ``from_pretrained``, applies
:func:`use_attention` with the spec stored in the saved config (or the one given), then loads every zoo tensor,
refusing a missing, unexpected or mis-shaped one; transformers' load report on the zoo tensors is held back, a key
outside them that differs is one warning line, and the whole report is shown when transformers' loading fails.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import json
import logging
import math
import re
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from einops import repeat
from safetensors import safe_open
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedConfig, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from attention_zoo import packing
from attention_zoo.core import AttentionCore, BuildContext
from attention_zoo.registry import create_attention, get_attention_class, list_attentions
from attention_zoo.seq2seq import causal_cores, resolve_decoder_attention
from attention_zoo.spec import AttentionSpec

__all__ = ["IMPLEMENTATION", "attention_layers", "from_pretrained", "read_mask", "split_mask", "use_attention"]

#: the ``attn_implementation`` name this module registers with transformers
IMPLEMENTATION = "attention_zoo"
#: where a layer keeps its core, where the model keeps state its cores share, where the config keeps the spec
CORE_ATTRIBUTE = "zoo_core"
SHARED_ATTRIBUTE = "attention_zoo_shared"
CONFIG_ATTRIBUTE = "attention_zoo"
#: where a cross-attention layer keeps the implementation it runs without a core ("sdpa" or "eager")
OWN_IMPLEMENTATION_ATTRIBUTE = "attention_zoo_own_implementation"
#: the names transformers' encoder-decoder models give their cross-attention layers (BART's ``encoder_attn``, T5's
#: ``EncDecAttention``, BERT's ``crossattention``, ``cross_attn``, ...): BART uses one class for both kinds
CROSS_ATTENTION_NAME = re.compile(r".*cross_?att.*|encoder_attn.*|enc_?dec_?att.*", re.IGNORECASE)
#: keyword arguments of the attention call that change what attention computes; the zoo cores do none of them
UNSUPPORTED_CALL_OPTIONS = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias", "alibi")
SUPPORTED_MAJOR = 5

if int(transformers.__version__.split(".")[0]) != SUPPORTED_MAJOR:
    raise ImportError(
        f"attention_zoo.integrations.transformers needs transformers {SUPPORTED_MAJOR}.x (its masking API); "
        f"found {transformers.__version__}: pip install -e '.[hf]'"
    )

logger = logging.getLogger(__name__)


def use_attention(
    model: PreTrainedModel,
    attention: str | AttentionSpec,
    *,
    decoder_options: dict[str, Any] | None = None,
    cross_attention: str | AttentionSpec | None = None,
    cross_options: dict[str, Any] | None = None,
    max_seq_len: int | None = None,
    **options: Any,
) -> PreTrainedModel:
    """Make every self-attention layer of ``model`` run the zoo core ``attention``; returns ``model`` (changed in
    place).

    ``attention``: a spec in the flag syntax every ``zoo`` command takes (``"linformer:k=32,sharing=kv"``, read by
    :mod:`attention_zoo.spec`), an :class:`~attention_zoo.AttentionSpec`, or a bare name; ``options``: more of the
    core's options as keywords (``zoo list``); an option given both ways is refused. The spec is checked against
    the registry before any layer changes. In a causal layer a non-causal mechanism is replaced by its
    ``causal_counterpart``, built with ``decoder_options`` (else its defaults), and a warning names the core that
    runs and the options dropped; a causal mechanism keeps its options unless ``decoder_options`` is given.
    Cross-attention layers keep the model's own implementation (sdpa, or eager where the model ran eager) unless
    ``cross_attention`` names a zoo core for them (a spec as ``attention``, with ``cross_options`` added; one that
    cannot attend queries of
    one sequence to keys of another, one query at a time, is refused). ``max_seq_len``: what cores that size
    parameters by length (Linformer's E, F) are built for; default the config's ``max_position_embeddings``.
    The model gets its own copy of its config first, so another model built from the same config object keeps
    its attention. Calling it again replaces the cores (fresh parameters).
    """
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"use_attention needs a transformers PreTrainedModel, got {type(model).__name__}")
    spec = _spec("attention", attention, options)
    name, options = spec.name, dict(spec.options)
    if cross_attention is not None:
        cross = _spec("cross_attention", cross_attention, cross_options or {})
        cross_attention, cross_options = cross.name, dict(cross.options)
    found = attention_layers(model)
    layers = [(path, module) for path, module in found if not _is_cross_attention(path, module)]
    cross_layers = [(path, module) for path, module in found if _is_cross_attention(path, module)]
    if not layers or not type(model)._can_set_attn_implementation():
        raise ValueError(
            f"{type(model).__name__} has no self-attention layer that dispatches through transformers' "
            "AttentionInterface (ALL_ATTENTION_FUNCTIONS), so its attention cannot be swapped"
        )
    causalities = {bool(getattr(module, "is_causal", False)) for _, module in layers}
    rules = {causal: _layer_rule(name, options, decoder_options, causal) for causal in sorted(causalities)}
    cross_rule = None if cross_attention is None else _cross_rule(cross_attention, cross_options)
    _own_config(model)
    shared = nn.ModuleDict()
    setattr(model, SHARED_ATTRIBUTE, shared)
    for index, (path, module) in enumerate(layers):
        core_name, core_options, _ = rules[bool(getattr(module, "is_causal", False))]
        context = BuildContext(layer_index=index, num_layers=len(layers), shared=shared)
        _attach_core(module, path, model, core_name, core_options, context, max_seq_len)
    cross_shared = nn.ModuleDict()  # cross-attention cores share state among themselves only
    for index, (path, module) in enumerate(cross_layers):
        if not hasattr(module, OWN_IMPLEMENTATION_ATTRIBUTE):
            setattr(module, OWN_IMPLEMENTATION_ATTRIBUTE, _own_implementation(module, model))
        if cross_rule is None:
            if hasattr(module, CORE_ATTRIBUTE):
                delattr(module, CORE_ATTRIBUTE)
            continue
        context = BuildContext(layer_index=index, num_layers=len(cross_layers), shared=cross_shared)
        _attach_core(module, path, model, cross_rule[0], cross_rule[1], context, max_seq_len)
    if len(cross_shared):
        shared["cross"] = cross_shared
    reference = next(model.parameters())
    shared.to(device=reference.device, dtype=reference.dtype)
    _declare_aliases(model)
    stored = {
        "attention": name, "options": options, "decoder_options": decoder_options,
        "cross_attention": cross_attention, "cross_options": cross_options, "max_seq_len": max_seq_len,
    }  # fmt: skip
    setattr(model.config, CONFIG_ATTRIBUTE, json.loads(json.dumps(stored)))  # as the saved config.json has it
    model.set_attn_implementation(IMPLEMENTATION)
    for causal, (core_name, core_options, reason) in rules.items():
        kind = "causal" if causal else "non-causal"
        if core_name == name:
            logger.info("attention_zoo: %s self-attention layers run %s (%s)", kind, core_name, reason)
            continue
        dropped = ", ".join(f"{k}={v!r}" for k, v in options.items()) or "none"
        logger.warning(
            "attention_zoo: %s self-attention layers run %s with options %s, not %s (%s); options dropped: %s",
            kind, core_name, core_options, name, reason, dropped,
        )  # fmt: skip
    if cross_layers:
        what = f"zoo core {cross_rule[0]}" if cross_rule else "the model's own implementation"
        logger.info("attention_zoo: %d cross-attention layers run %s", len(cross_layers), what)
    return model


def _spec(argument: str, value: str | AttentionSpec, options: dict[str, Any]) -> AttentionSpec:
    """``value`` (a spec, or the flag syntax) with the keyword ``options`` added, checked against the registry."""
    spec = AttentionSpec.of(value)
    twice = sorted(set(spec.options) & set(options))
    if twice:
        raise ValueError(
            f"{argument} {spec.label!r}: option(s) {', '.join(twice)} given both in the spec and as keywords; give "
            "each once"
        )
    return AttentionSpec(spec.name, {**spec.options, **options}).checked()


def _attach_core(
    module: nn.Module,
    path: str,
    model: PreTrainedModel,
    name: str,
    options: dict[str, Any],
    context: BuildContext,
    max_seq_len: int | None,
) -> None:
    heads, dim_head = _layer_shape(module, path)
    core = create_attention(
        name, dim_head=dim_head, heads=heads, max_seq_len=_max_seq_len(module, model, max_seq_len), context=context,
        **options,
    )  # fmt: skip
    reference = next(module.parameters(), None)
    if reference is not None:
        core.to(device=reference.device, dtype=reference.dtype)
    core.train(module.training)  # a model already in eval() must not train its new cores (Performer redraws)
    setattr(module, CORE_ATTRIBUTE, core)


def _own_config(model: nn.Module) -> None:
    """Point every module of ``model`` at a private copy of the config tree it holds (sub-configs included).

    transformers' ``from_config(config)`` keeps the object it is given, so two models built from one config share
    it: switching one model's implementation would switch the other's.
    """
    copies: dict[int, Any] = {}  # deepcopy's memo: id of each original object -> its copy
    copy.deepcopy(model.config, copies)
    for module in model.modules():
        for attribute, value in list(vars(module).items()):
            if isinstance(value, PreTrainedConfig) and id(value) in copies:
                setattr(module, attribute, copies[id(value)])


def from_pretrained(
    model_class: Any,
    path: str | Path,
    attention: str | AttentionSpec | None = None,
    *,
    decoder_options: dict[str, Any] | None = None,
    cross_attention: str | AttentionSpec | None = None,
    cross_options: dict[str, Any] | None = None,
    max_seq_len: int | None = None,
    model_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> PreTrainedModel:
    """Reload a model saved (``save_pretrained(path)``) after :func:`use_attention`, zoo parameters included.

    ``model_class``: a transformers model class or Auto class (``AutoModelForCausalLM``); ``model_kwargs`` go
    to its ``from_pretrained`` (``dtype``, ...). ``attention`` (as :func:`use_attention` takes it) and its options
    default to the spec that :func:`use_attention` stored in the saved config. Plain ``from_pretrained`` would drop
    the zoo tensors.

    transformers' load report is not printed for the zoo tensors it skips (they are loaded here); keys outside the
    zoo's that it found missing, unexpected or mis-shaped are logged as one warning line naming them. When its
    loading fails, its whole report is logged before the error.
    """
    path = Path(path)
    with _held_load_report(path):
        model, info = model_class.from_pretrained(path, **{**(model_kwargs or {}), "output_loading_info": True})
    _warn_foreign_keys(path, info)
    if attention is None:
        spec = getattr(model.config, CONFIG_ATTRIBUTE, None)
        if not isinstance(spec, dict):
            raise ValueError(
                f"{path}/config.json has no {CONFIG_ATTRIBUTE!r} entry (it was not saved after use_attention); "
                "pass the attention name and its options"
            )
        attention, options = spec["attention"], dict(spec["options"])
        decoder_options, max_seq_len = spec["decoder_options"], spec["max_seq_len"]
        cross_attention, cross_options = spec.get("cross_attention"), spec.get("cross_options")
    use_attention(
        model, attention, decoder_options=decoder_options, cross_attention=cross_attention,
        cross_options=cross_options, max_seq_len=max_seq_len, **options,
    )  # fmt: skip
    load_zoo_tensors(model, path)
    return model


@contextlib.contextmanager
def _held_load_report(path: Path) -> Iterator[None]:
    """Keep back the load report transformers logs for ``path``; log it after all if the loading fails.

    The report is told apart by the function that logs it, not by its wording; a report for another path (another
    thread loading at the same time) passes.
    """
    reporter = logging.getLogger("transformers.modeling_utils")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.funcName == "log_state_dict_report" and f"from: {path}" in record.getMessage():
            held.append(record)
            return False
        return True

    reporter.addFilter(hold)
    try:
        yield
    except BaseException:
        reporter.removeFilter(hold)
        for record in held:  # transformers' error points at its report
            reporter.handle(record)
        raise
    reporter.removeFilter(hold)


def _warn_foreign_keys(path: Path, info: dict[str, Any]) -> None:
    """One warning line naming the keys outside the zoo's that transformers' loading found missing, unexpected or
    mis-shaped (``info``: the ``loading_info`` of its ``from_pretrained``)."""
    found = {
        "unexpected": sorted(k for k in info["unexpected_keys"] if not _is_zoo_key(k)),
        "missing": sorted(info["missing_keys"]),
        "mis-shaped": [f"{k} (checkpoint {tuple(a)}, model {tuple(b)})" for k, a, b in sorted(info["mismatched_keys"])],
    }
    parts = [
        f"{kind} {', '.join(keys[:5])}" + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        for kind, keys in found.items()
        if keys
    ]
    if parts:
        logger.warning(
            "attention_zoo: %s: checkpoint and model differ outside the zoo's tensors: %s", path, "; ".join(parts)
        )


def load_zoo_tensors(model: nn.Module, path: str | Path) -> None:
    """Copy every zoo parameter and buffer of ``model`` from the safetensors checkpoint in folder ``path``.

    A tensor that several names share (Linformer's ``sharing="kv"`` or ``"layerwise"``) is found under any of
    them, since ``save_pretrained`` keeps one name per shared tensor.
    """
    stored = _checkpoint_tensor_files(Path(path))
    groups = _zoo_tensor_names(model)
    missing = []
    with torch.no_grad():
        for tensor, names in groups.values():
            found = next((n for n in names if n in stored), None)
            if found is None:
                missing.append(names[0])
                continue
            with safe_open(stored[found], framework="pt", device="cpu") as f:
                value = f.get_tensor(found)
            if value.shape != tensor.shape:
                raise ValueError(
                    f"{path}: {found} has shape {tuple(value.shape)}, the model's is {tuple(tensor.shape)}; "
                    "load with the attention and options it was saved with"
                )
            tensor.copy_(value)
    known = {n for _, names in groups.values() for n in names}
    unexpected = sorted(k for k in stored if _is_zoo_key(k) and k not in known)
    if missing or unexpected:
        raise ValueError(
            f"{path}: the zoo tensors do not match the model's (attention {getattr(model.config, CONFIG_ATTRIBUTE)}): "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}; load with the attention and options it was saved with"
        )


def _zoo_tensor_names(model: nn.Module) -> dict[int, tuple[Tensor, list[str]]]:
    """id -> (tensor, every state_dict name of it) for the zoo's tensors; shared ones have several names."""
    groups: dict[int, tuple[Tensor, list[str]]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if _is_zoo_key(key):
            groups.setdefault(id(tensor), (tensor, []))[1].append(key)
    return groups


def _declare_aliases(model: nn.Module) -> None:
    """Tell ``save_pretrained`` which names of a shared zoo tensor to drop (it refuses undeclared shared tensors).

    transformers reads ``_tied_weights_keys`` of every submodule when saving (patterns relative to that module);
    each core lists its names of a tensor whose kept name is elsewhere: the model-wide shared module's name if
    there is one, else the first in order.
    """
    cores = {path: module for path, module in model.named_modules() if path.endswith(f".{CORE_ATTRIBUTE}")}
    dropped: dict[str, dict[str, str]] = {path: {} for path in cores}
    for _, names in _zoo_tensor_names(model).values():
        kept = min(names, key=lambda n: (not n.startswith(f"{SHARED_ATTRIBUTE}."), n))
        for name in names:
            path = name.rsplit(f".{CORE_ATTRIBUTE}.", 1)[0] + f".{CORE_ATTRIBUTE}"
            if name != kept and path in dropped:
                dropped[path][re.escape(name[len(path) + 1 :]) + "$"] = kept
    for path, core in cores.items():
        core._tied_weights_keys = dropped[path] or None


def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules (path, module) whose forward calls transformers' attention interface, in model order."""
    return [(path, m) for path, m in model.named_modules() if _dispatches(type(m))]


def split_mask(mask: Tensor | None, q_length: int, kv_length: int, default_causal: bool) -> tuple[Tensor | None, bool]:
    """The zoo's (B, Nk) key mask (True = attend; None = no padding) and causal flag of a transformers mask.

    ``mask``: None (then ``default_causal``), a 4-D (B, 1 or H, Nq, Nk) boolean mask (True = attend) or float
    additive mask (0 = attend, the dtype's minimum or -inf = blocked). It must be padding of the keys, or that
    and causal aligned to the end (query i sees keys j <= i + Nk - Nq); anything else, packed documents included
    (:func:`read_mask` reads those), is refused. Where both readings fit (one query), ``default_causal`` decides.
    """
    key_mask, causal, segments = read_mask(mask, q_length, kv_length, default_causal)
    if segments is not None:
        raise ValueError(
            "attention_zoo: this attention mask is not padding, nor padding plus causal attention aligned to the end "
            "(it holds packed documents, which read_mask turns into segments)"
        )
    return key_mask, causal


def read_mask(
    mask: Tensor | None,
    q_length: int,
    kv_length: int,
    default_causal: bool,
    *,
    position_ids: Tensor | None = None,
    cu_seq_lens_q: Tensor | None = None,
    cu_seq_lens_k: Tensor | None = None,
) -> tuple[Tensor | None, bool, Tensor | None]:
    """(key mask, causal, segments) of what transformers hands an attention function: the (B, Nk) key mask (True =
    attend; None = no padding) and causal flag of :func:`split_mask`, or, for packed rows, no key mask and the
    documents' boundaries as ``segments`` (B, S + 1) (:mod:`attention_zoo.packing`), each document attending
    only to itself (causally or not: the mask says which).

    Packed rows come in one of two forms, and anything else than padding, padding plus causal, or these is refused:

    - ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (transformers' flash-attention varlen keywords, as
      ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` makes them): the boundaries of one flattened
      row (B = 1), taken as given, as transformers' flash-attention path does (even where a KV cache made the 4-D
      mask plain causal); they must be equal (self-attention), and ``mask`` must be plain (no padding) or packed
      into the same documents.
    - A block-diagonal 4-D mask: what transformers builds from ``position_ids`` that restart within a row, when the
      model gets no 2-D ``attention_mask`` and no KV cache (``use_cache=False``), or a custom 4-D mask. Its documents
      are recovered from the mask exactly (each query's first visible key is its document's start), and the mask
      must equal those documents' block-diagonal mask, causal or not, with padding (queries that see nothing, seen by
      none) after the last document only. ``position_ids`` that restart (a step other than +1) must then count 0, 1,
      2, ... within each document (:func:`~attention_zoo.packing.segments_from_position_ids`) and give the same
      documents: transformers starts a document at any jump, the zoo refuses a jump that is not a restart at 0.

    ``position_ids`` that restart while the mask is plain (transformers packs only without a KV cache) are not
    packed, as in transformers' sdpa, with a warning once. Where both readings fit (one query, or documents of one
    token), ``default_causal`` decides. The result of the last call is reused while the same, unchanged tensors come
    again (every layer of a forward gets the same ones).
    """
    key = (mask, q_length, kv_length, default_causal, position_ids, cu_seq_lens_q, cu_seq_lens_k)
    found = _last_read.get(key)
    if found is None:
        found = _read(mask, q_length, kv_length, default_causal, position_ids, cu_seq_lens_q, cu_seq_lens_k)
        _last_read.put(key, found)
    return found


class _LastRead:
    """A one-entry cache keyed by tensors' identities (held weakly) and versions, and by other values."""

    def __init__(self) -> None:
        self.entry: tuple[tuple[Any, ...], tuple[Tensor | None, bool, Tensor | None]] | None = None

    @staticmethod
    def _held(part: Any) -> tuple[Any, Any]:
        return (weakref.ref(part), part._version) if isinstance(part, Tensor) else (None, part)

    @staticmethod
    def _same(held: tuple[Any, Any], part: Any) -> bool:
        ref, rest = held
        if isinstance(part, Tensor):
            return ref is not None and ref() is part and rest == part._version
        return ref is None and rest == part

    def get(self, key: tuple[Any, ...]) -> tuple[Tensor | None, bool, Tensor | None] | None:
        if self.entry is None:
            return None
        held, value = self.entry
        return value if all(self._same(h, p) for h, p in zip(held, key, strict=True)) else None

    def put(self, key: tuple[Any, ...], value: tuple[Tensor | None, bool, Tensor | None]) -> None:
        self.entry = (tuple(self._held(part) for part in key), value)


_last_read = _LastRead()


def _read(
    mask: Tensor | None,
    q_length: int,
    kv_length: int,
    default_causal: bool,
    position_ids: Tensor | None,
    cu_seq_lens_q: Tensor | None,
    cu_seq_lens_k: Tensor | None,
) -> tuple[Tensor | None, bool, Tensor | None]:
    explicit = _cu_segments(cu_seq_lens_q, cu_seq_lens_k, q_length, kv_length)
    if mask is None:
        key_mask, causal_fits, plain_fits, segments = None, True, True, None
    else:
        allowed = _allowed(mask, q_length, kv_length)
        key_mask, causal_fits, plain_fits, segments = _plain_reading(allowed, q_length, kv_length)
        if not (causal_fits or plain_fits):
            key_mask, causal_fits, plain_fits, segments = _packed_reading(allowed)
    causal = default_causal if causal_fits and plain_fits else causal_fits
    if explicit is not None:
        if key_mask is not None:
            raise ValueError(
                "attention_zoo: transformers passed cu_seq_lens_q (packed rows) with a padding mask; give one or the "
                "other"
            )
        if segments is not None:
            _same_documents(segments, explicit, q_length, "cu_seq_lens_q")
        return None, causal, explicit
    if segments is not None:
        if position_ids is not None and _restarts(position_ids):
            try:
                stated = packing.segments_from_position_ids(position_ids.expand(segments.shape[0], -1))
            except ValueError as error:
                raise ValueError(f"attention_zoo: packed rows: {error}") from None
            _same_documents(segments, stated, q_length, "position_ids")
        return None, causal, segments
    if position_ids is not None and key_mask is None and q_length == kv_length > 1 and _restarts(position_ids):
        _warn_once(
            "position_ids restart within a row but transformers built an unpacked mask (it packs rows only without "
            "a KV cache: pass use_cache=False); attention crosses the restarts, as in transformers' sdpa"
        )
    return key_mask, causal, None


def _allowed(mask: Any, q_length: int, kv_length: int) -> Tensor:
    """``mask`` as a boolean (B, Nq, Nk) tensor, True = attend."""
    if not isinstance(mask, Tensor) or mask.ndim != 4:
        raise ValueError(
            f"attention_zoo takes None or a 4-D (B, 1, Nq, Nk) attention mask from transformers; got "
            f"{type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}"
        )
    if mask.shape[-1] != kv_length or mask.shape[-2] not in (1, q_length):
        raise ValueError(
            f"attention_zoo: attention mask of shape {tuple(mask.shape)} for {q_length} queries and {kv_length} keys; "
            "it must be (B, 1, Nq, Nk) (a static cache, whose keys include unfilled slots, is not supported)"
        )
    if mask.dtype != torch.bool:
        allowed = mask == 0
        if not bool((allowed | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            raise ValueError(
                "attention_zoo takes a 0 / -inf (or dtype minimum) float mask; this one carries an additive bias "
                "(values other than 0 and blocked), which the zoo cores cannot apply"
            )
        mask = allowed
    if mask.shape[1] > 1 and not bool((mask == mask[:, :1]).all()):
        raise ValueError("attention_zoo: the attention mask differs between heads; the zoo takes one per sequence")
    return mask[:, 0].expand(mask.shape[0], q_length, kv_length)


def _plain_reading(allowed: Tensor, q_length: int, kv_length: int) -> tuple[Tensor | None, bool, bool, None]:
    """(key mask, causal fits, non-causal fits, no segments): padding, or padding and causal aligned to the end."""
    key_mask = allowed[:, -1, :].clone()  # the last query sees every real key under either reading
    padded = key_mask[:, None, :]
    query = torch.arange(q_length, device=allowed.device)[:, None] + (kv_length - q_length)
    visible = torch.arange(kv_length, device=allowed.device)[None, :] <= query
    plain_fits, causal_fits = bool((allowed == padded).all()), bool((allowed == (padded & visible)).all())
    return (None if bool(key_mask.all()) else key_mask), causal_fits, plain_fits, None


def _packed_reading(allowed: Tensor) -> tuple[None, bool, bool, Tensor]:
    """(no key mask, causal fits, non-causal fits, segments) of a block-diagonal mask (see :func:`read_mask`)."""
    _, nq, n = allowed.shape
    refusal = ValueError(
        "attention_zoo: this attention mask is not padding, nor padding plus causal attention aligned to the end, nor "
        "packed documents (block-diagonal, causal or not, padding after the last); a sliding window, a static cache "
        "or a custom pattern? the zoo cores take a key mask, a causal flag and document boundaries only"
    )
    if nq != n:
        raise refusal
    positions = torch.arange(n, device=allowed.device)
    sees = allowed.any(-1)
    count = sees.sum(-1)
    if not torch.equal(sees, positions[None, :] < count[:, None]):
        raise refusal  # a query that sees nothing before one that does: not padding after the last document
    starts = sees & (allowed.to(torch.uint8).argmax(-1) == positions)  # argmax gives the first visible key
    lengths = []
    for row_starts, total in zip(starts.tolist(), count.tolist(), strict=True):
        edges = [index for index, start in enumerate(row_starts) if start] + [total]
        if edges[0] != 0:
            raise refusal
        lengths.append([end - start for start, end in itertools.pairwise(edges)])
    segments = packing.segments_from_lengths(lengths, n, device=allowed.device)
    ids = packing.document_ids(segments, n)
    same = (ids[:, :, None] == ids[:, None, :]) & (ids >= 0)[:, :, None]
    causal_fits = torch.equal(allowed, same & (positions[None, :] <= positions[:, None]))
    plain_fits = torch.equal(allowed, same)
    if not (causal_fits or plain_fits):
        raise refusal
    return None, causal_fits, plain_fits, segments


def _cu_segments(cu_q: Tensor | None, cu_k: Tensor | None, q_length: int, kv_length: int) -> Tensor | None:
    """The (1, S + 1) segments of transformers' ``cu_seq_lens_q`` / ``_k``, or None when it passed neither."""
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None or not torch.equal(cu_q.long(), cu_k.long()):
        raise ValueError(
            f"attention_zoo: cu_seq_lens_q {_brief(cu_q)} and cu_seq_lens_k {_brief(cu_k)} differ; packed rows are "
            "read for self-attention only, with one set of boundaries"
        )
    if q_length != kv_length:
        raise ValueError(
            f"attention_zoo: cu_seq_lens_q (packed rows) with {q_length} queries for {kv_length} keys (a cached "
            "step?); packed rows need as many queries as keys"
        )
    return packing.segments_from_cu_seqlens(cu_q)


def _restarts(position_ids: Tensor) -> bool:
    """Whether ``position_ids`` (B or 1, N) step by other than +1 somewhere: transformers' sign of packed rows."""
    return bool((position_ids.diff(dim=-1) != 1).any())


def _same_documents(found: Tensor, stated: Tensor, n: int, source: str) -> None:
    found_ids, stated_ids = packing.document_ids(found, n), packing.document_ids(stated.expand(found.shape[0], -1), n)
    differ = (found_ids != stated_ids).nonzero()
    if differ.numel():
        row, position = differ[0].tolist()
        raise ValueError(
            f"attention_zoo: the attention mask's documents and {source}'s disagree in row {row} at position "
            f"{position} (the mask puts it in document {int(found_ids[row, position])}, {source} in "
            f"{int(stated_ids[row, position])}; -1 = padding)"
        )


def zoo_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """The registered ``"attention_zoo"`` implementation: (B, H, N, D) in, (B, N, H, D) and no weights out.

    A cross-attention layer without a core runs its model's own implementation (sdpa or eager) instead.
    """
    core: AttentionCore | None = getattr(module, CORE_ATTRIBUTE, None)
    own = getattr(module, OWN_IMPLEMENTATION_ATTRIBUTE, None)  # set on cross-attention layers only
    if core is None:
        if own is not None:
            call = dict(dropout=dropout, scaling=scaling, is_causal=is_causal)
            return _own_attention(own, module, query, key, value, attention_mask, **call, **kwargs)
        raise ValueError(
            f"{type(module).__name__} has no zoo core; run attention_zoo.integrations.transformers.use_attention("
            f"model, name) before running a model with attn_implementation={IMPLEMENTATION!r}"
        )
    for option in UNSUPPORTED_CALL_OPTIONS:
        if kwargs.get(option) is not None:
            raise ValueError(
                f"{type(module).__name__} calls attention with {option} ({_brief(kwargs[option])}), which the zoo "
                "cores do not apply; supported: plain softmax attention with padding and causal masks"
            )
    if kwargs.get("output_attentions"):
        _warn_once("zoo cores return no attention weights (output_attentions gives None)")
    if dropout > 0:
        _warn_once(f"zoo cores apply no dropout to attention probabilities; the layer's p={dropout} is not applied")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        # the layout of transformers' repeat_kv: K/V head j serves query heads j * groups .. j * groups + groups - 1
        key, value = (repeat(t, "b h n d -> b (h g) n d", g=groups) for t in (key, value))
    if own is not None:
        default_causal = False  # cross-attention; its core is one that attends queries to another sequence
    else:
        default_causal = bool(getattr(module, "is_causal", False)) if is_causal is None else bool(is_causal)
    nq, nk = query.shape[-2], key.shape[-2]
    if own is not None:  # cross-attention: the packed-row keywords describe the queries' sequence only
        (key_mask, causal), segments = split_mask(attention_mask, nq, nk, default_causal), None
    else:
        key_mask, causal, segments = read_mask(
            attention_mask, nq, nk, default_causal, position_ids=kwargs.get("position_ids"),
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"), cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
        )  # fmt: skip
    if segments is not None:
        if not core.supports_segments:
            raise ValueError(
                f"transformers passed packed rows and {core.name} does not take them ({core.segments_refusal}); "
                f"cores that do: {', '.join(list_attentions(segments=True))}"
            )
        if segments.shape[0] != query.shape[0]:  # only cu_seq_lens_q gives one row for the whole batch
            raise ValueError(
                f"attention_zoo: cu_seq_lens_q describes one flattened row (batch 1); this batch has {query.shape[0]}"
            )
        segments = segments.to(query.device)  # a collator's cu_seq_lens may stay on the CPU
    if scaling is not None and not math.isclose(scaling, core.scale, rel_tol=1e-12):
        query = query * (scaling / core.scale)
    if nq < nk and own is None and not (core.supports_cross_attention and core.position_free_queries):
        if not causal:
            raise ValueError(
                f"{core.name} attends a sequence to itself only; this non-causal call has {nq} queries for {nk} keys"
            )
        # a cached step: the new queries are the last positions of the prefix (see the module docstring)
        query = torch.cat([query.new_zeros(*query.shape[:2], nk - nq, query.shape[-1]), query], dim=-2)
        out = core(query, key, value, mask=key_mask, causal=True)[:, :, nk - nq :]
    else:
        out = core(query, key, value, mask=key_mask, causal=causal, segments=segments)
    return out.transpose(1, 2).contiguous(), None


def zoo_mask(**kwargs: Any) -> Tensor | None:
    """The registered mask function: transformers' ``sdpa_mask``, of any pattern.

    A pattern other than padding, or padding plus causal, is refused by the layer it reaches (:func:`split_mask`),
    not here: some models (T5Gemma) build a sliding-window mask on every forward whether or not a layer uses it.
    Keyword arguments as transformers passes them to every mask function (the query positions come as
    ``q_length`` in recent 5.x releases and as ``cache_position`` in early ones; both are passed through).
    """
    q_length = kwargs["q_length"] if "q_length" in kwargs else kwargs["cache_position"].shape[0]
    if q_length not in (1, kwargs["kv_length"]):
        # sdpa's is_causal aligns to the top-left, the zoo's to the end: only these two shapes agree without a mask
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(**kwargs)


def _layer_rule(
    name: str, options: dict[str, Any], decoder_options: dict[str, Any] | None, causal: bool
) -> tuple[str, dict[str, Any], str]:
    """(core, options, why) for a causal or non-causal layer; refuses what no layer of that kind can run."""
    if causal:
        if not get_attention_class(name).supports_causal and get_attention_class(name).causal_counterpart is None:
            raise ValueError(
                f"the model's layers are causal and attention {name!r} is not, and it declares no "
                f"causal_counterpart; causal cores: {', '.join(causal_cores())}"
            )
        rule = resolve_decoder_attention(name, options, None, decoder_options)
        chosen = (rule.attention, rule.options, rule.reason)
    elif get_attention_class(name).causal_only:
        raise ValueError(
            f"the model has bidirectional attention layers and attention {name!r} is causal only; use it in a causal "
            "language model (GPT-2, Llama, ...), or a bidirectional core here"
        )
    else:
        chosen = (name, dict(options), "as named")
    cls = get_attention_class(chosen[0])
    if cls.needs_shared_qk:
        raise ValueError(
            f"attention {chosen[0]!r} needs one shared projection for queries and keys (Reformer's shared-QK), and "
            "transformers' attention layers project them separately; use a core without needs_shared_qk"
        )
    return chosen


def _cross_rule(name: str, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    cls = get_attention_class(name)
    if not (cls.supports_cross_attention and cls.position_free_queries):
        allowed = list_attentions(cross=True, position_free_queries=True)
        raise ValueError(
            f"cross_attention {name!r} cannot attend one sequence's queries to another's keys one query at a time "
            f"(as generation does); cross-attention cores: {', '.join(allowed)}"
        )
    return name, dict(options or {})


def _own_implementation(module: nn.Module, model: PreTrainedModel) -> str:
    """What cross-attention layer ``module`` runs without a core: the model's sdpa or eager implementation."""
    config = getattr(module, "config", None)
    found = (config if isinstance(config, PreTrainedConfig) else model.config)._attn_implementation
    if found == "eager" and _eager_function(module) is not None:
        return "eager"
    if found not in ("sdpa", IMPLEMENTATION):
        why = "its file has no eager_attention_forward" if found == "eager" else "the zoo's mask function builds sdpa's"
        _warn_once(
            f"cross-attention ({type(module).__name__}) runs transformers' sdpa, not the model's {found!r}: {why}"
        )
    return "sdpa"


def _eager_function(module: nn.Module) -> Any:
    """The ``eager_attention_forward`` of the modelling file that defines ``module``'s class, or None."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _own_attention(
    implementation: str,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **call: Any,
) -> tuple[Tensor, Tensor | None]:
    if implementation == "sdpa":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **call)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        # eager kernels add the mask to the scores: 0 where attended, the dtype's minimum elsewhere (as eager_mask)
        blocked = torch.finfo(query.dtype).min
        attention_mask = torch.where(attention_mask, torch.zeros((), dtype=query.dtype, device=query.device), blocked)
    return _eager_function(module)(module, query, key, value, attention_mask, **call)


def _brief(value: Any) -> str:
    """A one-line description of a call option's value for an error message (a tensor by its shape)."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _layer_shape(module: nn.Module, path: str) -> tuple[int, int]:
    config = getattr(module, "config", None)
    heads = _first_int(module, "num_heads", "num_attention_heads") or _first_int(config, "num_attention_heads")
    if heads is None:
        raise ValueError(f"layer {path} ({type(module).__name__}): found no num_heads / num_attention_heads")
    dim_head = _first_int(module, "head_dim", "attention_head_size") or _first_int(config, "head_dim")
    if dim_head is None:
        hidden = _first_int(config, "hidden_size")
        if hidden is None:
            raise ValueError(f"layer {path} ({type(module).__name__}): found no head_dim / attention_head_size")
        dim_head = hidden // heads
    return heads, dim_head


def _max_seq_len(module: nn.Module, model: nn.Module, given: int | None) -> int | None:
    if given is not None:
        return given
    for config in (getattr(module, "config", None), model.config.get_text_config()):
        found = _first_int(config, "max_position_embeddings")
        if found is not None:
            return found
    return None


def _first_int(owner: Any, *names: str) -> int | None:
    for attribute in names:
        value = getattr(owner, attribute, None) if owner is not None else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _is_cross_attention(path: str, module: nn.Module) -> bool:
    """Whether the layer at ``path`` attends to another sequence: declared, by its class or by its name."""
    return (
        bool(getattr(module, "is_cross_attention", False))
        or "CrossAttention" in type(module).__name__
        or any(CROSS_ATTENTION_NAME.fullmatch(part) for part in path.split("."))
    )


@functools.cache
def _dispatches(cls: type) -> bool:
    """Whether ``cls.forward`` calls the attention interface (transformers' own heuristic, per layer class)."""
    if cls.forward is nn.Module.forward:
        return False
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _is_zoo_key(key: str) -> bool:
    return f".{CORE_ATTRIBUTE}." in f".{key}" or key.startswith(f"{SHARED_ATTRIBUTE}.")


def _checkpoint_tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a ``save_pretrained`` folder (one file or a sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.is_file():
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else "no such folder"
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json (found {found})")
    with safe_open(single, framework="pt", device="cpu") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has keys(), no __iter__)


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("attention_zoo: %s", message)


AttentionInterface.register(IMPLEMENTATION, zoo_attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, zoo_mask)
