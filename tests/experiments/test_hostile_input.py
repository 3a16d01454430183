"""Hostile input and faults: every case ends in one line that names the bad value and what is
allowed, with the exit code, the files left afterwards and nothing earlier lost checked. CLI cases run
``zoo`` in a subprocess (``python -m experiments.cli``); their variants, and the library cases, run
in-process. One tiny trained checkpoint serves the whole module."""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

import attention_zoo as az
from experiments.bench import command as bench
from experiments.bench.cases import BenchConfig, invalid_entries, load_config
from experiments.compare import command as compare
from tasks.base import ConfigError, read_checkpoint
from tasks.cli import check_training_length
from tasks.data.base import DataError
from tasks.data.text import TextClassificationDataModule, normalise_label
from tasks.data.tokenize import SPECIAL_TOKENS, TextTokenizer
from tests.attention_zoo.registry_cases import build, case_id, cases, causal_modes, plain_causal, qkv

ROOT = Path(__file__).resolve().parents[2]
RECALL = ["-c", str(ROOT / "configs" / "recall.yaml"), "--data.seq_len", "32", "--data.num_kv_pairs", "4"]
RECALL += ["--data.vocab_size", "32", "--data.train_size", "32", "--data.val_size", "8", "--data.test_size", "8"]
TEXT = ["-c", str(ROOT / "configs" / "text.yaml"), "--data.data_dir", "null", "--data.max_seq_len", "32"]
TINY = [
    "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--trainer.accelerator", "cpu", "--model.dim", "16", "--model.depth", "1", "--model.heads", "2",
    "--data.batch_size", "8",
]  # fmt: skip


