"""A parallel corpus: which pairs, from which of the four sources, in which split (before tokenisation).

:class:`CorpusSpec` holds the options that define the pairs, checks them, fingerprints the source files
for the cache key, reads the chosen source and hands the pairs to :func:`assemble_splits`:

- whitespace runs become one space and the ends are stripped (counted as ``whitespace``); pairs with an
  empty side are dropped (``empty``); the ``gettext`` reader's own filters come first
  (:mod:`tasks.data.gettext_corpus`);
- a split without its own data is carved from the training pairs by a hash of the source (:func:`carve`): the
  same source never lands in two splits, and a pair's split depends neither on a seed, nor on reading order,
  nor on the other pairs. Training pairs and carved splits are in hash order, so "the first N validation
  pairs" are a spread sample; val/test read from their own files keep the file order;
- ``train_size`` keeps the first training pairs in hash order;
- ``eval_sources_in_train`` counts val/test sources also found in train: 0 when carved; given files
  (WMT's newstest against its training data) are reported, not filtered.

Near-duplicates: :func:`normalise_source` maps a source to a key, so "cannot chdir to '%s'" and "Cannot chdir
to %s." are one; the summary's ``normalised_sources`` counts pairs, distinct sources, keys and ``merged``, and
``eval_normalised_in_train`` the val/test messages whose key is also in train (the near-duplicate leak).
``split_by``: ``"source"`` (default) carves by the hash of the source string; ``"normalised"`` by the hash of
the key, so all pairs of one key go to one split; ``"catalog"`` (``gettext`` only) by the hash of the
catalog's file name, so one program's messages stay together (fractions are then shares of catalogs).
``dedupe_normalised=True`` keeps one pair per key in each carved pool (``normalised_duplicate``).

Pseudo-documents (``messages_per_document`` = m > 1, :func:`pseudo_documents`): after the split, every m
messages of one catalog are joined into one source and target; ``train_size`` then counts documents.
``train_single_messages=True`` also trains on every message of the training documents on its own (val and test
stay documents). The result is cached as JSON (pairs per split and the counts), keyed by :meth:`CorpusSpec.params`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import re
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tasks.data.base import SPLITS, DataError, Split, derive_seed, write_atomically
from tasks.data.gettext_corpus import (
    PLACEHOLDER,
    catalog_paths,
    missing_catalogs_message,
    normalise_whitespace,
    read_gettext_pairs_with_catalogs,
)
from tasks.data.parallel_text import data_files, read_hf_pairs, read_pairs
from tasks.data.synthetic_translation import synthetic_pairs
from tasks.data.tokenize import file_digest

Source = Literal["gettext", "files", "hf", "synthetic"]
SplitBy = Literal["source", "normalised", "catalog"]
Pair = tuple[str, str]
CORPUS_FORMAT = 1  # bump when reading, filtering or splitting changes
SPLIT_BY = ("source", "normalised", "catalog")
GROUPED_SOURCES = {"gettext": "by catalog", "synthetic": "one group"}  # sources that can form pseudo-documents
NOT_WORD = re.compile(r"[\W_]+")
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


def normalise_source(source: str) -> str:
    """The near-duplicate key of a source: printf-style and brace format specifiers removed (``%s``, ``%d``,
    ``%1$s``, ``%(name)s``, ``{0}``, ``{name}``, ``${name}``), case folded, and every character that is not a
    letter or a digit (punctuation, whitespace, the quotes around ``'%s'``) removed."""
    return NOT_WORD.sub("", PLACEHOLDER.sub("", source).casefold())


def carve(
    pairs: list[Pair], fractions: dict[Split, float], key: Callable[[str], str] | None = None
) -> dict[Split, list[Pair]]:
    """``pairs`` split by :func:`source_hash` of ``key(source)`` (default: the source itself) into test (lowest),
    val, then train, each in hash order: the first 53 bits of blake2b of the key's UTF-8 bytes, read as a number
    u in [0, 1), give test if u < test_fraction, val if u < test_fraction + val_fraction, else train. Adding
    catalogs moves no existing pair to another split."""
    key = key or (lambda source: source)
    carved: dict[Split, list[Pair]] = {"train": [], "val": [], "test": []}
    for pair in sorted(pairs, key=lambda pair: (source_hash(key(pair[0])), pair)):
        u = source_hash(key(pair[0]))
        split = "test" if u < fractions["test"] else "val" if u < fractions["test"] + fractions["val"] else "train"
        carved[split].append(pair)
    return carved


def dedupe_normalised_sources(pairs: list[Pair]) -> list[Pair]:
    """One pair per :func:`normalise_source` key: the first in hash order of the source."""
    kept: dict[str, Pair] = {}
    for pair in sorted(pairs, key=lambda pair: (source_hash(pair[0]), pair)):
        kept.setdefault(normalise_source(pair[0]), pair)
    return list(kept.values())


def pseudo_documents(pairs: list[Pair], group_of: Callable[[str], str], size: int, seed: int) -> list[list[Pair]]:
    """``pairs`` grouped by ``group_of(source)``, each group in a seeded order, cut into runs of ``size``
    messages (a group's last run holds the rest, counted as ``shorter``); documents in hash order of their
    joined source. The order within a group hashes the seed and the source, so it is independent of reading
    order and of the other groups; grouping after the split keeps every message of a test document out of
    training. An artificial construction: catalogs keep no source order (a ``.mo`` file is sorted by msgid), so
    a document is not a text anyone wrote. It still gives what the compressed-attention experiment needs:
    inputs m times as long as a message, from one program's vocabulary, and an alignment that runs
    monotonically across the whole sequence, which a low-rank projection of the keys must keep."""
    groups: dict[str, list[Pair]] = {}
    for pair in pairs:
        groups.setdefault(group_of(pair[0]), []).append(pair)
    documents = []
    for name in sorted(groups):
        members = sorted(groups[name], key=lambda pair: (source_hash(f"{seed}\x00{pair[0]}"), pair))
        documents += [members[start : start + size] for start in range(0, len(members), size)]
    return sorted(documents, key=lambda doc: (source_hash(join(doc)[0]), join(doc)))


def join(messages: list[Pair]) -> Pair:
    """One pseudo-document: the sources joined with a space, the targets joined in the same order."""
    return " ".join(source for source, _ in messages), " ".join(target for _, target in messages)


def assemble_splits(
    own: dict[Split, list[Pair] | None],
    summary: dict,
    *,
    fractions: dict[str, float],
    train_size: int | None,
    groups: dict[str, str] | None = None,
    split_by: SplitBy = "source",
    dedupe_normalised: bool = False,
    messages_per_document: int = 1,
    train_single_messages: bool = False,
    seed: int = 0,
) -> dict:
    """``{"splits": {split: pairs}, "summary": ...}`` from each split's own pairs (None: carve from train)
    and the reader's summary, whose ``dropped`` and ``normalised`` counts are extended. ``groups`` maps a
    source to its catalog (None: one group); the other options are those of the module docstring."""
    dropped = Counter({"empty": 0} | summary.pop("dropped", {}))
    normalised = Counter({"whitespace": 0} | summary.pop("normalised", {}))
    cleaned = {split: clean_pairs(pairs, dropped, normalised) for split, pairs in own.items() if pairs is not None}
    everything = [pair for pairs in cleaned.values() for pair in pairs]
    distinct_sources = {source for source, _ in everything}
    keys = {normalise_source(source) for source in distinct_sources}
    if dedupe_normalised:
        cleaned = {split: dedupe_normalised_sources(pairs) for split, pairs in cleaned.items()}
        dropped["normalised_duplicate"] = len(everything) - sum(len(pairs) for pairs in cleaned.values())
    group_of = (lambda source: groups[source]) if groups is not None else (lambda source: "all")
    key = {"source": None, "normalised": normalise_source, "catalog": group_of}[split_by]
    splits = carve(
        cleaned["train"], {split: 0.0 if split in cleaned else fractions[split] for split in ("val", "test")}, key
    )
    splits |= {split: cleaned[split] for split in ("val", "test") if split in cleaned}
    documents = {
        split: pseudo_documents(pairs, group_of, messages_per_document, seed)
        if messages_per_document > 1
        else [[pair] for pair in pairs]
        for split, pairs in splits.items()
    }
    if train_size is not None and len(documents["train"]) > train_size:
        dropped["train_size"] = len(documents["train"]) - train_size
        documents["train"] = documents["train"][:train_size]
    for split, docs in documents.items():
        if docs:
            continue
        origin = summary.get("origin")
        if split != "train" and split in cleaned:  # the split has its own data, none of it usable
            where, remedy = f"the {split} split of {origin}", "give it pairs"
            if isinstance(origin, dict):  # files
                where = f"{split}_data {origin[split]!r}"
                remedy += f", or leave {split}_data unset to carve the split from train"
            raise DataError(f"the {split} split is empty: {where} has no pair with both sides non-empty; {remedy}")
        raise DataError(
            f"the {split} split is empty ({len(cleaned['train'])} training pairs, val_fraction="
            f"{fractions['val']}, test_fraction={fractions['test']}, split_by={split_by!r}); give it data "
            f"or a larger fraction"
        )
    messages = {split: [pair for doc in docs for pair in doc] for split, docs in documents.items()}
    train_sources = {source for source, _ in messages["train"]}
    train_keys = {normalise_source(source) for source in train_sources}
    overlap = {split: sum(source in train_sources for source, _ in messages[split]) for split in ("val", "test")}
    near = {
        split: sum(normalise_source(source) in train_keys for source, _ in messages[split]) for split in ("val", "test")
    }
    summary |= {"dropped": dict(dropped), "normalised": dict(normalised), "eval_sources_in_train": overlap}
    summary |= {
        "split_by": split_by,
        "normalised_sources": {
            "pairs": len(everything),
            "distinct_sources": len(distinct_sources),
            "keys": len(keys),
            "merged": len(distinct_sources) - len(keys),
        },
        "eval_normalised_in_train": near,
    }
    if messages_per_document > 1:
        summary["documents"] = {
            "messages_per_document": messages_per_document,
            "documents": {split: len(documents[split]) for split in SPLITS},
            "messages": {split: len(messages[split]) for split in SPLITS},
            "shorter": {split: sum(len(doc) < messages_per_document for doc in documents[split]) for split in SPLITS},
            "train_single_messages": len(messages["train"]) if train_single_messages else 0,
        }
    splits = {split: [join(doc) for doc in documents[split]] for split in SPLITS}
    if train_single_messages:
        splits["train"] += messages["train"]
    return {"splits": splits, "summary": summary}


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
    split_by: SplitBy = "source"
    dedupe_normalised: bool = False
    messages_per_document: int = 1
    train_single_messages: bool = False

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
        if self.split_by not in SPLIT_BY:
            raise ValueError(f"split_by must be one of {list(SPLIT_BY)}; got {self.split_by!r}")
        if self.split_by == "catalog" and source != "gettext":
            raise ValueError(
                f"split_by='catalog' needs catalogs: source='gettext' only; got source={source!r} "
                f"(use split_by='source' or 'normalised')"
            )
        if not isinstance(self.messages_per_document, int) or self.messages_per_document < 1:
            raise ValueError(f"messages_per_document must be an int >= 1, got {self.messages_per_document!r}")
        if self.messages_per_document > 1 and source not in GROUPED_SOURCES:
            allowed = ", ".join(f"{name!r} ({how})" for name, how in GROUPED_SOURCES.items())
            raise ValueError(
                f"messages_per_document={self.messages_per_document} joins messages of one catalog, which "
                f"source={source!r} does not have; allowed with source {allowed}, or messages_per_document=1"
            )
        if self.train_single_messages and self.messages_per_document == 1:
            raise ValueError(
                "train_single_messages=True adds the messages of the training documents, but "
                "messages_per_document=1 makes no documents; set messages_per_document > 1 or leave it False"
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
        params |= {"split_by": self.split_by, "dedupe_normalised": self.dedupe_normalised}
        params |= {"documents": [self.messages_per_document, self.seed if self.messages_per_document > 1 else None]}
        if self.train_single_messages:  # absent when off, so that existing caches keep their keys
            params |= {"train_single_messages": True}
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
        return self.read_with_groups()[:2]

    def read_with_groups(self) -> tuple[dict[Split, list[Pair] | None], dict, dict[str, str] | None]:
        """:meth:`read`, plus each (whitespace-normalised) source's catalog for ``gettext`` (None otherwise)."""
        if self.source == "gettext":
            pairs, catalogs, summary = read_gettext_pairs_with_catalogs(self.locale_dir, self.target_lang)
            groups = {normalise_whitespace(source): name for (source, _), name in zip(pairs, catalogs, strict=True)}
            return {"train": pairs, "val": None, "test": None}, summary, groups
        if self.source == "synthetic":
            seed = derive_seed(self.seed, "synthetic translation")
            pairs = synthetic_pairs(self.synthetic_pairs, words=self.synthetic_words, seed=seed)
            return {"train": pairs, "val": None, "test": None}, {"origin": "synthetic"}, None
        fields = {"source_field": self.source_field, "target_field": self.target_field}
        fields |= {"source_lang": self.source_lang, "target_lang": self.target_lang}
        if self.source == "files":
            own = {
                split: None if path is None else read_pairs(path, **fields) for split, path in self.split_data.items()
            }
            return own, {"origin": {split: path for split, path in self.split_data.items() if path is not None}}, None
        own = read_hf_pairs(self.hf_dataset, self.hf_config, self.hf_data_files, **fields)
        return own, {"origin": f"hf:{self.hf_dataset}" + (f"/{self.hf_config}" if self.hf_config else "")}, None

    def load(self, path: Path) -> dict:
        """The corpus cached at ``path``, or read, assembled and cached there."""
        options = {"fractions": self.fractions, "train_size": self.train_size, "split_by": self.split_by}
        options |= {"dedupe_normalised": self.dedupe_normalised, "messages_per_document": self.messages_per_document}
        options |= {"train_single_messages": self.train_single_messages}
        options |= {"seed": derive_seed(self.seed, "pseudo-documents")}

        def build() -> dict:
            own, summary, groups = self.read_with_groups()
            return assemble_splits(own, summary, groups=groups, **options)

        return load_or_build_corpus(path, self.params(), build)
