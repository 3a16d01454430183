"""The TensorBoard layout of a ``zoo compare`` experiment: it opens on the comparison.

TensorBoard's Custom Scalars dashboard reads a layout from any event file under ``--logdir``; each chart
lists tag regexes and overlays every run that logs a matching tag. ``write_layout`` puts one chart per
metric (validation metrics, training loss, tokens/s, peak memory) in an event file at the experiment's
root, so ``tensorboard --logdir <experiment>`` shows every mechanism and seed on one chart per metric.
"""

from __future__ import annotations

import re
from pathlib import Path

from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

#: charts shown for every task, after the task's validation metrics
COMMON_CHARTS = {
    "training loss": "train/loss",
    "tokens/s (training)": "train/tokens_per_s",
    "peak memory (MB)": "train/peak_mem_mb",
}


def layout(val_metrics: list[str]) -> dict[str, dict[str, list]]:
    """``{"zoo compare": {chart title: ["Multiline", [tag regex]]}}`` for the given ``val/...`` tags."""
    charts = {f"validation {tag.split('/', 1)[1]}": tag for tag in val_metrics}
    charts |= COMMON_CHARTS
    return {"zoo compare": {title: ["Multiline", [f"^{re.escape(tag)}$"]] for title, tag in charts.items()}}


def write_layout(directory: Path, val_metrics: list[str]) -> Path:
    """Write the layout into an event file at ``directory``'s root; return that file."""
    writer = SummaryWriter(log_dir=str(directory), filename_suffix=".layout")
    writer.add_custom_scalars(layout(val_metrics))
    writer.close()
    return max(directory.glob("events.out.tfevents.*.layout"), key=lambda p: p.stat().st_mtime)


def read_layout(event_file: Path) -> dict[str, dict[str, list]]:
    """The layout stored in ``event_file`` (for tests and for checking a written experiment)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.custom_scalar import layout_pb2

    for event in EventFileLoader(str(event_file)).Load():
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == "custom_scalars":
                proto = layout_pb2.Layout()
                proto.ParseFromString(_tensor_bytes(value))
                return {
                    category.title: {chart.title: ["Multiline", list(chart.multiline.tag)] for chart in category.chart}
                    for category in proto.category
                }
    return {}


def _tensor_bytes(value: Summary.Value) -> bytes:
    return value.tensor.string_val[0]
