"""The committed results name no path of the machine they were made on: every path in them is relative to the
repository, so a reader's checkout resolves it, and nothing describes one machine's folders."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

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
    ("docs/training.md", "/tmp/zoo-measure"),
    ("docs/gpu.md", "/tmp/gpu-smoke"),
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


def test_no_committed_result_the_readme_or_the_docs_name_a_machine_path():
    files = sorted(p for p in RESULTS.rglob("*") if p.is_file()) + [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]
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
        "wrote /work/elsewhere/results/cpu_targets/sweep_paired/results.jsonl\n"
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
        "wrote results/cpu_targets/sweep_paired/results.jsonl",
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


# a command line in a README: ``python[3] -m dotted.module`` or ``python[3] some/path/script.py``
COMMAND = re.compile(r"\bpython3?\s+(?:-m\s+(?P<module>[\w.]+)|(?P<path>[\w./-]+\.py)\b)")


def code_lines(readme: Path) -> list[str]:
    """The lines of a Markdown file inside code: fenced blocks and blocks indented by four spaces."""
    lines, fenced = [], False
    for line in text_lines(readme):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            lines.append(line)
    return lines


def is_helper(script: Path, scripts: list[Path]) -> bool:
    """Whether another script under ``results/`` imports ``script`` as a module (then it produced no result itself)."""
    name = ".".join(script.relative_to(REPO).with_suffix("").parts)
    for other in scripts:
        tree = ast.parse(other.read_text(), str(other))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == name:
                return True
            if isinstance(node, ast.Import) and any(alias.name == name for alias in node.names):
                return True
    return False


def names(command: re.Match[str], script: Path) -> bool:
    """Whether a command line runs ``script``: as its module, or by a path whose last parts are the script's (a
    command may run from the folder it changes into, so leading ``./`` and ``../`` are not compared)."""
    relative = script.relative_to(REPO)
    if command["module"]:
        return command["module"] == ".".join(relative.with_suffix("").parts)
    parts = [part for part in command["path"].split("/") if part not in {"", ".", ".."}]
    return list(relative.parts[-len(parts) :]) == parts


def scripts_without_their_command() -> list[str]:
    """Every script under ``results/`` that no code line of the README nearest above it (in its folder or a
    parent folder inside ``results/``) runs, helper modules that other scripts import left aside."""
    results = REPO / "results"
    scripts = sorted(results.rglob("*.py"))
    missing = []
    for script in scripts:
        if is_helper(script, scripts):
            continue
        folder = script.parent
        while not (folder / "README.md").is_file() and folder != results:
            folder = folder.parent
        readme = folder / "README.md"
        lines = code_lines(readme) if readme.is_file() else []
        if not any(names(match, script) for line in lines for match in COMMAND.finditer(line)):
            missing.append(f"{script.relative_to(REPO).as_posix()} (nearest README: {readme.relative_to(REPO)})")
    return missing


def test_every_script_under_results_has_its_command_line_in_its_readme():
    """A script that produced a committed result lives beside it with the command that ran it, in a code block of
    the README of its folder (or of the nearest folder above it that has one)."""
    missing = scripts_without_their_command()
    assert not missing, "scripts without a command line in their README:\n" + "\n".join(missing)


def test_the_command_check_finds_a_script_without_its_command(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    folder = tmp_path / "results" / "study" / "probe"
    folder.mkdir(parents=True)
    for name in ("run.py", "ab.py", "shared.py", "cited_in_prose.py"):
        (folder / name).write_text("import results.study.probe.shared\n" if name == "ab.py" else "")
    (tmp_path / "results" / "study" / "README.md").write_text(
        "Made by `python cited_in_prose.py`, and:\n\n"
        "    cd results/study/probe && python ../probe/run.py --n 4\n"
        "\n```\npython -m results.study.probe.ab\n```\n"
    )
    assert scripts_without_their_command() == [
        "results/study/probe/cited_in_prose.py (nearest README: results/study/README.md)"
    ]


# a path of the results tree, as the README, the docs and the results' READMEs cite it from the repository root
RESULTS_PATH = re.compile(r"(?<![\w/.$<-])results/[\w./=+-]*")
# a Markdown link's target into the results tree, relative to the page: [sweep](../results/cpu_targets/sweep_paired/)
RESULTS_LINK = re.compile(r"\]\(((?:\.\./)*results/[^)\s#]*)")
# a path in backticks, relative to the README that cites it: `moba_flash/gate.py`, `../cpu_peers/`, `repeat2/`
RELATIVE_PATH = re.compile(r"`((?:\.\./)*[\w.=+-]+(?:/[\w.=+-]+)*(?:/|\.\w+))`")
# (README relative to the repository, cited text): placeholders and scratch folders, not committed paths
NOT_COMMITTED = {
    ("results/cpu_targets/README.md", "local_band/earlier_sweeps/sweepN.jsonl"),
    ("results/translation/README.md", "lr_probe/runs-LR.csv"),
    ("results/translation/README.md", "messages_lr_probe/runs-LR.csv"),
}


def missing_citations() -> list[str]:
    """``file:line: path`` for every cited results path that names nothing committed: ``results/...`` in the README,
    the docs and the results' READMEs, and a Markdown link into ``results/`` from its file; a relative path in
    backticks (containing a ``/``, not a ``runs/`` output folder) in a results README, looked for from its folder,
    every folder below it, ``results/`` and the repository root."""
    results = REPO / "results"
    readmes = sorted(results.rglob("README.md"))
    missing = []
    for file in [REPO / "README.md", *sorted(REPO.glob("docs/**/*.md")), *readmes]:
        if not file.is_file():
            continue
        name = file.relative_to(REPO).as_posix()
        below = [p.relative_to(file.parent).as_posix() for p in file.parent.rglob("*")] if file in readmes else []
        for number, line in enumerate(text_lines(file), 1):
            for match in RESULTS_PATH.finditer(line):
                cited = match.group(0).rstrip(".,;:")
                if not (REPO / cited).exists():
                    missing.append(f"{name}:{number}: {cited}")
            for match in RESULTS_LINK.finditer(line):
                if not (file.parent / match.group(1)).exists():
                    missing.append(f"{name}:{number}: {match.group(1)}")
            if file not in readmes:
                continue
            for match in RELATIVE_PATH.finditer(line):
                cited = match.group(1)
                # runs/...: where a command writes its outputs, never committed (a clean clone has none)
                if "/" not in cited or cited.startswith(("results/", "runs/")) or (name, cited) in NOT_COMMITTED:
                    continue
                bare = cited.rstrip("/")
                found = any((base / bare).exists() for base in (file.parent, results, REPO)) or any(
                    path == bare.removeprefix("./") or path.endswith("/" + bare) for path in below
                )
                if not found:
                    missing.append(f"{name}:{number}: {cited}")
    return missing


def test_every_results_path_a_readme_or_a_page_cites_exists():
    """A number quoted from a committed result keeps its link: every results path that the README, the docs and
    the results' READMEs cite names a committed file or folder (a renamed or pruned folder fails here)."""
    missing = missing_citations()
    assert not missing, f"{len(missing)} cited results paths name nothing committed:\n" + "\n".join(missing[:40])


