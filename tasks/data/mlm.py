"""Masked language modelling corpus from any local text folder; default: the Python standard library.

The pre-training objective of BERT (Devlin et al. 2019, arXiv:1810.04805, Sec. 3.1 "Task #1") that the
Linformer paper (Wang et al. 2020, arXiv:2006.04768, Sec. 5.1) pre-trains with: a share ``mask_prob``
(15 %) of the real (non-special) tokens is selected for prediction; a selected token is replaced by
``<mask>`` with probability 0.8, by a random regular token with 0.1, and kept with 0.1; the label is the
original token at selected positions and ``-100`` elsewhere (padding included). Option ``selection``:
``"per_token"`` (default, Hugging Face's collator) or ``"fixed_count"`` (original BERT); see
:class:`MaskedLMDataset`.

Masks are re-drawn every training epoch and are a pure function of ``(seed, epoch, index)`` (one
generator per example, keyed by the sampler), hence identical for any ``num_workers``, under DDP and
after a resume; validation and test use the epoch-0 masks every time, so their losses are comparable
across epochs. ``seed`` is the data's seed, not the run's (``zoo compare --seeds`` varies ``shuffle_seed``
and the initialisation only), so every run of a comparison at one ``max_seq_len`` scores the same masked
positions. With ``eval_tokens``, val and test keep only the first ``eval_tokens`` tokens of their split's
token stream, so runs at any ``max_seq_len`` are scored on the same text (their masked positions still
differ: masks are drawn per chunk).

Corpus: the files matching ``file_pattern`` under ``corpus_dir`` (recursively; hidden folders and
:data:`SKIPPED_FOLDERS` are skipped), shuffled by ``seed``, capped by
``max_files`` and ``max_bytes``, joined into one stream and split into contiguous train / val / test parts
by ``val_fraction``, ``test_fraction`` of the characters (so val and test are mostly other files than
train), tokenised, and cut into chunks of ``max_seq_len`` tokens; chunks may span file boundaries, as in
RoBERTa's FULL-SENTENCES packing (without its separator token: the files' tokens follow each other directly),
and only the last chunk of a split can be shorter. Default corpus: the standard library's ``*.py`` files (offline).

``pack=True``: the same chunks and masks; each batch also carries ``"segments"`` (B, S + 1), the boundaries of
the files' parts inside each chunk (:mod:`attention_zoo.packing`), so attention and positions stop at file
boundaries (a file cut by a chunk, ``max_bytes`` or the split continues as a new document after the cut).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import Dataset

from attention_zoo.packing import segments_from_lengths
from tasks.data.base import (
    IGNORE_INDEX,
    SPLITS,
    DataError,
    PadCollate,
    Sequences,
    Split,
    derive_seed,
    epoch_and_index,
    is_count,
)
from tasks.data.tokenize import MASK_ID, PAD_ID, SPECIAL_TOKENS, TokenizedDataModule, TokenizerKind, file_digest

SKIPPED_FOLDERS = {"__pycache__", "site-packages", "dist-packages"}
MASK_SHARE, RANDOM_SHARE = 0.8, 0.1  # of the selected tokens; the remaining 0.1 stay unchanged
Selection = Literal["per_token", "fixed_count"]


def default_corpus_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path, pattern: str) -> list[Path]:
    """Files under ``root`` whose name matches ``pattern``, sorted, skipping :data:`SKIPPED_FOLDERS`."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS and not d.startswith("."))
        found.extend(Path(folder) / name for name in names if fnmatch(name, pattern))
    return sorted(found)


def split_stream(documents: list[str], fractions: dict[Split, float]) -> dict[Split, list[str]]:
    """Cut the concatenated documents into contiguous train / val / test parts holding ``fractions`` of
    the characters; a document straddling a boundary is cut in two."""
    total = sum(len(d) for d in documents)
    train_end = round(fractions["train"] * total)
    val_end = round((fractions["train"] + fractions["val"]) * total)
    ranges = {"train": (0, train_end), "val": (train_end, val_end), "test": (val_end, total)}
    parts: dict[Split, list[str]] = {split: [] for split in SPLITS}
    start = 0
    for document in documents:
        end = start + len(document)
        for split, (low, high) in ranges.items():
            if max(start, low) < min(end, high):
                parts[split].append(document[max(start, low) - start : min(end, high) - start])
        start = end
    return parts


