"""``zoo compare``: the ``--attentions`` syntax, which options each mechanism gets, the experiment
directory rule, failure reasons, and one end-to-end comparison on a tiny config (summary files, plots,
TensorBoard runs, a failing mechanism recorded while the others finish)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import attention_zoo as az
from experiments.compare import command as compare
from experiments.compare import flags
from experiments.compare.runs import attention_arguments, failure_reason
from experiments.compare.tensorboard_layout import read_layout
from tasks.data import recall
from tests.experiments.tiny_recall import compare_command, fit_args, runs_of

ROOT = Path(__file__).resolve().parents[2]


def test_default_plan_is_every_mechanism_that_takes_padding_masks_with_its_defaults():
    entries = compare.plan(None, {"full": {"backend": "sdpa"}})
    expected = [n for n in az.list_attentions() if az.get_attention_class(n).supports_mask]
    assert [e.spec.name for e in entries] == expected == [e.label for e in entries]
    by_name = {e.spec.name: e for e in entries}
    assert by_name["full"].spec.options == {"backend": "sdpa"} and by_name["full"].options_from == "config"
    for entry in (e for e in entries if e.spec.name != "full"):
        assert (entry.spec.options, entry.options_from) == ({}, "defaults")


def test_options_come_from_the_command_line_then_the_config():
    entries = compare.plan("full,full:backend=math,local", {"full": {"backend": "sdpa"}})
    assert [(e.label, e.spec, e.options_from) for e in entries] == [
        ("full-backend=sdpa", az.AttentionSpec("full", {"backend": "sdpa"}), "config"),
        ("full-backend=math", az.AttentionSpec("full", {"backend": "math"}), "command line"),
        ("local", az.AttentionSpec("local"), "defaults"),
    ]
    twins = compare.plan("local,local:window=8:impl=dense", {})  # a twin without options: name-defaults
    assert [e.label for e in twins] == ["local-defaults", "local-window=8-impl=dense"]
    assert [e.label for e in twins] == ["local-defaults", twins[1].spec.folder]


def test_plan_rejects_unknown_names_and_duplicates():
    with pytest.raises(ValueError, match="unknown attention.*'flash'.*known: .*full"):
        compare.plan("full,flash", {})
    with pytest.raises(ValueError, match="twice"):
        compare.plan("full,full", {})
    with pytest.raises(ValueError, match="twice: linformer-sharing=kv-k=32"):  # the same options in another order
        compare.plan("linformer:k=32,sharing=kv,linformer:sharing=kv,k=32", {})


def test_plan_checks_every_entry_against_the_registry_in_one_line():
    with pytest.raises(ValueError) as error:
        compare.plan("full,linformer:kk=32,local:window=abc", {})
    message = str(error.value)
    assert "\n" not in message
    assert "attention 'linformer' has no option 'kk'; valid options: k: " in message
    assert "attention 'local': option window='abc' is not a valid int" in message
    with pytest.raises(ValueError, match="attention 'nystrom' has no option 'k'"):  # the config's options too
        compare.plan("full,nystrom", {"nystrom": {"k": 8}})


@pytest.mark.parametrize("text", ["", " ", ",", " , ,"])
def test_an_empty_attention_list_is_refused_not_read_as_every_mechanism(text):
    with pytest.raises(ValueError, match="names no mechanism"):
        compare.plan(text, {})


def test_option_values_run_as_typed_not_as_yaml_1_1_reads_them():
    with pytest.raises(ValueError, match="window='8:10' is not a valid int"):  # YAML 1.1 would run window=490
        compare.plan("local:window=8:10", {})
    (entry,) = compare.plan("nystrom:num_landmarks=8:pinv=exact", {})
    assert entry.spec.options == {"num_landmarks": 8, "pinv": "exact"}


def test_a_spec_reaches_the_task_with_its_typed_options():
    """compare hands a spec to ``zoo fit`` as ``attention_arguments`` (the name, and the options as JSON): the task
    records the very options, each of its type (a float written 1e-1, a string that YAML 1.1 reads as null)."""
    from tasks.cli import build

    for text in ("full:dropout=1e-1,backend=math", "linformer:k=8,sharing=none,projection=mean_pool"):
        spec = az.AttentionSpec.parse(text).checked()
        model, _ = build(["-c", str(ROOT / "configs" / "recall.yaml"), *attention_arguments(spec), "--data.seq_len=64"])
        recorded = model.hparams["attention_options"]
        assert az.AttentionSpec(model.hparams["attention"], recorded) == spec
        assert {k: type(v) for k, v in recorded.items()} == {k: type(v) for k, v in spec.options.items()}


def test_one_spec_string_means_one_name_and_options_in_compare_bench_and_the_hf_integration():
    """The walk from ``--attentions linformer:k=32,sharing=kv`` to a core: compare's plan, bench's sweep and the
    Hugging Face integration read the same text as the same name and typed options."""
    pytest.importorskip("transformers")
    from transformers import AutoModel, BertConfig

    from attention_zoo.integrations import transformers as hf
    from experiments.bench.cases import expand, load_config

    text = "linformer:k=32,sharing=kv"
    expected = az.AttentionSpec("linformer", {"k": 32, "sharing": "kv"})
    (entry,) = compare.plan(text, {})
    cases = expand(load_config(None, {"attentions": text, "seq_lens": [64]}), "cpu")
    config = BertConfig(vocab_size=32, max_position_embeddings=64, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2)  # fmt: skip
    model = hf.use_attention(AutoModel.from_config(config, attn_implementation="sdpa"), text)
    stored = getattr(model.config, hf.CONFIG_ATTRIBUTE)
    cores = [module.zoo_core for _, module in hf.attention_layers(model)]
    assert entry.spec == cases[0].spec == az.AttentionSpec(stored["attention"], stored["options"]) == expected
    assert [type(v) for v in entry.spec.options.values()] == [type(v) for v in cases[0].spec.options.values()]
    assert [type(v) for v in stored["options"].values()] == [int, str]
    assert {(c.name, c.k, c.sharing) for c in cores} == {("linformer", 32, "kv")}


def test_experiment_directory_resumes_the_same_comparison_and_never_touches_another(tmp_path):
    identity = {"task_config": "a.yaml", "fit_args": ["--x=1"]}
    first, resuming = compare.experiment_directory(tmp_path, "exp", identity, fresh=False)
    assert (first.name, resuming) == ("exp", False)
    (first / "compare.yaml").write_text(yaml.safe_dump({**identity, "seeds": 3}))
    (first / "keep.txt").write_text("earlier results")
    again, resuming = compare.experiment_directory(tmp_path, "exp", identity, fresh=False)
    assert (again, resuming) == (first, True)  # more or fewer seeds resume the same experiment
    with pytest.raises(ValueError, match="holds a different comparison.*fit_args.*--fresh"):
        compare.experiment_directory(tmp_path, "exp", {**identity, "fit_args": ["--x=2"]}, fresh=False)
    fresh, resuming = compare.experiment_directory(tmp_path, "exp", identity, fresh=True)
    assert (fresh.name, resuming) == ("exp-2", False)
    assert (first / "keep.txt").read_text() == "earlier results"
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a zoo compare experiment"):
        compare.experiment_directory(tmp_path, "plain", identity, fresh=False)


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "", "tab\there", "new\nline", "x" * 256])
def test_experiment_names_are_plain_folder_names(tmp_path, name):
    with pytest.raises(ValueError, match="plain folder name"):
        compare.experiment_directory(tmp_path / "runs", name, {}, fresh=False)
    assert not (tmp_path / "x").exists()


def test_failure_reason_prefers_the_run_record_then_the_cli_error_then_the_exception(tmp_path):
    log = tmp_path / "fit.log"
    log.write_text("Seed set to 0\nzoo fit: error: cannot build the encoder: bad k\n")
    assert failure_reason(2, {}, log, "exited", None) == "zoo fit: error: cannot build the encoder: bad k"
    log.write_text("Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    assert failure_reason(1, {}, log, "exited", None) == "torch.OutOfMemoryError: CUDA out of memory."
    record = {"status": "failed", "error": "RuntimeError: boom"}
    assert failure_reason(1, record, log, "exited", None) == "RuntimeError: boom"
    assert failure_reason(-9, {}, log, "exited", None) == "killed by SIGKILL (out of memory?)"
    assert failure_reason(-15, {}, log, "timed out", 30.0) == "timed out after 30 s"
    assert "rerun the same zoo compare command" in failure_reason(-2, {}, log, "interrupted", None)


@pytest.mark.parametrize("name", ["compare.yaml", "compare_variants.yaml"])
def test_default_config_parses_and_builds_every_mechanism_it_names(name):
    config = compare.build_parser().parse_args(["--config", str(flags.CONFIGS / name)])
    assert Path(config.task_config.absolute).is_file() and config.experiment and config.threads >= 1
    assert config.seeds >= 3  # a 95% interval needs at least 3 seeds to be worth printing
    entries = compare.plan(config.attentions, config.options)
    problems, shuffle = compare.check_entries(entries, str(config.task_config.absolute), config.fit_args)
    assert problems == [] and shuffle


def test_the_default_budgets_are_below_the_demand_of_its_task():
    """The default compares mechanisms at budgets below what MQAR asks (configs/compare.yaml): fewer low-rank or
    kernel slots than key-value pairs, at most half the keys per query for the sparse family, a local window that
    most query-value distances exceed, and every mechanism engaged (no budget that is full attention)."""
    config = compare.build_parser().parse_args(["--config", str(compare.DEFAULT_CONFIG)])
    task = yaml.safe_load(Path(config.task_config.absolute).read_text())
    data, model = task["data"]["init_args"], task["model"]["init_args"]
    n, pairs = data["seq_len"], data["num_kv_pairs"]
    options = config.options
    assert data["kv_placement"] == "random" and model["short_convolution"] >= 1
    assert options["linformer"]["k"] < pairs and options["nystrom"]["num_landmarks"] < pairs
    assert options["performer"]["nb_features"] < pairs
    bigbird = options["bigbird"]
    bigbird_keys = bigbird["block_size"] * (bigbird["window_blocks"] + bigbird["random_blocks"] + 2)
    moba_keys = options["moba"]["block_size"] * options["moba"]["top_k"]
    lsh_keys = options["lsh"]["n_hashes"] * 2 * options["lsh"]["bucket_size"]  # its chunk and the one before
    assert max(options["local"]["window"] + 1, bigbird_keys, moba_keys, lsh_keys) <= n // 2 + 1
    # the query-to-value distances of the generated data: most exceed the local window's reach (w/2)
    inputs, labels = recall.generate_mqar(
        256, seq_len=n, num_kv_pairs=pairs, vocab_size=data["vocab_size"], power_a=data["power_a"], seed=0,
        kv_placement="random",
    )  # fmt: skip
    distances = []
    for tokens, targets in zip(inputs.tolist(), labels.tolist(), strict=True):
        for q, value in enumerate(targets):
            if value != -100:  # the pair is the key (the query's token) right before its value, earlier
                pair = max(i for i in range(q - 1) if tokens[i] == tokens[q] and tokens[i + 1] == value)
                distances.append(q - (pair + 1))
    reach = options["local"]["window"] // 2
    assert sum(d > reach for d in distances) / len(distances) > 0.5


def test_check_entries_lists_every_bad_entry_before_anything_runs():
    entries = compare.plan("full,linformer:k=0,local:window=7", {})  # well-typed options that no core takes
    problems, _ = compare.check_entries(entries, str(ROOT / "configs" / "recall.yaml"), ["--data.seq_len=64"])
    assert [label for label, _ in problems] == ["linformer", "local"]
    assert "k=0 must be in [1" in problems[0][1] and "window must be an even int" in problems[1][1]
    listed = compare.entry_problems(problems, 3)
    assert listed.startswith("2 of 3 entries cannot be built, nothing was run:\n  linformer: ")
    same = [("full", "--seed_everything -3: ..."), ("local", "--seed_everything -3: ...")]
    one_line = compare.entry_problems(same, 2)  # every entry fails the same way: a bad fit argument, named once
    assert one_line == "2 of 2 entries cannot be built, nothing was run (full, local): --seed_everything -3: ..."


@pytest.mark.slow
def test_compare_end_to_end_with_seeds_a_failure_an_interruption_and_a_resume(tmp_path):
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(
        yaml.safe_dump(
            {
                "experiment": "tiny",
                "task_config": str(ROOT / "configs" / "recall.yaml"),
                "runs_dir": str(tmp_path / "runs"),
                "seeds": 2,
                "options": {"full": {"backend": "math"}},
                "fit_args": fit_args(),
            }
        )
    )  # fmt: skip
    zoo = compare_command(tmp_path / "cache", ROOT, "--config", str(tiny), "--attentions", "full,local:window=8")
    result = zoo()
    experiment = tmp_path / "runs" / "tiny"
    runs = runs_of(result, experiment)
    assert [(r["mechanism"], r["seed"], r["status"]) for r in runs] == [
        ("full", "0", "ok"),
        ("local", "0", "ok"),
        ("full", "1", "ok"),
        ("local", "1", "ok"),
    ]  # seed-major
    for row in runs:
        assert 0 <= float(row["val_acc"]) <= 1 and float(row["tokens_per_s"]) > 0
        assert float(row["peak_mem_mb"]) >= float(row["train_mem_mb"]) >= 0
        run_dir = experiment / row["mechanism"] / f"seed-{row['seed']}"
        assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
        assert any(run_dir.glob("events.out.tfevents.*"))
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["seed_everything"] == int(row["seed"])
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["init_args"]["shuffle_seed"] == int(
            row["seed"]
        )
    with open(experiment / "summary.csv") as file:
        summary = {r["mechanism"]: r for r in csv.DictReader(file)}
    assert set(summary) == {"full", "local"} and all(r["seeds"] == "2" and r["ok"] == "2" for r in summary.values())
    accuracies = [float(r["val_acc"]) for r in runs if r["mechanism"] == "full"]
    assert float(summary["full"]["val_acc_mean"]) == pytest.approx(sum(accuracies) / 2)
    assert (
        float(summary["full"]["val_acc_ci_low"])
        <= float(summary["full"]["val_acc_mean"])
        <= float(summary["full"]["val_acc_ci_high"])
    )
    # overlapping intervals no longer rank (they do not show equivalence): each row has its paired verdict
    assert summary["full"]["verdict"] == "reference"
    assert summary["local"]["verdict"] in {"on par", "better", "worse", "inconclusive"}
    assert summary["local"]["paired_seeds"] == "2" and summary["local"]["metric"] == "val_acc"
    for name in ("accuracy_vs_throughput.png", "peak_memory.png"):
        assert (experiment / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    layout = read_layout(next(experiment.glob("events.out.tfevents.*.layout")))
    assert layout["zoo compare"]["validation acc"] == ["Multiline", ["^val/acc$"]]
    assert "verdict" in result.stdout and "reference" in result.stdout
    table = [line for line in result.stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert len(table) >= 6 and max(len(line) for line in table) <= 120  # readable in a 120-column terminal

    # a rerun resumes: nothing runs again; one more seed adds exactly two runs
    again = zoo("--seeds", "3")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming" in again.stdout and "4 finished earlier" in again.stdout
    with open(experiment / "runs.csv") as file:
        assert [(r["mechanism"], r["seed"]) for r in csv.DictReader(file)][-2:] == [("full", "2"), ("local", "2")]
    # a different comparison in the same directory is refused, and nothing in it changes
    before = (experiment / "runs.csv").read_text()
    other = zoo("--", "--model.dim=32")
    assert other.returncode == 2 and "holds a different comparison" in other.stderr
    assert (experiment / "runs.csv").read_text() == before


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_writes_the_summary_and_a_rerun_resumes(tmp_path):
    env = os.environ | {"ZOO_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable, "-m", "experiments.cli", "compare", "--task-config", str(ROOT / "configs" / "recall.yaml"),
        "--attentions", "full,local:window=8", "--runs-dir", str(tmp_path / "runs"), "--experiment", "sigint",
        "--jobs", "1", "--fit-args", json.dumps(["--data.seq_len=32", "--data.num_kv_pairs=4", "--data.vocab_size=32",
                                  "--data.train_size=256", "--data.batch_size=8", "--model.dim=16", "--model.depth=1",
                                  "--trainer.max_steps=400", "--trainer.val_check_interval=100"]),
    ]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    experiment = tmp_path / "runs" / "sigint"
    deadline = time.monotonic() + 120
    while not (experiment / "full" / "seed-0" / "run.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output
    assert "interrupted" in output and "rerun the same command" in output and "Traceback" not in output
    with open(experiment / "runs.csv") as file:
        statuses = [(r["mechanism"], r["status"]) for r in csv.DictReader(file)]
    assert statuses == [("full", "interrupted"), ("local", "not run")]
    assert (experiment / "summary.md").is_file() and (experiment / "compare.yaml").is_file()
    # the same command again runs the interrupted and the unrun mechanisms to the end, in the same experiment
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"resuming {experiment}" in again.stdout
    with open(experiment / "runs.csv") as file:
        assert [(r["mechanism"], r["status"]) for r in csv.DictReader(file)] == [("full", "ok"), ("local", "ok")]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["sigint"]  # resumed in place, no sigint-2


def test_lower_is_better_knows_losses_memory_and_durations_from_rates():
    from experiments.compare.summary import lower_is_better

    assert all(map(lower_is_better, ["val_loss", "val_ppl", "train_mem_mb", "fit_s"]))
    assert not any(map(lower_is_better, ["val_acc", "test_bleu", "tokens_per_s", "test_greedy_cached_sentences_per_s"]))


@pytest.mark.slow
def test_compare_with_test_adds_each_runs_test_metrics(tmp_path):
    env = os.environ | {"ZOO_CACHE": str(tmp_path / "cache")}
    fit_args = ["--data.seq_len=32", "--data.num_kv_pairs=4", "--data.vocab_size=32", "--data.train_size=64",
                "--data.val_size=16", "--data.test_size=16", "--data.batch_size=8", "--model.dim=16",
                "--model.depth=1", "--trainer.max_steps=2", "--trainer.val_check_interval=2"]  # fmt: skip
    command = [
        sys.executable, "-m", "experiments.cli", "compare", "--task-config", str(ROOT / "configs" / "recall.yaml"),
        "--attentions", "full", "--runs-dir", str(tmp_path / "runs"), "--experiment", "tested", "--test", "true",
        "--fit-args", json.dumps(fit_args),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "tested" / "full" / "seed-0"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "finished" and record["tested_checkpoint"].endswith("last.ckpt")
    assert 0 <= record["metrics"]["test/acc"] <= 1 and (run_dir / "test.log").is_file()
    with open(tmp_path / "runs" / "tested" / "runs.csv") as file:
        (row,) = list(csv.DictReader(file))
    assert float(row["test_acc"]) == pytest.approx(record["metrics"]["test/acc"])


def test_summaries_name_the_task_config_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inside = tmp_path / "experiments" / "studies" / "x" / ".." / ".." / ".." / "configs" / "recall.yaml"
    assert compare.shown_path(str(inside)) == str(Path("configs") / "recall.yaml")
    outside = tmp_path.parent / "elsewhere" / ".." / "other.yaml"
    assert compare.shown_path(str(outside)) == str(tmp_path.parent / "other.yaml")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--attentions", ""], "names no mechanism"),
        (["--attentions", "local:window=8,window=16"], "option 'window' given twice"),
    ],
)
def test_bad_settings_stop_the_comparison_before_anything_runs(tmp_path, capsys, args, expected):
    assert compare.main([*args, "--runs-dir", str(tmp_path / "runs")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("zoo compare: error: ") and expected in line
    assert not (tmp_path / "runs").exists()
