"""Sequence classification (ListOps, text classification): one label per sequence.

The encoder's hidden states are pooled to one vector per sequence, either the mean over real tokens
(padding excluded, as Long Range Arena's classifiers do) or the state at the first position (a [CLS]
token the data puts there), then a linear layer gives the class logits.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch.nn.functional as F
from einops import reduce
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from attention_zoo.init import init_linear_
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

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        return self.head(self.pool(self.encoder(tokens, mask), mask))

    def pool(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """``(B, N, d)`` hidden states -> ``(B, d)``: their mean over real tokens, or the state at position 0."""
        # b: batch, n: positions, d: model width
        if self.pooling == "cls":
            return hidden[:, 0]
        weights = mask.to(hidden.dtype)
        summed = reduce(hidden * weights[..., None], "b n d -> b d", "sum")
        return summed / reduce(weights, "b n -> b", "sum").clamp(min=1.0)[:, None]

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits, labels)

    def update_metrics(self, stage: Stage, logits: Tensor, labels: Tensor) -> dict[str, Any]:
        collection = self.metrics[f"{stage}_metrics"]
        collection(logits, labels)
        return dict(collection.items(keep_base=False, copy_state=False))
