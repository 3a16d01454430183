"""What the studies share: loading a trained run, its validation sequences, the attention inputs of every
layer, CSV files that grow row by row and are read back checked, paths written relative to the repository, and
figures written as PNG and as TensorBoard images.

Attention inputs are captured with PyTorch forward pre-hooks on each layer's attention core: the
multi-head block calls ``core(q, k, v, mask=..., causal=...)`` with the projected heads, so a hook sees
exactly what the mechanism sees, and the model itself is neither changed nor copied.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor

from attention_zoo import MultiHeadAttention, TransformerEncoder
from experiments.records import csv_fields, read_text

ROOT = Path(__file__).resolve().parents[2]


class UnreadableRecord(ValueError):
    """A study's results file that is missing, truncated or not what the study wrote: one line naming the file
    (and line) and what is wrong."""


@dataclass
class TrainedRun:
    """A run's task (weights loaded from its checkpoint) and where it came from."""

    task: torch.nn.Module
    checkpoint: Path
    config: Path
    hparams: dict[str, Any]

    @property
    def encoder(self) -> TransformerEncoder:
        return self.task.encoder

    @property
    def max_seq_len(self) -> int:
        return int(self.hparams["max_seq_len"])

    @property
    def attention(self) -> str:
        return self.hparams["attention"]

    @property
    def label(self) -> str:
        """``<experiment>/<mechanism>/<seed>``: the three folders above ``checkpoints/last.ckpt``."""
        parts = self.checkpoint.resolve().parts
        return "/".join(parts[-5:-2]) if len(parts) >= 5 else self.checkpoint.stem


def default_config(checkpoint: Path) -> Path:
    """The resolved config a run saved next to its ``checkpoints/`` folder."""
    return checkpoint.resolve().parent.parent / "config.yaml"


def load_run(checkpoint: Path, config: Path | None = None, *, random_init_seed: int | None = None) -> TrainedRun:
    """The task of ``checkpoint`` rebuilt from the hyperparameters stored in it, in eval mode; with
    ``random_init_seed`` the same architecture freshly initialised (the untrained control) instead."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise FileNotFoundError(f"no checkpoint at {checkpoint}")
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or "hyper_parameters" not in saved or "state_dict" not in saved:
        raise ValueError(f"{checkpoint} is not a Lightning checkpoint of a zoo task (no hyper_parameters/state_dict)")
    hparams = dict(saved["hyper_parameters"])
    module_name, _, class_name = hparams["_class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    init = {k: v for k, v in hparams.items() if not k.startswith("_")} | {"init_from": None}
    if random_init_seed is not None:
        torch.manual_seed(random_init_seed)
    task = cls(**init)
    if random_init_seed is None:
        task.load_state_dict(saved["state_dict"])
    task.eval()
    return TrainedRun(task, checkpoint, Path(config) if config else default_config(checkpoint), hparams)


def load_data_module(run: TrainedRun) -> Any:
    """The data module of the run's ``config.yaml`` (its ``data`` section), ready for validation."""
    if not run.config.is_file():
        raise FileNotFoundError(f"no config at {run.config}; pass the run's config.yaml with --config")
    section = (yaml.safe_load(run.config.read_text()) or {}).get("data")
    if not isinstance(section, dict) or "class_path" not in section:
        raise ValueError(f"{run.config} has no data section with a class_path (expected a zoo fit config.yaml)")
    module_name, _, class_name = section["class_path"].rpartition(".")
    data = getattr(importlib.import_module(module_name), class_name)(**(section.get("init_args") or {}))
    if data.max_seq_len != run.max_seq_len:
        raise ValueError(
            f"{run.config} gives max_seq_len={data.max_seq_len} but {run.checkpoint} was trained with "
            f"{run.max_seq_len}; pass the run's own config.yaml"
        )
    data.setup("validate")
    return data