def zoo(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    """``zoo <args>`` from this worktree, one torch thread, the given data cache."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ZOO_CACHE": str(cache)}
    command = [sys.executable, "-m", "experiments.cli", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def one_line_error(result: subprocess.CompletedProcess, command: str) -> str:
    """The error line of a refused command: exit code 2, no traceback, the last stderr line is the error."""
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"zoo {command}: error: "), result.stderr[-2000:]
    return last


def runs_in(save_dir: Path) -> list[Path]:
    return sorted(save_dir.rglob("version_*")) if save_dir.exists() else []


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """A ``full`` recall run of two steps: its checkpoint, its save_dir and a data cache."""
    root = tmp_path_factory.mktemp("trained")
    runs = root / "runs"
    result = zoo(["fit", *RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(runs)], root / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = runs / "recall" / "full" / "version_0" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file()
    return {"checkpoint": checkpoint, "runs": runs, "cache": root / "cache", "root": root}


@pytest.fixture(scope="module")
def broken_checkpoints(trained) -> dict[str, Path]:
    """An empty file, the first 3000 bytes of the real checkpoint, and random bytes."""
    folder = trained["root"] / "broken"
    folder.mkdir()
    (folder / "empty.ckpt").write_bytes(b"")
    (folder / "truncated.ckpt").write_bytes(trained["checkpoint"].read_bytes()[:3000])
    (folder / "random.ckpt").write_bytes(random.Random(0).randbytes(5000))
    return {path.stem: path for path in folder.iterdir()}


# --- zoo bench ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--memory-budget-gb", "-1"], ["memory_budget_gb must be a number > 0", "got -1.0"]),
        (["--seq-lens", "0,-5"], ["seq_lens: [0, -5] must be >= 1"]),
        (["--dtypes", "float8"], ["dtypes: ['float8'] not among float32, bfloat16, float16"]),
        (
            ["--attentions", "full,linformer:k=abc,local:window=7", "--seq-lens", "64"],
            ["2 invalid attention entries, nothing was run", "linformer:k=abc:", "k='abc' is not a valid int",
             "local:window=7:", "window must be an even int >= 2", "got 7"],
        ),
    ],
    ids=["negative-memory-budget", "non-positive-lengths", "float8", "bad-options"],
)  # fmt: skip
def test_bench_refuses_a_bad_sweep_before_running_anything(flags, expected, tmp_path):
    out = tmp_path / "bench"
    result = zoo(["bench", *flags, "--out", str(out)], tmp_path / "cache")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.startswith("zoo bench: error: ")
    for text in expected:
        assert text in result.stderr
    assert not out.exists()  # nothing measured, nothing written (the baseline did not run first)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"memory_budget_gb": 0.0}, "memory_budget_gb must be a number > 0 (or unset for the default), got 0.0"),
        ({"memory_budget_gb": float("nan")}, "memory_budget_gb must be a number > 0"),
        ({"seq_lens": []}, "seq_lens is empty: the sweep would run no case"),
        ({"heads": [2, 0]}, "heads: [0] must be >= 1"),
        ({"seq_lens": 512}, "seq_lens must be a list of int, got 512"),
        ({"batch": [True]}, "batch must be int, got True"),
        ({"depth": 0}, "depth must be >= 1, got 0"),
        ({"case_timeout_s": -1.0}, "case_timeout_s must be a number > 0, got -1.0"),
        ({"max_batch": True, "isolation": "none"}, "the max-batch search needs isolation: process"),
    ],
)
def test_bench_settings_are_checked_by_type_and_range(changes, expected):
    with pytest.raises(ValueError) as error:
        BenchConfig(**changes)
    assert expected in str(error.value)


def test_bench_entries_refused_only_when_no_size_of_the_sweep_accepts_them():
    # Linformer's k must not exceed n: k=128 is fine for the n=256 cases (n=64 is recorded per case)
    sized = [az.AttentionSpec("linformer", {"k": 128})]
    assert invalid_entries(BenchConfig(attentions=sized, seq_lens=[64, 256], heads=[2], dim_head=[8])) == []
    (problem,) = invalid_entries(BenchConfig(attentions=sized, seq_lens=[64], heads=[2], dim_head=[8]))
    assert problem.startswith("linformer:k=128: ") and "k=128 must be in [1, max_seq_len=64]" in problem
    unknown = invalid_entries(BenchConfig(attentions=[az.AttentionSpec("linformr")], seq_lens=[64]))
    known = ", ".join(az.list_attentions())
    assert unknown == [f"linformr: unknown attention 'linformr'; known: {known}; did you mean 'linformer'?"]


def test_bench_sweep_of_no_case_is_refused(tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("attentions:\n  - {attention: full, min_seq_len: 1024}\nseq_lens: [64, 128]\n")
    out = tmp_path / "bench"
    assert bench.main(["--config", str(sweep), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert "the sweep has no case: no attention applies to seq_lens [64, 128] (full [1024, any])" in error
    assert bench.main(["--check-targets", "--attentions", "sparse", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert "no performance target for ['sparse']; targets exist for: cosformer, gated_deltanet, linear," in error
    sweep.write_text("seq_lens: [64\n")
    assert bench.main(["--config", str(sweep), "--out", str(out)]) == 2  # YAML that does not parse
    assert capsys.readouterr().err.startswith("zoo bench: error: ")
    assert not out.exists()
    sweep.write_text("- full\n")
    with pytest.raises(ValueError, match="expected a mapping of settings, got list"):
        load_config(sweep, {})


# --- checkpoints --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["missing", "truncated"])
def test_unreadable_ckpt_path_is_one_line_and_leaves_no_run_folder(kind, trained, broken_checkpoints, tmp_path):
    path = broken_checkpoints.get(kind, tmp_path / "missing.ckpt")
    runs = tmp_path / "runs"
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(runs), "--ckpt_path", str(path)]
    line = one_line_error(zoo(["fit", *args], trained["cache"]), "fit")
    assert repr(str(path)) in line
    assert ("no checkpoint file at" if kind == "missing" else "is not a readable checkpoint") in line
    assert runs_in(runs) == []  # no empty run folder left behind


@pytest.mark.parametrize(
    ("kind", "reason"),
    [("empty", "the file is empty"), ("truncated", "not a torch checkpoint, or truncated"),
     ("random", "not a torch checkpoint, or truncated")],
)  # fmt: skip
def test_broken_checkpoint_files_are_named_with_the_reason(kind, reason, broken_checkpoints):
    path = broken_checkpoints[kind]
    with pytest.raises(ConfigError) as error:
        read_checkpoint(path, "--ckpt_path")
    message = str(error.value)
    assert message.startswith(f"--ckpt_path: {str(path)!r} is not a readable checkpoint ({reason}")
    assert "\n" not in message


def test_files_that_are_no_lightning_checkpoint_are_named(tmp_path):
    plain = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, plain)
    with pytest.raises(
        ConfigError, match=r"^init_from: '.*weights.pt' is not a Lightning checkpoint \(no 'state_dict'\)$"
    ):
        read_checkpoint(plain, "init_from")
    with pytest.raises(ConfigError, match=r"^--ckpt_path: no checkpoint file at '.*' \(a directory\)$"):
        read_checkpoint(tmp_path, "--ckpt_path")


def test_init_from_a_random_file_is_one_line(trained, broken_checkpoints, tmp_path):
    runs = tmp_path / "runs"
    path = broken_checkpoints["random"]
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(runs), "--model.init_from", str(path)]
    line = one_line_error(zoo(["fit", *args], trained["cache"]), "fit")
    assert f"init_from: {str(path)!r} is not a readable checkpoint" in line
    assert runs_in(runs) == []


def test_checkpoint_of_another_attention_is_refused_naming_both(trained, tmp_path):
    runs = tmp_path / "runs"
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(runs), "--ckpt_path", str(trained["checkpoint"])]
    line = one_line_error(zoo(["test", *args, "--model.attention", "local"], trained["cache"]), "test")
    assert "was trained with attention 'full' options {}" in line
    assert "configured with attention 'local'" in line
    assert line.endswith("to use this checkpoint, pass --model.attention full --model.attention_options '{}'")
    assert runs_in(runs) == []
    assert trained["checkpoint"].is_file()  # the checkpoint is untouched


def test_a_checkpoint_of_another_vocabulary_names_the_datas(trained, tmp_path):
    runs = tmp_path / "runs"
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(runs), "--ckpt_path", str(trained["checkpoint"])]
    line = one_line_error(zoo(["test", *args, "--data.vocab_size", "48"], trained["cache"]), "test")
    assert "vocab_size 48 from the data (checkpoint: 32)" in line
    assert line.endswith("test it on data of the checkpoint's vocabulary and sizes (nothing was written)")
    assert runs_in(runs) == []


def test_a_size_flag_that_the_checkpoint_overrides_is_named(trained, tmp_path):
    runs = tmp_path / "runs"
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(runs), "--ckpt_path", str(trained["checkpoint"])]
    args += ["--model.dim", "32", "--trainer.limit_test_batches", "1"]
    result = zoo(["test", *args], trained["cache"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("zoo test: warning: ignored --model.dim 32 (checkpoint: 16): the model is built with the sizes saved in "
            "--ckpt_path") in result.stderr  # fmt: skip


@pytest.mark.parametrize(("ckpt", "expected"), [("best", "--ckpt_path best: zoo test starts no training"),
                                                ("last", "--ckpt_path last: no run under ")])  # fmt: skip
def test_test_without_a_checkpoint_to_test_is_refused(ckpt, expected, trained, tmp_path):
    """``best`` was Lightning's traceback; ``last`` with no run tested an untrained model and left a run folder."""
    runs = tmp_path / "runs"
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(runs), "--ckpt_path", ckpt]
    line = one_line_error(zoo(["test", *args], trained["cache"]), "test")
    assert expected in line and "name a checkpoint file" in line
    assert not runs.exists()


