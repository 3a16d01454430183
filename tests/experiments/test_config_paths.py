"""Configs by name from any folder (tasks/config_paths.py): ``-c recall`` and ``-c configs/recall.yaml`` read
the packaged config where the working folder has no such file; a file there wins; a name of no config is one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config_paths import ConfigNotFoundError, resolve_config

#: the repository's configs/, read here directly (not through the package's lookup under test)
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    ("value", "file"),
    [
        ("recall", "recall.yaml"),
        ("recall.yaml", "recall.yaml"),
        ("configs/recall.yaml", "recall.yaml"),
        ("./configs/recall.yaml", "recall.yaml"),
        ("bench/decoding", "bench/decoding.yaml"),
        ("configs/lra/lite/listops.yaml", "lra/lite/listops.yaml"),
    ],
)
def test_a_config_by_name_or_repository_path_resolves_from_any_folder(value, file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    resolved = Path(resolve_config(value))
    assert resolved.is_absolute() and resolved.is_file()
    assert resolved.read_bytes() == (REPO_CONFIGS / file).read_bytes()


def test_a_file_in_the_working_folder_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "recall.yaml").write_text("seed_everything: 7\n")
    (tmp_path / "mine.yaml").write_text("seed_everything: 8\n")
    assert resolve_config("configs/recall.yaml") == "configs/recall.yaml"
    assert resolve_config("mine.yaml") == "mine.yaml"
    assert resolve_config(str(tmp_path / "mine.yaml")) == str(tmp_path / "mine.yaml")
    assert Path(resolve_config("recall")).read_bytes() == (REPO_CONFIGS / "recall.yaml").read_bytes()  # not a file


@pytest.mark.parametrize(
    ("value", "suggestion"),
    [("recal", "'recall'"), ("configs/listop.yaml", "'listops'"), ("bench/decodng", "'bench/decoding'")],
)
def test_a_name_of_no_config_fails_in_one_line_with_the_closest_names(value, suggestion, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigNotFoundError) as caught:
        resolve_config(value)
    message = str(caught.value)
    assert "\n" not in message and repr(value) in message and f"did you mean {suggestion}" in message
    with pytest.raises(FileNotFoundError):  # callers that catch a missing file still do
        resolve_config("/no/such/dir/recall.yaml")  # an absolute path is never looked up among the packaged


def test_nothing_close_lists_the_packaged_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigNotFoundError, match=r"packaged: .*\brecall\b.*\bbench/\.\.\."):
        resolve_config("qqqqqq")


def test_zoo_fit_reads_a_packaged_config_by_name_and_dashed_flags(tmp_path, monkeypatch, capsys):
    from tasks import cli as fit_cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as printed:  # --print_config prints and exits 0
        fit_cli.run("fit", ["-c", "recall", "--trainer.max-steps", "3", "--print_config"])
    assert printed.value.code == 0
    text = capsys.readouterr().out
    assert "tasks.data.recall.AssociativeRecallDataModule" in text and "max_steps: 3" in text
    with pytest.raises(SystemExit):
        fit_cli.run("fit", ["--config=configs/recall.yaml", "--print_config"])
    assert "tasks.token_prediction.TokenPrediction" in capsys.readouterr().out


def test_zoo_fit_refuses_a_name_of_no_config_in_one_line(tmp_path, monkeypatch, capsys):
    from tasks import cli as fit_cli

    monkeypatch.chdir(tmp_path)
    assert fit_cli.run("fit", ["-c", "recal"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "zoo fit: error: -c recal: 'recal' is neither a file here nor a packaged config; did you mean 'recall'?"
    )
    assert not (tmp_path / "runs").exists()


def test_inline_configs_and_values_pass_unchanged():
    from tasks.cli import resolve_config_flags, underscored_flags

    inline = ["--config", "{trainer: {max_steps: 5}}"]
    assert resolve_config_flags(inline) == inline
    argv = ["--trainer.max-steps=5", "--model.attention-options", "{a-b: 1}", "-1", "--print_config"]
    assert underscored_flags(argv) == ["--trainer.max_steps=5", "--model.attention_options", "{a-b: 1}", "-1",
                                       "--print_config"]  # fmt: skip


def test_zoo_bench_config_by_name(tmp_path, monkeypatch, capsys):
    from experiments.bench.command import build_parser

    monkeypatch.chdir(tmp_path)
    config = build_parser().parse_args(["--config", "bench/decoding"]).config
    assert Path(config).read_bytes() == (REPO_CONFIGS / "bench" / "decoding.yaml").read_bytes()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", "bench/decodng"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'bench/decoding'?" in err
