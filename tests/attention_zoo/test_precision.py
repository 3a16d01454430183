"""The compute-dtype rule (:mod:`attention_zoo.precision`): half precision is raised to float32, float32 and
float64 are kept, autocast changes nothing about the dtype, and :func:`full_precision` turns autocast off."""

from __future__ import annotations

import contextlib
import pathlib
import re

import pytest
import torch

from attention_zoo.precision import compute_dtype, full_precision

RULE = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}
AUTOCAST = {
    "no autocast": contextlib.nullcontext,
    "autocast bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "autocast fp16": lambda: torch.autocast("cpu", dtype=torch.float16),
}


@pytest.mark.parametrize("autocast", list(AUTOCAST))
@pytest.mark.parametrize(("dtype", "expected"), list(RULE.items()), ids=str)
def test_compute_dtype_raises_half_precision_to_float32_only(dtype, expected, autocast):
    with AUTOCAST[autocast]():
        assert compute_dtype(dtype) == expected
        with full_precision(torch.zeros(2, dtype=dtype)) as work:
            assert work == expected


@pytest.mark.parametrize("autocast", ["autocast bf16", "autocast fp16"])
def test_full_precision_turns_autocast_off_inside_only(autocast):
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    with AUTOCAST[autocast]():
        lowered = (a @ b).dtype
        with full_precision(a) as work:
            assert not torch.is_autocast_enabled("cpu")
            assert (a @ b).dtype == work == torch.float32
        assert torch.is_autocast_enabled("cpu") and (a @ b).dtype == lowered
    assert lowered in (torch.bfloat16, torch.float16), "autocast lowers a float32 matmul outside the block"


def test_no_module_writes_its_own_compute_dtype():
    """The rule is written once: no other module of the package promotes half precision or turns autocast
    off by hand."""
    package = pathlib.Path(__file__).resolve().parents[2] / "attention_zoo"
    own_rule = re.compile(r"promote_types\(|in \(torch\.float16, torch\.bfloat16\)|autocast\([^)]*enabled=False")
    offenders = [
        f"{path.name}:{number}"
        for path in sorted(package.glob("*.py"))
        if path.name != "precision.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if own_rule.search(line)
    ]
    assert not offenders, f"use attention_zoo.precision instead: {', '.join(offenders)}"