def test_a_test_refused_inside_the_trainer_leaves_no_run_folder(trained, tmp_path):
    runs = tmp_path / "runs"
    (runs / "earlier").mkdir(parents=True)
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(runs)]
    args += ["--model", "tasks.classification.SequenceClassification"]  # per-sequence task, per-token data
    line = one_line_error(zoo(["test", *args], trained["cache"]), "test")
    assert "SequenceClassification trains on per-sequence labels" in line
    assert sorted(p.name for p in runs.iterdir()) == ["earlier"]  # the run's folders went; nothing earlier did


def test_a_negative_seed_is_one_line(trained, tmp_path):
    runs = tmp_path / "runs"
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(runs), "--seed_everything", "-3"]
    line = one_line_error(zoo(["fit", *args], trained["cache"]), "fit")
    assert line.endswith("--seed_everything -3: a seed must be an int in [0, 4294967295] (or true for a random one)")
    assert runs_in(runs) == []


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--model.dimm", "8"], "--model.dimm: TokenPrediction has no option 'dimm'; did you mean --model.dim?"),
        (["--data.seq_lenn", "8"], "--data.seq_lenn: AssociativeRecallDataModule has no option 'seq_lenn'; "
                                   "did you mean --data.seq_len?"),
        (["--model.attention_options", "[1, 2]"], "--model.attention_options [1, 2]: expected dict[str, Any] or null"),
        (["--model.dim", "abc"], "--model.dim abc: expected int"),
        (["--trainer.max_stepz", "3"], "unrecognized argument --trainer.max_stepz; did you mean --trainer.max_steps "
                                       "or --trainer.max_time or --trainer.min_steps?"),
    ],
    ids=["model-key", "data-key", "options-list", "type", "trainer-key"],
)  # fmt: skip
def test_a_parser_error_is_one_line_with_the_full_message_under_verbose(flags, expected, trained, tmp_path):
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *flags]
    result = zoo(["fit", *args], trained["cache"])
    line = one_line_error(result, "fit")
    assert line == f"zoo fit: error: {expected} (--verbose or ZOO_VERBOSE=1: the parser's full message)"
    assert len(result.stderr.strip().splitlines()) == 1  # no usage, no nested Union dump
    verbose = zoo(["fit", *args, "--verbose"], trained["cache"])
    assert one_line_error(verbose, "fit") == f"zoo fit: error: {expected}"
    assert "Parser key" in verbose.stderr or "unrecognized arguments" in verbose.stderr


# --- training length and save directory ---------------------------------------------------------------


def test_max_steps_0_is_refused(trained, tmp_path):
    runs = tmp_path / "runs"
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(runs), "--trainer.max_steps", "0"]
    line = one_line_error(zoo(["fit", *args], trained["cache"]), "fit")
    assert "--trainer.max_steps 0: a run would stop before its first step" in line and "max_steps >= 1" in line
    assert runs_in(runs) == []


@pytest.mark.parametrize(("max_steps", "max_epochs", "bad"), [(-1, 0, "max_epochs"), (-2, None, "max_steps")])
def test_training_length_limits(max_steps, max_epochs, bad):
    with pytest.raises(ConfigError, match=f"--trainer.{bad} "):
        check_training_length(Namespace(max_steps=max_steps, max_epochs=max_epochs))
    check_training_length(Namespace(max_steps=-1, max_epochs=None))  # Lightning's defaults: no step limit
    check_training_length(Namespace(max_steps=5, max_epochs=-1))


def test_save_dir_that_is_a_file_is_one_line(trained, tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("earlier content\n")
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(blocker / "nested")]
    line = one_line_error(zoo(["fit", *args], trained["cache"]), "fit")
    assert f"save_dir {str(blocker / 'nested')!r}" in line and f"{str(blocker)!r} is a file, not a directory" in line
    assert blocker.read_text() == "earlier content\n"  # nothing earlier lost


def unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process cannot create files in: a read-only folder, or (for root, whom permission
    bits do not stop) a sysfs directory."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    for candidate in (folder, Path("/sys")):
        try:
            tempfile.TemporaryFile(dir=candidate).close()
        except OSError:
            return candidate
    pytest.skip("no directory here refuses this process a new file")


def test_unwritable_save_dir_is_one_line(trained, tmp_path):
    target = unwritable_directory(tmp_path) / "runs"
    args = [*RECALL, *TINY, "--trainer.logger.init_args.save_dir", str(target)]
    line = one_line_error(zoo(["fit", *args], trained["cache"]), "fit")
    assert f"save_dir {str(target)!r}: cannot write in {str(target.parent)!r}" in line
    assert not target.exists()