class MaskedLMDataset(Dataset):
    """Items ``(inputs (N,), labels (N,))``: BERT masking of stored chunks, drawn per ``(epoch, index)``.

    ``selection="per_token"``: each real token independently with probability ``mask_prob``, so the count per
    sequence is binomial, as in Hugging Face's ``DataCollatorForLanguageModeling``; a sequence in which no token
    was selected gets one selected uniformly at random, so every sequence carries a label (this raises the rate
    only for sequences of a few tokens). ``"fixed_count"``: original BERT (``create_masked_lm_predictions`` in
    google-research/bert): exactly ``max(1, round(n * mask_prob))`` positions of a sequence of ``n`` tokens
    (Python's ``round``, half to even), drawn uniformly without replacement from its real tokens. BERT's ``n``
    also counts the ``[CLS]`` and ``[SEP]`` it never selects (these chunks have none), and BERT caps the count
    at ``max_predictions_per_seq``; no cap here. (RoBERTa's random rounding, ``int(mask_prob * n + U[0, 1))``,
    is not offered.)

    With ``documents=True`` an item also carries its chunk's document boundaries ``(S + 1,)`` (0, each position
    where a document starts inside the chunk, the chunk's length), read from ``data.labels``, which then marks
    with 1 the first token of each document of the stream (:meth:`MaskedLMDataModule.build_split`).
    """

    def __init__(
        self,
        data: Sequences,
        *,
        mask_prob: float,
        selection: Selection,
        seed: int,
        random_high: int,
        documents: bool = False,
    ):
        self.data = data
        self.mask_prob = mask_prob
        self.selection = selection
        self.seed = seed
        self.random_high = random_high  # random replacements are regular tokens in [len(SPECIAL_TOKENS), random_high)
        self.documents = documents

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, ...]:
        epoch, index = epoch_and_index(key)
        tokens = self.data.sequence(index)
        n = len(tokens)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "mask", epoch, index))
        maskable = tokens >= len(SPECIAL_TOKENS)
        candidates = maskable.nonzero().squeeze(1)
        if self.selection == "fixed_count":
            count = min(len(candidates), max(1, round(n * self.mask_prob)))
            selected = torch.zeros(n, dtype=torch.bool)
            selected[candidates[torch.randperm(len(candidates), generator=generator)[:count]]] = True
        else:
            selected = maskable & (torch.rand(n, generator=generator) < self.mask_prob)
            if not selected.any() and len(candidates):
                selected[candidates[torch.randint(len(candidates), (1,), generator=generator)]] = True
        action = torch.rand(n, generator=generator)
        replacement = torch.randint(len(SPECIAL_TOKENS), self.random_high, (n,), generator=generator)
        inputs = torch.where(selected & (action < MASK_SHARE), MASK_ID, tokens)
        randomize = selected & (action >= MASK_SHARE) & (action < MASK_SHARE + RANDOM_SHARE)
        inputs = torch.where(randomize, replacement, inputs)
        labels = torch.where(selected, tokens, IGNORE_INDEX)
        if not self.documents:
            return inputs, labels
        # a chunk always opens a document at 0, whether or not a file starts there
        starts = self.data.token_labels(index)[1:].nonzero().squeeze(1) + 1
        return inputs, labels, torch.cat([torch.tensor([0]), starts, torch.tensor([n])])


class PackedCollate:
    """:class:`tasks.data.base.PadCollate` for items ``(tokens, labels, boundaries)``, plus ``"segments"``
    (B, S + 1): each chunk's document boundaries, S the most documents in a chunk of the batch, a chunk with
    fewer repeating its last boundary (empty documents)."""

    def __init__(self, pad_id: int, pad_to: int | None = None):
        self.pad = PadCollate(pad_id, pad_to)

    def __call__(self, items: list[tuple[Tensor, Tensor, Tensor]]) -> dict[str, Tensor]:
        batch = self.pad([(tokens, labels) for tokens, labels, _ in items])
        width = self.pad.pad_to or batch["tokens"].shape[1]
        lengths = [boundaries.diff().tolist() for _, _, boundaries in items]
        return batch | {"segments": segments_from_lengths(lengths, width)}


