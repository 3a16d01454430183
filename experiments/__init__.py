"""Benchmark and comparison harness for attention-zoo (imports only ``attention_zoo`` and ``tasks``)."""