# --- token ids ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [10, -1])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_token_ids_outside_the_vocabulary_are_named(kind, bad):
    sizes = dict(vocab_size=10, dim=8, depth=1, heads=2, max_seq_len=8)
    config = az.ModelConfig(**sizes)
    model = az.TransformerEncoder(config) if kind == "encoder" else az.TransformerDecoder(config)
    run = (lambda t: model(t)) if kind == "encoder" else (lambda t: model(t, torch.zeros(1, 3, 8)))
    assert run(torch.tensor([[0, 9, 3]])).shape == (1, 3, 8)  # both ends of the vocabulary are fine
    with pytest.raises(ValueError, match=rf"token id {bad} is out of range for vocab_size=10: ids must be in \[0, 9\]"):
        run(torch.tensor([[0, bad, 3]]))
    with pytest.raises(ValueError, match="tokens must be integer ids"):
        run(torch.tensor([[0.0, 1.0]]))


# --- text data ----------------------------------------------------------------------------------------

ROWS = [(f"{'great lovely' if i % 2 else 'awful boring'} film {i}", i % 2) for i in range(24)]


def write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def text_module(tmp_path: Path, train_file: Path, **options) -> TextClassificationDataModule:
    return TextClassificationDataModule(train_file=str(train_file), max_seq_len=64, cache_dir=str(tmp_path / "cache"),
                                        **options)  # fmt: skip


def train_texts(module: TextClassificationDataModule) -> list[str]:
    return [text for split in ("train", "val", "test") for text, _ in module.records(split)]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("null.jsonl", "line 7: the text is empty (missing, null or ''); fix the row, or set empty_text='skip'"),
        ("broken.jsonl", "line 9: not valid JSON (Expecting value, column 10)"),
        ("latin1.csv", "line 7: not valid utf-8 (byte 0xe9: invalid continuation byte); set the data module's "
                       "encoding to the file's, e.g. encoding='latin-1'"),
        ("empty.csv", "line 5: the text is empty (missing, null or '')"),
    ],
)  # fmt: skip
def test_bad_text_files_are_one_line_naming_file_and_line(name, expected, trained, tmp_path):
    path = tmp_path / name
    if name == "null.jsonl":
        write_jsonl(path, [{"text": None if i == 6 else t, "label": label} for i, (t, label) in enumerate(ROWS)])
    elif name == "broken.jsonl":
        write_jsonl(path, ['{"text": ' if i == 8 else {"text": t, "label": label} for i, (t, label) in enumerate(ROWS)])
    elif name == "latin1.csv":
        lines = [f"{t},{label}".encode() for t, label in ROWS]
        lines[5] = "café au lait,1".encode("latin-1")
        path.write_bytes(b"text,label\n" + b"\n".join(lines) + b"\n")
    else:
        path.write_text("text,label\n" + "".join(f"{'' if i in (3, 9) else t},{label}\n" for i, (t, label) in
                                                 enumerate(ROWS)))  # fmt: skip
    runs = tmp_path / "runs"
    args = [*TEXT, *TINY, "--trainer.logger.init_args.save_dir", str(runs), "--data.train_file", str(path)]
    line = one_line_error(zoo(["fit", *args], trained["cache"]), "fit")
    assert f"{str(path)!r} {expected}" in line
    assert runs_in(runs) == []


def test_empty_texts_can_be_skipped_and_are_counted(tmp_path):
    rows = [{"text": t, "label": label} for t, label in ROWS]
    rows[2]["text"], rows[5]["text"] = None, ""
    path = write_jsonl(tmp_path / "gaps.jsonl", rows)
    with pytest.warns(UserWarning, match=r"skipped 2 empty text\(s\) in '.*gaps.jsonl' \(empty_text='skip'\): "
                                         r"line 3, line 6"):  # fmt: skip
        module = text_module(tmp_path, path, empty_text="skip")
    assert sorted(train_texts(module)) == sorted(r["text"] for r in rows if r["text"])
    assert "None" not in train_texts(module)  # a null text never becomes the string "None"
    with pytest.raises(ValueError, match="empty_text must be 'error' or 'skip'; got 'drop'"):
        text_module(tmp_path, path, empty_text="drop")


def test_csv_line_numbers_count_physical_lines(tmp_path):
    # a quoted text spanning three lines, then a blank-text row: its line is 6, not data row 3
    path = tmp_path / "multi.csv"
    path.write_text('text,label\nfirst,0\n"one\ntwo\nthree",1\n,0\nlast,1\n')
    with pytest.raises(DataError, match=r"'.*multi.csv' line 6: the text is empty"):
        text_module(tmp_path, path)


def test_jsonl_line_numbers_count_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "gaps.jsonl", [{"text": "a", "label": 0}, "", "", {"text": "b", "label": 1}, "[1]"])
    with pytest.raises(DataError, match=r"'.*gaps.jsonl' line 5: expected a JSON object \{...\}, got list"):
        text_module(tmp_path, path)
    write_jsonl(path, [{"text": "a", "label": 0}, {"text": 42, "label": 1}])
    with pytest.raises(DataError, match=r"line 2: the text must be a string, got int 42"):
        text_module(tmp_path, path)
    write_jsonl(path, [{"text": "a", "label": 0}, {"text": "b", "label": [1]}])
    with pytest.raises(DataError, match=r"line 2: 'label' must be a string or a number, got list"):
        text_module(tmp_path, path)


