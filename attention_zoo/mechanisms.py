"""Imports every built-in mechanism so that its ``@register_attention`` runs; one line per file."""

from attention_zoo import (  # noqa: F401
    cosformer,  # noqa: F401
    full,  # noqa: F401
    linear_attention,  # noqa: F401
    linformer,
    linformer_causal,
    lsh,  # noqa: F401
    moba,  # noqa: F401
    nystrom,  # noqa: F401
    performer,  # noqa: F401
    self_only,  # noqa: F401
    sparse,  # noqa: F401
)
