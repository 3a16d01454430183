"""Majority: at every position, name the most frequent symbol of the whole sequence.

A task that needs every query to aggregate the entire sequence, and nothing more: each sequence of
``seq_len`` symbols is drawn i.i.d. from ``num_symbols`` symbols, one of them (the planted symbol, chosen
per sequence) with probability ``planted_prob`` and the others equally likely; the label at every
position is the symbol that occurs most often in the sequence (a sequence whose top count is tied is
drawn again, so the label is always defined). Full attention solves it from the start of training:
uniform attention already averages the sequence, and the model only has to read the largest count off
that average. A query that sees only m of the n tokens (a window, a hash bucket, a few selected blocks)
can at best guess the majority of its sample, so its accuracy is bounded by the chance that the sample's
majority is the sequence's; for 8 symbols, planted probability 0.2 and n = 1024 (the default of ``zoo
compare``), that bound is about 0.49 for m = 33, 0.66 for m = 65, 0.84 for m = 129, 0.97 for m = 257
and 1.00 from m = 513 (simulated: ``majority_bound``). The task therefore separates mechanisms by how much
of the sequence each query can reach, which is the question an efficient attention answers differently.

This is a synthetic counting task (in the family of majority/parity tasks used to probe what attention
can compute), not one from the seed papers; the papers' own long-range tasks (ListOps, byte-level text,
retrieval) take thousands of GPU steps to separate mechanisms at this length, which a 10-minute CPU
comparison cannot afford (see the README).
"""

from __future__ import annotations

from typing import Any

import torch
from einops import repeat
from torch import Tensor

from tasks.data.base import Sequences, Split, ZooDataModule, derive_seed, split_sizes

PAD_ID = 0


def generate_majority(
    num_examples: int, *, seq_len: int, num_symbols: int, planted_prob: float, seed: int
) -> tuple[Tensor, Tensor]:
    """``(tokens, majority)``: tokens ``(num_examples, seq_len)`` in ``1..num_symbols`` (0 is padding),
    majority ``(num_examples,)``, the most frequent token of each row (never tied)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(num_examples, seq_len, dtype=torch.long)
    majority = torch.empty(num_examples, dtype=torch.long)
    pending = torch.arange(num_examples)
    while len(pending):
        planted = torch.randint(0, num_symbols, (len(pending),), generator=generator)
        probs = torch.full((len(pending), num_symbols), (1 - planted_prob) / (num_symbols - 1), dtype=torch.float64)
        probs.scatter_(1, planted[:, None], planted_prob)
        drawn = torch.multinomial(probs, seq_len, replacement=True, generator=generator)
        counts = torch.zeros(len(pending), num_symbols, dtype=torch.long).scatter_add_(1, drawn, torch.ones_like(drawn))
        top2 = counts.topk(2, dim=1).values
        unique = top2[:, 0] > top2[:, 1]
        tokens[pending[unique]] = drawn[unique] + 1
        majority[pending[unique]] = counts[unique].argmax(dim=1) + 1
        pending = pending[~unique]
    return tokens, majority


def majority_bound(sample: int, *, num_symbols: int, planted_prob: float, trials: int = 20_000, seed: int = 0) -> float:
    """The best accuracy of a query that sees ``sample`` of the tokens: how often the majority of an
    i.i.d. sample of that size is the planted symbol (ties split at random), by simulation."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.full((num_symbols,), (1 - planted_prob) / (num_symbols - 1), dtype=torch.float64)
    probs[0] = planted_prob
    drawn = torch.multinomial(probs.expand(trials, -1), sample, replacement=True, generator=generator)
    counts = torch.zeros(trials, num_symbols, dtype=torch.float64).scatter_add_(
        1, drawn, torch.ones_like(drawn, dtype=torch.float64)
    )
    counts += torch.rand(counts.shape, generator=generator, dtype=torch.float64) * 0.5  # random tie-break
    return float((counts.argmax(dim=1) == 0).double().mean())


class MajorityDataModule(ZooDataModule):
    """Majority of the sequence at every position (module docstring); ``target = "token"``.

    Args:
        seq_len: sequence length (also ``max_seq_len``).
        num_symbols: alphabet size K (chance accuracy 1/K); token ids ``1..K``, 0 is padding.
        planted_prob: probability of the planted symbol (the others share the rest equally); it must
            exceed 1/K. Smaller values make the majority harder to see from part of the sequence.
        train_size: training sequences.
        val_size: validation sequences.
        test_size: test sequences.
        batch_size: sequences per batch, per device under DDP.
        **loader: plus the other loader options of :class:`tasks.data.base.ZooDataModule` (``seed``,
            ``shuffle_seed``, ``num_workers``, ``pad_to_max_len``, ``cache_dir``).
    """

    target = "token"
    cache_name = "majority"
    cache_fields = ("seq_len", "num_symbols", "planted_prob", "sizes")

    def __init__(
        self,
        *,
        seq_len: int = 1024,
        num_symbols: int = 8,
        planted_prob: float = 0.2,
        train_size: int = 20_000,
        val_size: int = 256,
        test_size: int = 256,
        batch_size: int = 8,
        **loader: Any,
    ) -> None:
        super().__init__(batch_size=batch_size, **loader)
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if num_symbols < 2:
            raise ValueError(f"num_symbols must be >= 2, got {num_symbols}")
        if not 1 / num_symbols < planted_prob < 1:
            raise ValueError(
                f"planted_prob must be in (1/num_symbols, 1) = ({1 / num_symbols:.4g}, 1) so the planted symbol is "
                f"the likeliest; got {planted_prob}"
            )
        self.sizes = split_sizes(train_size, val_size, test_size)
        self.seq_len, self.num_symbols, self.planted_prob = seq_len, num_symbols, planted_prob
        self.expose(vocab_size=num_symbols + 1, max_seq_len=seq_len, num_classes=num_symbols + 1, pad_id=PAD_ID)

    def build_split(self, split: Split) -> Sequences:
        tokens, majority = generate_majority(
            self.sizes[split],
            seq_len=self.seq_len,
            num_symbols=self.num_symbols,
            planted_prob=self.planted_prob,
            seed=derive_seed(self.seed, "majority", split),
        )
        return Sequences.from_rows(tokens, repeat(majority, "b -> b n", n=self.seq_len))