def test_encoding_option_reads_latin1_and_binary_data_is_named(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("text,label\ncafé au lait,1\nthé noir,0\nun verre d'eau,1\n".encode("latin-1"))
    module = text_module(tmp_path, path, encoding="latin-1", val_fraction=0.0, test_fraction=0.0)
    assert sorted(text for text, _ in module.records("train")) == ["café au lait", "thé noir", "un verre d'eau"]
    with pytest.raises(ValueError, match="unknown encoding 'latin-9000'; give a Python codec name"):
        text_module(tmp_path, path, encoding="latin-9000")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"text": "a", "label": 0}\n\x00\x01\x02\n')
    with pytest.raises(DataError, match=r"'.*binary.jsonl' line 2: a NUL character: binary data, not utf-8 text"):
        text_module(tmp_path, binary)


def test_numeric_label_spellings_are_one_label(tmp_path):
    ones = [" 1", "1.0", 1, "1"]
    rows = [
        {"text": t, "label": ones[i // 2 % 4] if label else [0, "0"][i // 2 % 2]} for i, (t, label) in enumerate(ROWS)
    ]
    path = write_jsonl(tmp_path / "spellings.jsonl", rows)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = text_module(tmp_path, path)
    assert module.label_names == ["0", "1"] and module.num_classes == 2
    merged = [str(w.message) for w in caught if "differently spelled labels" in str(w.message)]
    assert len(merged) == 1 and "' 1', '1', '1.0', 1 -> '1'" in merged[0] and "'0', 0 -> '0'" in merged[0]
    module.prepare_data()
    labels = torch.cat([module.load_split(split).labels for split in ("train", "val", "test")])
    assert sorted(labels.tolist()) == sorted(label for _, label in ROWS)  # every row kept its class
    assert text_module(tmp_path, path, labels=[0, "1.0"]).label_names == ["0", "1"]


@pytest.mark.parametrize(
    ("value", "label"),
    [(" 1", "1"), ("1.0", "1"), (1, "1"), (1.0, "1"), ("-2", "-2"), ("0.50", "0.5"), ("1e3", "1000"),
     (" pos ", "pos"), ("nan", "nan"), ("12345678901234567890", "12345678901234567890")],
)  # fmt: skip
def test_normalise_label(value, label):
    assert normalise_label(value) == label


def test_a_trained_vocabulary_larger_than_asked_is_a_data_error(tmp_path):
    texts = ["".join(chr(0x4E00 + i + j) for j in range(5)) for i in range(0, 400, 5)]  # 400 distinct characters
    with pytest.raises(DataError, match=r"the trained wordpiece vocabulary has \d+ tokens .* more than "
                                        r"tokenizer_vocab_size=300; raise it"):  # fmt: skip
        TextTokenizer.train("wordpiece", texts, 300)


def test_byte_tokenizer_encodes_an_empty_text_as_no_tokens():
    empty, word = TextTokenizer().encode(["", "ab"])
    assert empty.shape == (0,) and empty.dtype == torch.long
    assert word.tolist() == [ord("a") + len(SPECIAL_TOKENS), ord("b") + len(SPECIAL_TOKENS)]


# --- library: every registered mechanism --------------------------------------------------------------

CASES = cases()


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_a_nan_input_is_never_hidden(case, where):
    """Defect 1 for every core (lsh once hid it): a NaN in one real position of q makes that query's scores
    NaN, so its output is NaN; a NaN in k or v at a real position j reaches at least the outputs that see
    j (every core lets some query see each real key). The other batch item stays finite."""
    name, options = case
    core = build(name, options)
    for causal in causal_modes(name):
        q, k, v = qkv(core, 2, 32)
        poisoned = {"q": q, "k": k, "v": v}[where].clone()
        poisoned[0, 0, 3, 0] = math.nan
        args = {"q": q, "k": k, "v": v, where: poisoned}
        if core.needs_shared_qk and where != "v":
            args["q"] = args["k"] = poisoned  # shared QK: one tensor is both
        out = core(args["q"], args["k"], args["v"], causal=causal)
        assert out[0].isnan().any(), f"{where}: the NaN vanished (causal={causal})"
        if where == "q" or (where == "k" and core.needs_shared_qk):
            assert out[0, 0, 3].isnan().all(), f"query 3's own output is not NaN (causal={causal})"
        assert torch.isfinite(out[1]).all(), f"the NaN leaked into another batch item (causal={causal})"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [3, 8, 15, 16])
@pytest.mark.parametrize(
    "name, options", [("full", {"backend": "sdpa"}), ("full", {"backend": "math"}), ("linformer", {"k": 4})]
)
def test_a_nan_query_stays_nan_over_few_keys(name, options, n, causal):
    """Torch's CPU SDPA without a mask returns 0 for a NaN query row over fewer than 16 keys (torch 2.13):
    short sequences through full attention, and Linformer's few projected slots, must not inherit that."""
    core = az.create_attention(name, dim_head=8, heads=2, max_seq_len=32, **options).eval()
    if causal and not core.supports_causal:
        pytest.skip("not causal")
    q, k, v = (torch.randn(2, 2, n, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))
    q[0, 0, 1, 0] = math.nan
    out = core(q, k, v, causal=causal)
    assert out[0, 0, 1].isnan().all() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_a_core_with_float32_weights_runs_under_autocast_as_its_error_suggests(case):
    """fp16/bf16 input to a float32 core is refused with "build the core in the inputs' dtype ... or run
    it under torch.autocast"; the second way must then work (CPU autocast: bfloat16)."""
    name, options = case
    core = build(name, options, torch.float32)
    if not any(t.is_floating_point() for t in (*core.parameters(), *core.buffers())):
        pytest.skip("no floating weights: any floating dtype is taken as it comes")
    q, k, v = qkv(core, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="or run it under torch.autocast"):
        core(q, k, v, causal=plain_causal(name))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = core(q, k, v, causal=plain_causal(name))
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("bad", [1, 0, "yes", "no", None, torch.tensor(True)], ids=repr)
@pytest.mark.parametrize("case", CASES[:1] + [c for c in CASES if c[0] == "lsh"][:1], ids=case_id)
def test_causal_must_be_a_bool(case, bad):
    """``causal=1`` or ``"no"`` would be read as truthy; only True and False are accepted."""
    core = build(*case)
    q, k, v = qkv(core, 1, 8)
    with pytest.raises(ValueError, match=rf"causal must be True or False \(a bool\), got {re.escape(repr(bad))}"):
        core(q, k, v, causal=bad)


def test_a_shared_qk_core_refuses_a_separate_k():
    core = az.create_attention("lsh", dim_head=8, heads=2, max_seq_len=32, bucket_size=4)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    with pytest.raises(ValueError, match=r"lsh shares one projection for queries and keys \(needs_shared_qk\): "
                                         r"pass k = q"):  # fmt: skip
        core(q, k, v)
    assert core(q, q, v).shape == q.shape
    assert core(q, q.detach(), v).shape == q.shape  # a view of the same memory is the same tensor
    assert torch.equal(core(q, q.clone(), v), core(q, q, v))  # and so is a copy


LENGTH_BOUNDS = [
    ("local", {"window": 10**9}, "window=1000000000 must be in [2, 256]", "2 x "),
    ("local", {"window": 4096}, "window=4096 must be in [2, 2048]", "2 x "),
    ("longformer", {"window": 10**9}, "window=1000000000 must be in [2, 256]", "2 x "),
    ("sparse", {"pattern": "strided", "stride": 10**9}, "stride=1000000000 must be in [1, 128]", ""),
    ("sparse", {"pattern": "blockwise", "block_size": 10**9}, "block_size=1000000000 must be in [1, 128]", ""),
    ("bigbird", {"block_size": 10**9, "global_tokens": 2}, "block_size=1000000000 must be in [1, 64]", ""),
    ("lsh", {"bucket_size": 10**9}, "bucket_size=1000000000 must be in [1, 64]", ""),
    ("lsh", {"n_buckets": 10**9}, "n_buckets=1000000000 must be in [1, ", ""),
    ("lsh", {"n_buckets": 2, "chunk_size": 10**9}, "chunk_size=1000000000 must be in [1, 64]", ""),
    ("linformer_causal", {"block_size": 10**9, "block_k": 4}, "block_size=1000000000 must be in [1, 256]", ""),
    ("nystrom", {"num_landmarks": 10**9}, "num_landmarks=1000000000 must be in [1, 64]", ""),
    ("moba", {"block_size": 10**9}, "block_size=1000000000 must be in [1, 512]", ""),
]  # fmt: skip


@pytest.mark.parametrize(("name", "options", "expected", "times"), LENGTH_BOUNDS)
def test_sizes_beyond_what_a_length_allows_are_refused_before_allocation(name, options, expected, times):
    """A size option above what max_seq_len allows (or above its default, when that is larger) fails when
    built, naming the allowed range; without max_seq_len, the first call with the call's key length, with
    the same message, instead of trying to allocate for the option (a MemoryError or an allocator abort)."""
    msl = 1024 if "4096" in expected else 64
    with pytest.raises(ValueError, match=re.escape(expected)) as error:
        az.create_attention(name, dim_head=8, heads=2, max_seq_len=msl, **options)
    assert f"{times}max_seq_len={msl}" in str(error.value) and "\n" not in str(error.value)
    if msl != 64 or name == "linformer_causal":  # linformer_causal allocates its (k_c x c) projections when built
        return
    core = az.create_attention(name, dim_head=8, heads=2, **options)  # unbounded: nothing to check yet
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    with pytest.raises(ValueError, match=re.escape(expected)) as error:
        core(q, q if core.needs_shared_qk else k, v)
    assert f"{times}the key length=64" in str(error.value) and "build the core with max_seq_len" in str(error.value)


def test_defaults_and_sizes_up_to_the_length_are_accepted():
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    for name, options in [("local", {}), ("local", {"window": 128}), ("sparse", {}), ("lsh", {"bucket_size": 64}),
                          ("nystrom", {}), ("moba", {}), ("bigbird", {})]:  # fmt: skip
        for msl in (64, None):
            core = az.create_attention(name, dim_head=8, heads=2, max_seq_len=msl, **options)
            assert core(q, q if core.needs_shared_qk else k, v).shape == q.shape
    core = az.create_attention("local", dim_head=8, heads=2, window=1024)
    state = core.start_decoding()
    for _ in range(3):  # decoding step by step: the length it will reach is unknown, so nothing is refused
        core.decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], state)
    with pytest.raises(ValueError, match=r"window=1024 must be in \[2, 256\] \(its default; 2 x the key length=8"):
        core(q, k, v)


