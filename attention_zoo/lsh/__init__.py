"""Reformer's LSH attention (Kitaev et al. 2020, arXiv:2001.04451).

``attention`` holds the core and its dense reference path, ``chunked`` the blocked CPU path with its backward."""

from attention_zoo.lsh.attention import LSHAttention

__all__ = ["LSHAttention"]
