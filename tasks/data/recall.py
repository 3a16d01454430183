"""Multi-query associative recall (MQAR), the synthetic task of the Zoology benchmark.

Arora, Eyuboglu et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language Models",
arXiv:2312.04927, Sec. 3 and ``zoology/data/multiquery_ar.py``. Each sequence of length ``seq_len``
starts with ``D = num_kv_pairs`` key-value pairs ``k_1 v_1 k_2 v_2 ... k_D v_D`` (keys distinct, drawn from
``[1, vocab_size // 2)``; values distinct, from ``[vocab_size // 2, vocab_size)``), followed by a query
region in which every key appears once more, at even offsets ``2 g`` from the end of the context; the
gaps ``g`` are drawn without replacement from ``{0, ..., (seq_len - 2 D) / 2 - 1}`` with probability
``p(g) ∝ a (g + 1)^(a - 1)`` (``a = power_a``, 0.01 in Zoology: short gaps are more likely, as repeated
bigrams are in text). All other query-region positions hold random tokens. The label at each query
position is the value paired with that key; every other position is ``-100``. Solving it needs lookups
over distances up to ``seq_len``: the task on which attention approximations really differ.

Deviations: Zoology draws the random filler tokens from ``[0, vocab_size)``; here from ``[1, vocab_size)``
so that id 0 is only ever padding (sequences all have length ``seq_len``, so there is none). With
``kv_placement="random"`` (not in Zoology) the key-value block starts at a random even offset ``o`` in
``[0, seq_len - 4 D]``, preceded by filler, and the gaps are drawn from ``{0, ..., (seq_len - o - 2 D) / 2 - 1}``
by the same power law. Zoology's block always starts at position 0, which a mechanism that mixes positions
(Linformer's E) can learn to route by position alone; a random offset makes every mechanism find the pairs
by content.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from einops import rearrange
from torch import Tensor

from tasks.data.base import IGNORE_INDEX, Sequences, Split, ZooDataModule, derive_seed, split_sizes

PAD_ID = 0
CHUNK = 4096  # examples generated at once: bounds the (chunk, vocab_size / 2) random draws


KVPlacement = Literal["start", "random"]


def power_law_weights(space: int, power_a: float) -> Tensor:
    """``(space,)`` float64: the unnormalised probability ``a (g + 1)^(a - 1)`` of each query gap ``g``."""
    return power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)


def generate_mqar(
    num_examples: int,
    *,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    power_a: float,
    seed: int,
    kv_placement: KVPlacement = "start",
) -> tuple[Tensor, Tensor]:
    """``(inputs, labels)``, both ``(num_examples, seq_len)`` int64; labels are -100 except at queries."""
    generator = torch.Generator().manual_seed(seed)
    context = 2 * num_kv_pairs
    key_vocab = vocab_size // 2
    space = (seq_len - context) // 2
    gap_weights = power_law_weights(space, power_a)
    slots = torch.arange(space)
    inputs, labels = [], []
    for start in range(0, num_examples, CHUNK):
        batch = min(CHUNK, num_examples - start)
        # top-k of i.i.d. uniforms: a uniformly random ordered sample without replacement
        keys = 1 + torch.rand(batch, key_vocab - 1, generator=generator).topk(num_kv_pairs, dim=1).indices
        values = (
            key_vocab + torch.rand(batch, vocab_size - key_vocab, generator=generator).topk(num_kv_pairs, dim=1).indices
        )
        if kv_placement == "random":  # even offsets 0 .. seq_len - 4 D: room for one query slot per key after
            offsets = 2 * torch.randint(0, (seq_len - 4 * num_kv_pairs) // 2 + 1, (batch, 1), generator=generator)
        else:
            offsets = torch.zeros(batch, 1, dtype=torch.long)
        weights = gap_weights * (slots < space - offsets // 2)  # the gaps that fit after this example's block
        gaps = torch.multinomial(weights, num_kv_pairs, replacement=False, generator=generator)
        tokens = torch.randint(1, vocab_size, (batch, seq_len), generator=generator)
        block = offsets + torch.arange(context)
        tokens.scatter_(1, block, rearrange([keys, values], "two b d -> b (d two)"))
        query_positions = offsets + context + 2 * gaps
        tokens.scatter_(1, query_positions, keys)
        targets = torch.full((batch, seq_len), IGNORE_INDEX, dtype=torch.long)
        targets.scatter_(1, query_positions, values)
        inputs.append(tokens)
        labels.append(targets)
    return torch.cat(inputs), torch.cat(labels)


class AssociativeRecallDataModule(ZooDataModule):
    """Multi-query associative recall (Zoology MQAR): predict, at each repeated key, its value.

    ``target = "token"``; ``num_classes = vocab_size`` (labels are token ids, -100 off the queries).
    Generated deterministically from ``seed`` (each split from its own derived seed) and cached.

    Args:
        seq_len: sequence length, even, at least ``4 * num_kv_pairs``; also ``max_seq_len``.
        num_kv_pairs: key-value pairs per sequence; each key is queried once.
        vocab_size: token ids ``0..vocab_size-1``: 0 is padding, keys ``[1, vocab_size // 2)``, values
            ``[vocab_size // 2, vocab_size)``. Zoology notes large vocabularies (>1k) separate
            architectures better.
        power_a: power-law exponent of the query gap distribution (Zoology: 0.01; 1.0 is uniform).
        kv_placement: ``start`` (Zoology: the key-value block opens the sequence) or ``random`` (it starts at a
            random even offset; module docstring).
        train_size: training sequences (Zoology: 100000).
        val_size: validation sequences.
        test_size: test sequences (Zoology: 3000).
        **loader: plus the loader options of :class:`tasks.data.base.ZooDataModule` (``seed``, ``shuffle_seed``,
            ``batch_size``, ``num_workers``, ``pad_to_max_len``, ``cache_dir``).
    """

    target = "token"
    cache_name = "mqar"
    cache_fields = ("seq_len", "num_kv_pairs", "vocab_size", "power_a", "kv_placement", "sizes")

    def __init__(
        self,
        *,
        seq_len: int = 256,
        num_kv_pairs: int = 16,
        vocab_size: int = 8192,
        power_a: float = 0.01,
        kv_placement: KVPlacement = "start",
        train_size: int = 100_000,
        val_size: int = 3_000,
        test_size: int = 3_000,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        if num_kv_pairs < 1:
            raise ValueError(f"num_kv_pairs must be >= 1, got {num_kv_pairs}")
        if seq_len % 2 or seq_len < 4 * num_kv_pairs:
            raise ValueError(
                f"seq_len must be even and >= 4 * num_kv_pairs = {4 * num_kv_pairs} (room for the pairs and one "
                f"query slot per key); got seq_len={seq_len}"
            )
        if vocab_size // 2 - 1 < num_kv_pairs:
            raise ValueError(
                f"vocab_size={vocab_size} leaves {vocab_size // 2 - 1} key ids for {num_kv_pairs} distinct keys; "
                f"use vocab_size >= {2 * num_kv_pairs + 2}"
            )
        weights = power_law_weights((seq_len - 2 * num_kv_pairs) // 2, power_a)
        if not (power_a > 0 and weights.isfinite().all() and weights.min() > 0):  # NaN fails every comparison
            raise ValueError(
                f"power_a must be a finite number > 0 whose gap weights a (g + 1)^(a - 1) are finite and positive "
                f"for the gaps of seq_len={seq_len}; got {power_a}"
            )
        self.sizes = split_sizes(train_size, val_size, test_size)
        if kv_placement not in ("start", "random"):
            raise ValueError(f"kv_placement must be 'start' or 'random', got {kv_placement!r}")
        self.seq_len, self.num_kv_pairs, self.power_a = seq_len, num_kv_pairs, power_a
        self.kv_placement = kv_placement
        self.expose(vocab_size=vocab_size, max_seq_len=seq_len, num_classes=vocab_size, pad_id=PAD_ID)

    def build_split(self, split: Split) -> Sequences:
        inputs, labels = generate_mqar(
            self.sizes[split],
            seq_len=self.seq_len,
            num_kv_pairs=self.num_kv_pairs,
            vocab_size=self.vocab_size,
            power_a=self.power_a,
            seed=derive_seed(self.seed, "mqar", split),
            kv_placement=self.kv_placement,
        )
        return Sequences.from_rows(inputs, labels)
