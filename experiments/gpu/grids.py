"""The GPU suite's grids, sized for minutes on one H100/H200: bf16, core level, B = 8, H = 8 (B H = 64),
d = 64, against the raw SDPA flash kernel at every length.

- ``registry``: every registered mechanism at its ``zoo bench`` default options, fwd+bwd at n = 8192: each
  one's time as a multiple of its floor (:mod:`experiments.gpu.measure`).
- ``nystromformer``: the mechanisms of the Nystromformer paper's efficiency table (Xiong et al. 2021,
  arXiv:2102.03902, Table 1's setting) at n = 512 ... 32768, fwd and fwd+bwd: the crossovers against flash.
- ``linformer``: Linformer Table 3's projected dimensions k = 128 ... 2048 (Wang et al. 2020,
  arXiv:2006.04768), forward, n = 512 ... 65536, each k from n = 2k as in the paper's table.

The committed CPU configs (``configs/bench/nystromformer_table.yaml``, ``linformer_table3.yaml``)
measure the ``mha`` and ``encoder`` levels in fp32/fp16 with a 30-minute max-batch search; those settings do not fit a
GPU session of minutes, so these grids time the cores alone at a fixed batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import attention_zoo as az
from attention_zoo import AttentionSpec
from experiments.bench import command as bench
from experiments.gpu.measure import RAW_SDPA_FLASH, Workload


@dataclass(frozen=True)
class GridEntry:
    """A mechanism of a grid (``spec``), its smaller options in a smoke run (None: the same), and the shortest
    length it is timed at."""

    spec: AttentionSpec
    smoke_options: dict[str, Any] | None = None
    min_seq_len: int = 1

    def at(self, smoke: bool) -> AttentionSpec:
        """The spec a run times: with its smoke options in a smoke run."""
        return (
            self.spec if not smoke or self.smoke_options is None else AttentionSpec(self.spec.name, self.smoke_options)
        )


@dataclass(frozen=True)
class Grid:
    name: str
    entries: tuple[GridEntry, ...]
    seq_lens: tuple[int, ...]
    modes: tuple[str, ...]
    smoke_seq_lens: tuple[int, ...] = (64, 128)

    def workloads(self, base: Workload, smoke: bool) -> list[Workload]:
        """Short lengths first, so a grid cut short by the budget still has every mechanism."""
        lengths = self.smoke_seq_lens if smoke else self.seq_lens
        out = []
        for mode in self.modes:
            for n in lengths:
                for entry in self.entries:
                    if n < entry.min_seq_len and not smoke:
                        continue
                    spec = entry.at(smoke)
                    # a causal-only core has no bidirectional form: it is timed causally (its row says so)
                    causal = base.causal or (
                        spec.name in az.list_attentions() and az.get_attention_class(spec.name).causal_only
                    )
                    out.append(dataclasses.replace(base, spec=spec, seq_len=n, mode=mode, causal=causal))
        return out


BASELINES = (GridEntry(RAW_SDPA_FLASH), GridEntry(AttentionSpec("full")))


def registry_grid(smoke: bool) -> Grid:
    """Every registered mechanism once: its ``zoo bench`` default (smoke: its first example config)."""
    if smoke:
        entries = [
            GridEntry(AttentionSpec(n, az.get_attention_class(n).example_configs[0])) for n in az.list_attentions()
        ]
    else:
        entries = [GridEntry(spec) for spec in bench.default_attentions()]
    if not smoke:  # the xformers backend of full attention, where the package is there
        entries.append(GridEntry(AttentionSpec("full", {"backend": "xformers"})))
    return Grid("registry", (BASELINES[0], *entries), (8192,), ("fwd+bwd",), smoke_seq_lens=(64,))


NYSTROMFORMER = Grid(
    "nystromformer",
    (
        *BASELINES,
        GridEntry(AttentionSpec("linformer", {"k": 256}), {"k": 32}),
        GridEntry(AttentionSpec("longformer", {"window": 256}), {"window": 16}),
        GridEntry(AttentionSpec("local", {"window": 256}), {"window": 16}),
        GridEntry(AttentionSpec("nystrom", {"num_landmarks": 64}), {"num_landmarks": 16}),
        GridEntry(AttentionSpec("nystrom", {"num_landmarks": 32}), {"num_landmarks": 8}),
    ),
    (512, 1024, 2048, 4096, 8192, 16384, 32768),
    ("fwd", "fwd+bwd"),
)

LINFORMER_TABLE3 = Grid(
    "linformer",
    (
        *BASELINES,
        *(
            GridEntry(
                AttentionSpec("linformer", {"k": k, "sharing": "layerwise"}), {"k": 16, "sharing": "layerwise"}, 2 * k
            )
            for k in (128, 256, 512, 1024, 2048)
        ),  # fmt: skip
    ),
    (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
    ("fwd",),
)


def grids(smoke: bool) -> tuple[Grid, ...]:
    """In the order of their value: per-mechanism floors, then crossovers, then Linformer's table."""
    return registry_grid(smoke), NYSTROMFORMER, LINFORMER_TABLE3
