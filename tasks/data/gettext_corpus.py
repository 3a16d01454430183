"""English -> xx sentence pairs from the machine's installed gettext message catalogs.

A GNU message catalog ``<locale_dir>/<lang>/LC_MESSAGES/<domain>.mo`` maps every English message of one
program (the msgid) to its human translation (the msgstr). Read with Python's :mod:`gettext`
(``GNUTranslations._catalog``), the catalogs of one language form a real parallel corpus of software
messages: menu labels, error messages, option help, country, language and keyboard-layout names.

Every catalog entry is counted exactly once in the summary: kept, or dropped by the first rule that drops it.

- ``header``: the catalog header (msgid ``""``, the catalog's metadata): dropped.
- ``plural``: entries with plural forms: dropped, counted once per msgid (msgstr[0] is not the singular in
  every language).
- context: ``msgctxt`` (a hint to translators) is stripped and the msgid kept (``context_stripped``); an
  entry with nothing after the context is dropped as ``context_only``.
- ``empty``: an empty source or translation: dropped.
- whitespace: every run of whitespace becomes one space and the ends are stripped, on both sides (terminal
  layout, not language; sacreBLEU's 13a tokenisation ignores it anyway).
- mnemonics: keyboard accelerator markers (GTK ``_Open``, Qt ``&Open``) are removed (:func:`strip_mnemonic`).
- ``no_letters``: a source without a letter outside its placeholders (``%s: %s``, ``--``): dropped.
- ``same_as_source``: a translation equal to its source after normalisation: dropped, since copying such pairs
  inflates BLEU. A source with an identical copy in one catalog and a real translation in another keeps the
  real one.
- ``duplicate_source``: one pair per source; the most frequent translation wins, a tie goes to the one seen
  first (catalogs in file-name order, entries in msgid order); ``conflicting_translations`` counts the sources
  that had several.

Kept unchanged: format placeholders (``%s``, ``%1$d``, ``{0}``, ``${name}``; ``with_placeholders`` counts the
pairs that have one), quotes, HTML entities, and long help texts (``overlong`` in :mod:`tasks.data.translation`
decides about those). A catalog whose header Python cannot decode is repaired (:func:`read_catalog`); one that
still cannot be read is skipped with a warning and listed in ``unreadable_catalogs``.
"""

from __future__ import annotations

import gettext
import io
import re
import struct
import warnings
from collections import Counter
from pathlib import Path

Pair = tuple[str, str]
DROP_RULES = (
    "header",
    "plural",
    "context_only",
    "empty",
    "no_letters",
    "same_as_source",
    "duplicate_source",
)
MO_MAGIC = 0x950412DE
WHITESPACE = re.compile(r"\s+")
LETTER = re.compile(r"[^\W\d_]")
ENTITY = re.compile(r"&(?:#\d+|#x[0-9a-fA-F]+|[A-Za-z]\w*);")
PLACEHOLDER = re.compile(
    r"%(?:\d+\$)?[-+#0']*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|j|z|t)?[diouxXeEfFgGaAcspm]"
    r"|%\(\w+\)[sdif]|\{\w*\}|\$\{\w+\}"
)
OTHER_SOURCES = (
    "source='files' (line-aligned text pairs, TSV or JSONL), source='hf' (Hugging Face datasets) or source='synthetic'"
)


def catalog_paths(locale_dir: Path, lang: str) -> list[Path]:
    """The ``.mo`` catalogs of ``lang``, in file-name order."""
    return sorted((locale_dir / lang / "LC_MESSAGES").glob("*.mo"))


def languages_with_catalogs(locale_dir: Path) -> list[str]:
    if not locale_dir.is_dir():
        return []
    return sorted(d.name for d in locale_dir.iterdir() if any((d / "LC_MESSAGES").glob("*.mo")))


def missing_catalogs_message(locale_dir: Path, lang: str) -> str:
    available = languages_with_catalogs(locale_dir)
    where = f"languages with catalogs there: {', '.join(available)}" if available else f"{locale_dir} has none"
    return (
        f"no gettext catalogs for en-{lang}: {locale_dir / lang / 'LC_MESSAGES'} holds no *.mo file (minimal "
        f"containers strip {locale_dir}); {where}. Set target_lang to one of them, point locale_dir elsewhere, "
        f"or use {OTHER_SOURCES}"
    )


def _ascii_header(data: bytes) -> bytes:
    """``data`` with the non-ASCII bytes of its header (the translation of msgid ``""``) replaced by ``?``."""
    order = "<" if struct.unpack_from("<I", data)[0] == MO_MAGIC else ">"
    _, _, count, ids_at, strs_at = struct.unpack_from(f"{order}5I", data)
    for entry in range(count):
        if struct.unpack_from(f"{order}I", data, ids_at + 8 * entry)[0] == 0:
            length, start = struct.unpack_from(f"{order}2I", data, strs_at + 8 * entry)
            header = bytes(byte if byte < 0x80 else ord("?") for byte in data[start : start + length])
            return data[:start] + header + data[start + length :]
    return data


def read_catalog(path: Path) -> tuple[dict, bool]:
    """The catalog's ``{msgid or (msgid, n): msgstr}`` and whether its header had to be made ASCII.

    Python's gettext decodes a catalog's header as UTF-8 before it knows the catalog's charset, so a header
    carrying a Latin-1 translator name (Debian's German ``net-tools.mo``) raises UnicodeDecodeError. Such a
    header's non-ASCII bytes are replaced by ``?`` (same length, so every offset in the file stays valid; the
    charset and plural fields it needs are ASCII) and the catalog is read again (``repaired_headers``)."""
    data = path.read_bytes()
    try:
        return gettext.GNUTranslations(io.BytesIO(data))._catalog, False
    except UnicodeDecodeError:
        return gettext.GNUTranslations(io.BytesIO(_ascii_header(data)))._catalog, True


