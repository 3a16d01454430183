"""Imports every built-in mechanism so that its ``@register_attention`` runs; one line per file."""

from attention_zoo import full  # noqa: F401
from attention_zoo import linformer, linformer_causal  # noqa: F401
from attention_zoo import nystrom  # noqa: F401
from attention_zoo import sparse  # noqa: F401
from attention_zoo import lsh  # noqa: F401
