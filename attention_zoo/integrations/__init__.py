"""Bridges from attention-zoo to other libraries; each submodule imports its library only when it is imported.

- :mod:`attention_zoo.integrations.transformers`: every zoo mechanism inside a Hugging Face transformers model
  (``pip install -e ".[hf]"``).
"""
