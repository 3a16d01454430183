"""``zoo gpu-suite``: the GPU harness (environment, targets, conformance, compare, grids) under a time budget."""
