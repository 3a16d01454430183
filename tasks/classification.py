"""Sequence classification (ListOps, text classification): one label per sequence.

The encoder's hidden states are pooled to one vector per sequence, either the mean over real tokens
(padding excluded, as Long Range Arena's classifiers do) or the state at the first position (a [CLS]
token the data puts there), then a linear layer gives the class logits.

A packed batch (data option ``pack``) holds several documents per row with their boundaries (``segments``,
:mod:`attention_zoo.packing`): the encoder keeps attention inside each document, and each document is pooled on its
own (the mean over its tokens, or its first token), giving one vector, and one prediction, per document in
document order: row by row, from a row's first document to its last; empty documents (repeated boundaries) give
none. That is the order of the packed batch's labels (:class:`tasks.data.base.PackCollate`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from einops import reduce, repeat
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from attention_zoo.init import init_linear_
from attention_zoo.packing import document_ids
from tasks.base import STAGES, EncoderTask, Stage


class SequenceClassification(EncoderTask):
    """Classify each sequence; logs loss, accuracy and macro F1 per stage.

    Args:
        vocab_size: token vocabulary (linked from the data module).
        max_seq_len: longest sequence (linked from the data module).
        num_classes: number of classes (linked from the data module).
        pooling: ``mean`` over real tokens, or ``cls``: the hidden state at position 0.
        **encoder: ``init_from`` (:class:`tasks.base.EncoderTask`) and the model's and the optimizer's flags
            (:class:`tasks.base.ZooTask`).
    """

    target: ClassVar[str] = "sequence"
    hparam_metrics = ("val/acc", "val/f1", *EncoderTask.hparam_metrics)

    def __init__(
        self,
        vocab_size: int,
        max_seq_len: int,
        num_classes: int,
        *,
        pooling: Literal["mean", "cls"] = "mean",
        **encoder: Any,
    ) -> None:
        super().__init__(vocab_size, max_seq_len, num_classes, **encoder)
        self.pooling = pooling
        self.head = nn.Linear(self.hparams.dim, num_classes)
        init_linear_(self.head)  # Xavier, zero bias: the encoder's convention (attention_zoo.init)
        self.metrics = nn.ModuleDict(
            {
                f"{stage}_metrics": MetricCollection(
                    {
                        "acc": MulticlassAccuracy(num_classes, average="micro"),
                        "f1": MulticlassF1Score(num_classes, average="macro"),
                    },
                    prefix=f"{stage}/",
                )
                for stage in STAGES
            }
        )

    def forward(self, tokens: Tensor, mask: Tensor, segments: Tensor | None = None) -> Tensor:
        """Logits ``(B, C)``; with ``segments`` (packed rows, (R, S + 1)) one row of logits per non-empty document,
        in document order (module docstring)."""
        hidden = self.encoder(tokens, mask, segments)
        return self.head(self.pool(hidden, mask) if segments is None else self.pool_documents(hidden, segments))

    def pool(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """``(B, N, d)`` hidden states -> ``(B, d)``: their mean over real tokens, or the state at position 0."""
        # b: batch, n: positions, d: model width
        if self.pooling == "cls":
            return hidden[:, 0]
        weights = mask.to(hidden.dtype)
        summed = reduce(hidden * weights[..., None], "b n d -> b d", "sum")
        return summed / reduce(weights, "b n -> b", "sum").clamp(min=1.0)[:, None]

    def pool_documents(self, hidden: Tensor, segments: Tensor) -> Tensor:
        """``(R, N, d)`` hidden states of packed rows -> ``(D, d)``, one vector per non-empty document in document
        order: the mean over the document's tokens, or the state at its first position."""
        # r: rows, s: document slots of a row, n: positions, d: model width
        starts, lengths = segments[:, :-1], segments.diff(dim=1)
        if self.pooling == "cls":
            # an empty slot after a full row starts at N: clamped to read something, then dropped with the empties
            pooled = hidden.gather(1, repeat(starts.clamp(max=hidden.shape[1] - 1), "r s -> r s d", d=hidden.shape[-1]))
        else:
            slots = torch.arange(lengths.shape[1], device=segments.device)
            member = document_ids(segments, hidden.shape[1])[:, None, :] == slots[None, :, None]  # (r, s, n)
            # in the hidden states' precision, as the padded path sums: autocast would round the sums to 16 bits
            with torch.autocast(hidden.device.type, enabled=False):
                summed = torch.einsum("rsn,rnd->rsd", member.to(hidden.dtype), hidden)
            pooled = summed / lengths.clamp(min=1)[..., None].to(hidden.dtype)
        return pooled[lengths > 0]

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits, labels)

    def update_metrics(self, stage: Stage, logits: Tensor, labels: Tensor) -> dict[str, Any]:
        collection = self.metrics[f"{stage}_metrics"]
        collection(logits, labels)
        return dict(collection.items(keep_base=False, copy_state=False))
