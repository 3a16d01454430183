"""Static checks of what the package declares against what its code needs."""

from __future__ import annotations

import re
from pathlib import Path

import attention_zoo as az
from attention_zoo.nystrom import attention as nystrom

ROOT = Path(__file__).resolve().parents[1]


def torch_floor() -> tuple[int, int]:
    line = next(ln for ln in (ROOT / "pyproject.toml").read_text().splitlines() if re.match(r'\s*"torch>=', ln))
    major, minor = re.search(r'"torch>=(\d+)\.(\d+)', line).groups()
    return int(major), int(minor)


def test_the_torch_floor_admits_only_versions_the_code_runs_on():
    """flex_attention (torch 2.5) is imported when attention_zoo is; is_autocast_enabled(device_type) needs 2.4."""
    sources = [p.read_text() for p in (ROOT / "attention_zoo").rglob("*.py")]
    needs = [(2, 5) for text in sources if re.search(r"^from torch\.nn\.attention\.flex_attention", text, re.M)]
    needs += [(2, 4) for text in sources if re.search(r"is_autocast_enabled\(\w", text)]
    assert needs, "the checks above no longer find what they look for: update this test"
    assert torch_floor() >= max(needs)


def test_nystrom_refuses_iterations_with_the_exact_pinv_against_its_own_default():
    default = {o.name: o.default for o in az.attention_options(az.get_attention_class("nystrom"))}["pinv_iterations"]
    assert default == nystrom.PAPER_PINV_ITERATIONS
    az.create_attention("nystrom", dim_head=8, heads=2, num_landmarks=4, pinv="exact")  # the default passes