# --- zoo compare --------------------------------------------------------------------------------------

COMPARE_FIT = ["--data.seq_len=32", "--data.num_kv_pairs=4", "--data.vocab_size=32", "--data.train_size=256",
               "--data.batch_size=8", "--model.dim=16", "--model.depth=1", "--trainer.max_steps=400",
               "--trainer.val_check_interval=100"]  # fmt: skip


def compare_args(runs: Path, attentions: str, experiment: str) -> list[str]:
    return ["compare", "--task-config", str(ROOT / "configs" / "recall.yaml"), "--attentions", attentions,
            "--runs-dir", str(runs), "--experiment", experiment, "--fit-args", json.dumps(COMPARE_FIT)]  # fmt: skip


def test_compare_refuses_every_bad_entry_before_anything_runs(tmp_path):
    runs = tmp_path / "runs"
    result = zoo(compare_args(runs, "full,linformer:k=0,local:window=7", "bad"), tmp_path / "cache")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "zoo compare: error: 2 of 3 entries cannot be built, nothing was run:\n" in result.stderr
    lines = [line.strip() for line in result.stderr.splitlines()]
    (linformer,) = [line for line in lines if line.startswith("linformer: ")]
    (local,) = [line for line in lines if line.startswith("local: ")]
    assert "k=0 must be in [1" in linformer and "window must be an even int >= 2" in local and "got 7" in local
    assert not runs.exists()  # nothing ran, nothing was written (full, the valid entry, did not run first)


