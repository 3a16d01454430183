"""``zoo fit | validate | test`` end to end on tiny data: every config loads, every task trains with two
mechanisms, TensorBoard gets the promised tags, errors stop before training, pretrain -> finetune,
resume after SIGKILL, and DDP on CPU with two processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import attention_zoo as az
from experiments import cli

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
TASK_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("compare"))

#: small data for each task config (each generated or read in well under a second)
TINY_DATA = {
    "listops": ["--data.min_length", "10", "--data.max_length", "40", "--data.max_depth", "3"]
    + ["--data.train_size", "64", "--data.val_size", "16", "--data.test_size", "16"],
    "recall": ["--data.seq_len", "32", "--data.num_kv_pairs", "4", "--data.vocab_size", "32"]
    + ["--data.train_size", "64", "--data.val_size", "16", "--data.test_size", "16"],
    "mlm": ["--data.max_bytes", "20000", "--data.max_seq_len", "32"],
    "majority": ["--data.seq_len", "32", "--data.train_size", "64", "--data.val_size", "16", "--data.test_size", "16"],
    "text": ["--data.data_dir", "null", "--data.max_seq_len", "32"],  # + --data.train_file, see tiny_args
}
#: a second mechanism per task, with options for 32-token inputs (skipped where it is not registered)
SECOND = {
    "listops": ("linformer", {"k": 8}),
    "recall": ("local", {"window": 8}),
    "mlm": ("nystrom", {"num_landmarks": 4}),
    "majority": ("linformer", {"k": 8}),
    "text": ("sparse", {"pattern": "strided", "stride": 4}),
}


pytestmark = pytest.mark.usefixtures("one_thread_and_private_cache")


@pytest.fixture(scope="module")
def reviews_csv(tmp_path_factory) -> Path:
    """A tiny two-class text classification fixture."""
    path = tmp_path_factory.mktemp("text") / "reviews.csv"
    good, bad = ["great", "lovely", "superb", "fine"], ["awful", "boring", "poor", "bad"]
    rows = [f"{' '.join(good if i % 2 else bad)} film number {i},{'pos' if i % 2 else 'neg'}" for i in range(60)]
    path.write_text("text,label\n" + "\n".join(rows) + "\n")
    return path


def tiny_args(task: str, runs: Path, reviews_csv: Path, steps: int = 4) -> list[str]:
    args = ["-c", str(CONFIGS / f"{task}.yaml"), *TINY_DATA[task]]
    if task == "text":
        args += ["--data.train_file", str(reviews_csv)]
    return args + [
        "--trainer.max_steps", str(steps), "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.accelerator", "cpu",
        "--trainer.logger.init_args.save_dir", str(runs),
        "--model.dim", "16", "--model.depth", "1", "--model.heads", "2", "--model.warmup_steps", "1",
        "--data.batch_size", "8",
    ]  # fmt: skip


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


@pytest.mark.parametrize("config", TASK_CONFIGS, ids=lambda p: p.name)
def test_every_config_prints_its_resolved_config(config, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", "-c", str(config), "--model.attention", "nystrom", "--print_config"])
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["init_args"]["attention"] == "nystrom"
    assert printed["trainer"]["logger"]["class_path"].endswith("TensorBoardLogger")


def fit_cases():
    for task in TINY_DATA:
        second, options = SECOND[task]
        yield pytest.param(task, "full", {}, id=f"{task}-full")
        marks = [] if second in az.list_attentions() else [pytest.mark.skip(reason=f"{second} is not registered")]
        yield pytest.param(task, second, options, id=f"{task}-{second}", marks=marks)


@pytest.mark.parametrize(("task", "attention", "options"), list(fit_cases()))
def test_fit_each_task_with_two_mechanisms(task, attention, options, tmp_path, reviews_csv):
    runs = tmp_path / "runs"
    args = tiny_args(task, runs, reviews_csv) + ["--model.attention", attention]
    for key, value in options.items():
        args += [f"--model.attention_options.{key}", str(value)]  # the documented one-flag-per-option form
    assert cli.main(["fit", *args]) == 0
    run_dir = runs / task / attention / "version_0"
    result = record(run_dir)
    assert result["status"] == "finished" and result["step"] == 4
    assert result["attention"] == attention and result["attention_options"] == options
    assert result["tokens_per_s"] > 0 and result["peak_mem_mb"] > 0
    assert math_finite(result["metrics"]["val/loss"]) and 0 <= result["metrics"]["val/acc"] <= 1
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["init_args"]["attention"] == attention
    assert saved["model"]["init_args"]["attention_options"] == options
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_run_records_the_cuda_allocators_peak(tmp_path, reviews_csv):
    # Lightning's teardown moves the module to the CPU before on_fit_end, where the record is written: a record that
    # asked the module for its device wrote the process's resident set (over 1 GB) for a run of a few MB
    runs = tmp_path / "runs"
    args = tiny_args("recall", runs, reviews_csv) + ["--model.attention", "full", "--trainer.accelerator", "gpu"]
    assert cli.main(["fit", *args]) == 0
    result = record(runs / "recall" / "full" / "version_0")
    assert result["peak_mem_mb"] == pytest.approx(torch.cuda.max_memory_allocated() / 2**20)


def math_finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def test_tensorboard_gets_the_promised_tags_and_hparams(tmp_path, reviews_csv):
    runs = tmp_path / "runs"
    assert cli.main(["fit", *tiny_args("recall", runs, reviews_csv), "--model.attention_options.backend", "math"]) == 0
    events = EventAccumulator(str(runs / "recall" / "full" / "version_0"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    expected = {"train/loss", "val/loss", "val/acc", "val/ppl", "train/tokens_per_s", "train/peak_mem_mb"}
    assert expected <= scalars, f"missing {expected - scalars}"
    # the landing page leads with the metrics: no epoch card, the learning rate under train/
    assert "train/lr/weights" in scalars and "epoch" not in scalars
    assert not any(tag.startswith("lr-") for tag in scalars)
    assert [e.step for e in events.Scalars("val/acc")] == [1, 3]  # after steps 2 and 4 (0-based)
    assert "config" in "".join(events.Tags()["tensors"])  # the resolved YAML, as TensorBoard text
    plugins = events.PluginTagToContent("hparams")
    session = plugins["_hparams_/session_start_info"].decode(errors="replace")
    assert "attention" in session and "full" in session and "backend=math" in session
    assert "_class_path" not in session and "_instantiator" not in session
    experiment = plugins["_hparams_/experiment"].decode(errors="replace")
    assert "val/acc" in experiment and "train/tokens_per_s" in experiment


def test_training_metrics_are_computed_at_the_steps_the_logger_writes_and_the_last(tmp_path, reviews_csv, monkeypatch):
    from tasks.token_prediction import TokenPrediction

    updated_at: list[int] = []
    update = TokenPrediction.update_metrics

    def counting_update(self, stage, logits, labels):
        if stage == "train":
            updated_at.append(self.global_step)
        return update(self, stage, logits, labels)

    monkeypatch.setattr(TokenPrediction, "update_metrics", counting_update)
    runs = tmp_path / "runs"
    args = tiny_args("recall", runs, reviews_csv, steps=5) + ["--trainer.log_every_n_steps", "3"]
    assert cli.main(["fit", *args, "--model.attention_options.backend", "math"]) == 0
    run_dir = runs / "recall" / "full" / "version_0"
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert updated_at == [2, 4]  # the logger's third step, and the last
    assert [e.step for e in events.Scalars("train/loss")] == [2]  # Lightning writes only its interval
    assert [e.step for e in events.Scalars("train/acc")] == [2]
    assert math_finite(record(run_dir)["metrics"]["train/loss"])


def test_wrong_attention_name_fails_before_training_listing_the_names(tmp_path, reviews_csv, capsys):
    runs = tmp_path / "runs"
    assert cli.main(["fit", *tiny_args("listops", runs, reviews_csv), "--model.attention", "linformr"]) == 2
    error = capsys.readouterr().err
    assert "zoo fit: error:" in error and "unknown attention 'linformr'" in error
    assert all(name in error for name in az.list_attentions())
    assert not any(runs.rglob("*.ckpt")) and not any(runs.rglob("events.*"))


def test_wrong_attention_option_fails_before_training_listing_the_options(tmp_path, reviews_csv, capsys):
    runs = tmp_path / "runs"
    args = [*tiny_args("listops", runs, reviews_csv), "--model.attention_options.window", "8"]
    assert cli.main(["fit", *args]) == 2
    error = capsys.readouterr().err
    assert "has no option 'window'" in error and "valid options: backend" in error
    assert not any(runs.rglob("*.ckpt"))


@pytest.mark.parametrize(
    ("config", "flag", "allowed"),
    [
        ("recall", "--data.kv_placement", "'start', 'random'"),
        ("mlm", "--data.selection", "'per_token', 'fixed_count'"),
        ("translation", "--data.split_by", "'source', 'normalised', 'catalog'"),
        ("recall", "--model.positional", "'learned', 'sinusoidal'"),
    ],
)
def test_a_bad_fixed_choice_names_the_value_and_the_choices_in_one_line(config, flag, allowed, tmp_path, capsys):
    """Not "expected null": the enclosing Union's other member, which jsonargparse lists after the option's own type."""
    args = ["fit", "-c", str(CONFIGS / f"{config}.yaml"), flag, "middle"]
    assert cli.main([*args, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]) == 2
    more = "(--verbose or ZOO_VERBOSE=1: the parser's full message)"
    assert capsys.readouterr().err == f"zoo fit: error: {flag} middle: expected one of {allowed} {more}\n"
    assert not (tmp_path / "runs").exists()


def test_pretrain_mlm_then_finetune_text_classification(tmp_path, reviews_csv, capsys):
    runs = tmp_path / "runs"
    assert cli.main(["fit", *tiny_args("mlm", runs, reviews_csv)]) == 0
    pretrained = runs / "mlm" / "full" / "version_0" / "checkpoints" / "last.ckpt"
    finetune = [*tiny_args("text", runs, reviews_csv), "--model.init_from", str(pretrained)]
    assert cli.main(["fit", *finetune]) == 0
    assert record(runs / "text" / "full" / "version_0")["status"] == "finished"

    if "nystrom" in az.list_attentions():
        wrong = [*finetune, "--model.attention", "nystrom", "--model.attention_options.num_landmarks", "4"]
        assert cli.main(["fit", *wrong]) == 2
        assert "trained with attention 'full', this model uses 'nystrom'" in capsys.readouterr().err
    assert cli.main(["fit", *finetune, "--model.dim", "32"]) == 2
    error = capsys.readouterr().err
    assert "token_embedding.weight: checkpoint (260, 16) vs model (260, 32)" in error


def test_a_resume_that_does_not_fit_the_checkpoint_is_refused_and_leaves_the_run_as_it_was(
    tmp_path, reviews_csv, capsys
):
    """``--ckpt_path last`` with other sizes failed with a size-mismatch traceback after replacing the run's
    config.yaml (and adding TensorBoard files); now nothing of the run changes and the error is one line."""
    runs = tmp_path / "runs"
    args = tiny_args("listops", runs, reviews_csv)
    assert cli.main(["fit", *args]) == 0
    run_dir = runs / "listops" / "full" / "version_0"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert cli.main(["fit", *args, "--model.dim", "32", "--ckpt_path", "last"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]  # not Lightning's INFO
    assert len(errors) == 1 and errors[0].startswith("zoo fit: error: --ckpt_path last")
    assert "dim 32 (checkpoint: 16)" in errors[0] and "last.ckpt" in errors[0]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["version_0"]
    assert cli.main(["validate", *args, "--model.depth", "2", "--ckpt_path", "last"]) == 2
    assert "depth 2 (checkpoint: 1)" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_validate_and_test_subcommands_read_a_checkpoint(tmp_path, reviews_csv, capsys):
    runs = tmp_path / "runs"
    args = tiny_args("listops", runs, reviews_csv)
    assert cli.main(["fit", *args]) == 0
    checkpoint = runs / "listops" / "full" / "version_0" / "checkpoints" / "last.ckpt"
    for command in ("validate", "test"):
        assert cli.main([command, *args, "--ckpt_path", str(checkpoint)]) == 0
    assert "test/acc" in capsys.readouterr().out


def zoo(args: list[str], tmp_path: Path) -> subprocess.Popen:
    """``zoo <args>`` in a subprocess (one torch thread, the test's cache), output to a log file."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "ZOO_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / f"zoo-{time.monotonic_ns()}.log", "w")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen([sys.executable, "-m", "experiments.cli", *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip


CHECKPOINT_EVERY_20 = json.dumps(
    [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
      "init_args": {"every_n_train_steps": 20, "save_last": True, "save_top_k": 0}}]
)  # fmt: skip


