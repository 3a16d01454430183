"""The committed results name no path of the machine they were made on: every path in them is relative to the
repository, so a reader's checkout resolves it, and nothing describes one machine's folders."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from tools.relative_paths import relative

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
# an absolute path starts its token (not inside a relative path or a URL) and names a machine's own folders
MACHINE_PATH = re.compile(
    r"(?<![\w.~/-])(?:/work/|/tmp/|/home/|/root/|/opt/|/Users/|/usr/lib/python|/usr/local/lib/python)"
    r"|/(?:site|dist)-packages\b"
)
# (file relative to the repository, text of the line): example commands that name a scratch folder on purpose
ALLOWED = {
    ("README.md", "/tmp/zoo-measure"),
    ("README.md", "/tmp/gpu-smoke"),
}


def text_lines(path: Path) -> list[str]:
    raw = path.read_bytes()
    if b"\0" in raw:
        return []
    try:
        return raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return []


def machine_paths(files: list[Path]) -> list[str]:
    """``file:line: text`` for every line of ``files`` that names a machine path and is not in ``ALLOWED``."""
    found = []
    for path in files:
        name = path.relative_to(REPO).as_posix()
        for number, line in enumerate(text_lines(path), 1):
            match = MACHINE_PATH.search(line)
            if match and not any(name == file and text in line for file, text in ALLOWED):
                found.append(f"{name}:{number}: {line.strip()[:160]}")
    return found


def test_no_committed_result_or_the_readme_names_a_machine_path():
    files = sorted(p for p in RESULTS.rglob("*") if p.is_file()) + [REPO / "README.md"]
    found = machine_paths(files)
    assert not found, f"{len(found)} lines name an absolute machine path:\n" + "\n".join(found[:40])


def test_the_check_finds_each_kind_of_machine_path(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    log = tmp_path / "fit.log"
    log.write_text(
        "/opt/torch/.venv/lib/python3.12/site-packages/lightning/trainer.py:4: warning\n"
        "see https://example.org/home/page and runs/tmp/x (relative), <site-packages>/torch/x.py\n"
        '{"config": "/work/checkout/runs/a/config.yaml"}\n'
        "/tmp/w/run-1/tasks/data/base.py:351: UserWarning\n"
    )
    assert [line.split(":")[1] for line in machine_paths([log])] == ["1", "3", "4"]


def test_the_rewriting_tool_leaves_nothing_the_check_finds(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    text = (
        "/opt/torch/.venv/lib/python3.12/site-packages/lightning/trainer.py:4: warning\n"
        '  "executable": "/opt/torch/.venv/bin/python3",\n'
        "/root/.pyenv/versions/3.11.7/lib/python3.11/warnings.py:1\n"
        "/tmp/w/full-s1/tasks/data/base.py:351: UserWarning: dropped 6 of 1990 val pairs\n"
        "task_config: /work/elsewhere/configs/mlm.yaml\n"
        "/tmp/site/xformers/ops/fmha/dispatch.py:83: NotImplementedError\n"
        "locale_dir: /usr/share/locale\n"
    )
    log = tmp_path / "test.log"
    log.write_text(relative(text))
    assert machine_paths([log]) == []
    assert log.read_text().splitlines() == [
        "<site-packages>/lightning/trainer.py:4: warning",
        '  "executable": "python3",',
        "<python>/warnings.py:1",
        "tasks/data/base.py:351: UserWarning: dropped 6 of 1990 val pairs",
        "task_config: configs/mlm.yaml",
        "<site-packages>/xformers/ops/fmha/dispatch.py:83: NotImplementedError",
        "locale_dir: /usr/share/locale",
    ]


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_every_script_a_committed_result_runs_exists():
    """A command in a result's README or output names a script of this checkout (from the repository root, the
    file's folder, or a folder beside it that the command changes into), unless it checks out the commit it ran at."""
    command = re.compile(r"\bpython3?\s+(?:-m\s+([\w.]+)|([\w./-]+\.py)\b)")
    missing = []
    for path in sorted(RESULTS.rglob("*")):
        if path.suffix not in {".md", ".txt", ".sh", ".py"}:
            continue
        bases = [REPO, path.parent, *(p for p in path.parent.iterdir() if p.is_dir())]
        for number, line in enumerate(text_lines(path), 1):
            if "git checkout" in line:
                continue
            for match in command.finditer(line):
                module, script = match.groups()
                found = module_exists(module) if module else any((base / script).is_file() for base in bases)
                if not found:
                    missing.append(f"{path.relative_to(REPO).as_posix()}:{number}: {match.group(0)}")
    assert not missing, "commands name scripts that do not exist:\n" + "\n".join(missing)
