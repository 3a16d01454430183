"""``zoo gpu-suite``: the GPU harness (environment, speed, targets, conformance, compare, grids) under a time budget."""
