"""The translation data options for long, leak-free pairs: the near-duplicate key and the splits
it drives (``split_by``, ``dedupe_normalised``), pseudo-documents (``messages_per_document``), their cache keys,
and the length report (:mod:`experiments.studies.translation_lengths`). Tiny .mo catalogs written here, the
real BPE; every test has its own cache."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from experiments.studies.translation_lengths import describe, length_distribution, main, markdown
from tasks.data.parallel_corpus import normalise_source, source_hash
from tasks.data.translation import TranslationDataModule
from tests.tasks.test_translation_data import write_mo

SMALL = dict(bpe_vocab_size=400, val_fraction=0.2, test_fraction=0.2, batch_size=4)
SPLITS = ("train", "val", "test")
VERBS = ["open", "read", "close", "remove", "create", "rename", "copy", "move", "lock", "sync", "find", "load"]
OBJECTS = ["file", "folder", "socket", "device", "archive", "link"]


def variant_catalogs(tmp_path: Path) -> tuple[Path, dict[str, list[str]]]:
    """Families of near-duplicate messages ("Cannot open '%s'", "cannot open %s.", "Cannot open %1$s"), spread
    over two catalogs, and the sources of each family by its key."""
    first, second, families = {}, {}, {}
    for v, verb in enumerate(VERBS):
        for o, noun in enumerate(OBJECTS):
            variants = {
                f"Cannot {verb} {noun} '%s'": f"Kann {noun} »%s« nicht {verb}",
                f"cannot {verb} {noun} %s.": f"{noun} %s kann nicht {verb} werden.",
                f"Cannot {verb} {noun}: %1$s": f"{noun} kann nicht {verb}: %1$s",
            }
            for i, (source, target) in enumerate(variants.items()):
                (first if (v + o + i) % 2 else second)[source] = target
            families[normalise_source(next(iter(variants)))] = list(variants)
    write_mo(tmp_path / "locale" / "de" / "LC_MESSAGES" / "alpha.mo", first)
    write_mo(tmp_path / "locale" / "de" / "LC_MESSAGES" / "beta.mo", second)
    return tmp_path / "locale", families


def numbered_catalogs(tmp_path: Path, sizes: dict[str, int]) -> tuple[Path, dict[str, tuple[str, str]]]:
    """One catalog per name with ``sizes[name]`` messages ending in '.', and ``{source: (catalog, target)}``."""
    messages = {}
    for name, size in sizes.items():
        catalog = {
            f"Catalog {name} message {i} says %s.": f"Katalog {name} Nachricht {i} sagt %s." for i in range(size)
        }
        write_mo(tmp_path / "locale" / "de" / "LC_MESSAGES" / f"{name}.mo", catalog)
        messages |= {source: (name, target) for source, target in catalog.items()}
    return tmp_path / "locale", messages


def sentences(document: str) -> list[str]:
    return re.split(r"(?<=\.) ", document)


def split_of(sources_by_split: dict[str, list[str]]) -> dict[str, str]:
    return {source: split for split, sources in sources_by_split.items() for source in sources}


# ---- the near-duplicate key and the splits -------------------------------------------------------------------
@pytest.mark.parametrize(
    "variants",
    [
        ["cannot chdir to '%s'", "cannot chdir to %s", "Cannot chdir to %1$s.", "CANNOT  chdir to «%d»"],
        ["Unknown option %(name)s!", "unknown option {0}", "Unknown option: {name}", "unknown option ${name}"],
        ["File-name", "file name", "filename", "File name:"],
    ],
)
def test_normalised_key_merges_case_punctuation_whitespace_and_format_specifiers(variants):
    assert len({normalise_source(v) for v in variants}) == 1 and normalise_source(variants[0])


@pytest.mark.parametrize(("a", "b"), [("file 1", "file 2"), ("Open %s", "Close %s"), ("Größe", "Grosse")])
def test_normalised_key_keeps_words_and_digits_apart(a, b):
    assert normalise_source(a) != normalise_source(b)


def test_split_by_normalised_keeps_every_family_in_one_split_and_reports_the_merges(tmp_path):
    locale, families = variant_catalogs(tmp_path)
    options = dict(locale_dir=str(locale), **SMALL)
    by_source = TranslationDataModule(**options, cache_dir=str(tmp_path / "a"))
    by_key = TranslationDataModule(**options, split_by="normalised", cache_dir=str(tmp_path / "b"))
    where_source = split_of({split: by_source.texts(split)[0] for split in SPLITS})
    where_key = split_of({split: by_key.texts(split)[0] for split in SPLITS})
    total = sum(len(variants) for variants in families.values())
    assert len(where_source) == len(where_key) == total == 216
    crossing = [key for key, variants in families.items() if len({where_source[v] for v in variants}) > 1]
    assert crossing  # the premise: by the source string, near-duplicates cross the split
    for key, variants in families.items():
        assert {where_key[v] for v in variants} == {where_key[variants[0]]}
        u = source_hash(key)
        assert where_key[variants[0]] == ("test" if u < 0.2 else "val" if u < 0.4 else "train")
    summaries = {"source": by_source.corpus_summary(), "normalised": by_key.corpus_summary()}
    for summary in summaries.values():
        assert summary["normalised_sources"] == {"pairs": 216, "distinct_sources": 216, "keys": 72, "merged": 144}
    leaked = {
        split: sum(where_source[v] == split and any(where_source[w] == "train" for w in variants) for key, variants in
                   families.items() for v in variants)
        for split in ("val", "test")
    }  # fmt: skip
    assert summaries["source"]["eval_normalised_in_train"] == leaked and sum(leaked.values()) > 0
    assert summaries["normalised"]["eval_normalised_in_train"] == {"val": 0, "test": 0}
    assert summaries["source"]["split_by"] == "source" and summaries["normalised"]["split_by"] == "normalised"


def test_dedupe_normalised_keeps_one_pair_per_key(tmp_path):
    locale, families = variant_catalogs(tmp_path)
    dm = TranslationDataModule(
        locale_dir=str(locale), split_by="normalised", dedupe_normalised=True, cache_dir=str(tmp_path / "c"), **SMALL
    )
    sources = [source for split in SPLITS for source in dm.texts(split)[0]]
    assert sorted(normalise_source(s) for s in sources) == sorted(families)
    for source in sources:
        variants = families[normalise_source(source)]
        assert source == min(variants, key=lambda v: (source_hash(v), v))  # the first in hash order
    summary = dm.corpus_summary()
    assert summary["dropped"]["normalised_duplicate"] == 144 and summary["pairs"]["total"] == 72


def test_split_by_catalog_keeps_each_catalog_in_one_split(tmp_path):
    names = [f"prog{i}" for i in range(14)]
    locale, messages = numbered_catalogs(tmp_path, dict.fromkeys(names, 3))
    dm = TranslationDataModule(locale_dir=str(locale), split_by="catalog", cache_dir=str(tmp_path / "c"), **SMALL)
    where = split_of({split: dm.texts(split)[0] for split in SPLITS})
    assert set(where) == set(messages)
    for name in names:
        u = source_hash(f"{name}.mo")
        expected = "test" if u < 0.2 else "val" if u < 0.4 else "train"
        assert {where[s] for s, (catalog, _) in messages.items() if catalog == name} == {expected}


# ---- pseudo-documents ----------------------------------------------------------------------------------------
def test_pseudo_documents_join_messages_of_one_catalog_in_the_same_order_on_both_sides(tmp_path):
    sizes = {"apt": 23, "bash": 17, "coreutils": 9}
    locale, messages = numbered_catalogs(tmp_path, sizes)
    m = 4
    dm = TranslationDataModule(locale_dir=str(locale), messages_per_document=m, cache_dir=str(tmp_path / "c"), **SMALL)
    seen: dict[str, str] = {}
    count: dict[tuple[str, str], int] = {}
    for split in SPLITS:
        for source, target in zip(*dm.texts(split), strict=True):
            parts, translated = sentences(source), sentences(target)
            assert 1 <= len(parts) <= m
            assert translated == [messages[part][1] for part in parts]  # the same order on both sides
            (catalog,) = {messages[part][0] for part in parts}  # one catalog per document
            for part in parts:
                assert part not in seen  # each message once, in one document
                seen[part] = split
                u = source_hash(part)  # split per message, before joining: no test message in a train document
                assert split == ("test" if u < 0.2 else "val" if u < 0.4 else "train")
            count[split, catalog] = count.get((split, catalog), 0) + 1
    assert set(seen) == set(messages)
    for (split, catalog), documents in count.items():
        in_split = sum(seen[s] == split for s, (c, _) in messages.items() if c == catalog)
        assert documents == math.ceil(in_split / m)  # runs of m, the last one holds the rest
    summary = dm.corpus_summary()["documents"]
    assert summary["messages_per_document"] == m
    assert summary["documents"] == {split: sum(n for (s, _), n in count.items() if s == split) for split in SPLITS}
    assert summary["messages"] == {split: sum(v == split for v in seen.values()) for split in SPLITS}
    assert summary["shorter"]["train"] == sum(
        sum(seen[s] == "train" for s, (c, _) in messages.items() if c == catalog) % m != 0 for catalog in sizes
    )
    dm.setup()
    batch = next(iter(dm.val_dataloader()))
    assert dm.decode(batch["source"][0]) == dm.texts("val")[0][int(batch["index"][0])]


def test_single_messages_join_the_training_documents_and_only_them(tmp_path):
    locale, messages = numbered_catalogs(tmp_path, {"apt": 23, "bash": 17})
    options = dict(locale_dir=str(locale), messages_per_document=4, cache_dir=str(tmp_path / "c"), **SMALL)
    documents = TranslationDataModule(**options).corpus()["splits"]
    mixed_dm = TranslationDataModule(**options, train_single_messages=True)
    mixed = mixed_dm.corpus()["splits"]
    assert mixed["val"] == documents["val"] and mixed["test"] == documents["test"]
    assert mixed["train"][: len(documents["train"])] == documents["train"]
    singles = mixed["train"][len(documents["train"]) :]
    expected = [[part, messages[part][1]] for source, _ in documents["train"] for part in sentences(source)]
    assert [list(pair) for pair in singles] == expected  # every training message once, with its own translation
    assert mixed_dm.corpus_summary()["documents"]["train_single_messages"] == len(expected) > 0


def test_pseudo_documents_are_deterministic_given_the_seed_and_the_seed_reorders_them(tmp_path):
    locale, _ = numbered_catalogs(tmp_path, {"apt": 30, "bash": 30})
    options = dict(locale_dir=str(locale), messages_per_document=5, **SMALL)
    corpora = {
        (seed, where): TranslationDataModule(**options, seed=seed, cache_dir=str(tmp_path / where)).corpus()["splits"]
        for seed in (0, 1)
        for where in ("x", "y")
    }
    assert corpora[0, "x"] == corpora[0, "y"] and corpora[1, "x"] == corpora[1, "y"]
    assert corpora[0, "x"] != corpora[1, "x"]
    for split in SPLITS:  # another seed regroups the messages of a split, never moves them to another split
        messages = [
            sorted(sentence for doc, _ in corpora[seed, "x"][split] for sentence in sentences(doc)) for seed in (0, 1)
        ]
        assert messages[0] == messages[1]


def test_synthetic_pseudo_documents_form_one_group(tmp_path):
    dm = TranslationDataModule(
        source="synthetic", synthetic_pairs=60, messages_per_document=3, cache_dir=str(tmp_path), **SMALL
    )
    single = TranslationDataModule(source="synthetic", synthetic_pairs=60, cache_dir=str(tmp_path), **SMALL)
    for split in SPLITS:
        pairs = dict(zip(*single.texts(split), strict=True))
        documents = list(zip(*dm.texts(split), strict=True))
        assert len(documents) == math.ceil(len(pairs) / 3)
        joined = [(part, target) for source, target in documents for part in sentences(source)]
        assert sorted(part for part, _ in joined) == sorted(pairs)
        for source, target in documents:
            assert sentences(target) == [pairs[part] for part in sentences(source)]


def test_overlong_documents_are_an_error_or_dropped(tmp_path):
    locale, _ = numbered_catalogs(tmp_path, {"apt": 40, "bash": 25})
    options = dict(locale_dir=str(locale), messages_per_document=3, **SMALL)
    dm = TranslationDataModule(**options, cache_dir=str(tmp_path / "c"))
    lengths = {
        split: [len(dm.tokenizer.encode([source])[0]) + 1 for source, _ in dm.corpus()["splits"][split]]
        for split in SPLITS
    }
    limit = max(lengths["train"]) - 1  # the longest training documents are too long
    too_long = {split: sum(n > limit for n in values) for split, values in lengths.items()}
    assert 0 < too_long["train"] < len(lengths["train"])
    strict = TranslationDataModule(**options, max_source_len=limit, max_target_len=512, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=rf"{too_long['train']} of {len(lengths['train'])} train pairs are longer"):
        strict.load_split("train")
    dropping = TranslationDataModule(
        **options, max_source_len=limit, max_target_len=512, overlong="drop", cache_dir=str(tmp_path / "c")
    )
    with pytest.warns(UserWarning, match="dropped"):
        dropping.prepare_data()
    assert dropping.corpus_summary()["dropped"]["overlong"] == too_long
    assert all(len(dropping.encode_source(source)) <= limit for source in dropping.texts("train")[0])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"source": "files", "messages_per_document": 2}, "messages_per_document=2 .* source='files' .*'gettext'"),
        ({"messages_per_document": 0}, "messages_per_document must be an int >= 1, got 0"),
        ({"train_single_messages": True}, "train_single_messages=True .* messages_per_document=1 makes no documents"),
        ({"source": "synthetic", "split_by": "catalog"}, "split_by='catalog' needs catalogs.*source='synthetic'"),
        ({"split_by": "hash"}, r"split_by must be one of \['source', 'normalised', 'catalog'\]; got 'hash'"),
    ],
)
def test_option_errors_name_the_value_and_what_is_allowed(tmp_path, options, message):
    locale, _ = numbered_catalogs(tmp_path, {"apt": 2})
    fixtures = Path(__file__).parents[1] / "fixtures" / "translation"
    files = {"train_data": str(fixtures / "tiny.tsv")} if options.get("source") == "files" else {}
    with pytest.raises(ValueError, match=message):
        TranslationDataModule(locale_dir=str(locale), cache_dir=str(tmp_path), **files, **options)


def test_each_option_has_its_own_cache(tmp_path):
    """Built one after another in one cache folder, every option gives what it gives in a fresh folder."""
    locale, _ = variant_catalogs(tmp_path)
    numbered_catalogs(tmp_path, dict.fromkeys([f"prog{i}" for i in range(14)], 3))  # enough catalogs for 3 splits
    variants = [
        {},
        {"split_by": "normalised"},
        {"split_by": "catalog"},
        {"dedupe_normalised": True},
        {"messages_per_document": 3},
        {"messages_per_document": 3, "seed": 1},
        {"messages_per_document": 4},
        {"messages_per_document": 4, "train_single_messages": True},
    ]
    shared = tmp_path / "shared"
    built = []
    for extra in variants:
        dm = TranslationDataModule(locale_dir=str(locale), cache_dir=str(shared), **SMALL, **extra)
        dm.prepare_data()
        built.append((dm.corpus()["splits"], [dm.load_split(s).tokens.tolist() for s in SPLITS]))
    for i, extra in enumerate(variants):
        fresh = TranslationDataModule(locale_dir=str(locale), cache_dir=str(tmp_path / f"fresh{i}"), **SMALL, **extra)
        assert (fresh.corpus()["splits"], [fresh.load_split(s).tokens.tolist() for s in SPLITS]) == built[i]
    assert len({json.dumps(corpus) for corpus, _ in built}) == len(variants)
    assert len(list((shared / "translation").glob("corpus-*.json"))) == len(variants)


# ---- length distributions ------------------------------------------------------------------------------------
def test_describe_by_nearest_rank():
    stats = describe(list(range(10, 0, -1)), ks=(4, 20))
    assert {name: stats[name] for name in ("count", "mean", "median", "p90", "p99", "max")} == {
        "count": 10, "mean": 5.5, "median": 5, "p90": 9, "p99": 10, "max": 10,
    }  # fmt: skip
    assert stats["k"]["4"] == {"longer": 0.6, "ratio_median": 1.25, "ratio_p90": 2.25}
    assert stats["k"]["20"]["longer"] == 0.0


def test_length_distribution_counts_the_tokens_the_model_sees(tmp_path):
    locale, _ = numbered_catalogs(tmp_path, {"apt": 30, "bash": 20})
    dm = TranslationDataModule(locale_dir=str(locale), messages_per_document=3, cache_dir=str(tmp_path / "c"), **SMALL)
    ks = (16, 48)
    distribution = length_distribution(dm, ks)
    for split in SPLITS:
        sources, targets = dm.texts(split)
        expected = {
            "source": [len(dm.encode_source(s)) for s in sources],  # tokens + EOS
            "target": [len(dm.tokenizer.encode([t])[0]) + 1 for t in targets],  # tokens + BOS
        }
        for side, lengths in expected.items():
            stats = distribution[split][side]
            values = np.array(lengths)
            assert stats["count"] == len(lengths) and stats["max"] == values.max()
            assert stats["mean"] == pytest.approx(values.mean())
            for name, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99)):
                assert stats[name] == np.percentile(values, 100 * q, method="inverted_cdf")
            for k in ks:
                assert stats["k"][str(k)]["longer"] == pytest.approx((values > k).mean())
                assert stats["k"][str(k)]["ratio_median"] == pytest.approx(stats["median"] / k)
    assert 0 < distribution["train"]["source"]["k"]["16"]["longer"] < 1  # the fixture straddles k = 16
    table = markdown(distribution)
    assert table.count("\n") == 2 + 2 * len(SPLITS) and "| > 16 | > 48 |" in table


def test_length_command_reads_a_config_with_overrides(tmp_path, capsys):
    locale, _ = numbered_catalogs(tmp_path, {"apt": 30, "bash": 20})
    config = tmp_path / "translation.yaml"
    init_args = {"locale_dir": str(locale), "cache_dir": str(tmp_path / "c"), **SMALL}
    config.write_text(json.dumps({"data": {"class_path": "tasks.data.translation.TranslationDataModule",
                                           "init_args": init_args}}))  # fmt: skip
    out = tmp_path / "lengths.json"
    assert main(["-c", str(config), "--set", "messages_per_document=2", "--k", "8", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    dm = TranslationDataModule(**init_args, messages_per_document=2)
    assert written == json.loads(json.dumps(length_distribution(dm, (8,))))
    assert "| train | source |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["-c", str(config), "--set", "split_by=hash"])
