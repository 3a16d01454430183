"""Tokenizers shared by the text-classification and MLM data modules, and their shared base
(:class:`TokenizedDataModule`).

Special tokens sit at the same ids in every tokenizer (``<pad>`` 0, ``<cls>`` 1, ``<mask>`` 2,
``<unk>`` 3):

- ``byte``: UTF-8 bytes, ids 4..259 (vocabulary 260), as in the LRA byte-level text task;
- ``bpe``: byte-level BPE (GPT-2 style, never unknown) trained by ``tokenizers`` on the training split;
- ``wordpiece``: BERT-style WordPiece (lower-cased) trained by ``tokenizers`` on the training split.

A trained tokenizer is saved next to the cache (``tokenizer_path``) and can be reused with
``tokenizer_file``, e.g. to fine-tune with the vocabulary of an MLM pre-training run.

Translation adds ``<bos>`` 4 and ``<eos>`` 5 after the four shared specials
(:data:`TRANSLATION_SPECIAL_TOKENS`), so ``<pad>`` and ``<unk>`` keep their ids. Byte-level BPE decodes
losslessly (spaces, punctuation and non-ASCII letters come back exactly), which is what lets a translation
be scored by sacreBLEU against its raw reference.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from tasks.data.base import DataError, ZooDataModule, cache_file, write_atomically

SPECIAL_TOKENS = ("<pad>", "<cls>", "<mask>", "<unk>")
PAD_ID, CLS_ID, MASK_ID, UNK_ID = range(len(SPECIAL_TOKENS))
TRANSLATION_SPECIAL_TOKENS = (*SPECIAL_TOKENS, "<bos>", "<eos>")
BOS_ID, EOS_ID = range(len(SPECIAL_TOKENS), len(TRANSLATION_SPECIAL_TOKENS))
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
TokenizerKind = Literal["byte", "bpe", "wordpiece"]


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError(
            "tokenizer='bpe' or 'wordpiece' needs the `tokenizers` package: pip install tokenizers"
        ) from error
    return tokenizers


class TextTokenizer:
    """Byte-level (``subword=None``) or a ``tokenizers.Tokenizer`` with :data:`SPECIAL_TOKENS` at ids 0-3
    (and, for translation, the rest of :data:`TRANSLATION_SPECIAL_TOKENS` after them)."""

    def __init__(self, subword=None):
        self.subword = subword

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE if self.subword is None else self.subword.get_vocab_size()

    @classmethod
    def train(
        cls,
        kind: Literal["bpe", "wordpiece"],
        texts: Sequence[str],
        vocab_size: int,
        special_tokens: Sequence[str] = SPECIAL_TOKENS,
        max_token_bytes: int | None = None,
    ) -> TextTokenizer:
        """A ``kind`` tokenizer trained on ``texts``; ``max_token_bytes`` (BPE only) caps the length of a learned
        token, so that a text of b bytes has at least b / max_token_bytes tokens."""
        tk = _import_tokenizers()
        if kind == "bpe":
            tokenizer = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
            tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
            tokenizer.decoder = tk.decoders.ByteLevel()
            alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
            trainer = tk.trainers.BpeTrainer(
                vocab_size=vocab_size,
                special_tokens=list(special_tokens),
                initial_alphabet=alphabet,
                show_progress=False,
                max_token_length=max_token_bytes,  # byte-level: one character per byte
            )
        else:
            tokenizer = tk.Tokenizer(tk.models.WordPiece(unk_token="<unk>"))
            tokenizer.normalizer = tk.normalizers.BertNormalizer(lowercase=True)
            tokenizer.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
            tokenizer.decoder = tk.decoders.WordPiece()
            trainer = tk.trainers.WordPieceTrainer(
                vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False
            )
        tokenizer.train_from_iterator(texts, trainer=trainer)
        if tokenizer.get_vocab_size() > vocab_size:
            raise DataError(
                f"the trained {kind} vocabulary has {tokenizer.get_vocab_size()} tokens (the alphabet of the "
                f"training text alone needs that many), more than tokenizer_vocab_size={vocab_size}; raise it"
            )
        return cls(tokenizer)

    @classmethod
    def load(
        cls, path: str | Path, kind: Literal["bpe", "wordpiece"], special_tokens: Sequence[str] = SPECIAL_TOKENS
    ) -> TextTokenizer:
        tk = _import_tokenizers()
        if not Path(path).is_file():
            raise FileNotFoundError(f"tokenizer_file {str(path)!r} does not exist")
        tokenizer = tk.Tokenizer.from_file(str(path))
        model = {"bpe": "BPE", "wordpiece": "WordPiece"}[kind]
        if type(tokenizer.model).__name__ != model:
            raise ValueError(
                f"tokenizer_file {str(path)!r} holds a {type(tokenizer.model).__name__} model, not {kind!r}"
            )
        ids = {token: tokenizer.token_to_id(token) for token in special_tokens}
        if ids != {token: i for i, token in enumerate(special_tokens)}:
            raise ValueError(
                f"tokenizer_file {str(path)!r} must have the special tokens {tuple(special_tokens)} at ids "
                f"0-{len(special_tokens) - 1}; has {ids}"
            )
        return cls(tokenizer)

    def save(self, path: Path) -> None:
        text = self.subword.to_str()
        write_atomically(path, lambda file: file.write(text.encode()))

    def encode(self, texts: Sequence[str]) -> list[Tensor]:
        if self.subword is None:
            return [self._encode_bytes(t.encode()) for t in texts]
        return [torch.tensor(encoding.ids, dtype=torch.long) for encoding in self.subword.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special tokens and ids outside the vocabulary are skipped."""
        if self.subword is None:
            raw = bytes(i - len(SPECIAL_TOKENS) for i in ids if len(SPECIAL_TOKENS) <= i < BYTE_VOCAB_SIZE)
            return raw.decode(errors="replace")
        return self.subword.decode(list(ids), skip_special_tokens=True)

    @staticmethod
    def _encode_bytes(data: bytes) -> Tensor:
        if not data:  # torch.frombuffer refuses an empty buffer
            return torch.zeros(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long() + len(SPECIAL_TOKENS)


def resolve_tokenizer(
    kind: TokenizerKind,
    *,
    vocab_size: int,
    tokenizer_file: str | None,
    trained_path: Path | None,
    texts: Callable[[], list[str]],
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    max_token_bytes: int | None = None,
) -> TextTokenizer:
    """The byte tokenizer; the one in ``tokenizer_file``; or one trained on ``texts()`` (tokens of at most
    ``max_token_bytes``, :meth:`TextTokenizer.train`) and saved at ``trained_path`` (reused from there when it
    already exists)."""
    if kind == "byte":
        return TextTokenizer()
    if tokenizer_file is not None:
        return TextTokenizer.load(tokenizer_file, kind, special_tokens)
    if trained_path.exists():
        try:
            return TextTokenizer.load(trained_path, kind, special_tokens)
        except Exception as error:  # an unreadable saved tokenizer is retrained
            warnings.warn(f"ignoring unusable tokenizer {trained_path} ({error}); retraining it", stacklevel=2)
    tokenizer = TextTokenizer.train(kind, texts(), vocab_size, special_tokens, max_token_bytes)
    tokenizer.save(trained_path)
    return tokenizer


def tokenizer_capacity(kind: TokenizerKind, tokenizer_vocab_size: int, tokenizer_file: str | None) -> int:
    """The model's vocabulary size, known before any tokenizer is trained: every id is below it."""
    if kind == "byte":
        if tokenizer_file is not None:
            raise ValueError("tokenizer_file needs tokenizer='bpe' or 'wordpiece' (the byte tokenizer has no file)")
        return BYTE_VOCAB_SIZE
    if tokenizer_file is not None:
        return TextTokenizer.load(tokenizer_file, kind).vocab_size
    if tokenizer_vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(
            f"tokenizer_vocab_size must be >= {BYTE_VOCAB_SIZE} (specials + 256 bytes), got {tokenizer_vocab_size}"
        )
    return tokenizer_vocab_size


def file_digest(paths: Sequence[Path], root: Path | None = None) -> str:
    """Hash of the names, sizes and modification times of ``paths``: changes when the files do."""
    digest = hashlib.sha256()
    for path in paths:
        stat = path.stat()
        name = path.relative_to(root) if root is not None else path.resolve()
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


class TokenizedDataModule(ZooDataModule):
    """Base of the data modules that tokenise local text (classification, MLM): the tokenizer options, the
    tokenizer itself (trained on the training texts and saved next to the cache, or read from
    ``tokenizer_file``), its part of the cache key, and the raw texts dropped once the splits are built.

    A subclass declares ``tokenizer``, ``tokenizer_vocab_size`` and ``tokenizer_file`` in its own signature
    and hands them to :meth:`use_tokenizer`; it implements :meth:`source_params` (what defines the texts),
    :meth:`training_texts` and :meth:`release_sources`, and adds its own entries to :meth:`cache_params`.
    """

    def use_tokenizer(self, tokenizer: TokenizerKind, tokenizer_vocab_size: int, tokenizer_file: str | None) -> None:
        """Check and keep the tokenizer options; :meth:`tokenizer_capacity` then gives the vocabulary size."""
        if tokenizer not in ("byte", "bpe", "wordpiece"):
            raise ValueError(f"tokenizer must be one of 'byte', 'bpe', 'wordpiece'; got {tokenizer!r}")
        self.tokenizer, self.tokenizer_vocab_size, self.tokenizer_file = tokenizer, tokenizer_vocab_size, tokenizer_file
        self._text_tokenizer: TextTokenizer | None = None

    def tokenizer_capacity(self) -> int:
        """The model's vocabulary size, known before any tokenizer is trained (:func:`tokenizer_capacity`)."""
        return tokenizer_capacity(self.tokenizer, self.tokenizer_vocab_size, self.tokenizer_file)

    def source_params(self) -> dict:
        """JSON-serialisable parameters that define the texts of every split (the tokenizer's cache key)."""
        raise NotImplementedError

    def training_texts(self) -> list[str]:
        """The texts a tokenizer is trained on: the training split's."""
        raise NotImplementedError

    def release_sources(self) -> None:
        """Drop the raw texts, needed only while the splits are built (after ``prepare_data`` and ``setup``)."""

    @property
    def tokenizer_path(self) -> Path | None:
        """Where the tokenizer trained here is saved; None for ``byte`` or a given ``tokenizer_file``."""
        if self.tokenizer == "byte" or self.tokenizer_file is not None:
            return None
        params = self.source_params() | {"kind": self.tokenizer, "vocab_size": self.tokenizer_vocab_size}
        return cache_file(self.cache_dir, self.cache_name, "tokenizer", params).with_suffix(".json")

    def text_tokenizer(self) -> TextTokenizer:
        """The tokenizer: bytes, the one in ``tokenizer_file``, or one trained on :meth:`training_texts`."""
        if self._text_tokenizer is None:
            self._text_tokenizer = resolve_tokenizer(
                self.tokenizer,
                vocab_size=self.tokenizer_vocab_size,
                tokenizer_file=self.tokenizer_file,
                trained_path=self.tokenizer_path,
                texts=self.training_texts,
            )
        return self._text_tokenizer

    def cache_params(self) -> dict:
        tokenizer_file_digest = None
        if self.tokenizer_file is not None:
            tokenizer_file_digest = hashlib.sha256(Path(self.tokenizer_file).read_bytes()).hexdigest()
        return self.source_params() | {
            "max_seq_len": self.max_seq_len,
            "tokenizer": self.tokenizer,
            "tokenizer_vocab_size": self.tokenizer_vocab_size,
            "tokenizer_file": tokenizer_file_digest,
        }

    def prepare_data(self) -> None:
        super().prepare_data()
        self.release_sources()

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        self.release_sources()
