"""Figures of a sweep: log-log PNGs of time and memory against n (one line per mechanism, one file per
setting) and TensorBoard scalars with n as the step, so ``tensorboard --logdir <out>/tensorboard``
overlays the mechanisms (one run each, in the folder ``AttentionSpec.folder`` names: ``linformer-k=128``) on
one chart per setting and quantity."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)

from experiments.bench.tables import Row, by_config, group_rows, group_title, spec  # noqa: E402

QUANTITIES = (("time_ms_median", "time (ms, median)"), ("peak_mb", "peak memory (MB)"))


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9+=.-]+", "_", text).strip("_")


def write_plots(rows: list[Row], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, members in group_rows(rows).items():
        title = group_title(key)
        figure, axes = plt.subplots(1, len(QUANTITIES), figsize=(15, 4.5))
        for axis in axes:
            axis.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # 20 distinct colours, not 10
        plotted = False
        for name, per_n in by_config(members).items():
            ok = sorted((n, r) for n, r in per_n.items() if r["status"] == "ok")
            if not ok:
                continue
            plotted = True
            for axis, (field, _) in zip(axes, QUANTITIES, strict=True):
                points = [(n, r[field]) for n, r in ok if r[field] > 0]  # a log axis has no room for 0
                axis.plot([n for n, _ in points], [v for _, v in points], marker="o", label=name)
        if not plotted:
            plt.close(figure)
            continue
        for axis, (_, ylabel) in zip(axes, QUANTITIES, strict=True):
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("sequence length n")
            axis.set_ylabel(ylabel)
            axis.grid(True, which="both", alpha=0.3)
        figure.legend(*axes[0].get_legend_handles_labels(), loc="center right", fontsize="small")
        figure.suptitle(title, fontsize="medium")
        figure.tight_layout(rect=(0, 0, 0.75, 1))  # the right quarter holds the legend
        path = out_dir / f"{slug(title)}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


def write_tensorboard(rows: list[Row], log_dir: Path) -> Path:
    """Rewritten from scratch each time, so a resumed sweep never shows a point twice."""
    from torch.utils.tensorboard import SummaryWriter

    shutil.rmtree(log_dir, ignore_errors=True)
    writers: dict[str, SummaryWriter] = {}
    for key, members in group_rows(rows).items():
        tag = slug(group_title(key))
        for per_n in by_config(members).values():
            folder = spec(next(iter(per_n.values()))).folder  # one run per mechanism: linformer-k=128
            writer = writers.setdefault(folder, SummaryWriter(str(log_dir / folder)))
            for n, row in sorted(per_n.items()):
                if row["status"] != "ok":
                    continue
                writer.add_scalar(f"{tag}/time_ms", row["time_ms_median"], n)
                writer.add_scalar(f"{tag}/peak_mb", row["peak_mb"], n)
                if row.get("gflops_per_s") is not None:
                    writer.add_scalar(f"{tag}/gflops_per_s", row["gflops_per_s"], n)
    for writer in writers.values():
        writer.close()
    return log_dir
