"""What every task shares (:class:`ZooTask`): AdamW with linear warm-up and cosine decay, throughput and
peak-memory logging, the run record, the TensorBoard HParams session, and the check that the data module
gives the task's kind of labels; and the model's flags, declared once here, from which
:meth:`ZooTask.build_model` makes one :class:`attention_zoo.ModelConfig` for the model. The encoder tasks
(:class:`EncoderTask`) add an :class:`attention_zoo.TransformerEncoder`, one ``_shared_step(batch, stage)``,
and ``init_from`` (start the encoder from another run's checkpoint); the translation task
(:mod:`tasks.translation`) an encoder-decoder.

A task never knows which attention it holds: ``attention`` and ``attention_options`` become the config's
:class:`attention_zoo.AttentionSpec`, checked against the registry when the task is built, i.e. before any
data is read or any step is taken. Batches follow the data contract (``tasks/data``): a dict with
``tokens`` (B, N) long, ``mask`` (B, N) bool (True = real token) and ``labels``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.tensorboard.summary import hparams as hparams_summary

from attention_zoo import AttentionSpec, ModelConfig, TransformerEncoder
from attention_zoo.config import Positional
from tasks.callbacks import RunRecord, SpeedAndMemory

Stage = Literal["train", "val", "test"]
#: the learning-rate schedule after warm-up (:meth:`ZooTask.configure_optimizers`)
Schedule = Literal["cosine", "linear", "constant"]
STAGES: tuple[Stage, ...] = ("train", "val", "test")


class ConfigError(ValueError):
    """A configuration the task cannot run (bad attention name or option, mismatching checkpoint, data of
    the wrong kind). ``zoo fit`` prints it as a one-paragraph error instead of a traceback."""


class ZooTask(pl.LightningModule):
    """Base of every task ``zoo fit`` runs: it declares the model's flags and the optimizer's, once for every
    task, and saves every ``__init__`` argument (a subclass's too) as a hyperparameter.

    The model's flags are the fields of :class:`attention_zoo.ModelConfig`, flattened (``--model.dim 128``,
    ``--model.attention linformer --model.attention_options.k 32``), with its defaults; the sizes come from the
    data, linked by ``zoo fit``.

    Args:
        attention: registered attention name (``zoo list`` shows them).
        attention_options: that mechanism's options, e.g. ``{k: 32}`` for Linformer; on the command
            line ``--model.attention_options.k 32``.
        dim: model width.
        depth: number of layers (of the encoder, and of a decoder unless the task has ``decoder_depth``).
        heads: attention heads per layer.
        dim_head: width of one head (default ``dim // heads``).
        ff_mult: feed-forward hidden width as a multiple of ``dim``.
        dropout: dropout on embeddings, attention output and feed-forward.
        positional: ``learned`` or ``sinusoidal`` absolute positions.
        short_convolution: kernel size of a causal depthwise convolution over the encoder's embeddings before its
            first layer (:mod:`attention_zoo.short_convolution`), the same for every attention; 0 adds none.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay (not applied to biases, norms or other 1-D parameters).
        warmup_steps: linear warm-up steps before the schedule.
        schedule: ``cosine`` decays to 0 at the last step; ``linear`` decays linearly to 0 at the last step (the
            Nystromformer authors' LRA code: ``OneCycleLR(anneal_strategy="linear")``); ``constant`` keeps ``lr``
            after warm-up.
    """

    #: the data module's ``target`` this task trains on ("sequence", "token", "translation")
    target: ClassVar[str]
    #: metrics listed in TensorBoard's HParams view next to the hyperparameters
    hparam_metrics: ClassVar[tuple[str, ...]] = ("val/loss", "train/tokens_per_s", "train/peak_mem_mb")

    def __init__(
        self,
        *,
        attention: str = ModelConfig.attention,
        attention_options: dict[str, Any] | None = None,
        dim: int = ModelConfig.dim,
        depth: int = ModelConfig.depth,
        heads: int = ModelConfig.heads,
        dim_head: int | None = ModelConfig.dim_head,
        ff_mult: int = ModelConfig.ff_mult,
        dropout: float = ModelConfig.dropout,
        positional: Positional = ModelConfig.positional,
        short_convolution: int = ModelConfig.short_convolution,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 100,
        schedule: Schedule = "cosine",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def real_tokens(self, batch: dict[str, Tensor]) -> int:
        """The real (not padding) tokens of a training batch: the work ``train/tokens_per_s`` counts."""
        return int(batch["mask"].sum())

    def describe_run(self) -> dict[str, Any]:
        """Task-specific entries of the run record (``run.json``), written when fitting starts."""
        return {}

    def build_model(self, model: Callable[[ModelConfig], nn.Module], what: str, **fields: Any) -> nn.Module:
        """``model`` built from one :class:`attention_zoo.ModelConfig`: the model's flags of this task and
        ``fields`` (the sizes from the data, a subclass's own model flags); a ``ValueError`` (a bad size, attention
        name or option) becomes a :class:`ConfigError` naming ``what``."""
        hparams = self.hparams
        flags = {name: hparams[name] for name in CONFIG_FLAGS}
        try:
            spec = AttentionSpec(hparams.attention, hparams.attention_options or {})
            return model(ModelConfig(attention=spec, **flags, **fields))
        except ValueError as error:
            raise ConfigError(f"cannot build the {what} with attention={hparams.attention!r}: {error}") from None

    def configure_optimizers(self) -> dict[str, Any]:
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay, "name": "weights"},
                {"params": no_decay, "weight_decay": 0.0, "name": "biases_norms"},
            ],
            lr=self.hparams.lr,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup, schedule = self.hparams.warmup_steps, self.hparams.schedule

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if schedule == "constant":
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            if schedule == "linear":
                return 1.0 - progress
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        # named under train/ so that TensorBoard lists it with the training curves, after the val/ cards
        scheduler = {"scheduler": LambdaLR(optimizer, factor), "interval": "step", "name": "train/lr"}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def configure_callbacks(self) -> list[pl.Callback]:
        # every run measures speed and memory and records its outcome, whatever its config says
        return [SpeedAndMemory(), RunRecord()]

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        data_target = getattr(datamodule, "target", self.target)
        if data_target != self.target:
            raise ConfigError(
                f"{type(self).__name__} trains on per-{self.target} labels but {type(datamodule).__name__} gives "
                f"per-{data_target} labels; pair it with a data module whose target is {self.target!r}"
            )

    def on_fit_start(self) -> None:
        self._log_hparams_session()

    @rank_zero_only
    def _log_hparams_session(self) -> None:
        """Write the HParams-plugin session with this task's metric tags, so TensorBoard's HParams view
        lists the attention, its options and the final metrics of each run side by side. (Lightning's
        own hparams logging either lists no metrics or writes a placeholder value into the metric's curve.)"""
        logger = self.logger
        if not isinstance(logger, TensorBoardLogger):
            return
        flat = hparams_for_view(dict(self.hparams))
        writer = logger.experiment._get_file_writer()  # the writer SummaryWriter.add_hparams itself uses
        for summary in hparams_summary(flat, {name: 0.0 for name in self.hparam_metrics}):
            writer.add_summary(summary)


#: the model's flags of :class:`ZooTask` that are :class:`attention_zoo.ModelConfig` fields of the same name
#: (``attention`` and ``attention_options`` make the config's one ``attention`` spec)
CONFIG_FLAGS: tuple[str, ...] = tuple(
    name
    for name in inspect.signature(ZooTask.__init__).parameters
    if name in {field.name for field in dataclasses.fields(ModelConfig)} and name != "attention"
)


class EncoderTask(ZooTask):
    """Base of the encoder tasks: ``forward(tokens, mask) -> logits`` over a Transformer encoder.

    Args:
        vocab_size: token vocabulary (linked from ``data.vocab_size`` by ``zoo fit``).
        max_seq_len: longest sequence the model accepts (linked from ``data.max_seq_len``).
        num_classes: output classes: labels per sequence or per token (linked from ``data.num_classes``).
        init_from: a checkpoint (``last.ckpt`` of another run, e.g. MLM pretraining) whose encoder
            weights this model starts from; it must use the same attention and shapes.
        causal: every layer attends causally, each position to itself and the ones before it (a decoder-only model,
            as Zoology runs associative recall); the attention must support it (``zoo list``). Default False.
        **shared: the model's and the optimizer's flags of :class:`ZooTask`.
    """

    def __init__(
        self,
        vocab_size: int,
        max_seq_len: int,
        num_classes: int,
        *,
        init_from: str | None = None,
        causal: bool = False,
        **shared: Any,
    ) -> None:
        super().__init__(**shared)
        self.encoder = self.build_model(
            partial(TransformerEncoder, causal=causal), "encoder", vocab_size=vocab_size, max_seq_len=max_seq_len
        )
        if num_classes < 1:
            raise ConfigError(f"num_classes must be >= 1, got {num_classes}")
        if init_from is not None:
            load_encoder(self, init_from)

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        raise NotImplementedError

    def loss_terms(self, labels: Tensor) -> int:
        """How many terms :meth:`loss` averages over for these labels: one per sequence here."""
        return labels.shape[0]

    def update_metrics(self, stage: Stage, logits: Tensor, labels: Tensor) -> dict[str, Any]:
        """Update the stage's torchmetrics with one batch; return them keyed by their logged tag."""
        raise NotImplementedError

    def _shared_step(self, batch: dict[str, Tensor], stage: Stage) -> Tensor:
        # packed batches (data option ``pack``) carry their documents' boundaries (attention_zoo.packing)
        packed = (batch["segments"],) if "segments" in batch else ()
        logits = self(batch["tokens"], batch["mask"], *packed)
        loss = self.loss(logits, batch["labels"])
        is_train = stage == "train"
        if is_train and not self._logger_writes_this_step():
            # the logger keeps only every log_every_n_steps-th training value; logging and metric updates at the
            # other steps are pure overhead, a sizeable share of a small model's step
            return loss
        batch_size = batch["labels"].shape[0]  # examples, not rows: a packed batch holds B examples in R <= B rows
        logged = dict(on_step=is_train, on_epoch=not is_train, batch_size=batch_size)
        # an epoch value is Lightning's batch_size-weighted mean of the batch values; weighting each batch loss
        # by its number of terms makes val/loss the mean over all sequences (or scored tokens), so that for
        # token tasks exp(val/loss) = val/ppl. Training logs steps only, where the weight is unused.
        loss_weight = {"batch_size": batch_size if is_train else self.loss_terms(batch["labels"])}
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=not is_train, **(logged | loss_weight))
        metrics = self.update_metrics(stage, logits.detach(), batch["labels"])
        self.log_dict(metrics, prog_bar=not is_train, **logged)
        return loss

    def _logger_writes_this_step(self) -> bool:
        trainer = self._trainer
        if trainer is None or trainer._logger_connector.should_update_logs:
            return True
        # the last step's values stay the run's train summary (callback_metrics), whatever the interval
        last_step = trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps
        last_epoch = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs
        return last_step or (last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "test")


def hparams_for_view(params: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """What TensorBoard's HParams view lists for a run: ``attention``, its options as one short string
    ``attention_options`` (``k=64 sharing=kv``, or ``-``; the view sorts columns by name, so it sits next to
    ``attention``) and the other hyperparameters flattened; LightningCLI's bookkeeping entries
    (``_class_path``, ``_instantiator``) are left out."""
    visible = {k: v for k, v in params.items() if not k.startswith("_")}
    options = params.get("attention_options") or {}
    visible["attention_options"] = " ".join(f"{k}={v}" for k, v in options.items()) or "-"
    return flatten_hparams(visible)


def flatten_hparams(params: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """``{"attention_options": {"k": 32}}`` -> ``{"attention_options/k": 32}``; values TensorBoard cannot
    show become strings, ``None`` becomes ``"None"``."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_hparams(value, f"{name}/") if value else {name: "{}"})
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def read_checkpoint(path: str | Path, option: str) -> dict[str, Any]:
    """The Lightning checkpoint at ``path``, or :class:`ConfigError` naming ``option`` and the file when
    there is no such file or it is not a readable checkpoint (empty, truncated, random bytes).

    Loaded with ``weights_only=True``: tensors and plain containers only, no pickled code runs. The
    tensors of a zip-format file (what ``torch.save`` and Lightning write) are memory-mapped, so checking
    a large checkpoint reads little more than its pickle.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"{option}: no checkpoint file at {str(path)!r}" + (" (a directory)" if file.is_dir() else "")
        )
    is_zip = zipfile.is_zipfile(file)
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True, mmap=is_zip)
    except Exception as error:  # whatever the bytes are, the answer is the same: not a checkpoint
        if file.stat().st_size == 0:
            reason = "the file is empty"
        elif not is_zip:
            reason = "not a torch checkpoint, or truncated"
        else:
            reason = "damaged, or it holds objects other than tensors and plain containers"
        raise ConfigError(
            f"{option}: {str(path)!r} is not a readable checkpoint ({reason}; {type(error).__name__}); "
            "give a .ckpt file that Lightning wrote, e.g. <run>/checkpoints/last.ckpt"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConfigError(f"{option}: {str(path)!r} is not a Lightning checkpoint (no 'state_dict')")
    return checkpoint


def state_dict_mismatches(weights: dict[str, Tensor], expected: dict[str, Tensor]) -> list[str]:
    """Every missing, unexpected and mis-shaped key of checkpoint ``weights`` against a model's ``expected``
    state dict, one line each (empty when they fit)."""
    problems = [f"missing {k} {tuple(v.shape)}" for k, v in expected.items() if k not in weights]
    problems += [f"unexpected {k} {tuple(v.shape)}" for k, v in weights.items() if k not in expected]
    problems += [
        f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in weights and weights[k].shape != v.shape
    ]
    return problems


def load_encoder(task: EncoderTask, path: str) -> None:
    """Copy the ``encoder.*`` weights of a Lightning checkpoint into ``task.encoder``.

    Read by :func:`read_checkpoint` (no pickled code runs). Raises :class:`ConfigError` naming the file
    when it is not a readable checkpoint, and naming the attention names, or every missing, unexpected
    and mis-shaped key, when the checkpoint's encoder is not this encoder.
    """
    checkpoint = read_checkpoint(path, "init_from")
    saved = checkpoint.get("hyper_parameters", {})
    theirs, ours = saved.get("attention"), task.hparams.attention
    if theirs is not None and theirs != ours:
        raise ConfigError(
            f"init_from: {path!r} was trained with attention {theirs!r}, this model uses {ours!r}; "
            f"finetune with --model.attention {theirs} (and its options {saved.get('attention_options') or {}})"
        )
    if (saved.get("attention_options") or {}) != (task.hparams.attention_options or {}):
        rank_zero_warn(
            f"init_from: {path!r} used attention_options {saved.get('attention_options') or {}}, this model "
            f"{task.hparams.attention_options or {}}; loading anyway because every weight shape matches"
        )
    prefix = "encoder."
    weights = {k.removeprefix(prefix): v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    problems = state_dict_mismatches(weights, task.encoder.state_dict())
    if problems:
        raise ConfigError(
            f"init_from: the encoder in {path!r} (attention {theirs!r}) does not fit this model (attention "
            f"{ours!r}); check dim, depth, heads, max_seq_len, vocab_size and attention_options:\n  "
            + "\n  ".join(problems)
        )
    task.encoder.load_state_dict(weights)
