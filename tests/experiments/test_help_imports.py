"""``zoo <command> --help`` prints from the parser alone: torch, Lightning and scipy are not imported (each takes
seconds to import; the help takes well under one)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "lightning", "scipy")


@pytest.mark.parametrize("command", ["compare", "bench", "targets", "study", "lra", "list", "demo"])
def test_help_imports_no_heavy_module(command):
    code = (
        "import sys\n"
        "from experiments import cli\n"
        "try:\n"
        f"    cli.main([{command!r}, '--help'])\n"
        "except SystemExit as done:\n"
        "    assert done.code in (0, None), done.code\n"
        f"print('imported:', *(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: zoo" in result.stdout
    assert result.stdout.splitlines()[-1] == "imported:", f"zoo {command} --help: {result.stdout.splitlines()[-1]}"