def test_the_citation_check_finds_a_renamed_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    sweep = tmp_path / "results" / "targets" / "sweep_rounds" / "repeat2"
    sweep.mkdir(parents=True)
    (sweep / "targets.txt").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "performance.md").write_text(
        "See `results/targets/sweep_rounds/` and results/targets/sweep_2026-11-27/.\n"
        "[the rounds](../results/targets/sweep_rounds/repeat2/targets.txt), [one](../results/targets/sweep_1/)\n"
    )
    (tmp_path / "results" / "targets" / "README.md").write_text(
        "`sweep_rounds/repeat2/targets.txt`, `repeat2/`, `../targets/`, `sweep_2026-11-27_try/`, `a.b` and `x -> y`\n"
    )
    assert missing_citations() == [
        "docs/performance.md:1: results/targets/sweep_2026-11-27/",
        "docs/performance.md:2: ../results/targets/sweep_1/",
        "results/targets/README.md:1: sweep_2026-11-27_try/",
    ]


def test_the_ab_scripts_timing_loop_warms_up_once_and_interleaves_the_variants():
    from results.ab_timing import Timing, interleaved

    calls = []
    timings = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    assert calls == ["a", "b"] * 4  # one untimed warm-up round, then 3 timed rounds, each variant in turn
    assert [len(t.seconds) for t in timings.values()] == [3, 3] and [len(t.faults) for t in timings.values()] == [3, 3]
    assert Timing([0.004, 0.001, 0.003, 0.002], [5, 0, 7, 1]).text() == "min 1.0 median 3.0 ms, faults median 5"
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        interleaved({"a": lambda: None}, 0)