class MaskedLMDataModule(TokenizedDataModule):
    """Masked language modelling (BERT's 15 % masking, 80/10/10) on chunks of a local text corpus.

    ``target = "token"``; ``num_classes = vocab_size`` (labels are token ids, -100 where not selected).

    Args:
        corpus_dir: folder of text files; default: the Python standard library (``sysconfig`` "stdlib").
        file_pattern: file-name glob, searched recursively; default ``*.py`` for the standard library and
            ``*.txt`` for a ``corpus_dir``.
        max_files: use at most this many files (a seeded sample); None uses all.
        max_bytes: read at most this many bytes in all; None reads everything.
        max_seq_len: tokens per chunk (the last chunk of a split may be shorter).
        mask_prob: share of real tokens selected for prediction (BERT: 0.15).
        selection: ``per_token`` selects each real token with probability ``mask_prob`` (Hugging Face's
            collator); ``fixed_count`` selects exactly ``max(1, round(n * mask_prob))`` of a chunk's ``n``
            tokens (original BERT).
        val_fraction: share of the corpus (characters) used for validation.
        test_fraction: share of the corpus (characters) used for test.
        tokenizer: ``"byte"`` (UTF-8 bytes, vocabulary 260), ``"bpe"`` or ``"wordpiece"`` (trained on train).
        tokenizer_vocab_size: vocabulary size of a trained tokenizer.
        tokenizer_file: use this saved tokenizer (``tokenizers`` JSON) instead of training one.
        eval_tokens: val and test keep only the first this many tokens of their split (then chunked by
            ``max_seq_len``; the last chunk may be shorter), so that every ``max_seq_len`` is evaluated on the
            same text; a split with fewer tokens is an error. None (default) keeps the whole split.
        pack: False (default): attention spans the whole chunk, across file boundaries. True: batches also
            carry ``"segments"``, the boundaries of the files inside each chunk, and attention and positions stay
            inside each file (module docstring); the tokens, chunks and masks are those of ``pack=False``.
        **loader: plus the loader options of :class:`tasks.data.base.ZooDataModule` (``seed``, ``shuffle_seed``,
            ``batch_size``, ``num_workers``, ``pad_to_max_len``, ``cache_dir``).
    """

    target = "token"
    cache_name = "mlm"

    def __init__(
        self,
        *,
        corpus_dir: str | None = None,
        file_pattern: str | None = None,
        max_files: int | None = None,
        max_bytes: int | None = None,
        max_seq_len: int = 512,
        mask_prob: float = 0.15,
        selection: Selection = "per_token",
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        tokenizer: TokenizerKind = "byte",
        tokenizer_vocab_size: int = 8192,
        tokenizer_file: str | None = None,
        eval_tokens: int | None = None,
        pack: bool = False,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.corpus_dir = Path(corpus_dir) if corpus_dir is not None else default_corpus_dir()
        if not self.corpus_dir.is_dir():
            raise FileNotFoundError(f"corpus_dir {str(self.corpus_dir)!r} is not a folder")
        self.file_pattern = file_pattern or ("*.py" if corpus_dir is None else "*.txt")
        for name, limit in (("max_files", max_files), ("max_bytes", max_bytes), ("eval_tokens", eval_tokens)):
            if limit is not None and (not is_count(limit) or limit < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {limit!r}")
        if not is_count(max_seq_len) or max_seq_len < 2:
            raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
        if not is_count(tokenizer_vocab_size):
            raise ValueError(f"tokenizer_vocab_size must be an int, got {tokenizer_vocab_size!r}")
        if not 0 < mask_prob <= 1:
            raise ValueError(f"mask_prob must be in (0, 1], got {mask_prob}")
        if not isinstance(pack, bool):
            raise ValueError(f"pack must be true or false, got {pack!r}")
        if selection not in ("per_token", "fixed_count"):
            raise ValueError(f"selection must be one of 'per_token', 'fixed_count'; got {selection!r}")
        if not (val_fraction > 0 and test_fraction > 0 and val_fraction + test_fraction < 1):
            raise ValueError(f"need val_fraction, test_fraction > 0 with sum < 1; got {val_fraction}, {test_fraction}")
        self.use_tokenizer(tokenizer, tokenizer_vocab_size, tokenizer_file)
        self.max_files, self.max_bytes = max_files, max_bytes
        self.eval_tokens = eval_tokens
        self.pack = pack
        self.mask_prob = mask_prob
        self.selection = selection
        self.fractions: dict[Split, float] = {
            "train": 1 - val_fraction - test_fraction,
            "val": val_fraction,
            "test": test_fraction,
        }
        self._files: list[Path] | None = None
        self._documents: dict[Split, list[str]] | None = None  # the corpus text, dropped after setup
        vocab_size = self.tokenizer_capacity()
        self.expose(vocab_size=vocab_size, max_seq_len=max_seq_len, num_classes=vocab_size, pad_id=PAD_ID)
        self.mask_id = MASK_ID

    def files(self) -> list[Path]:
        """The corpus files in use: matching, shuffled by ``seed``, at most ``max_files``."""
        if self._files is None:
            found = list_corpus_files(self.corpus_dir, self.file_pattern)
            if not found:
                raise FileNotFoundError(f"no files matching {self.file_pattern!r} under {str(self.corpus_dir)!r}")
            order = torch.randperm(len(found), generator=torch.Generator().manual_seed(derive_seed(self.seed, "files")))
            self._files = [found[i] for i in order[: self.max_files].tolist()]
        return self._files

    def documents(self) -> dict[Split, list[str]]:
        """The corpus text, read within ``max_bytes`` and cut into contiguous train / val / test parts."""
        if self._documents is None:
            self._documents = split_stream(self._read_documents(), self.fractions)
        return self._documents

    def _read_documents(self) -> list[str]:
        documents, budget = [], self.max_bytes
        for path in self.files():
            raw = path.read_bytes()
            if budget is not None:
                raw = raw[:budget]
                budget -= len(raw)
            documents.append(raw.decode("utf-8", errors="replace"))
            if budget == 0:
                break
        return documents

    def source_params(self) -> dict:
        return {
            "files": file_digest(self.files(), root=self.corpus_dir),
            "max_bytes": self.max_bytes,
            "fractions": self.fractions,
            "seed": self.seed,
        }

    def cache_params(self) -> dict:
        # only when set, so the caches built before the option existed keep their keys
        extra = {} if self.eval_tokens is None else {"eval_tokens": self.eval_tokens}
        # a packed split also stores where each document starts
        return super().cache_params() | extra | ({"pack": True} if self.pack else {})

    def training_texts(self) -> list[str]:
        return self.documents()["train"]

    def build_split(self, split: Split) -> Sequences:
        pieces = self.text_tokenizer().encode(self.documents()[split])
        stream = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
        if len(stream) == 0:
            raise ValueError(
                f"the {split} part of the corpus is empty ({len(self.files())} files, max_bytes={self.max_bytes}); "
                f"use more files or bytes, or a larger {split}_fraction"
            )
        if split != "train" and self.eval_tokens is not None:
            if len(stream) < self.eval_tokens:
                raise DataError(
                    f"the {split} part of the corpus has {len(stream)} tokens, fewer than eval_tokens="
                    f"{self.eval_tokens}; lower eval_tokens, or use more files or bytes, or a larger {split}_fraction"
                )
            stream = stream[: self.eval_tokens]
        offsets = torch.cat([torch.arange(0, len(stream), self.max_seq_len), torch.tensor([len(stream)])])
        if not self.pack:
            return Sequences(stream.to(torch.int32), offsets)
        # labels (stored per token; MLM draws its targets per epoch): 1 at the first token of each file's part
        lengths = torch.tensor([0, *(len(piece) for piece in pieces)])
        firsts = torch.zeros(len(stream) + 1, dtype=torch.uint8)
        firsts[lengths.cumsum(0)[:-1].clamp(max=len(stream))] = 1  # an empty file starts where the next one does
        return Sequences(stream.to(torch.int32), offsets, firsts[:-1])

    def release_sources(self) -> None:
        self._documents = None

    def make_dataset(self, split: Split, data: Sequences) -> Dataset:
        return MaskedLMDataset(
            data,
            mask_prob=self.mask_prob,
            selection=self.selection,
            seed=self.seed,
            random_high=self.text_tokenizer().vocab_size,
            documents=self.pack,
        )

    def collate(self) -> Callable[[list], dict[str, Tensor]]:
        if not self.pack:
            return super().collate()
        return PackedCollate(self.pad_id, self.max_seq_len if self.pad_to_max_len else None)
