"""Docstrings: a mechanism module opens with its paper in at most 40 lines, other modules take at most 30, no
docstring quotes a measurement or a results folder, and no test module opens with an issue number."""

import ast
import re
import sys
from functools import cache
from pathlib import Path

import pytest

import attention_zoo as az
from attention_zoo.core import AttentionCore

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted([*(ROOT / "attention_zoo").rglob("*.py"), *(ROOT / "tasks" / "data").glob("*.py")])
MEASUREMENT = re.compile(
    r"results/|measured on|this machine|\b\d+(\.\d+)? ?x (faster|slower)\b|\b\d+(\.\d+)? ?ms\b|speed-up", re.IGNORECASE
)


@cache
def mechanism_modules() -> set[Path]:
    """The files that define a registered core or a base class of one (below AttentionCore)."""
    classes = {c for name in az.list_attentions() for c in az.get_attention_class(name).__mro__}
    cores = [c for c in classes if issubclass(c, AttentionCore) and c is not AttentionCore]
    return {Path(sys.modules[c.__module__].__file__).resolve() for c in cores}


def docstrings(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [node for node in ast.walk(tree) if isinstance(node, kinds)]
    return [(getattr(node, "name", "module"), ast.get_docstring(node) or "") for node in nodes]


def label(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize(
    "path",
    LIBRARY,
    ids=label,
)
def test_module_docstring_is_short(path):
    mechanism = path in mechanism_modules()
    text = ast.get_docstring(ast.parse(path.read_text())) or ""
    most = 40 if mechanism else 30
    assert len(text.splitlines()) <= most, f"{label(path)}: module docstring of {len(text.splitlines())} lines"
    if mechanism:
        assert "arXiv" in text, f"{label(path)}: a mechanism module names its paper"


@pytest.mark.parametrize(
    "path", sorted([*(ROOT / "attention_zoo").rglob("*.py"), *(ROOT / "tasks").rglob("*.py")]), ids=label
)
def test_no_docstring_quotes_a_measurement_or_a_results_folder(path):
    found = [(name, MEASUREMENT.search(text).group()) for name, text in docstrings(path) if MEASUREMENT.search(text)]
    assert not found, f"{label(path)}: {found}"


def test_no_test_module_opens_with_an_issue_number():
    opening = {
        label(p): (ast.get_docstring(ast.parse(p.read_text())) or "").partition("\n")[0]
        for p in (ROOT / "tests").rglob("*.py")
    }
    assert not {path: line for path, line in opening.items() if re.search(r"\bissue \d+|#\d+", line, re.IGNORECASE)}


def test_the_mechanism_modules_are_found():
    names = {label(p) for p in mechanism_modules()}
    assert {"attention_zoo/full.py", "attention_zoo/kernel/attention.py", "attention_zoo/sparse/attention.py"} <= names
