"""Translation data: sentence pairs from one of four sources, a joint BPE, and teacher-forcing batches.

Sources (``source``), nothing downloaded at run time:

- ``gettext`` (default): the machine's installed message catalogs, real human translations of software
  messages (:mod:`tasks.data.gettext_corpus`).
- ``files``: line-aligned ``<prefix>.<lang>`` pairs, TSV or JSONL (:mod:`tasks.data.parallel_text`), e.g. WMT14.
- ``hf``: a Hugging Face ``datasets`` dataset (``wmt14``/``de-en`` from a local cache, or local JSON files
  through ``hf_dataset="json"`` and ``hf_data_files``).
- ``synthetic``: a seeded toy language pair with reordering and agreement (:mod:`tasks.data.synthetic_translation`).

Every source's pairs are cleaned, split (no source in two splits; near-duplicates by ``split_by`` and
``dedupe_normalised``) and optionally joined into pseudo-documents the same way: :mod:`tasks.data.parallel_corpus`.

Tokenisation: one byte-level BPE (``tokenizers``) for both languages, trained on the training split's sources
and targets only, cached by its parameters; ``<pad>`` 0, ``<bos>`` 4, ``<eos>`` 5
(:data:`tasks.data.tokenize.TRANSLATION_SPECIAL_TOKENS`). It decodes losslessly, so :meth:`decode` gives text
that sacreBLEU scores directly against the raw reference of :meth:`texts`. Overlong pairs (``overlong``) are an
error or dropped; a pair whose bytes alone exceed the limits (:meth:`overlong_by_bytes`) is found before the BPE
is trained and never trained on (training time grows with the square of the length of a text without spaces).

Batches (the contract with :mod:`tasks.translation`; packed training batches, ``pack``: :class:`PackedPairCollate`):

- ``source`` (B, S) long, padded with ``pad_id``, ending in EOS (no BOS); ``source_mask`` (B, S) bool, True = real;
- ``target_in`` (B, T) long = BOS y_1 .. y_m, padded with ``pad_id``; ``target_mask`` (B, T) bool, True = real;
- ``target_out`` (B, T) long = y_1 .. y_m EOS, -100 at padding;
- ``index`` (B,) long, the pair's position in its split (``texts(split)[0][index]`` is its raw source).

Caches under ``<cache_dir>/translation/``: the corpus (JSON), the BPE (JSON) and the tokenised splits (``.pt``),
each keyed by every parameter that defines it, including a fingerprint of the source files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from attention_zoo.packing import padding_mask
from tasks.data.base import (
    IGNORE_INDEX,
    SPLITS,
    DataError,
    Sequences,
    Split,
    ZooDataModule,
    cache_file,
    epoch_and_index,
)
from tasks.data.gettext_corpus import normalise_whitespace
from tasks.data.packing import first_fit, pack_side
from tasks.data.parallel_corpus import CorpusSpec, Source, SplitBy
from tasks.data.tokenize import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TRANSLATION_SPECIAL_TOKENS,
    TextTokenizer,
    resolve_tokenizer,
)

Overlong = Literal["error", "drop"]
#: the longest token the joint BPE may learn, in bytes: longer than the words of real text, so it rarely binds
MAX_TOKEN_BYTES = 32


class PairDataset(Dataset):
    """Items ``(source ids + EOS, target ids, index)`` from sequences stored as source, target, source, ..."""

    def __init__(self, data: Sequences):
        self.data = data

    def __len__(self) -> int:
        return len(self.data) // 2

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, Tensor, int]:
        _, index = epoch_and_index(key)
        return self.data.sequence(2 * index), self.data.sequence(2 * index + 1), index


class PairCollate:
    """Batch ``(source, target, index)`` items into the translation batch dict (see the module docstring)."""

    def __init__(self, pad_source_to: int | None = None, pad_target_to: int | None = None):
        self.pad_source_to, self.pad_target_to = pad_source_to, pad_target_to

    def __call__(self, items: list[tuple[Tensor, Tensor, int]]) -> dict[str, Tensor]:
        source_lengths = torch.tensor([len(source) for source, _, _ in items])
        target_lengths = torch.tensor([len(target) + 1 for _, target, _ in items])
        width_s = self.pad_source_to or int(source_lengths.max())
        width_t = self.pad_target_to or int(target_lengths.max())
        source = torch.full((len(items), width_s), PAD_ID, dtype=torch.long)
        target_in = torch.full((len(items), width_t), PAD_ID, dtype=torch.long)
        target_out = torch.full((len(items), width_t), IGNORE_INDEX, dtype=torch.long)
        for row, (source_ids, target_ids, _) in enumerate(items):
            m = len(target_ids)
            source[row, : len(source_ids)] = source_ids
            target_in[row, 0], target_in[row, 1 : m + 1] = BOS_ID, target_ids
            target_out[row, :m], target_out[row, m] = target_ids, EOS_ID
        return {
            "source": source,
            "source_mask": torch.arange(width_s)[None, :] < source_lengths[:, None],
            "target_in": target_in,
            "target_out": target_out,
            "target_mask": torch.arange(width_t)[None, :] < target_lengths[:, None],
            "index": torch.tensor([index for _, _, index in items], dtype=torch.long),
        }


class PackedPairCollate:
    """Pack a batch of B ``(source, target, index)`` items into R <= B rows, each side with its boundaries.

    Each pair is two documents, its source (tokens + EOS) and its decoder input (BOS + tokens, the length of its
    ``target_out`` too), placed by :func:`tasks.data.packing.first_fit` into rows holding up to
    ``max_source_len`` source and ``max_target_len`` target tokens (every pair of the module fits one). A batch is
    as wide as its fullest row on each side, or the row lengths themselves with ``pad_to_max_len``. The batch:

    - ``source`` (R, S), ``source_mask``, ``target_in`` (R, T), ``target_out`` (-100 after each row's last pair)
      and ``target_mask`` as in a padded batch, row by row; pair d of a row is source document d and target
      document d;
    - ``source_segments``, ``target_segments`` (R, D + 1) long (:mod:`attention_zoo.packing`), D the most pairs
      in a row (a row with fewer repeats its last boundary);
    - ``index`` (B,) long, the pairs in packed order: row 0's documents, then row 1's, and so on.
    """

    def __init__(self, max_source_len: int, max_target_len: int, *, pad_to_max_len: bool = False):
        self.max_source_len, self.max_target_len, self.pad_to_max_len = max_source_len, max_target_len, pad_to_max_len

    def __call__(self, items: list[tuple[Tensor, Tensor, int]]) -> dict[str, Tensor]:
        sources = [source for source, _, _ in items]
        targets_in = [torch.cat([torch.tensor([BOS_ID]), target]) for _, target, _ in items]
        targets_out = [torch.cat([target, torch.tensor([EOS_ID])]) for _, target, _ in items]
        sizes = [(len(s), len(t)) for s, t in zip(sources, targets_in, strict=True)]
        rows = first_fit(sizes, (self.max_source_len, self.max_target_len))
        if self.pad_to_max_len:
            width_s, width_t = self.max_source_len, self.max_target_len
        else:
            width_s = max(sum(sizes[i][0] for i in row) for row in rows)
            width_t = max(sum(sizes[i][1] for i in row) for row in rows)
        source, source_segments = pack_side(sources, rows, width_s, PAD_ID)
        target_in, target_segments = pack_side(targets_in, rows, width_t, PAD_ID)
        target_out, _ = pack_side(targets_out, rows, width_t, IGNORE_INDEX)
        return {
            "source": source,
            "source_mask": padding_mask(source_segments, width_s),
            "target_in": target_in,
            "target_out": target_out,
            "target_mask": padding_mask(target_segments, width_t),
            "source_segments": source_segments,
            "target_segments": target_segments,
            "index": torch.tensor([items[i][2] for row in rows for i in row], dtype=torch.long),
        }


class TranslationDataModule(ZooDataModule):
    """Sentence pairs for encoder-decoder translation, tokenised with a joint BPE (see the module docstring).

    ``vocab_size`` is ``bpe_vocab_size`` (every id is below it; a small corpus may train fewer tokens),
    ``max_seq_len`` the larger of ``max_source_len`` and ``max_target_len``, ``num_classes`` the vocabulary.
    ``seed`` draws the synthetic pairs, the order of messages in pseudo-documents and the training order, not the
    split (which is by source hash).

    Args:
        source: where the pairs come from: ``"gettext"`` (installed catalogs), ``"files"``, ``"hf"``, ``"synthetic"``.
        source_lang: language of the source side (``gettext``: ``"en"``, the language of msgids).
        target_lang: language of the target side (``gettext``: a folder of ``locale_dir``, e.g. ``de``, ``fr``, ``es``).
        locale_dir: where ``gettext`` looks for ``<target_lang>/LC_MESSAGES/*.mo``.
        train_data: ``files``: training pairs: a ``.tsv`` or ``.jsonl`` file, or the prefix of two
            ``<prefix>.<lang>`` files.
        val_data: ``files``: validation pairs (same formats); default: carved from train by source hash.
        test_data: ``files``: test pairs (same formats); default: carved from train by source hash.
        source_field: JSONL / ``hf`` field of the source text (dotted names reach into nested objects).
        target_field: JSONL / ``hf`` field of the target text (``hf`` rows with a ``translation`` column are
            read as ``translation[<lang>]`` instead).
        hf_dataset: ``hf``: dataset name (``wmt14``) or a builder such as ``json`` for local files.
        hf_config: ``hf``: configuration name (``de-en``).
        hf_data_files: ``hf``: ``{split name: file}`` for a builder such as ``json`` (splits ``train``,
            ``validation``, ``test``).
        synthetic_pairs: ``synthetic``: number of distinct pairs drawn (before the split).
        synthetic_words: ``synthetic``: nouns and adjectives in the toy lexicon (half as many verbs).
        val_fraction: share of the carved data that goes to validation.
        test_fraction: share of the carved data that goes to test.
        train_size: keep at most this many training pairs (the first in hash order); None keeps all.
        bpe_vocab_size: size of the joint BPE vocabulary, specials included (>= 262: 6 specials + 256 bytes).
        max_source_len: maximum source tokens, EOS included.
        max_target_len: maximum target tokens plus one (the BOS of ``target_in`` / EOS of ``target_out``).
        overlong: a longer pair is an ``"error"`` (default: raise, saying how many and the longest) or is
            dropped (``"drop"``: counted per split in ``corpus_summary()``); a pair longer in bytes than
            :data:`MAX_TOKEN_BYTES` per allowed token is found before the BPE is trained, and never trained on.
        split_by: what a carved split is drawn by: ``"source"`` (default: the hash of the source string),
            ``"normalised"`` (the hash of its near-duplicate key: case, punctuation, whitespace and printf /
            brace format specifiers removed, so near-duplicates never cross train/val/test) or ``"catalog"``
            (``gettext`` only: the hash of the catalog's file name; fractions are then shares of catalogs).
        dedupe_normalised: keep one pair per near-duplicate key (the first in source-hash order); the others
            are counted in ``corpus_summary()["dropped"]["normalised_duplicate"]``.
        messages_per_document: m > 1 joins m messages of one catalog (``gettext``; ``synthetic``: one group;
            other sources are refused) into one source, their translations in the same order into its target,
            after the split and in an order drawn from ``seed``. An artificial construction (a ``.mo`` catalog
            is sorted by msgid and keeps no source order) that gives inputs m times as long, with an alignment
            running across the whole sequence; ``max_source_len`` / ``max_target_len`` and ``overlong`` then
            apply to the documents, ``train_size`` counts documents. Default 1: one message per pair.
        train_single_messages: with documents (m > 1), also train on each message of the training documents on
            its own (val and test stay documents), so that the model can learn to align on short pairs; counted in
            ``corpus_summary()["documents"]["train_single_messages"]``. Default False.
        pack: pack the training batches (:class:`PackedPairCollate`): each batch of the unchanged sampler, its
            ``batch_size`` pairs, is laid into as few rows as first-fit decreasing finds, rows of up to
            ``max_source_len`` source and ``max_target_len`` target tokens, with each row's pair boundaries on both
            sides, so that no token attends to another pair's (cross-attention included). The loss is the same
            mean over the same target tokens as padded. Validation and test batches stay padded: they are decoded
            (greedy BLEU, beam search), which is not packed, and their loss and perplexity do not depend on the
            layout. Default False: every batch padded.
        **loader: plus the loader options of :class:`tasks.data.base.ZooDataModule` (``seed``, ``shuffle_seed``,
            ``batch_size``, ``num_workers``, ``pad_to_max_len``, ``cache_dir``).
    """

    target = "translation"
    cache_name = "translation"

    def __init__(
        self,
        *,
        source: Source = "gettext",
        source_lang: str = "en",
        target_lang: str = "de",
        locale_dir: str = "/usr/share/locale",
        train_data: str | None = None,
        val_data: str | None = None,
        test_data: str | None = None,
        source_field: str = "source",
        target_field: str = "target",
        hf_dataset: str | None = None,
        hf_config: str | None = None,
        hf_data_files: dict[str, str] | None = None,
        synthetic_pairs: int = 20000,
        synthetic_words: int = 32,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        train_size: int | None = None,
        bpe_vocab_size: int = 8000,
        max_source_len: int = 256,
        max_target_len: int = 256,
        overlong: Overlong = "error",
        split_by: SplitBy = "source",
        dedupe_normalised: bool = False,
        messages_per_document: int = 1,
        train_single_messages: bool = False,
        pack: bool = False,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        if overlong not in ("error", "drop"):
            raise ValueError(f"overlong must be 'error' or 'drop'; got {overlong!r}")
        minimum_vocab = len(TRANSLATION_SPECIAL_TOKENS) + 256
        if bpe_vocab_size < minimum_vocab:
            raise ValueError(
                f"bpe_vocab_size must be >= {minimum_vocab} (6 specials + 256 bytes), got {bpe_vocab_size}"
            )
        if min(max_source_len, max_target_len) < 2:
            raise ValueError(f"max_source_len and max_target_len must be >= 2; got {max_source_len}, {max_target_len}")
        self.spec = CorpusSpec(
            source=source,
            source_lang=source_lang,
            target_lang=target_lang,
            locale_dir=Path(locale_dir),
            split_data={"train": train_data, "val": val_data, "test": test_data},
            source_field=source_field,
            target_field=target_field,
            hf_dataset=hf_dataset,
            hf_config=hf_config,
            hf_data_files=hf_data_files,
            synthetic_pairs=synthetic_pairs,
            synthetic_words=synthetic_words,
            seed=self.seed,
            fractions={"val": val_fraction, "test": test_fraction},
            train_size=train_size,
            split_by=split_by,
            dedupe_normalised=dedupe_normalised,
            messages_per_document=messages_per_document,
            train_single_messages=train_single_messages,
        )
        self.source, self.source_lang, self.target_lang = source, source_lang, target_lang
        self.bpe_vocab_size, self.overlong = bpe_vocab_size, overlong
        self.max_source_len, self.max_target_len = max_source_len, max_target_len
        self.pack = pack
        max_seq_len = max(max_source_len, max_target_len)
        self.expose(vocab_size=bpe_vocab_size, max_seq_len=max_seq_len, num_classes=bpe_vocab_size, pad_id=PAD_ID)
        self.bos_id, self.eos_id = BOS_ID, EOS_ID
        self._corpus: dict | None = None
        self._tokenizer: TextTokenizer | None = None
        self._overlong_by_bytes: dict[Split, set[int]] = {}

    def corpus(self) -> dict:
        """``{"splits": {split: [[source, target], ...]}, "summary": {...}}`` from the cache, or built."""
        if self._corpus is None:
            path = cache_file(self.cache_dir, self.cache_name, "corpus", self.spec.params()).with_suffix(".json")
            self._corpus = self.spec.load(path)
        return self._corpus

    # ---- tokenisation ---------------------------------------------------------------------------------
    def overlong_by_bytes(self, split: Split) -> set[int]:
        """Indices of the ``split`` pairs whose UTF-8 length alone makes them overlong: more bytes than
        :data:`MAX_TOKEN_BYTES` per token allows within ``max_source_len`` / ``max_target_len``. A learned token
        is at most that long, so a text of b UTF-8 bytes has at least b / MAX_TOKEN_BYTES tokens and such a pair
        is overlong under the same rule before any tokenizer exists."""
        if split not in self._overlong_by_bytes:
            most_source = MAX_TOKEN_BYTES * (self.max_source_len - 1)  # source tokens + <eos>
            most_target = MAX_TOKEN_BYTES * (self.max_target_len - 1)  # target tokens + <bos> / <eos>
            self._overlong_by_bytes[split] = {
                i
                for i, (source, target) in enumerate(self.corpus()["splits"][split])
                if len(source.encode()) > most_source or len(target.encode()) > most_target
            }
        return self._overlong_by_bytes[split]

    @property
    def tokenizer(self) -> TextTokenizer:
        """The joint BPE, trained on the training split's sources and targets except the pairs overlong by their
        bytes alone (cached by its parameters)."""
        if self._tokenizer is None:
            params = self.spec.params() | {"bpe_vocab_size": self.bpe_vocab_size} | self._left_out_params()
            left_out = self.overlong_by_bytes("train")
            train = self.corpus()["splits"]["train"]
            self._tokenizer = resolve_tokenizer(
                "bpe",
                vocab_size=self.bpe_vocab_size,
                tokenizer_file=None,
                trained_path=cache_file(self.cache_dir, self.cache_name, "bpe", params).with_suffix(".json"),
                texts=lambda: [text for i, pair in enumerate(train) if i not in left_out for text in pair],
                special_tokens=TRANSLATION_SPECIAL_TOKENS,
                max_token_bytes=MAX_TOKEN_BYTES,
            )
        return self._tokenizer

    def _left_out_params(self) -> dict:
        """The cache-key entry of the training pairs left out of the BPE: present only when there are some, so
        that the limits then key the BPE and the splits it tokenised, and every other cache keeps its key."""
        if not self.overlong_by_bytes("train"):
            return {}
        return {"left_out_overlong": [self.max_source_len, self.max_target_len]}

    def cache_params(self) -> dict:
        lengths = {"max_source_len": self.max_source_len, "max_target_len": self.max_target_len}
        params = self.spec.params() | {"bpe_vocab_size": self.bpe_vocab_size, "overlong": self.overlong} | lengths
        return params | self._left_out_params()

    def build_split(self, split: Split) -> Sequences:
        """Stored as source + EOS, target, source + EOS, ...; ``labels`` = each pair's index in the corpus split
        (twice), ``truncated`` = the number of over-long pairs dropped."""
        pairs = self.corpus()["splits"][split]
        by_bytes = self.overlong_by_bytes(split)
        limits = (
            f"max_source_len={self.max_source_len} (source + <eos>) or max_target_len={self.max_target_len} "
            f"(target + <bos>) tokens"
        )
        remedy = "set overlong='drop' to drop them (counted in corpus_summary()) or raise the limits"
        if by_bytes and self.overlong == "error":
            longest = max(by_bytes, key=lambda i: max(len(text.encode()) for text in pairs[i]))
            raise DataError(
                f"{len(by_bytes)} of {len(pairs)} {split} pairs are longer than {limits} by their length alone "
                f"(a token holds at most {MAX_TOKEN_BYTES} bytes; e.g. pair {longest}: "
                f"{max(len(text.encode()) for text in pairs[longest])} bytes, {pairs[longest][0][:60]!r}); {remedy}"
            )
        measured = [i for i in range(len(pairs)) if i not in by_bytes]
        sources = self.tokenizer.encode([pairs[i][0] for i in measured])
        targets = self.tokenizer.encode([pairs[i][1] for i in measured])
        ids = dict(zip(measured, zip(sources, targets, strict=True), strict=True))
        lengths = {i: (len(s) + 1, len(t) + 1) for i, (s, t) in ids.items()}
        overlong = [i for i, (s, t) in lengths.items() if s > self.max_source_len or t > self.max_target_len]
        if overlong and self.overlong == "error":
            longest = max(
                overlong, key=lambda i: max(lengths[i][0] / self.max_source_len, lengths[i][1] / self.max_target_len)
            )
            raise DataError(
                f"{len(overlong)} of {len(pairs)} {split} pairs are longer than {limits}; the longest "
                f"sources have {max(lengths[i][0] for i in overlong)} tokens, the longest targets "
                f"{max(lengths[i][1] for i in overlong)} (e.g. pair {longest}: {pairs[longest][0][:60]!r}); {remedy}"
            )
        dropped = by_bytes | set(overlong)
        if len(dropped) == len(pairs):
            raise DataError(
                f"all {len(pairs)} {split} pairs are longer than max_source_len={self.max_source_len} or "
                f"max_target_len={self.max_target_len} tokens; raise the limits"
            )
        kept = [i for i in measured if i not in dropped]
        sequences = [part for i in kept for part in (torch.cat([ids[i][0], torch.tensor([EOS_ID])]), ids[i][1])]
        index = torch.tensor([i for i in kept for _ in range(2)], dtype=torch.int64)
        return Sequences.from_tensors(sequences, index, truncated=len(dropped))

    def truncation_warning(self, split: Split, data: Sequences) -> str:
        return (
            f"dropped {data.truncated} of {data.truncated + len(data) // 2} {split} pairs longer than "
            f"max_source_len={self.max_source_len} / max_target_len={self.max_target_len} tokens (overlong='drop')"
        )

    # ---- what the task uses -----------------------------------------------------------------------------
    def decode(self, ids: Tensor | list[int]) -> str:
        """Detokenised text of one sequence of ids: stops at the first EOS, drops BOS and PAD."""
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        if EOS_ID in ids:
            ids = ids[: ids.index(EOS_ID)]
        return self.tokenizer.decode(ids)

    def encode_source(self, text: str) -> list[int]:
        """Token ids of a source sentence (whitespace normalised, EOS appended), as in the ``source`` batches;
        it may be longer than ``max_source_len``."""
        return [*self.tokenizer.encode([normalise_whitespace(text)])[0].tolist(), EOS_ID]

    def texts(self, split: Split) -> tuple[list[str], list[str]]:
        """Raw sources and references of a split, in loader order (position = the batch's ``index``)."""
        pairs = self.corpus()["splits"][split]
        kept = self.load_split(split).labels[::2].tolist()
        return [pairs[i][0] for i in kept], [pairs[i][1] for i in kept]

    def corpus_summary(self) -> dict:
        """Source, languages, pairs per split, pairs dropped by each filter, normalisations, a content hash."""
        summary = json.loads(json.dumps(self.corpus()["summary"]))
        digest = hashlib.sha256()
        pairs = {}
        for split in SPLITS:
            sources, targets = self.texts(split)
            pairs[split] = len(sources)
            for source, target in zip(sources, targets, strict=True):
                digest.update(f"{split}\t{source}\t{target}\n".encode())
        summary["dropped"]["overlong"] = {split: self.load_split(split).truncated for split in SPLITS}
        head = {"source": self.source, "source_lang": self.source_lang, "target_lang": self.target_lang}
        head |= {"pairs": pairs | {"total": sum(pairs.values())}, "content_hash": digest.hexdigest()}
        return head | summary | {"bpe_vocab_size": self.tokenizer.vocab_size}

    def make_dataset(self, split: Split, data: Sequences) -> Dataset:
        return PairDataset(data)

    def collate(self) -> PairCollate:
        pad_to = (self.max_source_len, self.max_target_len) if self.pad_to_max_len else (None, None)
        return PairCollate(*pad_to)

    def packed_collate(self) -> PackedPairCollate:
        """The collate of the training batches with ``pack``."""
        return PackedPairCollate(self.max_source_len, self.max_target_len, pad_to_max_len=self.pad_to_max_len)

    def train_dataloader(self) -> DataLoader:
        loader = super().train_dataloader()
        if self.pack:
            # the base builds every split's loader with collate(); only training is packed (evaluation decodes)
            loader.collate_fn = self.packed_collate()
        return loader
