"""A parallel corpus: which pairs, from which of the four sources, in which split (before tokenisation).

:class:`CorpusSpec` holds the options that define the pairs, checks them, fingerprints the source files
for the cache key, reads the chosen source and hands the pairs to :func:`assemble_splits`:

- whitespace runs become one space and the ends are stripped (counted as ``whitespace``); pairs with an
  empty side are dropped (``empty``); the ``gettext`` reader's own filters come first
  (:mod:`tasks.data.gettext_corpus`);
- a split without its own data is carved from the training pairs by a hash of the source string (the
  first 53 bits of blake2b of its UTF-8 bytes, read as a number u in [0, 1): test if u < test_fraction,
  val if u < test_fraction + val_fraction, else train). The same source never lands in two splits, and a pair's
  split depends neither on a seed, nor on reading order, nor on the other pairs (adding catalogs moves no
  existing pair to another split). Training pairs and carved splits are in hash order, so "the first N
  validation pairs" are a spread sample, not one program's messages; val/test read from their own files
  keep the file order;
- ``train_size`` keeps the first training pairs in hash order;
- ``eval_sources_in_train`` counts val/test sources also found in train: 0 when carved; given files
  (WMT's newstest against its training data) are reported, not filtered.

The result is cached as JSON (pairs per split and the counts), keyed by :meth:`CorpusSpec.params`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tasks.data.base import SPLITS, Split, derive_seed, write_atomically
from tasks.data.gettext_corpus import catalog_paths, missing_catalogs_message, normalise_whitespace, read_gettext_pairs
from tasks.data.parallel_text import data_files, read_hf_pairs, read_pairs
from tasks.data.synthetic_translation import synthetic_pairs
from tasks.data.tokenize import file_digest

Source = Literal["gettext", "files", "hf", "synthetic"]
Pair = tuple[str, str]
CORPUS_FORMAT = 1  # bump when reading, filtering or splitting changes
SOURCE_OPTIONS = {
    "gettext": (),
    "files": ("train_data", "val_data", "test_data"),
    "hf": ("hf_dataset", "hf_config", "hf_data_files"),
    "synthetic": (),
}


def source_hash(source: str) -> float:
    """A number in [0, 1) that depends only on ``source``: where its pair falls among the splits."""
    bits = int.from_bytes(hashlib.blake2b(source.encode(), digest_size=8).digest(), "little") >> 11
    return bits / 2**53  # 53 bits: exact in a float64, so never rounds up to 1


def clean_pairs(pairs: list[Pair], dropped: Counter, normalised: Counter) -> list[Pair]:
    """Pairs with whitespace normalised and empty ones dropped, counting both."""
    kept = []
    for source, target in pairs:
        clean = normalise_whitespace(source), normalise_whitespace(target)
        normalised["whitespace"] += clean != (source, target)
        if clean[0] and clean[1]:
            kept.append(clean)
        else:
            dropped["empty"] += 1
    return kept


def carve(pairs: list[Pair], fractions: dict[Split, float]) -> dict[Split, list[Pair]]:
    """``pairs`` split by :func:`source_hash` into test (lowest), val, then train, each in hash order."""
    carved: dict[Split, list[Pair]] = {"train": [], "val": [], "test": []}
    for pair in sorted(pairs, key=lambda pair: (source_hash(pair[0]), pair)):
        u = source_hash(pair[0])
        split = "test" if u < fractions["test"] else "val" if u < fractions["test"] + fractions["val"] else "train"
        carved[split].append(pair)
    return carved


def assemble_splits(
    own: dict[Split, list[Pair] | None], summary: dict, *, fractions: dict[str, float], train_size: int | None
) -> dict:
    """``{"splits": {split: pairs}, "summary": ...}`` from each split's own pairs (None: carve from train)
    and the reader's summary, whose ``dropped`` and ``normalised`` counts are extended."""
    dropped = Counter({"empty": 0} | summary.pop("dropped", {}))
    normalised = Counter({"whitespace": 0} | summary.pop("normalised", {}))
    cleaned = {split: clean_pairs(pairs, dropped, normalised) for split, pairs in own.items() if pairs is not None}
    splits = carve(
        cleaned["train"], {split: 0.0 if split in cleaned else fractions[split] for split in ("val", "test")}
    )
    splits |= {split: cleaned[split] for split in ("val", "test") if split in cleaned}
    if train_size is not None and len(splits["train"]) > train_size:
        dropped["train_size"] = len(splits["train"]) - train_size
        splits["train"] = splits["train"][:train_size]
    for split, pairs in splits.items():
        if not pairs:
            raise ValueError(
                f"the {split} split is empty ({len(cleaned['train'])} training pairs, val_fraction="
                f"{fractions['val']}, test_fraction={fractions['test']}); give it data or a larger fraction"
            )
    train_sources = {source for source, _ in splits["train"]}
    overlap = {split: sum(source in train_sources for source, _ in splits[split]) for split in ("val", "test")}
    summary |= {"dropped": dict(dropped), "normalised": dict(normalised), "eval_sources_in_train": overlap}
    return {"splits": {split: splits[split] for split in SPLITS}, "summary": summary}