@pytest.mark.slow
def test_sigkilled_run_resumes_from_its_last_checkpoint_and_finishes(tmp_path, reviews_csv):
    runs = tmp_path / "runs"
    steps = 400
    args = tiny_args("recall", runs, reviews_csv, steps=steps)
    args += ["--trainer.val_check_interval", "100", "--trainer.callbacks", CHECKPOINT_EVERY_20]
    run_dir = runs / "recall" / "full" / "version_0"
    last = run_dir / "checkpoints" / "last.ckpt"
    process = zoo(["fit", *args], tmp_path)
    deadline = time.monotonic() + 120
    while not last.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert last.exists(), "no checkpoint appeared"
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    killed_at = torch.load(last, weights_only=True)["global_step"]
    assert 0 < killed_at < steps, "the run was not killed mid-training"
    killed = record(run_dir)
    assert killed["status"] == "running" and killed["fit_seconds"] > 0
    earlier_seconds = 1000.0  # far above what one sitting here takes, so the sum is unmistakable
    (run_dir / "run.json").write_text(json.dumps(killed | {"fit_seconds": earlier_seconds}))

    started = time.monotonic()
    resumed = zoo(["fit", *args, "--ckpt_path", "last"], tmp_path)
    assert resumed.wait(timeout=180) == 0
    resumed_wall = time.monotonic() - started
    result = record(run_dir)  # the same directory: --ckpt_path last found the newest version of "full"
    assert result["status"] == "finished" and result["step"] == steps
    assert result["start_step"] == killed_at  # continued from the checkpoint, not restarted
    assert result["sittings"] == 2  # the wall time of both sittings
    assert earlier_seconds < result["fit_seconds"] < earlier_seconds + resumed_wall
    assert torch.load(last, weights_only=True)["global_step"] == steps
    assert not (runs / "recall" / "full" / "version_1").exists()


@pytest.mark.slow
def test_ddp_on_cpu_with_two_processes(tmp_path, reviews_csv):
    runs = tmp_path / "runs"
    args = tiny_args("listops", runs, reviews_csv, steps=6)
    args += ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    process = zoo(["fit", *args], tmp_path)
    assert process.wait(timeout=120) == 0
    result = record(runs / "listops" / "full" / "version_0")
    assert result["status"] == "finished" and result["world_size"] == 2 and result["step"] == 6
    assert math_finite(result["metrics"]["val/loss"])
