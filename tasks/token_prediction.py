"""Token-level prediction: masked language modelling (the Linformer paper's pretraining objective,
BERT-style masking done by the data module) and multi-query associative recall.

Labels are (B, N) with -100 at every position that is not scored (unmasked MLM tokens, recall keys);
the loss is the mean cross-entropy over scored positions and perplexity is exp of that mean, accumulated
over all scored tokens of a stage (torchmetrics ``Perplexity``). The epoch's ``val/loss`` and
``test/loss`` weight each batch by its scored tokens, so they are the mean over all scored tokens of the
stage and ``exp(val/loss) = val/ppl`` however unevenly the labels fall into batches.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from attention_zoo.init import init_linear_
from tasks.base import STAGES, EncoderTask, Stage
from tasks.data.base import IGNORE_INDEX


class TokenPrediction(EncoderTask):
    """Predict a class (a vocabulary id for MLM) at every labelled position; logs loss, accuracy and
    perplexity per stage.

    Args:
        vocab_size: token vocabulary (linked from the data module).
        max_seq_len: longest sequence (linked from the data module).
        num_classes: classes per position, the vocabulary for MLM (linked from the data module).
        **encoder: ``init_from`` (:class:`tasks.base.EncoderTask`) and the model's and the optimizer's flags
            (:class:`tasks.base.ZooTask`).
    """

    target: ClassVar[str] = "token"
    hparam_metrics = ("val/acc", "val/ppl", *EncoderTask.hparam_metrics)

    def __init__(self, vocab_size: int, max_seq_len: int, num_classes: int, **encoder: Any) -> None:
        super().__init__(vocab_size, max_seq_len, num_classes, **encoder)
        self.head = nn.Linear(self.hparams.dim, num_classes)
        init_linear_(self.head)  # Xavier, zero bias: the encoder's convention (attention_zoo.init)
        # one metric object per stage ("train" cannot be a ModuleDict key: it is nn.Module.train)
        self.accuracy = nn.ModuleDict(
            {f"{s}_acc": MulticlassAccuracy(num_classes, average="micro", ignore_index=IGNORE_INDEX) for s in STAGES}
        )
        self.perplexity = nn.ModuleDict({f"{s}_ppl": Perplexity(ignore_index=IGNORE_INDEX) for s in STAGES})

    def forward(self, tokens: Tensor, mask: Tensor, segments: Tensor | None = None) -> Tensor:
        """Logits (B, N, C); ``segments``: packed rows' document boundaries (attention_zoo.packing)."""
        # b: batch, n: positions, c: classes
        return self.head(self.encoder(tokens, mask, segments))

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(
            rearrange(logits, "b n c -> (b n) c"), rearrange(labels, "b n -> (b n)"), ignore_index=IGNORE_INDEX
        )

    def loss_terms(self, labels: Tensor) -> int:
        return int((labels != IGNORE_INDEX).sum())

    def update_metrics(self, stage: Stage, logits: Tensor, labels: Tensor) -> dict[str, Any]:
        accuracy, perplexity = self.accuracy[f"{stage}_acc"], self.perplexity[f"{stage}_ppl"]
        accuracy(rearrange(logits, "b n c -> (b n) c"), rearrange(labels, "b n -> (b n)"))
        perplexity(logits.float(), labels)
        return {f"{stage}/acc": accuracy, f"{stage}/ppl": perplexity}
