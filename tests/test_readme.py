"""The README is a guide that works: short, its Python blocks run, its links and the docs' links resolve, and its
set-up block still holds the test command CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_LINES = 300
#: the two set-up commands, byte for byte: CI (.ci/run) runs the second one verbatim
SETUP_COMMANDS = [
    'python3 -m pip install -e ".[test]" "torch==2.13.0" && zoo compare',
    'python3 -m pip install -e ".[test]" "torch==2.13.0" && python3 -m pytest -q',
]

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
# [text](target) outside code: the target up to a space or the closing parenthesis
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def fenced_blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def prose(text: str) -> str:
    """``text`` without fenced blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = anchor(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    """``file: target (why)`` for every relative link of ``path`` whose file, folder or heading does not exist."""
    broken = []
    for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file, _, fragment = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        name = f"{path.relative_to(REPO).as_posix()}: {target}"
        if not resolved.is_relative_to(REPO):
            broken.append(f"{name} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{name} (no such file or folder)")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{name} (no such heading)")
    return broken


def test_readme_is_at_most_300_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; a guide of at most {MAX_LINES}, the rest in docs/"


PYTHON_BLOCKS = fenced_blocks(README.read_text(encoding="utf-8"), "python")


def test_readme_has_python_blocks():
    assert PYTHON_BLOCKS, "README.md has no ```python block"


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    """Each block on its own, in a fresh namespace, in a scratch folder (a block may save a model)."""
    monkeypatch.chdir(tmp_path)
    exec(compile(PYTHON_BLOCKS[index], f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})


def test_links_of_the_readme_and_the_docs_resolve():
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    assert len(pages) > 1, "docs/ holds no page"
    broken = [line for page in pages for line in broken_links(page)]
    assert not broken, "links that resolve to nothing:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_docs_index():
    index = DOCS / "README.md"
    linked = {(DOCS / target.partition("#")[0]).resolve() for target in LINK.findall(prose(index.read_text()))}
    orphans = [p.name for p in sorted(DOCS.glob("*.md")) if p != index and p.resolve() not in linked]
    assert not orphans, f"docs pages not linked from docs/README.md: {orphans}"


def test_the_link_check_finds_a_missing_file_folder_and_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "results").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# A `zoo compare` page\n\n## The verdict rule\n\n"
        "[ok](../results/) [ok](#the-verdict-rule) [ok](#a-zoo-compare-page) [web](https://example.org/x.md)\n"
        "[gone](../results/none.csv) [no heading](page.md#the-rule) [out](../../x.md)\n"
        "`[code](not/a/link.md)`\n```bash\n[code](neither.md)\n```\n"
    )
    assert [line.split(": ")[1] for line in broken_links(page)] == [
        "../results/none.csv (no such file or folder)",
        "page.md#the-rule (no such heading)",
        "../../x.md (outside the repository)",
    ]


def test_the_setup_block_holds_the_two_commands_and_ci_runs_the_test_command():
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Set-up: two commands\n", 1)
    assert len(section) == 2, 'README.md has no "## Set-up: two commands" section'
    blocks = fenced_blocks(section[1].split("\n## ", 1)[0], "bash")
    assert len(blocks) == 1, f"the set-up section holds {len(blocks)} bash blocks; one is expected"
    commands = [line for line in blocks[0].splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands == SETUP_COMMANDS
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert SETUP_COMMANDS[1] in ci, ".ci/run no longer runs the README's test command verbatim"
