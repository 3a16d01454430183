"""The built wheel carries every config of ``configs/`` (package data of ``experiments`` through the link
``experiments/configs``): ``zoo compare``'s default and the task config it names, the task configs, the bench
sweeps (``configs/bench/``), every study's compare config (``configs/studies/<study>/``) and the task config each
names; and the installed code finds them inside the installed package (``importlib.resources``), not next to it
in a source tree."""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
#: what setuptools reads to build the wheel (pyproject.toml names README.md as the readme)
SOURCES = ("pyproject.toml", "README.md", "configs", "attention_zoo", "tasks", "experiments")
#: every config, as a path inside configs/ (and so inside experiments/configs/ of the installed package)
CONFIGS = sorted(p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml"))
STUDY_CONFIGS = [name for name in CONFIGS if name.startswith("studies/")]
BENCH_CONFIGS = [name for name in CONFIGS if name.startswith("bench/")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built (no network: the installed setuptools) from a copy of the sources, so the build leaves
    nothing (build/, *.egg-info) in the working tree."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "results")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q"]
    result = subprocess.run([*command, "-w", str(root / "dist")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = (root / "dist").glob("attention_zoo-*.whl")
    return built


def test_the_wheel_holds_every_config_and_the_task_configs_the_compare_configs_name(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert STUDY_CONFIGS and BENCH_CONFIGS and "compare.yaml" in CONFIGS
    assert {f"experiments/configs/{name}" for name in CONFIGS} <= names
    for name in ["compare.yaml", *STUDY_CONFIGS]:
        task = yaml.safe_load((ROOT / "configs" / name).read_text()).get("task_config")
        if task is not None:  # relative to the compare config, inside the installed package
            installed = posixpath.dirname(f"experiments/configs/{name}")
            assert posixpath.normpath(posixpath.join(installed, task)) in names, name


def test_the_installed_commands_find_their_configs_inside_the_installed_package(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel, unpacked: what pip would install
    probe = f"""
import json, sys
import experiments
from experiments.bench.cases import load_config
from experiments.compare import flags
from experiments.studies import mlm
parser = flags.build_parser()
studies = {{}}
for name in {STUDY_CONFIGS!r}:
    config = parser.parse_args(["--config", str(flags.CONFIGS / name)])
    studies[name] = config.task_config.absolute if config.task_config else None
bench = {{name: load_config(flags.CONFIGS / name, {{}}).seq_lens for name in {BENCH_CONFIGS!r}}}
default = parser.parse_args(["--config", str(flags.DEFAULT_CONFIG)])
print(json.dumps({{"package": experiments.__path__[0], "default": str(flags.DEFAULT_CONFIG),
                  "task": default.task_config.absolute, "mlm": str(mlm.CONFIGS), "studies": studies,
                  "bench": bench}}))
"""
    env = os.environ | {"PYTHONPATH": str(site)}
    # run outside the source tree: only the unpacked wheel provides experiments, tasks and attention_zoo
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["package"] == str(site / "experiments")
    assert Path(found["default"]) == site / "experiments" / "configs" / "compare.yaml"
    task = Path(os.path.realpath(found["task"]))
    assert task.is_file() and task.is_relative_to(site) and task.parent == site / "experiments" / "configs"
    assert Path(found["mlm"]) == site / "experiments" / "configs" / "studies" / "linformer_mlm"
    assert sorted(found["studies"]) == STUDY_CONFIGS and sorted(found["bench"]) == BENCH_CONFIGS
    for study, task in found["studies"].items():
        assert task is not None and Path(task).is_file(), study
        assert Path(os.path.realpath(task)).is_relative_to(site), study
    assert all(found["bench"].values())
