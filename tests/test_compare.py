"""``zoo compare``: the ``--attentions`` syntax, which options each mechanism gets, the experiment
directory rule, failure reasons, and one end-to-end comparison on a tiny config (summary files, plots,
TensorBoard runs, a failing mechanism recorded while the others finish)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import attention_zoo as az
from experiments import compare

ROOT = Path(__file__).resolve().parents[1]


def test_parse_attentions_entries_and_options():
    assert compare.parse_attentions("full,linformer:k=32,sharing=kv,local:window=16") == [
        ("full", None),
        ("linformer", {"k": 32, "sharing": "kv"}),
        ("local", {"window": 16}),
    ]
    assert compare.parse_attentions(" full , nystrom:pinv=exact,conv_kernel_size=null ") == [
        ("full", None),
        ("nystrom", {"pinv": "exact", "conv_kernel_size": None}),
    ]
    assert compare.parse_attentions("sparse:seed=3,x=1.5,y=true") == [("sparse", {"seed": 3, "x": 1.5, "y": True})]


@pytest.mark.parametrize("text", ["k=3", "full,k=3", "linformer:k", "linformer:=3"])
def test_parse_attentions_rejects_options_without_an_entry(text):
    with pytest.raises(ValueError, match="--attentions"):
        compare.parse_attentions(text)


def test_default_plan_is_every_mechanism_that_takes_padding_masks():
    entries = compare.plan(None, {"full": {}})
    expected = [n for n in az.list_attentions() if az.get_attention_class(n).supports_mask]
    assert [e.attention for e in entries] == expected == [e.label for e in entries]
    by_name = {e.attention: e for e in entries}
    assert by_name["full"].options == {} and by_name["full"].options_from == "config"
    for entry in (e for e in entries if e.attention != "full"):
        cls = az.get_attention_class(entry.attention)
        if any(spec.required for spec in az.attention_options(cls)):
            assert (entry.options, entry.options_from) == (cls.example_configs[0], "example_configs")
        else:
            assert (entry.options, entry.options_from) == ({}, "defaults")


def test_options_come_from_the_command_line_then_the_config():
    entries = compare.plan("full,full:backend=math", {"full": {"backend": "sdpa"}})
    assert [(e.label, e.options, e.options_from) for e in entries] == [
        ("full-backend=sdpa", {"backend": "sdpa"}, "config"),
        ("full-backend=math", {"backend": "math"}, "command line"),
    ]


def test_plan_rejects_unknown_names_and_duplicates():
    with pytest.raises(ValueError, match="unknown attention 'flash'; known: .*full"):
        compare.plan("full,flash", {})
    with pytest.raises(ValueError, match="twice"):
        compare.plan("full,full", {})


def test_experiment_directories_are_never_reused(tmp_path):
    first = compare.new_experiment_dir(tmp_path, "exp")
    (first / "keep.txt").write_text("earlier results")
    second = compare.new_experiment_dir(tmp_path, "exp")
    third = compare.new_experiment_dir(tmp_path, "exp")
    assert [first.name, second.name, third.name] == ["exp", "exp-2", "exp-3"]
    assert (first / "keep.txt").read_text() == "earlier results"


def test_failure_reason_prefers_the_run_record_then_the_cli_error_then_the_exception(tmp_path):
    log = tmp_path / "fit.log"
    log.write_text("Seed set to 0\nzoo fit: error: cannot build the encoder: bad k\n")
    assert compare.failure_reason(2, {}, log, False, None) == "zoo fit: error: cannot build the encoder: bad k"
    log.write_text("Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    assert compare.failure_reason(1, {}, log, False, None) == "torch.OutOfMemoryError: CUDA out of memory."
    record = {"status": "failed", "error": "RuntimeError: boom"}
    assert compare.failure_reason(1, record, log, False, None) == "RuntimeError: boom"
    assert compare.failure_reason(-9, {}, log, False, None) == "killed by SIGKILL (out of memory?)"
    assert compare.failure_reason(-15, {}, log, True, 30.0) == "timed out after 30 s"


def test_default_config_parses_and_its_options_build_at_its_length():
    config = compare.build_parser().parse_args(["--config", str(compare.DEFAULT_CONFIG)])
    assert Path(config.task_config.absolute).is_file() and config.experiment and config.threads >= 1
    (seq_len,) = [int(arg.split("=")[1]) for arg in config.fit_args if arg.startswith("--data.seq_len=")]
    for name, options in config.options.items():
        if name in az.list_attentions():
            az.create_attention(name, dim_head=32, heads=2, max_seq_len=seq_len, **options)


@pytest.mark.slow
def test_compare_end_to_end_on_a_tiny_config(tmp_path):
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(
        yaml.safe_dump(
            {
                "experiment": "tiny",
                "task_config": str(ROOT / "configs" / "recall.yaml"),
                "runs_dir": str(tmp_path / "runs"),
                "options": {"full": {"backend": "math"}},
                "fit_args": [
                    "--data.seq_len=32", "--data.num_kv_pairs=4", "--data.vocab_size=32", "--data.train_size=64",
                    "--data.val_size=16", "--data.test_size=16", "--data.batch_size=8", "--model.dim=16",
                    "--model.depth=1", "--model.warmup_steps=1", "--trainer.max_steps=4",
                    "--trainer.val_check_interval=2", "--trainer.log_every_n_steps=1",
                ],
            }
        )
    )  # fmt: skip
    second = "linformer:k=8" if "linformer" in az.list_attentions() else "full:backend=sdpa"
    env = os.environ | {"ZOO_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "compare", "--config", str(tiny),
         "--attentions", f"full,{second},full:backend=cuda"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    experiment = tmp_path / "runs" / "tiny"
    with open(experiment / "summary.csv") as file:
        rows = list(csv.DictReader(file))
    assert [r["attention"] for r in rows] == ["full", second.split(":")[0], "full"]
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    assert "backend='cuda' is not a valid" in rows[2]["reason"] and "'math'" in rows[2]["reason"]
    for row in rows[:2]:
        assert 0 <= float(row["val_acc"]) <= 1 and float(row["tokens_per_s"]) > 0
        assert float(row["peak_mem_mb"]) >= float(row["train_mem_mb"]) >= 0
        assert int(row["parameters"]) > 0 and int(row["steps"]) == 4
        assert any((experiment / row["mechanism"]).glob("events.out.tfevents.*"))
        assert json.loads((experiment / row["mechanism"] / "run.json").read_text())["status"] == "finished"
    summary = (experiment / "summary.md").read_text()
    assert all(row["mechanism"] in summary for row in rows) and "| mechanism |" in summary
    for plot in ("accuracy_vs_throughput.png", "peak_memory.png"):
        assert (experiment / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert yaml.safe_load((experiment / "compare.yaml").read_text())["experiment"] == "tiny"
    assert "zoo compare" in result.stdout and "failed" in result.stdout  # the final table