def full_length_batches(data: Any, count: int, length: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Up to ``count`` validation sequences with ``length`` real tokens (no padding), as ``(tokens, mask)``
    batches in the loader's order; shorter sequences (only the last chunk of a split) are left out."""
    left = count
    for batch in data.val_dataloader():
        tokens, mask = batch["tokens"], batch["mask"]
        if tokens.shape[1] != length:
            continue
        keep = mask.all(dim=1).nonzero().flatten()[:left]
        if len(keep):
            yield tokens[keep], mask[keep]
            left -= len(keep)
        if left <= 0:
            return


@dataclass
class LayerInputs:
    """What one layer's attention core received: ``q, k, v`` (B, H, N, D) and ``mask`` (B, N) or None."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None


class AttentionInputs:
    """Context manager that records the inputs of every attention core of ``encoder``, layer by layer.

    >>> with AttentionInputs(model.encoder) as layers:
    ...     model(tokens, mask)
    >>> layers[0].q.shape  # (B, H, N, D) of layer 0

    Each forward pass replaces the records. Tensors are detached; nothing else is kept.
    """

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.blocks = [m for m in encoder.modules() if isinstance(m, MultiHeadAttention)]
        if not self.blocks:
            raise ValueError(f"{type(encoder).__name__} has no MultiHeadAttention block to record")
        self.records: list[LayerInputs | None] = []
        self.handles: list[Any] = []

    def __enter__(self) -> list[LayerInputs | None]:
        self.records[:] = [None] * len(self.blocks)
        for index, block in enumerate(self.blocks):
            self.handles.append(block.core.register_forward_pre_hook(self._recorder(index), with_kwargs=True))
        return self.records

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _recorder(self, index: int):
        def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            q, k, v = (t.detach() for t in args[:3])
            mask = kwargs.get("mask")
            self.records[index] = LayerInputs(q, k, v, None if mask is None else mask.detach())

        return record


def capture(run: TrainedRun, tokens: Tensor, mask: Tensor) -> list[LayerInputs]:
    """The attention inputs of every layer of ``run`` for one batch (no gradients)."""
    with AttentionInputs(run.encoder) as layers, torch.no_grad():
        run.task(tokens, mask)
    return list(layers)


# ---- files ------------------------------------------------------------------------------------------------


class RowLog:
    """A CSV that grows by whole rows (flushed at once), so a study stopped at any point keeps what it
    finished and a rerun reads it back to skip that work. A last row that a killed run left without its line end
    is cut off when the log is opened (and said so on stderr): the rerun measures it again."""

    def __init__(self, path: Path, columns: list[str]) -> None:
        self.path, self.columns = path, columns
        if path.exists() and path.stat().st_size:
            with open(path, newline="") as file:
                header = next(csv.reader(file), [])
            if header != columns:
                raise ValueError(
                    f"{path} has columns {header}, this version of the study writes {columns}; "
                    "move it away or use another --out"
                )
            data = path.read_bytes()
            if not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                print(f"note: {path}: cutting off a half-written last row ({len(data) - keep} bytes)", file=sys.stderr)
                with open(path, "r+b") as file:
                    file.truncate(keep)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", newline="") as file:
                csv.writer(file).writerow(columns)

    def rows(self) -> list[dict[str, str]]:
        return read_csv(self.path, self.columns, what="a study's row log", allow_empty=True)

    def append(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        with open(self.path, "a", newline="") as file:
            csv.DictWriter(file, fieldnames=self.columns, extrasaction="raise").writerows(rows)
            file.flush()


def read_csv(
    path: Path,
    columns: list[str] | tuple[str, ...] = (),
    *,
    what: str = "a CSV of a study",
    integers: tuple[str, ...] = (),
    numbers: tuple[str, ...] = (),
    allow_empty: bool = False,
) -> list[dict[str, str]]:
    """The rows of a CSV a study wrote, checked as ``zoo report`` checks a ``runs.csv``: the file exists and is text
    (:func:`experiments.records.csv_fields`), its header has ``columns``, every row as many fields as the
    header and a line end (a file cut anywhere fails one of these), ``integers`` and ``numbers`` cells parse (or are
    empty), and, unless ``allow_empty``, it has a row. Any failure is an :class:`UnreadableRecord` naming the file,
    the line and what is wrong; ``what`` says what the file should have been."""
    try:
        header, records = csv_fields(path, what)
    except ValueError as error:
        raise UnreadableRecord(str(error)) from None
    missing = [c for c in columns if c not in header]
    if missing:
        raise UnreadableRecord(f"{path}: not {what}: no column(s) {', '.join(missing)}")
    rows = []
    for where, fields in records:
        row = dict(zip(header, fields, strict=True))
        for column in (*integers, *numbers):
            try:
                if row.get(column, "") != "":  # an optional column may be absent
                    (int if column in integers else float)(row[column])
            except ValueError:
                raise UnreadableRecord(f"{where}: {column} {row[column]!r} is not a number") from None
        rows.append(row)
    if not rows and not allow_empty:
        raise UnreadableRecord(f"{path}: no rows, only a header: not {what}")
    return rows


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object a study wrote; an :class:`UnreadableRecord` naming the file when it is not one."""
    try:
        value = json.loads(read_text(path, what))
    except json.JSONDecodeError as error:
        message = f"{path}: not JSON ({error.msg}, line {error.lineno}): a truncated or corrupt file"
        raise UnreadableRecord(message) from None
    except ValueError as error:
        raise UnreadableRecord(str(error)) from None
    if not isinstance(value, dict):
        raise UnreadableRecord(f"{path}: expected a JSON object {{...}}, got {type(value).__name__}: not {what}")
    return value


def repo_path(path: str | Path | None) -> str | None:
    """``path`` as the files a study writes name it: relative to the repository's root (POSIX separators), so that
    a reader's checkout resolves it and no folder of the machine is named; None stays None."""
    if path is None:
        return None
    return Path(os.path.relpath(Path(path).resolve(), ROOT)).as_posix()


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def number(text: str | None) -> float | None:
    """A CSV cell as a float (None when empty)."""
    return None if text in (None, "") else float(text)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, path: Path, tensorboard: Path | None = None) -> Path:
    """Write ``figure`` as ``path`` (PNG) and, with ``tensorboard``, that PNG as an image in an event file of
    its own, ``tensorboard/<stem>/`` (tag: the stem), then close the figure. A replot replaces that event file,
    so TensorBoard shows each figure once."""
    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    if tensorboard is not None:
        from torch.utils.tensorboard import SummaryWriter

        folder = tensorboard / path.stem
        for old in folder.glob("events.out.tfevents.*"):
            old.unlink()
        writer = SummaryWriter(log_dir=str(folder))
        writer.add_image(path.stem, plt.imread(path)[..., :3], dataformats="HWC")
        writer.close()
    return path
