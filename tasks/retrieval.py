"""Document matching (Long Range Arena's Retrieval task): a two-tower classifier over pairs of documents.

Tay et al. 2020, arXiv:2011.04006, Sec. 3.3; the head follows the Nystromformer authors' LRA reimplementation
(github.com/mlpen/Nystromformer, ``LRA/code/model_wrapper.py``, ``SCHeadDual``): both documents go through the
same encoder (no attention across them), each is mean-pooled over its real tokens into ``u`` and ``v``, and
``[u, v, u * v, u - v]`` feeds ``Linear(4 dim, hidden) -> ReLU -> Linear(hidden, classes)`` with ``hidden`` the
feed-forward width (``dim * ff_mult``; theirs ``transformer_hidden_dim``). LRA's own ``classifier_head_dual``
builds the same features under ``interaction="NLI"`` with a three-layer MLP, but its released matching
``train.py`` never sets it (only ``[u, v]`` reaches the head there). Batches are the pair form of the data
contract (:mod:`tasks.data.retrieval`): ``tokens`` and ``mask`` ``(B, 2, N)``, ``labels`` ``(B,)``; packed rows
(``segments``) are refused: the pair data are not packed.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from einops import rearrange
from torch import Tensor, nn

from attention_zoo.init import init_linear_
from tasks.classification import SequenceClassification


def interaction_features(u: Tensor, v: Tensor) -> Tensor:
    """``[u, v, u * v, u - v]`` along the last axis: ``(..., d)`` twice -> ``(..., 4 d)``."""
    return torch.cat([u, v, u * v, u - v], dim=-1)


class DocumentMatching(SequenceClassification):
    """Classify pairs of documents, each encoded by the one encoder and mean-pooled; logs loss, accuracy and macro
    F1 per stage (those of :class:`tasks.classification.SequenceClassification`).

    Args:
        vocab_size: token vocabulary (linked from the data module).
        max_seq_len: longest document (linked from the data module).
        num_classes: number of classes (linked from the data module; 2 for LRA Retrieval).
        **encoder: ``init_from`` (:class:`tasks.base.EncoderTask`) and the model's and the optimizer's flags
            (:class:`tasks.base.ZooTask`).
    """

    target: ClassVar[str] = "pair"

    def __init__(self, vocab_size: int, max_seq_len: int, num_classes: int, **encoder: Any) -> None:
        super().__init__(vocab_size, max_seq_len, num_classes, pooling="mean", **encoder)
        dim = self.hparams.dim
        hidden = dim * self.hparams.ff_mult
        self.head = nn.Sequential(nn.Linear(4 * dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        for layer in (self.head[0], self.head[2]):
            init_linear_(layer)  # Xavier, zero bias: the encoder's convention (attention_zoo.init)

    def encode_pairs(self, tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``(u, v)``, each ``(B, dim)``: both documents of each pair encoded in one batch of ``2 B`` sequences by
        the same encoder, then mean-pooled over their real tokens (padding excluded)."""
        # b: pairs, two: the pair's documents, n: positions, d: model width
        flat_mask = rearrange(mask, "b two n -> (b two) n")
        pooled = self.pool(self.encoder(rearrange(tokens, "b two n -> (b two) n"), flat_mask), flat_mask)
        pairs = rearrange(pooled, "(b two) d -> two b d", two=2)
        return pairs[0], pairs[1]

    def forward(self, tokens: Tensor, mask: Tensor, segments: Tensor | None = None) -> Tensor:
        if segments is not None:
            raise ValueError(
                "DocumentMatching takes pairs of documents (tokens (B, 2, N)), not packed rows: segments are not "
                "supported; leave the data option pack off"
            )
        u, v = self.encode_pairs(tokens, mask)
        return self.head(interaction_features(u, v))
