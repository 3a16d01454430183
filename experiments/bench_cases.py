"""What ``zoo bench`` measures: the sweep configuration (one dataclass, read from YAML and the command
line alike) and its expansion into :class:`Case` objects, each one workload on one device.

An attention entry is ``name`` or ``name:opt=value,opt=value`` (values parsed as YAML scalars), or in
YAML a mapping ``{attention, options, min_seq_len, max_seq_len}``; the length bounds drop cases that
make no sense for a config (Linformer Table 3 shows "-" where k >= n).

Levels: ``core`` (the mechanism alone), ``mha`` (with its projections), ``layer`` (an encoder layer),
``encoder`` (``depth`` layers with embeddings), ``seq2seq`` (an encoder-decoder,
:class:`attention_zoo.seq2seq.Seq2SeqTransformer`, ``depth`` layers each, the mechanism in the encoder and,
by the decoder rule, the decoder; cross-attention ``full``; n source tokens). Modes ``fwd`` and ``fwd+bwd``
(at ``seq2seq``: teacher forcing over n target tokens), and, at the ``seq2seq`` level only, ``decode``
(greedy decoding of n target tokens with the decoding cache) and ``decode-recompute`` (the same, the
decoder recomputed over the whole prefix at every step); EOS is never generated, so every case decodes
exactly n tokens per sequence.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

Level = Literal["core", "mha", "layer", "encoder", "seq2seq"]
Mode = Literal["fwd", "fwd+bwd", "decode", "decode-recompute"]
DType = Literal["float32", "bfloat16", "float16"]
Kind = Literal["time", "max_batch"]

LEVELS: tuple[str, ...] = Level.__args__
MODES: tuple[str, ...] = Mode.__args__
DTYPES: tuple[str, ...] = DType.__args__
DECODE_MODES: tuple[str, ...] = ("decode", "decode-recompute")


@dataclass(frozen=True)
class AttentionSpec:
    """One mechanism configuration of a sweep, and the sequence lengths it applies to."""

    attention: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    min_seq_len: int = 1
    max_seq_len: int | None = None

    @property
    def label(self) -> str:
        return attention_label(self.attention, self.options)

    def fits(self, n: int) -> bool:
        return self.min_seq_len <= n and (self.max_seq_len is None or n <= self.max_seq_len)


def attention_label(attention: str, options: dict[str, Any]) -> str:
    """``linformer:k=128``: the name people read in tables and plots."""
    return attention + (":" + ",".join(f"{k}={v}" for k, v in options.items()) if options else "")


def parse_attentions(text: str) -> list[AttentionSpec]:
    """``"full,linformer:k=128,lsh:n_hashes=4,bucket_size=64"``: a piece with ``=`` and no ``:`` is
    one more option of the mechanism before it (mechanism names never contain ``=``)."""
    specs: list[tuple[str, dict[str, Any]]] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        if "=" in piece and ":" not in piece:
            if not specs:
                raise ValueError(f"option {piece!r} comes before any attention name in {text!r}")
            assignments = [piece]
        else:
            name, _, rest = piece.partition(":")
            specs.append((name, {}))
            assignments = [a for a in rest.split(":") if a]
        for assignment in assignments:
            key, eq, value = assignment.partition("=")
            if not eq or not key:
                raise ValueError(f"expected opt=value after {specs[-1][0]!r}, got {assignment!r} in {text!r}")
            specs[-1][1][key] = yaml.safe_load(value)
    return [AttentionSpec(name, options) for name, options in specs]


def attention_spec(entry: str | dict[str, Any]) -> list[AttentionSpec]:
    if isinstance(entry, str):
        return parse_attentions(entry)
    unknown = set(entry) - {"attention", "options", "min_seq_len", "max_seq_len"}
    if unknown or "attention" not in entry:
        raise ValueError(
            f"attention entry {entry!r}: expected keys attention, options, min_seq_len, max_seq_len"
            + (f"; unknown {sorted(unknown)}" if unknown else "")
        )
    return [AttentionSpec(**entry)]


def setting(help: str, default: Any) -> Any:
    """A :class:`BenchConfig` field; ``help`` becomes the ``--flag``'s help."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class BenchConfig:
    """Every setting of a sweep; YAML keys and ``--flag-names`` are these field names."""

    attentions: list[AttentionSpec] = setting(
        "mechanisms, e.g. full,linformer:k=128 (default: every registered one)", []
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
    causal: bool = setting("causal attention (cores without it are recorded unsupported)", False)
    dim: int | None = setting("model width for mha/layer/encoder (default heads * dim_head)", None)
    depth: int = setting("encoder layers (seq2seq: encoder and decoder layers each)", 12)
    ff_mult: int = setting("feed-forward width multiple", 4)
    vocab_size: int = setting("encoder vocabulary", 1000)
    repeats: int = setting("timed repeats (median, min, max reported)", 5)
    warmup: int = setting("untimed calls first", 1)
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
        for name, allowed in (("levels", LEVELS), ("modes", MODES), ("dtypes", DTYPES)):
            bad = [v for v in getattr(self, name) if v not in allowed]
            if bad:
                raise ValueError(f"{name}: {bad} not among {', '.join(allowed)}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.isolation not in ("process", "none"):
            raise ValueError(f"isolation must be process or none, got {self.isolation!r}")
        if any(m in DECODE_MODES for m in self.modes) and "seq2seq" not in self.levels:
            raise ValueError(f"modes {', '.join(DECODE_MODES)} decode with an encoder-decoder: add level seq2seq")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats}, {self.warmup}")


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> BenchConfig:
    """Defaults, then the YAML file, then ``overrides`` (the command line) on top."""
    values: dict[str, Any] = {}
    if path is not None:
        values = yaml.safe_load(Path(path).read_text()) or {}
        known = {f.name for f in dataclasses.fields(BenchConfig)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown key(s) {unknown}; known: {', '.join(sorted(known))}")
    values.update(overrides)
    if "attentions" in values:
        entries = values["attentions"]
        entries = [entries] if isinstance(entries, str) else entries
        values["attentions"] = [s for e in entries for s in attention_spec(e)]
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
    def label(self) -> str:
        return attention_label(self.attention, self.options)

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
        if mode in DECODE_MODES and level != "seq2seq":
            continue  # decoding needs a decoder (checked in BenchConfig: seq2seq is among the levels)
        model = _model_fields(config, level, heads, dim_head)
        for spec in config.attentions:
            if not spec.fits(n):
                continue
            common = dict(
                attention=spec.attention,
                options=dict(spec.options),
                level=level,
                mode=mode,
                dtype=dtype,
                device=device,
                seq_len=n,
                heads=heads,
                dim_head=dim_head,
                threads=threads,
                causal=config.causal,
                **model,
            )
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
