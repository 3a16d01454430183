"""A seeded toy language pair for fast translation tests and sanity runs.

The source language is English-like and SVO; the target language puts the verb last and adjectives after
their noun, so a word's translation is rarely at its source position (alignments are not monotonic), and
marks agreement that the source does not show locally:

    source: DET [ADJ] NOUN[s]  VERB[s]  DET [ADJ] NOUN[s]  [PREP DET [ADJ] NOUN[s]] .
    target: DET' NOUN'[pl] [ADJ'+agr]  DET' NOUN'[pl] [ADJ'+agr]  [PREP' DET' NOUN'[pl] [ADJ'+agr]]  VERB'+agr .

Every content word has one translation (the lexicon, a bijection per word class). Each target noun has
a gender (one of 3); the target determiner depends on definiteness, gender and number, an adjective's
suffix on its noun's gender and number, a noun's plural suffix on its gender, and the final verb's
suffix on the subject's number (so the model must carry the subject across the object). Target words use
umlauts and ``ß``, to exercise the byte-level tokenizer. Words are random syllable strings drawn from
``random.Random(seed)``: the same seed gives the same lexicon and sentences.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

Pair = tuple[str, str]
SOURCE_LETTERS = ("bdfgklmnprstv", "aeiou")
TARGET_LETTERS = ("bdgklmnprsßtwz", "aeiouäöü")
GENDERS = 3
PLURAL_SUFFIX = ("en", "er", "s")  # by gender
ADJECTIVE_SUFFIX = (("er", "e", "es"), ("en", "en", "en"))  # [plural][gender]
VERB_SUFFIX = ("t", "en")  # by the subject's number
PP_PROBABILITY, ADJECTIVE_PROBABILITY, PLURAL_PROBABILITY = 0.3, 0.5, 0.4


def _words(rng: random.Random, letters: tuple[str, str], count: int, taken: set[str]) -> list[str]:
    """``count`` new distinct words of 2-3 consonant-vowel syllables (optionally a final consonant)."""
    consonants, vowels = letters
    words = []
    while len(words) < count:
        syllables = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(2, 3)))
        word = syllables + (rng.choice(consonants) if rng.random() < 0.3 else "")
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


@dataclass(frozen=True)
class Lexicon:
    nouns: list[Pair]
    genders: list[int]
    adjectives: list[Pair]
    verbs: list[Pair]
    prepositions: list[Pair]
    determiners: dict[tuple[bool, int, bool], str]  # (definite, gender, plural) -> target determiner

    @classmethod
    def draw(cls, rng: random.Random, words: int) -> Lexicon:
        source_taken, target_taken = {"the", "a", "some"}, set()

        def pairs(count: int) -> list[Pair]:
            sources = _words(rng, SOURCE_LETTERS, count, source_taken)
            return list(zip(sources, _words(rng, TARGET_LETTERS, count, target_taken), strict=True))

        nouns, adjectives, verbs, prepositions = pairs(words), pairs(words), pairs(max(2, words // 2)), pairs(4)
        keys = [
            (definite, gender, plural)
            for definite in (True, False)
            for gender in range(GENDERS)
            for plural in (False, True)
        ]
        determiners = dict(zip(keys, _words(rng, TARGET_LETTERS, len(keys), target_taken), strict=True))
        genders = [rng.randrange(GENDERS) for _ in nouns]
        return cls(nouns, genders, adjectives, verbs, prepositions, determiners)

    def noun_phrase(self, rng: random.Random) -> tuple[list[str], list[str], bool]:
        """``(source words, target words, plural)`` of one random noun phrase."""
        noun = rng.randrange(len(self.nouns))
        gender = self.genders[noun]
        plural, definite = rng.random() < PLURAL_PROBABILITY, rng.random() < 0.5
        adjective = (
            self.adjectives[rng.randrange(len(self.adjectives))] if rng.random() < ADJECTIVE_PROBABILITY else None
        )
        source_noun, target_noun = self.nouns[noun]
        source = ["the" if definite else "some" if plural else "a"]
        source += [adjective[0]] if adjective else []
        source.append(source_noun + ("s" if plural else ""))
        target = [self.determiners[definite, gender, plural], target_noun + (PLURAL_SUFFIX[gender] if plural else "")]
        target += [adjective[1] + ADJECTIVE_SUFFIX[plural][gender]] if adjective else []
        return source, target, plural

    def sentence(self, rng: random.Random) -> Pair:
        subject, subject_target, plural = self.noun_phrase(rng)
        source_verb, target_verb = self.verbs[rng.randrange(len(self.verbs))]
        obj, obj_target, _ = self.noun_phrase(rng)
        source = [*subject, source_verb + ("" if plural else "s"), *obj]
        target = [*subject_target, *obj_target]
        if rng.random() < PP_PROBABILITY:
            source_prep, target_prep = self.prepositions[rng.randrange(len(self.prepositions))]
            pp, pp_target, _ = self.noun_phrase(rng)
            source += [source_prep, *pp]
            target += [target_prep, *pp_target]
        target.append(target_verb + VERB_SUFFIX[plural])
        return " ".join([*source, "."]), " ".join([*target, "."])


def synthetic_pairs(count: int, *, words: int, seed: int) -> list[Pair]:
    """``count`` pairs with distinct sources, over a lexicon of ``words`` nouns and adjectives."""
    rng = random.Random(seed)
    lexicon = Lexicon.draw(rng, words)
    pairs: dict[str, str] = {}
    for _ in range(100 * count):
        if len(pairs) == count:
            return list(pairs.items())
        source, target = lexicon.sentence(rng)
        pairs.setdefault(source, target)
    raise ValueError(f"could not draw {count} distinct synthetic sentences from {words} words; raise synthetic_words")
