"""The built wheel carries what the commands read at run time: ``zoo compare``'s default config and the task
config it names, every study's compare config and the task config each names (``configs/`` of the repository,
package data of ``experiments`` through the link ``experiments/configs``), and the installed code finds them
inside the installed package (``importlib.resources``), not next to it in a source tree."""

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
STUDY_CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "experiments" / "studies").rglob("*.yaml"))


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


def test_the_wheel_holds_the_default_compare_config_the_study_configs_and_the_task_configs_they_name(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    default = "experiments/configs/compare.yaml"
    assert default in names
    task = yaml.safe_load((ROOT / "configs" / "compare.yaml").read_text())["task_config"]
    assert posixpath.normpath(posixpath.join(posixpath.dirname(default), task)) in names
    task_configs = [f"experiments/configs/{path.name}" for path in (ROOT / "configs").glob("*.yaml")]
    assert STUDY_CONFIGS and {*STUDY_CONFIGS, *task_configs} <= names
    for study in STUDY_CONFIGS:
        task = yaml.safe_load((ROOT / study).read_text()).get("task_config")
        if task is not None:  # relative to the study's config, inside the installed package
            assert posixpath.normpath(posixpath.join(posixpath.dirname(study), task)) in names, study


def test_the_installed_commands_find_their_configs_inside_the_installed_package(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel, unpacked: what pip would install
    probe = f"""
import json, sys
import experiments
from experiments.compare import command
from experiments.studies import mlm
parser = command.build_parser()
studies = {{}}
for name in {STUDY_CONFIGS!r}:
    config = parser.parse_args(["--config", str(experiments.__path__[0] + "/" + name.split("/", 1)[1])])
    studies[name] = config.task_config.absolute if config.task_config else None
default = parser.parse_args(["--config", str(command.DEFAULT_CONFIG)])
print(json.dumps({{"package": experiments.__path__[0], "default": str(command.DEFAULT_CONFIG),
                  "task": default.task_config.absolute, "mlm": str(mlm.CONFIGS), "studies": studies}}))
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
    assert Path(found["mlm"]) == site / "experiments" / "studies" / "linformer_mlm"
    for study, task in found["studies"].items():
        if task is not None:
            assert Path(task).is_file() and Path(os.path.realpath(task)).is_relative_to(site), study
