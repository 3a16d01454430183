"""Step-by-step decoding: the key/value caches (``cache``) and greedy and beam search (``search``)."""

from attention_zoo.decoding.search import beam_search, greedy_search

__all__ = ["beam_search", "greedy_search"]
