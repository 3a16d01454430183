"""Everything ``zoo bench`` writes next to ``results.jsonl``: ``results.csv``, ``report.md`` (machine,
method, the papers' tables, crossover, max batch, throughput, every case), ``plots/*.png`` and
``tensorboard/``. All of it is rebuilt from the store, so ``zoo bench --report-only`` redraws a sweep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.bench import tables
from experiments.bench.plots import write_plots, write_tensorboard
from experiments.bench.store import ResultStore

METHOD = """\
Method: each case runs in a fresh worker process (unless `isolation: none`), builds its inputs and parameters,
then makes `warmup` untimed calls and `repeats` timed ones; times are the median (min and max in
`results.csv`). `fwd` runs under `torch.inference_mode()`; `fwd+bwd` is one forward and one backward. `decode`
/ `decode-recompute` (level `seq2seq`) are greedy decoding of n tokens by an encoder-decoder, with the
decoding cache / recomputing the decoder over the prefix at every step, under `torch.no_grad()`. Memory
(`peak_mb`) is the peak growth, above the inputs and parameters, during one more (warm) call: on CUDA
`torch.cuda.max_memory_allocated` after a reset; on CPU the resident-set high-water mark (`VmHWM`, reset
through `/proc/self/clear_refs` after `malloc_trim(0)`) minus the resident set before the call. The CPU figure
counts whole pages and every allocation of the process, and a block freed and reused within the call once.
`allocated_peak_mb` is the peak of the bytes torch's allocator handed out during one warm call, above those
live before it: on CUDA the same as `peak_mb`, on CPU summed from `torch.profiler`'s allocation events in a
further call (no malloc pages, no libraries' own buffers). With `rounds` > 1 the whole sweep is measured that
many times, one round after another, and each case's row is its fastest round's (`rounds` in `results.csv`:
how many it was chosen from). FLOPs are formulas (`experiments/bench/flops.py`: matrix products only, fwd+bwd
= 3x fwd; n/a where none is known); the peak is the best large matmul of the same dtype and threads on the
same device. Ratios are full attention (SDPA backend) / mechanism in the same setting: > 1 means faster or
smaller."""


def machine_section(rows: list[dict[str, Any]]) -> str:
    machines = {json.dumps(r["machine"], sort_keys=True): r["machine"] for r in rows if "machine" in r}
    lines = ["- " + "; ".join(f"{k}: {v}" for k, v in machine.items()) for machine in machines.values()]
    threads = sorted({r["threads"] for r in rows})
    lines.append(
        f"- torch threads per case: {', '.join(map(str, threads))} "
        "(the CPU default is 1: these machines throttle a second busy thread)"
    )
    loads = [r["load_avg_1m"] for r in rows if "load_avg_1m" in r]
    if loads:
        # the benchmark's own worker keeps `threads` cores busy; more load than that is someone else's work
        shared = max(loads) > max(threads) + 0.5
        lines.append(
            f"- 1-minute load average when cases finished: {min(loads):.1f} to {max(loads):.1f} "
            + (
                "(above the threads in use: other work shared the CPUs, and times are inflated)"
                if shared
                else "(no more than the threads in use: the CPUs were not shared)"
            )
        )
    return "\n".join(lines)


def render_report(rows: list[dict[str, Any]], title: str = "attention-zoo benchmark") -> str:
    sections = [
        f"# {title}",
        "## Machine\n\n" + machine_section(rows),
        METHOD,
        "## Memory and time by mechanism and n (Nystromformer table layout)\n\n" + tables.nystromformer_table(rows),
    ]
    swept = tables.linformer_table(rows)
    if swept:
        sections.append("## Speedup and memory saving by n and option (Linformer Table 3 layout)\n\n" + swept)
    sections.append("## Crossover: where each mechanism overtakes full attention\n\n" + tables.crossover_table(rows))
    decoding = tables.decoding_table(rows)
    if decoding:
        sections.append("## Greedy decoding: with the decoding cache vs recomputing the prefix\n\n" + decoding)
    searched = tables.max_batch_table(rows)
    if searched:
        sections.append("## Largest batch that fits (ratio to full attention)\n\n" + searched)
    sections.append("## Achieved GFLOP/s (fraction of the measured matmul peak)\n\n" + tables.throughput_table(rows))
    sections.append("## Every case\n\n" + tables.all_cases_table(rows))
    return "\n\n".join(sections) + "\n"


def write_outputs(store: ResultStore) -> dict[str, Path | list[Path]]:
    rows = list(store.best().values())
    report = store.out_dir / "report.md"
    temporary = report.with_suffix(".md.tmp")
    temporary.write_text(render_report(rows))
    temporary.replace(report)
    return {
        "jsonl": store.path,
        "csv": store.write_csv(),
        "markdown": report,
        "plots": write_plots(rows, store.out_dir / "plots"),
        "tensorboard": write_tensorboard(rows, store.out_dir / "tensorboard"),
    }