@pytest.mark.parametrize("name", ["../x", "a/b"])
def test_compare_experiment_must_be_a_plain_folder_name(name, tmp_path):
    runs = tmp_path / "runs"
    result = zoo(compare_args(runs, "full", name), tmp_path / "cache")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"--experiment {name!r} must be a plain folder name" in result.stderr and "--runs-dir" in result.stderr
    assert not runs.exists() and not (tmp_path / "x").exists()  # nothing written, inside runs/ or outside it


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--", "--seed_everything", "-3"], "2 of 2 entries cannot be built, nothing was run (full, local): "
         "--seed_everything -3: a seed must be an int in [0, 4294967295] (or true for a random one)"),
        (["--", "--model.dimm", "8"], "2 of 2 entries cannot be built, nothing was run (full, local): --model.dimm: "
         "TokenPrediction has no option 'dimm'; did you mean --model.dim? (--verbose or ZOO_VERBOSE=1: the parser's "
         "full message)"),
        (["--seeds", "abc"], "--seeds abc: expected int (--verbose or ZOO_VERBOSE=1: the parser's full message)"),
        (["--seed", "-1"], "--seed must be >= 0 (seeds are seed .. seed + seeds - 1), got -1"),
        (["--task-config", "/nowhere/missing.yaml"], "--task-config /nowhere/missing.yaml: '/nowhere/missing.yaml' is "
         "neither a file here nor a packaged config; packaged: compare, compare_causal, compare_variants, listops, "
         "majority, mlm, recall, text, translation, bench/..., lra/..., studies/..."),
        (["--bench", "."], "--bench: . has no results.jsonl: not a zoo bench --out folder"),
    ],
    ids=["negative-seed-everything", "fit-key", "type", "negative-seed", "missing-task-config", "bench-folder"],
)  # fmt: skip
def test_compare_refusals_are_one_line_before_anything_runs(args, expected, tmp_path, capsys, monkeypatch):
    """Through ``--`` to every ``zoo fit`` (each entry built as its run's config, one line for the entries that
    fail the same way) or in its own flags: one line, as ``zoo fit`` gives it, and nothing written."""
    monkeypatch.chdir(tmp_path)
    own = ["--task-config", str(ROOT / "configs" / "recall.yaml"), "--attentions", "full,local:window=8"]
    own += ["--timeout", "1"]  # should a refusal come too late, the runs it lets start stop at once
    assert compare.main([*own, "--runs-dir", str(tmp_path / "runs"), *args]) == 2
    assert capsys.readouterr().err == f"zoo compare: error: {expected}\n"
    assert not (tmp_path / "runs").exists()


def test_compare_verbose_prints_the_parsers_full_message_first(tmp_path, capsys):
    own = ["--task-config", str(ROOT / "configs" / "recall.yaml"), "--attentions", "full"]
    assert compare.main([*own, "--runs-dir", str(tmp_path / "runs"), "--verbose", "--", "--model.dim", "abc"]) == 2
    error = capsys.readouterr().err
    assert error.endswith("zoo compare: error: 1 of 1 entry cannot be built, nothing was run (full): --model.dim abc: "
                          "expected int\n")  # fmt: skip
    assert error.startswith("full: ") and 'Parser key "model' in error
    assert not (tmp_path / "runs").exists()


# --- zoo report ---------------------------------------------------------------------------------------