def normalise_whitespace(text: str) -> str:
    return WHITESPACE.sub(" ", text).strip()


def _marker(text: str, char: str, *, word_start: bool) -> int | None:
    """Where the one accelerator marker ``char`` of ``text`` is, or None if there is not exactly one."""
    bare = ENTITY.sub(lambda entity: " " * len(entity.group()), text) if char == "&" else text
    if bare.count(char) != 1:
        return None
    at = bare.index(char)
    followed = at + 1 < len(text) and text[at + 1].isalnum()
    return at if followed and (not word_start or at == 0 or text[at - 1].isspace()) else None


def strip_mnemonic(source: str, target: str) -> Pair | None:
    """The pair without its accelerator markers (``_File`` / ``_Datei``), or None if it has none: removed from
    both sides when the source has exactly one marker, at the start of a word, and the translation has exactly
    one (``In _Ordner speichern``). A ``_`` inside a word (``SIG_IGN``, ``pg_dump``: identifiers, far more
    common than mid-word English mnemonics such as ``C_ollate``) is left alone, as are HTML entities (``&lt;``)
    and ``&&``."""
    for char in "_&":
        in_source = _marker(source, char, word_start=True)
        in_target = _marker(target, char, word_start=False)
        if in_source is not None and in_target is not None:
            return source[:in_source] + source[in_source + 1 :], target[:in_target] + target[in_target + 1 :]
    return None


def _entry_order(key: str | tuple[str, int]) -> tuple[str, int]:
    return (key, -1) if isinstance(key, str) else key


def read_gettext_pairs(locale_dir: Path, lang: str) -> tuple[list[Pair], dict]:
    """Distinct ``(english, translation)`` pairs of every catalog of ``lang`` and a summary of what was
    kept, dropped (per rule) and normalised. Pairs come in the order their sources were first seen."""
    pairs, _, summary = read_gettext_pairs_with_catalogs(locale_dir, lang)
    return pairs, summary


def read_gettext_pairs_with_catalogs(locale_dir: Path, lang: str) -> tuple[list[Pair], list[str], dict]:
    """:func:`read_gettext_pairs`, plus the catalog (file name) of each pair: the first catalog, in file-name
    order, that holds the pair as kept (the winning translation of its source)."""
    paths = catalog_paths(locale_dir, lang)
    if not paths:
        raise FileNotFoundError(missing_catalogs_message(locale_dir, lang))
    dropped = Counter(dict.fromkeys(DROP_RULES, 0))
    normalised = Counter(dict.fromkeys(("context_stripped", "whitespace", "mnemonic"), 0))
    translations: dict[str, Counter] = {}
    first_seen: dict[Pair, int] = {}
    catalog_of: dict[Pair, str] = {}
    entries, repaired, unreadable = 0, [], []
    for path in paths:
        try:
            catalog, was_repaired = read_catalog(path)
        # UnicodeDecodeError is a ValueError; LookupError: a charset Python has no codec for
        except (OSError, ValueError, LookupError, struct.error) as error:
            warnings.warn(f"skipping unreadable gettext catalog {path} ({error})", stacklevel=2)
            unreadable.append(path.name)
            continue
        if was_repaired:
            repaired.append(path.name)
        for key in sorted(catalog, key=_entry_order):
            if isinstance(key, tuple):
                entries += key[1] == 0
                dropped["plural"] += key[1] == 0
                continue
            entries += 1
            source, target = key, catalog[key]
            if source == "":
                dropped["header"] += 1
                continue
            if "\x04" in source:
                source = source.split("\x04", 1)[1]
                if source == "":
                    dropped["context_only"] += 1
                    continue
                normalised["context_stripped"] += 1
            clean = normalise_whitespace(source), normalise_whitespace(target)
            if not clean[0] or not clean[1]:
                dropped["empty"] += 1
                continue
            normalised["whitespace"] += clean != (source, target)
            without_mnemonic = strip_mnemonic(*clean)
            if without_mnemonic is not None:
                normalised["mnemonic"] += 1
                clean = without_mnemonic
            if not LETTER.search(PLACEHOLDER.sub("", clean[0])):
                dropped["no_letters"] += 1
            elif clean[0] == clean[1]:
                dropped["same_as_source"] += 1
            else:
                translations.setdefault(clean[0], Counter())[clean[1]] += 1
                if clean not in first_seen:
                    first_seen[clean] = len(first_seen)
                    catalog_of[clean] = path.name
    pairs = []
    for source, counts in translations.items():
        target = max(counts, key=lambda t: (counts[t], -first_seen[source, t]))
        pairs.append((source, target))
        dropped["duplicate_source"] += sum(counts.values()) - 1
    summary = {
        "origin": str(locale_dir / lang / "LC_MESSAGES"),
        "catalogs": len(paths) - len(unreadable),
        "catalog_entries": entries,
        "distinct_pairs": len(pairs),
        "dropped": dict(dropped),
        "normalised": dict(normalised),
        "conflicting_translations": sum(len(counts) > 1 for counts in translations.values()),
        "with_placeholders": sum(bool(PLACEHOLDER.search(source)) for source, _ in pairs),
        "repaired_headers": repaired,
        "unreadable_catalogs": unreadable,
    }
    return pairs, [catalog_of[pair] for pair in pairs], summary
