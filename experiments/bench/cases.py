"""What ``zoo bench`` measures: the sweep configuration (one dataclass, read from YAML and the command
line alike) and its expansion into :class:`Case` objects, each one workload on one device.

An attention entry is a spec in the flag syntax of every command (``linformer:k=128``, :mod:`attention_zoo.spec`),
or in YAML a mapping ``{attention, options, min_seq_len, max_seq_len}``; the length bounds drop cases that make no
sense for a config (Linformer Table 3 shows "-" where k >= n).

Levels: ``core`` (the mechanism alone), ``mha`` (with its projections), ``layer`` (an encoder layer),
``encoder`` (``depth`` layers with embeddings), ``seq2seq`` (an encoder-decoder,
:class:`attention_zoo.seq2seq.Seq2SeqTransformer`, ``depth`` layers each, the mechanism in the encoder and,
by the decoder rule, the decoder; cross-attention ``full``; n source tokens). Modes ``fwd`` and ``fwd+bwd``
(at ``seq2seq``: teacher forcing over n target tokens), and, at the ``seq2seq`` level only, ``decode``
(greedy decoding of n target tokens with the decoding cache) and ``decode-recompute`` (the same, the
decoder recomputed over the whole prefix at every step); EOS is never generated, so every case decodes
exactly n tokens per sequence. Mode ``decode-step``, at the ``core`` level only: one step of step-by-step
causal decoding (:meth:`attention_zoo.AttentionCore.decode`, one new position per sequence) after a prefill
of n positions: the per-token cost of decoding at position n (constant for a recurrent state, growing
with n for a key/value cache), timed over ``measure.DECODE_STEPS_PER_CALL`` steps per call and reported per step.

A sweep is checked before anything runs: every setting has its type and range (:class:`BenchConfig`),
every entry's name and options are checked against the registry (:meth:`attention_zoo.AttentionSpec.checked`) and
the entry is built (on the ``meta`` device: no memory) at the sizes it will run at
(:func:`invalid_entries`), and a sweep that expands to no case is refused by ``zoo bench``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

if TYPE_CHECKING:  # torch and the zoo are imported where they are used: zoo bench --help stays fast
    from attention_zoo.spec import AttentionSpec

Level = Literal["core", "mha", "layer", "encoder", "seq2seq"]
Mode = Literal["fwd", "fwd+bwd", "decode", "decode-recompute", "decode-step"]
DType = Literal["float32", "bfloat16", "float16"]
Kind = Literal["time", "max_batch"]

LEVELS: tuple[str, ...] = Level.__args__
MODES: tuple[str, ...] = Mode.__args__
DTYPES: tuple[str, ...] = DType.__args__
DECODE_MODES: tuple[str, ...] = ("decode", "decode-recompute")


@dataclass(frozen=True)
class SweepEntry:
    """One mechanism of a sweep (``spec``), and the sequence lengths it applies to."""

    spec: AttentionSpec
    min_seq_len: int = 1
    max_seq_len: int | None = None

    def fits(self, n: int) -> bool:
        return self.min_seq_len <= n and (self.max_seq_len is None or n <= self.max_seq_len)


def sweep_entries(entry: str | dict[str, Any]) -> list[SweepEntry]:
    """The entries of one item of ``attentions``: specs in the flag syntax (``full,linformer:k=128``), or a YAML
    mapping ``{attention, options, min_seq_len, max_seq_len}``."""
    from attention_zoo.spec import AttentionSpec, parse_list

    if isinstance(entry, str):
        return [SweepEntry(spec) for spec in parse_list(entry)]
    unknown = set(entry) - {"attention", "options", "min_seq_len", "max_seq_len"}
    if unknown or "attention" not in entry:
        raise ValueError(
            f"attention entry {entry!r}: expected keys attention, options, min_seq_len, max_seq_len"
            + (f"; unknown {sorted(unknown)}" if unknown else "")
        )
    bounds = [entry.get("min_seq_len", 1), entry.get("max_seq_len")]
    if not isinstance(entry.get("options", {}), dict) or not all(_is_a(b, int) for b in bounds if b is not None):
        raise ValueError(f"attention entry {entry!r}: options must be a mapping, min_seq_len and max_seq_len ints")
    spec = AttentionSpec(entry["attention"], entry.get("options") or {})
    return [SweepEntry(spec, *bounds)]


def setting(help: str, default: Any) -> Any:
    """A :class:`BenchConfig` field; ``help`` becomes the ``--flag``'s help."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class BenchConfig:
    """Every setting of a sweep; YAML keys and ``--flag-names`` are these field names."""

    attentions: list[SweepEntry] = setting(
        "mechanisms in the flag syntax of attention_zoo.spec, e.g. full,linformer:k=128 (default: every registered "
        "one)",
        [],
    )
    seq_lens: list[int] = setting("sequence lengths n", [512, 1024])
    batch: list[int] = setting("batch sizes", [1])
    heads: list[int] = setting("attention heads", [8])
    dim_head: list[int] = setting("head width D", [64])
    levels: list[str] = setting(f"what runs: {', '.join(LEVELS)}", ["core"])
    modes: list[str] = setting(f"{', '.join(MODES)}", ["fwd+bwd"])
    dtypes: list[str] = setting(f"{', '.join(DTYPES)}", ["float32"])
    threads: list[int] = setting("torch CPU threads (1: these machines throttle a second busy thread)", [1])
    device: str = setting("cpu, cuda or auto", "auto")
    causal: bool = setting(
        "causal attention (cores without it are recorded unsupported, and so are causal-only cores without this)", False
    )
    dim: int | None = setting("model width for mha/layer/encoder (default heads * dim_head)", None)
    depth: int = setting("encoder layers (seq2seq: encoder and decoder layers each)", 12)
    ff_mult: int = setting("feed-forward width multiple", 4)
    vocab_size: int = setting("encoder vocabulary", 1000)
    repeats: int = setting("timed repeats (median, min, max reported)", 5)
    warmup: int = setting("untimed calls first", 1)
    rounds: int = setting(
        "times the whole sweep is measured, round after round; each case's fastest round is its result", 1
    )
    case_timeout_s: float = setting("wall-clock bound of one case, start-up included", 300.0)
    max_batch: bool = setting("also search the largest batch that fits (Linformer Table 3)", False)
    memory_budget_gb: float | None = setting("memory a case may use (CPU default 8; CUDA default: the device)", None)
    max_batch_cap: int = setting("largest batch the search tries", 4096)
    search_timeout_s: float = setting("wall-clock bound of one max-batch search", 600.0)
    isolation: str = setting(
        "process: a fresh worker process per case (memory isolation, OOM safety, the time bound); "
        "none: in-process (quick, unbounded, memory less clean)",
        "process",
    )

    def __post_init__(self) -> None:
        from attention_zoo.spec import AttentionSpec

        # a spec alone is an entry of every length: BenchConfig(attentions=[AttentionSpec("full")])
        self.attentions = [SweepEntry(e) if isinstance(e, AttentionSpec) else e for e in self.attentions]
        for spec in dataclasses.fields(self):
            _check_type(spec.name, getattr(self, spec.name), typing.get_type_hints(BenchConfig)[spec.name])
        for name, allowed in (("levels", LEVELS), ("modes", MODES), ("dtypes", DTYPES)):
            bad = [v for v in getattr(self, name) if v not in allowed]
            if bad:
                raise ValueError(f"{name}: {bad} not among {', '.join(allowed)}")
        for name in ("seq_lens", "batch", "heads", "dim_head", "threads", "levels", "modes", "dtypes"):
            if not getattr(self, name):
                raise ValueError(f"{name} is empty: the sweep would run no case")
        for name in ("seq_lens", "batch", "heads", "dim_head", "threads"):
            bad = [v for v in getattr(self, name) if v < 1]
            if bad:
                raise ValueError(f"{name}: {bad} must be >= 1")
        for name in ("depth", "ff_mult", "vocab_size", "max_batch_cap", "dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("case_timeout_s", "search_timeout_s", "memory_budget_gb"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                unset = " (or unset for the default)" if name == "memory_budget_gb" else ""
                raise ValueError(f"{name} must be a number > 0{unset}, got {value}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.isolation not in ("process", "none"):
            raise ValueError(f"isolation must be process or none, got {self.isolation!r}")
        if any(m in DECODE_MODES for m in self.modes) and "seq2seq" not in self.levels:
            raise ValueError(f"modes {', '.join(DECODE_MODES)} decode with an encoder-decoder: add level seq2seq")
        if "decode-step" in self.modes and "core" not in self.levels:
            raise ValueError("mode decode-step times one decoding step of a core: add level core")
        if self.repeats < 1 or self.warmup < 0 or self.rounds < 1:
            raise ValueError(
                f"repeats and rounds must be >= 1 and warmup >= 0, got {self.repeats}, {self.rounds}, {self.warmup}"
            )
        if self.max_batch and self.isolation != "process":
            raise ValueError("the max-batch search needs isolation: process (a probe may run out of memory)")


def _check_type(name: str, value: Any, hint: Any) -> None:
    """``value`` fits ``hint``: a list of one type, a type, or a type or None (the kinds of hints
    :class:`BenchConfig` has). A YAML file can hold anything, so the sweep checks."""
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ValueError(f"{name} must be a list of {item.__name__}, got {value!r}")
        for element in value:
            _check_type(name, element, item)
        return
    kinds = [kind for kind in typing.get_args(hint) or (hint,) if kind is not type(None)]
    if value is None and type(None) in typing.get_args(hint):
        return
    if not any(_is_a(value, kind) for kind in kinds):
        raise ValueError(f"{name} must be {' or '.join(kind.__name__ for kind in kinds)}, got {value!r}")


def _is_a(value: Any, kind: type) -> bool:
    if kind is bool or isinstance(value, bool):  # True is an int to Python, not to a sweep
        return kind is bool and isinstance(value, bool)
    return isinstance(value, (int, float) if kind is float else kind)


def invalid_entries(config: BenchConfig) -> list[str]:
    """One line per attention entry of the sweep that cannot run at all: an unknown name, an unknown or
    ill-typed option (:meth:`attention_zoo.AttentionSpec.checked`), or options its mechanism rejects at every
    (heads, dim_head, seq_len) it applies to (a size-dependent refusal, e.g. Linformer's k > n at the shortest n
    only, is recorded per case instead). Entries that apply to no sequence length of the sweep are built at no
    size: they do not run."""
    problems = []
    for entry in config.attentions:
        try:
            entry.spec.checked()
        except ValueError as error:
            problems.append(f"{entry.spec.label}: {error}")
            continue
        sizes = itertools.product(config.heads, config.dim_head, [n for n in config.seq_lens if entry.fits(n)])
        errors = [_build_error(entry.spec, heads, dim_head, n) for heads, dim_head, n in sizes]
        if errors and all(errors):
            problems.append(f"{entry.spec.label}: {errors[0]}")
    return problems


def _build_error(spec: AttentionSpec, heads: int, dim_head: int, n: int) -> str | None:
    """Why the core cannot be built at this size (its ``ValueError``), or None if it can. Built on the
    ``meta`` device, so a large Linformer projection costs nothing; any other exception is the runner's
    to record, not a sign of bad options."""
    import torch

    import attention_zoo as az

    try:
        with torch.device("meta"):
            az.create_attention(spec.name, dim_head=dim_head, heads=heads, max_seq_len=n, **spec.options)
    except ValueError as error:
        return f"{error} (at heads={heads}, dim_head={dim_head}, n={n})"
    except Exception:  # not a verdict on the options: the runner records it per case
        return None
    return None


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> BenchConfig:
    """Defaults, then the YAML file, then ``overrides`` (the command line) on top."""
    values: dict[str, Any] = {}
    if path is not None:
        values = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of settings, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(BenchConfig)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown key(s) {unknown}; known: {', '.join(sorted(known))}")
    values.update(overrides)
    if "attentions" in values:
        entries = values["attentions"]
        entries = [entries] if isinstance(entries, str) else entries
        values["attentions"] = [s for e in entries for s in sweep_entries(e)]
    return BenchConfig(**values)


@dataclass
class Case:
    """One workload: every field is part of the resume key (:meth:`key`)."""

    attention: str
    options: dict[str, Any]
    level: Level
    mode: Mode
    dtype: DType
    device: str
    seq_len: int
    batch: int | None  # None for a max-batch search
    heads: int
    dim_head: int
    threads: int
    causal: bool
    dim: int | None = None
    depth: int | None = None
    ff_mult: int | None = None
    vocab_size: int | None = None
    kind: Kind = "time"

    @property
    def spec(self) -> AttentionSpec:
        from attention_zoo.spec import AttentionSpec

        return AttentionSpec(self.attention, self.options)

    @property
    def label(self) -> str:
        return self.spec.label

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def with_batch(self, batch: int) -> Case:
        return dataclasses.replace(self, batch=batch, kind="time")


def expand(config: BenchConfig, device: str) -> list[Case]:
    """The grid, in an order that measures every mechanism at short n before any at long n."""
    cases = []
    grid = itertools.product(
        config.levels, config.modes, config.dtypes, config.threads, config.heads, config.dim_head, config.seq_lens
    )
    for level, mode, dtype, threads, heads, dim_head, n in grid:
        if (mode in DECODE_MODES and level != "seq2seq") or (mode == "decode-step" and level != "core"):
            continue  # decoding needs a decoder, a decoding step a core (checked in BenchConfig)
        model = _model_fields(config, level, heads, dim_head)
        for entry in config.attentions:
            if not entry.fits(n):
                continue
            common = dict(attention=entry.spec.name, options=dict(entry.spec.options), level=level, mode=mode,
                          dtype=dtype, device=device, seq_len=n, heads=heads, dim_head=dim_head, threads=threads,
                          causal=config.causal, **model)  # fmt: skip
            cases.extend(Case(batch=b, **common) for b in config.batch)
            if config.max_batch:
                cases.append(Case(batch=None, kind="max_batch", **common))
    return cases


def _model_fields(config: BenchConfig, level: str, heads: int, dim_head: int) -> dict[str, int | None]:
    """The model sizes that matter at this level; the others stay None so they never split the key."""
    if level == "core":
        return {}
    dim = config.dim or heads * dim_head
    if level == "mha":
        return {"dim": dim}
    if level == "layer":
        return {"dim": dim, "ff_mult": config.ff_mult}
    return {"dim": dim, "ff_mult": config.ff_mult, "depth": config.depth, "vocab_size": config.vocab_size}
