"""Measurements taken from the training runs themselves, so accuracy, speed and memory of a mechanism
come from one run: throughput (real tokens/s), peak memory, a ``run.json`` record per run, and the
resolved config saved next to the run (and shown in TensorBoard's Text tab).

Throughput times each training step (forward, backward, optimizer step; CUDA synchronised at both ends)
and counts real tokens (``mask.sum()``), so padding is never counted as work done. Peak memory is
``torch.cuda.max_memory_allocated`` on CUDA and the process's peak resident set size (``VmHWM``,
reset at fit start where Linux allows it) on CPU; the CPU figure includes the Python/PyTorch baseline
of the process, so the memory in use at fit start (allocated CUDA memory, or the resident set size) is
recorded too: the difference is what training added.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

RUN_RECORD = "run.json"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS; elsewhere (or where it
    # is not allowed) the peak covers the whole process
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = _proc_status_mb("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def current_memory_mb(device: torch.device) -> float:
    """What the peak is measured against: allocated CUDA memory, or the resident set size (NaN where
    neither /proc nor CUDA tells)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    current = _proc_status_mb("VmRSS")
    return current if current is not None else float("nan")


def _proc_status_mb(field: str) -> float | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024  # the kernel reports kB
    return None


class SpeedAndMemory(pl.Callback):
    """Logs ``train/tokens_per_s`` (over the last ``window`` steps, summed over ranks) and
    ``train/peak_mem_mb`` (max over ranks) at the steps the logger writes (``log_every_n_steps``; the peak is a
    high-water mark, so nothing is lost, and reading and logging it at every step costs a small model's run
    several percent); :meth:`summary` gives the whole run's figures, leaving out the first ``skip_steps`` steps
    (allocator and kernel warm-up)."""

    def __init__(self, skip_steps: int = 5, window: int = 20) -> None:
        self.skip_steps = skip_steps
        self.window: deque[tuple[int, float]] = deque(maxlen=window)
        self.steps_seen = 0
        self.tokens_total = 0
        self.seconds_total = 0.0
        self._step_start = 0.0
        self.start_memory_mb = float("nan")
        self.device = torch.device("cpu")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the device trained on, kept: at on_fit_end (where the summary is read) Lightning's teardown has already
        # moved the module back to the CPU, and its device would make a CUDA run report the process's resident set
        self.device = pl_module.device
        reset_peak_memory(self.device)
        self.start_memory_mb = current_memory_mb(self.device)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        _synchronize(pl_module.device)
        self._step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        _synchronize(pl_module.device)
        seconds = time.perf_counter() - self._step_start
        count = getattr(pl_module, "real_tokens", None)  # the task knows what its batches hold
        tokens = count(batch) if count is not None else int(batch["mask"].sum())
        self.window.append((tokens, seconds))
        self.steps_seen += 1
        if self.steps_seen > self.skip_steps:
            self.tokens_total += tokens
            self.seconds_total += seconds
        if not trainer._logger_connector.should_update_logs:  # as LearningRateMonitor: only steps the logger writes
            return
        rate = sum(t for t, _ in self.window) / max(sum(s for _, s in self.window), 1e-9)
        log = dict(on_step=True, on_epoch=False, sync_dist=trainer.world_size > 1)
        pl_module.log("train/tokens_per_s", rate, reduce_fx="sum", **log)
        pl_module.log("train/peak_mem_mb", peak_memory_mb(pl_module.device), reduce_fx="max", **log)

    def summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Mean tokens/s after warm-up (over every step in runs too short to have any after it; summed
        over ranks), peak memory and the memory in use when fitting started (max over ranks); every rank
        must call it (it reduces across them)."""
        if self.seconds_total:
            rate = self.tokens_total / self.seconds_total
        else:
            rate = sum(t for t, _ in self.window) / max(sum(s for _, s in self.window), 1e-9)
        memory, start = peak_memory_mb(self.device), self.start_memory_mb
        if trainer.world_size > 1:
            device = self.device
            reduce = lambda value, op: float(trainer.strategy.reduce(torch.tensor(value, device=device), reduce_op=op))
            rate, memory, start = reduce(rate, "sum"), reduce(memory, "max"), reduce(start, "max")
        return {"tokens_per_s": rate, "peak_mem_mb": memory, "fit_start_mem_mb": start}


class RunRecord(pl.Callback):
    """Keeps ``run.json`` in the run's log directory up to date: progress while training (at most every
    ``every_seconds``), then the final metrics, throughput, peak memory, parameter count and wall time;
    ``status`` is ``running``, ``finished`` or ``failed`` (with the error). ``zoo compare`` reads it.
    ``fit_seconds`` is the wall time of every sitting of the run: a run resumed from a checkpoint in the same
    directory adds the time its earlier sittings recorded (work lost after their last checkpoint included), and
    ``sittings`` counts them.
    A task's ``describe_run()`` entries (e.g. the translation corpus and decoder rule) are added at fit start.

    ``zoo test`` adds its metrics (``test/...``) to the ``metrics`` of the run.json in its log directory
    (``--ckpt_path last`` tests the newest run of the mechanism in that run's own directory) and, when the
    checkpoint lies in another run's ``checkpoints/``, to that run's run.json too; a test logged inside the
    checkpoint's run (``<run>/test/``, ``tasks.cli.place_evaluation``) writes only the run's; other entries stay.
    """

    def __init__(self, every_seconds: float = 1.0) -> None:
        self.every_seconds = every_seconds
        self.record: dict[str, Any] = {}
        self._started = 0.0
        self._last_write = 0.0
        self._path: Path | None = None
        self._earlier: dict[str, Any] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.perf_counter()
        log_dir = trainer.log_dir  # a broadcast in DDP: every rank asks, here, at the same point
        self._path = Path(log_dir) / RUN_RECORD if log_dir is not None else None
        self._earlier = read_json_record(self._path) if self._path is not None else {}
        hparams = pl_module.hparams
        self.record = {
            "status": "running",
            "task": type(pl_module).__name__,
            "attention": hparams.get("attention"),
            "attention_options": hparams.get("attention_options") or {},
            "parameters": sum(p.numel() for p in pl_module.parameters()),
            "world_size": trainer.world_size,
            "start_step": trainer.global_step,
            "step": trainer.global_step,
            "max_steps": trainer.max_steps if trainer.max_steps > 0 else int(trainer.estimated_stepping_batches),
            "sittings": 1,
        }
        describe = getattr(pl_module, "describe_run", None)
        self.record.update(describe() if describe is not None else {})
        self._write(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record["start_step"] = trainer.global_step  # after a checkpoint is restored
        if trainer.global_step > 0:  # resumed: this directory's earlier sittings count too
            self.record["sittings"] = int(self._earlier.get("sittings", 1)) + 1
        else:
            self._earlier = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if time.perf_counter() - self._last_write >= self.every_seconds:
            self.record["step"] = trainer.global_step
            self._write(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        speed = next((c for c in trainer.callbacks if isinstance(c, SpeedAndMemory)), None)
        self.record.update(speed.summary(trainer, pl_module) if speed is not None else {})
        self.record.update(
            status="finished",
            step=trainer.global_step,
            metrics={k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
        )
        self._write(trainer)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        tested = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/") and v.numel() == 1}
        log_dir = trainer.log_dir
        if not trainer.is_global_zero or log_dir is None:
            return
        paths = {Path(log_dir) / RUN_RECORD}
        if trainer.ckpt_path:
            checkpoint_run = Path(trainer.ckpt_path).resolve().parent.parent / RUN_RECORD
            if checkpoint_run.exists():
                paths.add(checkpoint_run)
                if Path(log_dir).resolve().parent == checkpoint_run.parent:  # logged in <run>/test: one record
                    paths = {checkpoint_run}
        for path in paths:
            record = read_json_record(path) or {"status": "tested", "task": type(pl_module).__name__}
            record.setdefault("metrics", {}).update(tested)
            record["tested_checkpoint"] = str(trainer.ckpt_path) if trainer.ckpt_path else None
            _write_json(path, record)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.record.update(status="failed", error=f"{type(exception).__name__}: {exception}", step=trainer.global_step)
        self._write(trainer)

    def _write(self, trainer: pl.Trainer) -> None:
        self._last_write = time.perf_counter()
        earlier = float(self._earlier.get("fit_seconds") or 0.0)
        self.record["fit_seconds"] = earlier + self._last_write - self._started
        if not trainer.is_global_zero or self._path is None:
            return
        _write_json(self._path, self.record)


def read_json_record(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a run.json), or ``{}`` when it is missing, unreadable or not an object."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=2, default=str))
    os.replace(temporary, path)  # readers never see half a file


class SaveConfigToRun(SaveConfigCallback):
    """Saves the resolved config as ``config.yaml`` in the run's log directory (LightningCLI's behaviour)
    and also as text in TensorBoard, so the exact config of every curve is one click away."""

    def save_config(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(trainer.logger, TensorBoardLogger):
            text = self.parser.dump(self.config, skip_none=False)
            indented = "\n".join("    " + line for line in text.splitlines())  # a Markdown code block
            trainer.logger.experiment.add_text("config", indented)


class _ZooBarMetrics:
    """The bar's metrics without ``v_num``: the run's version is in its folder's name, and as a float
    (``v_num: 0.000``) it reads as a measurement."""

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int | str | float]:
        items = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        items.pop("v_num", None)
        return items


class ZooRichProgressBar(_ZooBarMetrics, RichProgressBar):
    """Lightning's rich bar for runs bounded by steps: ``Epoch 3`` where no ``max_epochs`` bounds the run (Lightning
    would show ``Epoch 3/-2`` for its -1 = unlimited; the bar's count is then the epoch's steps, up to ``max_steps``),
    ``Epoch 3/9`` where one does; no ``v_num``."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        if self.trainer.max_epochs is not None and self.trainer.max_epochs > 0:
            description += f"/{self.trainer.max_epochs - 1}"
        # as Lightning's: padded to the validation bar's label, so the two do not flicker
        return f"{description:{len(self.validation_description)}}"


class ZooTQDMProgressBar(_ZooBarMetrics, TQDMProgressBar):
    """Lightning's tqdm bar (where ``rich`` is not installed), without ``v_num``."""


def zoo_progress_bar() -> ProgressBar:
    """The progress bar of ``zoo fit | validate | test``: rich where installed, else tqdm, as Lightning chooses."""
    return ZooRichProgressBar() if _RICH_AVAILABLE else ZooTQDMProgressBar()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
