"""Imports every built-in mechanism so that its ``@register_attention`` runs; one line per file."""

from attention_zoo import full  # noqa: F401