def load_or_build_corpus(path: Path, params: dict, build: Callable[[], dict]) -> dict:
    """The corpus stored at ``path`` (JSON) for ``params``; built and written atomically if absent or unusable."""
    params = json.loads(json.dumps(params))
    if path.exists():
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
            if stored.get("params") != params:
                raise ValueError("stored parameters differ from the requested ones")
            return stored
        except Exception as error:  # any unreadable file is rebuilt, whatever broke it
            warnings.warn(f"ignoring unusable cache file {path} ({error}); rebuilding it", stacklevel=2)
    corpus = json.loads(json.dumps({"params": params} | build()))  # as it will read back: pairs as lists
    text = json.dumps(corpus, ensure_ascii=False)
    write_atomically(path, lambda file: file.write(text.encode()))
    return corpus


@dataclass(frozen=True)
class CorpusSpec:
    """The options that define a corpus (documented on :class:`tasks.data.translation.TranslationDataModule`)."""

    source: Source
    source_lang: str
    target_lang: str
    locale_dir: Path
    split_data: dict[Split, str | None]
    source_field: str
    target_field: str
    hf_dataset: str | None
    hf_config: str | None
    hf_data_files: dict[str, str] | None
    synthetic_pairs: int
    synthetic_words: int
    seed: int
    fractions: dict[str, float]
    train_size: int | None

    def __post_init__(self) -> None:
        source, (val, test) = self.source, (self.fractions["val"], self.fractions["test"])
        if source not in SOURCE_OPTIONS:
            raise ValueError(f"source must be one of {list(SOURCE_OPTIONS)}; got {source!r}")
        given = {f"{split}_data": path for split, path in self.split_data.items()}
        given |= {"hf_dataset": self.hf_dataset, "hf_config": self.hf_config, "hf_data_files": self.hf_data_files}
        foreign = sorted(
            name for name, value in given.items() if value is not None and name not in SOURCE_OPTIONS[source]
        )
        if foreign:
            raise ValueError(f"{', '.join(foreign)} do not apply to source={source!r}")
        if source == "files" and self.split_data["train"] is None:
            raise ValueError(
                "source='files' needs train_data (a .tsv or .jsonl file, or the prefix of <prefix>.<lang> files)"
            )
        if source == "hf" and self.hf_dataset is None:
            raise ValueError(
                "source='hf' needs hf_dataset ('wmt14' with hf_config='de-en', or 'json' with hf_data_files)"
            )
        if source == "gettext" and self.source_lang != "en":
            raise ValueError(
                f"source='gettext' reads English msgids: source_lang must be 'en', got {self.source_lang!r}"
            )
        if self.source_lang == self.target_lang:
            raise ValueError(f"source_lang and target_lang are both {self.source_lang!r}")
        if not (0 <= val < 1 and 0 <= test < 1 and val + test < 1):
            raise ValueError(f"need 0 <= val_fraction, test_fraction and their sum < 1; got {val}, {test}")
        if self.train_size is not None and self.train_size < 1:
            raise ValueError(f"train_size must be >= 1 or None, got {self.train_size}")
        if self.synthetic_pairs < 1 or self.synthetic_words < 2:
            raise ValueError(
                f"need synthetic_pairs >= 1 and synthetic_words >= 2; got {self.synthetic_pairs}, "
                f"{self.synthetic_words}"
            )
        if source == "hf" and importlib.util.find_spec("datasets") is None:
            raise ImportError(
                f"source='hf' (hf_dataset={self.hf_dataset!r}) needs the Hugging Face `datasets` package: "
                f"pip install datasets; or use source='files' with local files"
            )
        for split, path in self.split_data.items():
            for file in [] if path is None else data_files(path, self.source_lang, self.target_lang):
                if not file.is_file():
                    raise FileNotFoundError(f"data file {str(file)!r} ({split}_data={path!r}) does not exist")
        if source == "gettext" and not catalog_paths(self.locale_dir, self.target_lang):
            raise FileNotFoundError(missing_catalogs_message(self.locale_dir, self.target_lang))

    def params(self) -> dict:
        """Everything that defines the pairs of every split, including a fingerprint of the source files."""
        params = {"format": CORPUS_FORMAT, "source": self.source, "langs": [self.source_lang, self.target_lang]}
        params |= {"fractions": self.fractions, "train_size": self.train_size}
        if self.source == "gettext":
            return params | {"catalogs": file_digest(catalog_paths(self.locale_dir, self.target_lang), self.locale_dir)}
        if self.source == "synthetic":
            return params | {"pairs": self.synthetic_pairs, "words": self.synthetic_words, "seed": self.seed}
        params |= {"fields": [self.source_field, self.target_field]}
        if self.source == "files":
            named = {split: path for split, path in self.split_data.items() if path is not None}
            files = [file for path in named.values() for file in data_files(path, self.source_lang, self.target_lang)]
            return params | {"files": sorted(named), "digest": file_digest(files)}
        local = [Path(file) for file in (self.hf_data_files or {}).values()]
        digest = file_digest(local) if local and all(file.is_file() for file in local) else None
        return params | {
            "hf": [self.hf_dataset, self.hf_config, self.hf_data_files, digest, importlib.metadata.version("datasets")]
        }

    def read(self) -> tuple[dict[Split, list[Pair] | None], dict]:
        """Each split's own pairs (None: carve it from train) and what the reader reports."""
        if self.source == "gettext":
            pairs, summary = read_gettext_pairs(self.locale_dir, self.target_lang)
            return {"train": pairs, "val": None, "test": None}, summary
        if self.source == "synthetic":
            seed = derive_seed(self.seed, "synthetic translation")
            pairs = synthetic_pairs(self.synthetic_pairs, words=self.synthetic_words, seed=seed)
            return {"train": pairs, "val": None, "test": None}, {"origin": "synthetic"}
        fields = {"source_field": self.source_field, "target_field": self.target_field}
        fields |= {"source_lang": self.source_lang, "target_lang": self.target_lang}
        if self.source == "files":
            own = {
                split: None if path is None else read_pairs(path, **fields) for split, path in self.split_data.items()
            }
            return own, {"origin": {split: path for split, path in self.split_data.items() if path is not None}}
        own = read_hf_pairs(self.hf_dataset, self.hf_config, self.hf_data_files, **fields)
        return own, {"origin": f"hf:{self.hf_dataset}" + (f"/{self.hf_config}" if self.hf_config else "")}

    def load(self, path: Path) -> dict:
        """The corpus cached at ``path``, or read, assembled and cached there."""
        options = {"fractions": self.fractions, "train_size": self.train_size}
        return load_or_build_corpus(path, self.params(), lambda: assemble_splits(*self.read(), **options))
