"""Bridges from attention-zoo to other libraries; each submodule imports its library only when it is imported.

- :mod:`attention_zoo.integrations.transformers`: every zoo mechanism in the self-attention layers of a Hugging Face
  transformers model; cross-attention keeps the model's own implementation unless a core is named for it
  (``pip install -e ".[hf]"``).
"""
