"""Accuracy, time and memory in one table (experiments/compare/axes.py) and zoo report's Pareto rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.compare import axes
from experiments.compare.report import pareto_front
from experiments.compare.summary import RUN_COLUMNS, write_runs, write_summary
from experiments.stats import Interval
from tests.experiments.tiny_recall import RECALL, ROOT, compare_command, fit_args, runs_of

#: accuracy per seed: local about +0.005 on full (on par at the 0.01 margin), self_only far below (worse)
ACCURACY = {"full": [0.90, 0.91, 0.92], "local": [0.904, 0.915, 0.926], "self_only": [0.10, 0.12, 0.11]}
OPTIONS = {"full": {}, "local": {"window": 16, "impl": "dense"}, "self_only": {}}
#: bench timings (ms at n = 32, 64) and peak MB at 64: self_only fastest, local faster than full
TIMES = {"full": (2.0, 8.0, 5.0), "local": (1.0, 2.5, 1.5), "self_only": (0.5, 0.75, 0.25)}


def _run(name: str, seed: int) -> dict:
    row = dict.fromkeys(RUN_COLUMNS)
    row |= {"mechanism": name, "attention": name, "options": json.dumps(OPTIONS[name]), "options_from": "config",
            "seed": seed, "status": "ok", "validated": "yes", "val_acc": ACCURACY[name][seed], "val_loss": 1.0,
            "tokens_per_s": 1000.0 * (1 + (name != "full")), "train_mem_mb": 10.0, "reason": ""}  # fmt: skip
    return row


def _timing(name: str, n: int, ms: float, peak_mb: float) -> dict:
    options = axes.bench_spec(axes.AttentionSpec(name)).options  # the bench times the default budget and kernel
    return {"kind": "time", "status": "ok", "attention": name, "options": options, "seq_len": n, "mode": "fwd+bwd",
            "dtype": "float32", "level": "core", "causal": False, "time_ms_median": ms, "peak_mb": peak_mb}  # fmt: skip


@pytest.fixture
def experiment(tmp_path: Path) -> tuple[Path, Path]:
    """A finished comparison of three mechanisms (three seeds) and a bench folder with their timings at 32 and 64."""
    directory, bench = tmp_path / "exp", tmp_path / "exp" / "bench"
    bench.mkdir(parents=True)
    rows = [_run(name, seed) for seed in range(3) for name in ACCURACY]
    write_runs(directory, rows)
    write_summary(directory, rows, ["# zoo compare: exp"])
    lines = [_timing(name, n, ms, mb if n == 64 else 99.0) for name, (t32, t64, mb) in TIMES.items()
             for n, ms in ((32, t32), (64, t64))]  # fmt: skip
    (bench / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return directory, bench


def _table(markdown: str) -> dict[str, list[str]]:
    """The joined table's rows by mechanism: the cells after the mechanism's name."""
    section = markdown.split("## Accuracy, time and memory", 1)[1]
    return {cells[0]: cells[1:] for line in section.splitlines() if line.startswith("| ") and "---" not in line
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}  # fmt: skip


def test_the_joined_table_has_accuracy_verdict_time_memory_and_which_n(experiment):
    directory, bench = experiment
    written = axes.write_axes(directory, bench)
    assert written == ["report.md", "pareto.png", axes.PLOT]
    assert all((directory / name).is_file() for name in written)
    for name in ("summary.md", "report.md"):
        markdown = (directory / name).read_text()
        assert (
            "time: median ms of the attention core at its default budget for long sequences (zoo bench's), "
            "forward+backward, float32, one thread, at n = 32, 64" in markdown
        )
        assert "memory: the peak a call added at n = 64" in markdown
        table = _table(markdown)
        assert table["mechanism"] == ["val_acc (the task's length)", "verdict", "ms (n = 32)", "ms (n = 64)",
                                      "peak MB (n = 64)", "Pareto"]  # fmt: skip
        # means of ACCURACY, verdicts by the rule, times and memory as the bench recorded them (default budgets)
        assert table["full"][0].startswith("0.910") and table["full"][1:] == ["reference", "2", "8", "5", ""]
        assert table["local"][0].startswith("0.915") and table["local"][1:] == ["on par", "1", "2.5", "1.5", "yes"]
        assert table["self_only"][0].startswith("0.110")
        assert table["self_only"][1:] == ["worse", "0.5", "0.75", "0.25", ""]  # fastest, but worse: not on the front


def test_the_task_length_is_named_when_the_runs_record_it(experiment):
    directory, bench = experiment
    run = directory / "full" / "seed-0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("data:\n  class_path: tasks.data.recall.RecallDataModule\n  init_args:\n"
                                     "    seq_len: 48\n")  # fmt: skip
    axes.write_axes(directory, bench)
    assert "| mechanism | val_acc (n = 48) | verdict |" in (directory / "summary.md").read_text()


def _point(name: str, speedup: float, accuracy: float, verdict: str) -> dict:
    return {"summary": {"mechanism": name, "verdict": verdict}, "speedup": speedup,
            "metric": Interval(3, accuracy, 0.0, accuracy, accuracy)}  # fmt: skip


@pytest.mark.parametrize("verdict", ["worse", "not validated"])
def test_a_mechanism_worse_or_not_validated_is_off_the_front_however_fast(verdict):
    points = [_point("full", 1.0, 0.99, "reference"), _point("local", 1.02, 0.05, verdict),
              _point("moba", 0.8, 0.99, "on par")]  # fmt: skip
    # judged on speed and the metric alone, local was on the front: nothing is faster
    unjudged = [p | {"summary": {**p["summary"], "verdict": "inconclusive"}} for p in points]
    assert [p["summary"]["mechanism"] for p in pareto_front(unjudged, lower_better=False)] == ["full", "local"]
    assert [p["summary"]["mechanism"] for p in pareto_front(points, lower_better=False)] == ["full"]


def test_a_failed_benchmark_keeps_the_summary(experiment):
    directory, _ = experiment
    before = (directory / "summary.md").read_text()
    said: list[str] = []
    spec = axes.AttentionSpec("linformer", {"k": 64})  # more slots than the n = 32 tokens: no case can run
    assert axes.long_n_axes(directory, [spec], [32], say=said.append) == []
    assert len(said) == 1 and said[0].startswith("zoo compare: warning: no benchmark at long n (ValueError")
    assert "k" in said[0] and said[0].endswith("the summary stands")
    assert (directory / "summary.md").read_text() == before
    assert not (directory / axes.PLOT).exists() and not (directory / "report.md").exists()


def test_the_benchmark_times_the_default_budget_and_kernel_not_the_comparisons():
    from experiments.bench.command import default_attentions

    expected = next(spec for spec in default_attentions() if spec.name == "moba")
    assert axes.bench_spec(axes.AttentionSpec("moba", {"block_size": 2, "top_k": 16, "impl": "dense"})) == expected
    assert "impl" not in expected.options and expected.options.get("block_size") != 2
    # a switch is a variant of the mechanism, not a size: it is timed with it
    local = next(spec for spec in default_attentions() if spec.name == "local")
    sink = axes.bench_spec(axes.AttentionSpec("local", {"window": 62, "sink_logit": True, "impl": "dense"}))
    assert sink == axes.AttentionSpec("local", {**local.options, "sink_logit": True})


def test_the_tiniest_compare_ends_with_the_joined_table(tmp_path):
    """``zoo compare --long-n [32]``: two tiny runs, then zoo bench of both at n = 32 into <experiment>/bench/."""
    args = ["--task-config", RECALL, "--attentions", "full,self_only", "--runs-dir", str(tmp_path / "runs"),
            "--fit-args", json.dumps(fit_args(max_steps=2)), "--jobs", "1", "--long-n", "[32]"]  # fmt: skip
    zoo = compare_command(tmp_path / "cache", ROOT, *args)
    result = zoo("--experiment", "axes")
    directory = tmp_path / "runs" / "axes"
    runs_of(result, directory)
    assert "no benchmark" not in result.stderr, result.stderr
    timed = [json.loads(line) for line in (directory / "bench" / "results.jsonl").read_text().splitlines()]
    assert {(r["attention"], r["seq_len"], r["mode"], r["threads"]) for r in timed if r.get("kind") == "time"} == {
        ("full", 32, "fwd+bwd", 1), ("self_only", 32, "fwd+bwd", 1)}  # fmt: skip
    table = _table((directory / "summary.md").read_text())
    assert table["mechanism"][:4] == ["val_acc (n = 32)", "verdict", "ms (n = 32)", "peak MB (n = 32)"]
    assert table["full"][1] == "reference" and set(table) == {"mechanism", "full", "self_only"}
    assert all(float(table[name][2]) > 0 for name in ("full", "self_only"))
    assert (directory / axes.PLOT).is_file() and (directory / "report.md").is_file()


def test_a_causal_task_is_timed_causally(tmp_path):
    """With ``--model.causal true`` the runs attend causally, and so does the benchmark: a causal-only core (which a
    bidirectional benchmark refuses) gets its time, against causal full attention."""
    args = ["--task-config", RECALL, "--attentions", "full,gated_deltanet", "--runs-dir", str(tmp_path / "runs"),
            "--fit-args", json.dumps([*fit_args(max_steps=2), "--model.causal", "true"]), "--jobs", "1",
            "--long-n", "[32]"]  # fmt: skip
    zoo = compare_command(tmp_path / "cache", ROOT, *args)
    result = zoo("--experiment", "causal")
    directory = tmp_path / "runs" / "causal"
    runs_of(result, directory)
    assert axes.task_causal(directory) and "no benchmark" not in result.stderr, result.stderr
    timed = [json.loads(line) for line in (directory / "bench" / "results.jsonl").read_text().splitlines()]
    assert {(r["attention"], r["causal"], r["status"]) for r in timed if r.get("kind") == "time"} == {
        ("full", True, "ok"), ("gated_deltanet", True, "ok")}  # fmt: skip
    summary = (directory / "summary.md").read_text()
    assert "forward+backward, causal, float32" in summary and float(_table(summary)["gated_deltanet"][2]) > 0