def report_records(root: Path) -> tuple[Path, Path]:
    """A compare experiment (runs.csv of full and local, 2 seeds) and a bench folder (results.jsonl) that
    ``zoo report`` reads."""
    experiment, bench = root / "experiment", root / "bench"
    experiment.mkdir()
    bench.mkdir()
    header = "mechanism,attention,options,options_from,seed,status,val_acc,tokens_per_s,train_mem_mb,reason,run_dir"
    runs = [f"{name},{name},{{}},defaults,{seed},ok,{acc},{speed},10.0,,runs/x/{name}/seed-{seed}"
            for name, speed, accs in [("full", 100.0, (0.9, 0.8)), ("local", 150.0, (0.85, 0.7))]
            for seed, acc in enumerate(accs)]  # fmt: skip
    (experiment / "runs.csv").write_text("\n".join([header, *runs]) + "\n")
    timing = {"kind": "time", "status": "ok", "mode": "fwd+bwd", "dtype": "float32", "level": "core", "causal": False,
              "options": {}, "seq_len": 1024}  # fmt: skip
    rows = [timing | {"attention": name, "time_ms_median": ms} for name, ms in [("full", 10.0), ("local", 5.0)]]
    (bench / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return experiment, bench


def replace(old: str | bytes, new: str | bytes):
    """A damage: the first ``old`` in the file becomes ``new``."""

    def damage(path: Path) -> None:
        data = path.read_text() if isinstance(old, str) else path.read_bytes()
        assert old in data
        changed = data.replace(old, new, 1)
        path.write_text(changed) if isinstance(changed, str) else path.write_bytes(changed)

    return damage


def columns(change):
    """A damage of runs.csv: each line's fields (the header's first) through ``change(number, fields)``."""
    return lambda p: p.write_text("".join(",".join(change(i, ln.split(","))) + "\n" for i, ln in
                                          enumerate(p.read_text().splitlines())))  # fmt: skip


#: fault -> (file, damage, what the error line says after the file's path)
REPORT_FAULTS = {
    "truncated-csv": ("runs.csv", lambda p: p.write_text(p.read_text()[:-40]),
                      " line 5: 5 fields, the header has 11: a truncated or corrupt file"),
    "binary-csv": ("runs.csv", lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256))),
                   ": not UTF-8 text (byte 0): a binary or corrupt file, not a zoo compare experiment"),
    "nul-csv": ("runs.csv", replace(b"defaults", b"default\x00"), ": a NUL character: a binary or corrupt file"),
    "empty-csv": ("runs.csv", lambda p: p.write_text(""), ": empty: not a zoo compare experiment"),
    "missing-column": ("runs.csv", columns(lambda i, fields: fields[:5] + fields[6:]),
                       ": not a zoo compare runs.csv: missing column(s) 'status' (zoo report reads mechanism, "),
    "unexpected-column": ("runs.csv", columns(lambda i, fields: [*fields, "gpu" if i == 0 else "h100"]),
                          ": not a zoo compare runs.csv: unexpected column(s) 'gpu' (zoo compare writes mechanism, "),
    "not-a-number": ("runs.csv", replace(",0.85,", ",high,"), " line 4: val_acc 'high' is not a number"),
    "options": ("runs.csv", replace("local,local,{}", "local,local,w=8"),
                " line 4: options 'w=8' is not a JSON object {...}"),
    "status": ("runs.csv", replace(",ok,", ",done,"),
               " line 2: status 'done'; a run's status is one of ok, failed, interrupted, not run"),
    "no-speed": ("runs.csv", replace(",100.0,", ",,"),
                 " line 2: a finished run (status ok) with tokens_per_s None; it must be a number > 0"),
    "truncated-jsonl": ("results.jsonl", lambda p: p.write_text(p.read_text()[:-30]),
                        " line 2: not JSON (Unterminated string starting at): a truncated or corrupt file"),
    "binary-jsonl": ("results.jsonl", lambda p: p.write_bytes(b"\xff" + random.Random(0).randbytes(300)),
                     ": not UTF-8 text (byte 0): a binary or corrupt file, not a zoo bench --out folder"),
    "not-an-object": ("results.jsonl", lambda p: p.write_text(p.read_text() + "[1, 2]\n"),
                      " line 3: expected a JSON object {...}, got list"),
    "missing-field": ("results.jsonl", replace(', "time_ms_median": 5.0', ""),
                      " line 2: a timing (kind time, status ok) without 'time_ms_median'"),
    "zero-time": ("results.jsonl", replace('"time_ms_median": 5.0', '"time_ms_median": 0'),
                  " line 2: time_ms_median 0 is not a number > 0"),
    "length": ("results.jsonl", replace('"seq_len": 1024', '"seq_len": "1k"'),
               " line 1: seq_len '1k' is not an int >= 1"),
}  # fmt: skip


@pytest.mark.parametrize("fault", REPORT_FAULTS)
def test_report_records_of_another_shape_or_corrupt_are_one_line_naming_the_file(fault, tmp_path, capsys):
    from experiments.compare.report import main as report

    experiment, bench = report_records(tmp_path)
    assert report(["--compare", str(experiment), "--bench", str(bench)]) == 0  # the records as they come are read
    for written in ("report.md", "pareto.png"):
        (experiment / written).unlink()
    capsys.readouterr()
    name, damage, expected = REPORT_FAULTS[fault]
    path = (experiment if name == "runs.csv" else bench) / name
    damage(path)
    assert report(["--compare", str(experiment), "--bench", str(bench)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"zoo report: error: {path}{expected}") and error.count("\n") == 1, error
    assert sorted(p.name for p in experiment.iterdir()) == ["runs.csv"]  # nothing written


def test_report_on_a_corrupt_record_is_one_line_from_the_command_line(tmp_path):
    experiment, bench = report_records(tmp_path)
    (bench / "results.jsonl").write_text('{"kind": "time", "status": "ok", "mode": "fw')
    result = zoo(["report", "--compare", str(experiment), "--bench", str(bench)], tmp_path / "cache")
    line = one_line_error(result, "report")
    assert line == (f"zoo report: error: {bench / 'results.jsonl'} line 1: not JSON (Unterminated string starting at): "
                    "a truncated or corrupt file")  # fmt: skip
    assert len(result.stderr.splitlines()) == 1 and sorted(p.name for p in experiment.iterdir()) == ["runs.csv"]
