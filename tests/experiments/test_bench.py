"""The benchmark harness (``zoo bench``) on tiny sizes: what it records, how it fails, resumes and renders.

No timing asserts: times are only checked to be present and positive.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
from rich.console import Console

import attention_zoo as az
from attention_zoo import registry
from attention_zoo.full import FullAttention
from experiments import cli, preload
from experiments.bench import measure as bench_measure
from experiments.bench import runner as bench_runner
from experiments.bench import tables as bench_tables
from experiments.bench import targets
from experiments.bench.cases import BenchConfig, Case, SweepEntry, expand, invalid_entries, load_config
from experiments.bench.command import with_baseline
from experiments.bench.flops import _window_pairs, case_flops
from experiments.bench.measure import measure_case
from experiments.bench.plots import write_tensorboard
from experiments.bench.report import write_outputs
from experiments.bench.runner import Runner, precheck
from experiments.bench.store import ResultStore, case_of


def core_case(attention="full", options=None, n=64, **changes) -> Case:
    """The targets' protocol case (float32 fwd+bwd on the CPU, batch 1), at 2 heads of 8 dimensions, one thread."""
    case = targets.protocol_case(attention, options or {}, n, threads=1)
    return dataclasses.replace(case, **({"heads": 2, "dim_head": 8} | changes))


def row_of(case: Case, **result) -> dict:
    return dataclasses.asdict(case) | {"status": "ok", "detail": ""} | result


# --- sweep definition ---------------------------------------------------------------------------------


def test_sweep_entries_read_the_flag_syntax_as_typed():
    text = "full,linformer:k=128,lsh:n_hashes=4,bucket_size=64,nystrom:num_landmarks=32:pinv=exact,x:v=1e3,y:a=yes"
    entries = load_config(None, {"attentions": text}).attentions
    assert [e.spec for e in entries] == az.spec.parse_list(text)
    assert [(e.spec.name, e.spec.options) for e in entries] == [
        ("full", {}),
        ("linformer", {"k": 128}),
        ("lsh", {"n_hashes": 4, "bucket_size": 64}),
        ("nystrom", {"num_landmarks": 32, "pinv": "exact"}),
        ("x", {"v": 1000.0}),  # bench once read the string '1e3'
        ("y", {"a": "yes"}),  # and True
    ]
    assert entries[1].spec.label == "linformer:k=128" and (entries[1].min_seq_len, entries[1].max_seq_len) == (1, None)
    with pytest.raises(ValueError, match="follows no 'name:' entry"):
        load_config(None, {"attentions": "k=3,full"})


def test_a_sweep_checks_every_entry_against_the_registry(capsys):
    config = BenchConfig(attentions=[az.AttentionSpec("linformer", {"kk": 8}), az.AttentionSpec("lokal")])
    problems = invalid_entries(config)
    assert problems[0].startswith("linformer:kk=8: attention 'linformer' has no option 'kk'; valid options: k: ")
    assert problems[1].startswith("lokal: unknown attention 'lokal'; known: ")
    argv = ["bench", "--check-targets", "--attentions", "lokal", "--out", "unused"]
    assert cli.main(argv) == 2 and "unknown attention 'lokal'; known: " in capsys.readouterr().err


def test_yaml_then_command_line(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(
        "attentions:\n  - full\n  - {attention: linformer, options: {k: 64}, min_seq_len: 256}\n"
        "seq_lens: [128, 256]\nmodes: [fwd]\n"
    )
    config = load_config(path, {"seq_lens": [128, 256, 512]})
    assert config.modes == ["fwd"] and config.seq_lens == [128, 256, 512]
    cases = expand(config, "cpu")
    assert [(c.attention, c.seq_len) for c in cases] == [
        ("full", 128),
        ("full", 256),
        ("linformer", 256),
        ("full", 512),
        ("linformer", 512),
    ]
    path.write_text("seq_len: [1]\n")
    with pytest.raises(ValueError, match="unknown key"):
        load_config(path, {})
    with pytest.raises(ValueError, match="modes"):
        BenchConfig(modes=["backward"])


def test_default_sweep_covers_every_registered_mechanism_and_the_baseline():
    config = with_baseline(BenchConfig())
    names = [e.spec.name for e in config.attentions]
    assert set(names) == set(az.list_attentions())
    assert names.count("full") == 1
    only_linformer = with_baseline(BenchConfig(attentions=[az.AttentionSpec("linformer", {"k": 8})]))
    assert only_linformer.attentions[0] == SweepEntry(az.AttentionSpec("full"))


def test_case_key_ignores_model_sizes_that_do_not_apply():
    a = expand(BenchConfig(attentions=[az.AttentionSpec("full")], dim=32, seq_lens=[64]), "cpu")[0]
    b = expand(BenchConfig(attentions=[az.AttentionSpec("full")], dim=64, seq_lens=[64]), "cpu")[0]
    assert a.key() == b.key()  # the core level has no model width
    c, d = (
        expand(BenchConfig(attentions=[az.AttentionSpec("full")], dim=w, levels=["layer"], seq_lens=[64]), "cpu")[0]
        for w in (32, 64)
    )
    assert c.key() != d.key()


def test_tensorboard_runs_are_named_by_the_spec_folder(tmp_path):
    rows = [row_of(core_case(name, options), time_ms_median=1.0, peak_mb=1.0) for name, options in
            (("full", {}), ("linformer", {"k": 16, "sharing": "kv"}), ("local", {"window": 8}))]  # fmt: skip
    write_tensorboard(rows, tmp_path)
    folders = {p.name for p in tmp_path.iterdir()}
    assert folders == {"full", "linformer-k=16-sharing=kv", "local-window=8"}
    assert folders == {bench_tables.spec(row).folder for row in rows}


# --- measuring ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["core", "mha", "layer", "encoder"])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_every_level_and_mode_measures(level, mode):
    config = BenchConfig(levels=[level], modes=[mode], seq_lens=[32], heads=[2], dim_head=[8], depth=2)
    case = expand(dataclasses.replace(config, attentions=[az.AttentionSpec("full")]), "cpu")[0]
    result = measure_case(case, repeats=2, warmup=1)
    assert result["status"] == "ok", result
    assert 0 < result["time_ms_min"] <= result["time_ms_median"] <= result["time_ms_max"]
    assert result["memory_method"] == "rss-hwm" and result["total_mb"] >= result["peak_mb"] >= 0


def test_cpu_memory_sees_the_attention_matrix():
    """The math backend materialises B H n^2 scores (and their softmax): the peak must exceed them."""
    case = core_case(options={"backend": "math"}, n=512, heads=8, mode="fwd")
    result = measure_case(case, repeats=1, warmup=1)
    scores_mb = 8 * 512 * 512 * 4 / 2**20
    assert result["status"] == "ok" and result["peak_mb"] >= scores_mb


def test_allocated_peak_is_the_most_bytes_live_at_once():
    kept = torch.ones(2**18)  # allocated before the call: neither counted nor, when freed, subtracted
    held = []

    def step() -> None:
        first = torch.empty(2**20)  # 4 MiB
        held.append(torch.empty(2**19))  # 2 MiB, kept past the call
        del first
        held.append(torch.empty(3 * 2**18))  # 3 MiB: 5 live, fewer than the 6 before
        held.clear()
        kept.resize_(0)

    assert bench_measure.allocated_peak(step) == 6 * 2**20


def test_allocated_peak_sees_the_attention_matrix():
    """The math backend materialises B H n^2 scores; the allocated peak counts them, nothing of malloc's pages."""
    case = core_case(options={"backend": "math"}, n=512, heads=8, mode="fwd")
    result = measure_case(case, repeats=1, warmup=1)
    scores_mb = 8 * 512 * 512 * 4 / 2**20
    assert result["status"] == "ok" and scores_mb <= result["allocated_peak_mb"] <= 4 * scores_mb


def test_failures_are_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    class Exploding(FullAttention):
        def attend(self, q, k, v, *, mask, causal):
            raise RuntimeError("boom")

    class Starving(FullAttention):
        def attend(self, q, k, v, *, mask, causal):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    class NotCausal(FullAttention):
        supports_causal = False

    for name, cls in (("exploding", Exploding), ("starving", Starving), ("not_causal", NotCausal)):
        monkeypatch.setitem(registry._REGISTRY, name, cls)
    store = ResultStore(tmp_path)
    runner = Runner(BenchConfig(isolation="none", repeats=1, warmup=0), store, "cpu")
    cases = [
        core_case("exploding"),
        core_case("starving"),
        core_case("not_causal", causal=True),
        core_case("no_such_attention"),
        core_case("full", {"bakcend": "math"}),
        core_case("full", {"backend": "math"}, n=32, heads=3),  # the core is built for heads=3: fine
        core_case("full"),
    ]
    assert runner.run(cases) == len(cases)
    statuses = [store.latest()[c.key()]["status"] for c in cases]
    assert statuses == ["error", "oom", "unsupported", "unsupported", "error", "ok", "ok"]
    assert "boom" in store.latest()[cases[0].key()]["detail"]


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "subprocess"])
def test_isolated_worker_out_of_memory_and_timeout(tmp_path, monkeypatch, forked):
    """A real allocation beyond the budget fails inside the worker (RLIMIT_AS) and is recorded as oom, in a worker
    forked from the preloaded server and in the plain subprocess used where there is none."""
    monkeypatch.setattr(preload, "available", lambda: forked)
    config = BenchConfig(repeats=1, warmup=0, memory_budget_gb=0.05)
    runner = Runner(config, ResultStore(tmp_path), "cpu")
    big = core_case(options={"backend": "math"}, n=1024, batch=4, heads=8, mode="fwd")  # 128 MB of scores
    result = runner.measure(big, repeats=1, warmup=0)
    assert result["status"] == "oom", result
    slow = runner.measure(core_case(), repeats=1, warmup=0, timeout_s=0.01)
    assert slow["status"] == "timeout"
    fits = Runner(BenchConfig(), ResultStore(tmp_path), "cpu").measure(core_case(mode="fwd"), repeats=1, warmup=0)
    assert fits["status"] == "ok" and fits["memory_method"] == "rss-hwm" and fits["peak_mb"] >= 0


def test_max_batch_search_doubles_then_bisects(tmp_path, monkeypatch):
    limit, asked = 37, []

    def fake_measure(self, case, *, repeats, warmup, timeout_s=None):
        asked.append(case.batch)
        if case.batch > limit:
            return {"status": "oom", "detail": "too big"}
        return {"status": "ok", "time_ms_median": 2.0 * case.batch, "total_mb": case.batch, "peak_mb": 1.0}

    monkeypatch.setattr(Runner, "measure", fake_measure)
    runner = Runner(BenchConfig(max_batch=True, max_batch_cap=1000), ResultStore(tmp_path), "cpu")
    result = runner.search_max_batch(dataclasses.replace(core_case(), batch=None, kind="max_batch"))
    assert result["max_batch"] == limit and result["limited_by"] == "memory"
    assert asked[:7] == [1, 2, 4, 8, 16, 32, 64] and asked[-1] == limit
    assert result["ms_per_sequence_at_max_batch"] == pytest.approx(2.0)
    capped = Runner(BenchConfig(max_batch=True, max_batch_cap=16), ResultStore(tmp_path), "cpu")
    assert capped.search_max_batch(core_case(batch=None, kind="max_batch"))["limited_by"] == "cap"


def test_precheck_needs_no_process():
    assert precheck(core_case()) is None
    assert precheck(core_case("no_such_attention"))["status"] == "unsupported"


# --- the store ----------------------------------------------------------------------------------------


def test_store_drops_a_half_written_line_and_resumes(tmp_path):
    store = ResultStore(tmp_path)
    first, second = core_case(n=32), core_case(n=64)
    store.append(row_of(first, time_ms_median=1.0))
    with open(store.path, "ab") as handle:  # a kill in the middle of the second append
        handle.write(json.dumps(row_of(second, time_ms_median=2.0)).encode()[:40])
    with pytest.warns(UserWarning, match="half-written"):
        reopened = ResultStore(tmp_path)
    assert list(reopened.latest()) == [first.key()]
    reopened.append(row_of(second, time_ms_median=2.0))
    lines = store.path.read_text().splitlines()
    assert [json.loads(line)["seq_len"] for line in lines] == [32, 64]
    assert case_of(json.loads(lines[1])) == second


def test_rerun_skips_finished_cases(tmp_path):
    config = BenchConfig(isolation="none", repeats=1, warmup=0)
    cases = [core_case(n=32), core_case(n=48)]
    assert Runner(config, ResultStore(tmp_path), "cpu").run(cases) == 2
    store = ResultStore(tmp_path)
    assert Runner(config, store, "cpu").run(cases + [core_case(n=64)]) == 1
    assert len(store.path.read_text().splitlines()) == 3


def test_rounds_measure_the_sweep_again_and_keep_each_case_fastest(tmp_path, monkeypatch):
    calls = iter(range(100))  # the cases' calls take 3, 2, 1, 7, 6, 5 s; the matmul peak's (5 repeats) 1 s
    fake = lambda step, warmup, repeats, device: [1.0] * 5 if repeats == 5 else [(30 - next(calls)) % 7 + 1.0]
    monkeypatch.setattr(bench_measure, "time_calls", fake)
    config = BenchConfig(isolation="none", repeats=1, warmup=0, rounds=3)
    cases = [core_case(n=32), core_case(n=48)]
    store = ResultStore(tmp_path)
    store.append(row_of(cases[0], time_ms_min=0.5, code="other-code"))  # other code: neither counted nor chosen
    assert Runner(config, store, "cpu").run(cases[:1]) == 3
    assert Runner(config, store, "cpu").run(cases) == 3
    seconds = {c.key(): [r["time_ms_min"] for r in store.rows[1:] if case_of(r) == c] for c in cases}
    assert seconds == {cases[0].key(): [3e3, 2e3, 1e3], cases[1].key(): [7e3, 6e3, 5e3]}
    best = store.best()
    assert [best[c.key()]["time_ms_min"] for c in cases] == [1e3, 5e3] and best[cases[1].key()]["rounds"] == 3
    assert Runner(config, ResultStore(tmp_path), "cpu").run(cases) == 0
    assert Runner(dataclasses.replace(config, rounds=4), ResultStore(tmp_path), "cpu").run(cases) == 2


def test_a_case_that_fails_is_not_measured_again_in_later_rounds(tmp_path, monkeypatch):
    good, bad = core_case(n=32), core_case(n=48)
    ok = {"status": "ok", "time_ms_min": 1.0, "time_ms_median": 1.0, "peak_mb": 1.0}
    result = lambda case: {"status": "error", "detail": "boom"} if case == bad else ok
    monkeypatch.setattr(Runner, "time_case", lambda self, case: result(case))
    store = ResultStore(tmp_path)
    config = BenchConfig(isolation="none", repeats=1, warmup=0, rounds=3)
    assert Runner(config, store, "cpu").run([good, bad]) == 4
    assert [case_of(row).seq_len for row in store.rows] == [32, 48, 32, 32]
    assert Runner(config, ResultStore(tmp_path), "cpu").run([good, bad]) == 0


def test_a_failed_round_is_not_a_result_but_counts_unless_retried(tmp_path):
    case = core_case(n=32)
    store = ResultStore(tmp_path)
    code = bench_runner.code_fingerprint()
    store.append(row_of(case, time_ms_min=2.0, code=code))
    store.append(row_of(case, status="error", detail="boom", code=code))
    assert store.best()[case.key()]["time_ms_min"] == 2.0 and store.latest()[case.key()]["status"] == "error"
    pending = lambda cases, rounds=2, **kw: bench_runner.pending_cases(store, cases, rounds=rounds, **kw)[0]
    assert pending([case], retry_failed=False) == [] and pending([case], retry_failed=True) == [case]
    other = core_case(n=48)  # round after round, the rounds a case lacks interleaved with the others'
    assert pending([other, case], retry_failed=True) == [other, other, case]
    assert pending([other, case], rounds=3, retry_failed=True) == [other, other, case, other, case]
    store.append(row_of(case, time_ms_min=3.0, code=code))  # retried and measured: its later rounds are due again
    assert pending([case], rounds=3, retry_failed=False) == [case]


def test_results_of_other_code_are_measured_again(tmp_path, monkeypatch):
    config = BenchConfig(isolation="none", repeats=1, warmup=0)
    cases = [core_case(n=32)]
    assert Runner(config, ResultStore(tmp_path), "cpu").run(cases) == 1
    monkeypatch.setattr(bench_runner, "code_fingerprint", lambda: "edited-code")
    store = ResultStore(tmp_path)
    assert Runner(config, store, "cpu").run(cases) == 1  # the stored row was measured with other code
    assert store.latest()[cases[0].key()]["code"] == "edited-code"
    assert Runner(config, ResultStore(tmp_path), "cpu").run(cases) == 0


def test_zoo_bench_end_to_end_in_worker_processes(tmp_path, capsys):
    """The issue's command, tiny: isolated workers, every output file, then a resume that runs nothing."""
    argv = ["bench", "--attentions", "full", "--seq-lens", "64,128", "--mode", "fwd+bwd"]
    argv += ["--heads", "2", "--dim-head", "8", "--repeats", "2", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    rows = list(ResultStore(tmp_path).latest().values())
    assert len(rows) == 2 and {r["status"] for r in rows} == {"ok"}
    for row in rows:
        assert row["time_ms_median"] > 0 and row["peak_mb"] >= 0 and row["total_mb"] > 0
        assert row["flops"] == 3 * 4 * 2 * row["seq_len"] ** 2 * 8 and row["gflops_per_s"] > 0
        assert row["machine"]["torch"] == torch.__version__ and row["threads"] == 1
    csv_header = (tmp_path / "results.csv").read_text().splitlines()[0].split(",")
    assert {"time_ms_median", "time_ms_min", "time_ms_max", "peak_mb", "status", "machine.cpu_model"} <= set(csv_header)
    report = (tmp_path / "report.md").read_text()
    assert "| full | " in report and "1 (the CPU default is 1" in report
    assert list((tmp_path / "plots").glob("*.png"))
    assert list((tmp_path / "tensorboard" / "full").glob("events.out.tfevents.*"))
    capsys.readouterr()
    assert cli.main(argv) == 0
    assert "resuming: 2 of 2 cases" in capsys.readouterr().out
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2


def test_every_mechanism_benches_at_its_defaults(tmp_path):
    """``zoo bench --attentions <name>`` with no options: each mechanism's own defaults (Linformer's k = None,
    resolved by the core) must measure and get its FLOPs, not crash the sweep; a causal-only core, in a causal
    sweep, and refused in one line in a bidirectional one."""
    argv = ["bench", "--attentions", ",".join(az.list_attentions()), "--seq-lens", "16", "--mode", "fwd"]
    argv += ["--heads", "2", "--dim-head", "8", "--repeats", "1", "--warmup", "0", "--isolation", "none"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    rows = {row["attention"]: row for row in ResultStore(tmp_path).latest().values()}
    assert set(rows) == set(az.list_attentions())
    causal_only = set(az.list_attentions(causal_only=True))
    assert {name: row["status"] for name, row in rows.items() if row["status"] != "ok"} == dict.fromkeys(
        causal_only, "unsupported"
    )
    assert all(rows[name]["detail"] == f"{name} is causal only: time it with --causal" for name in causal_only)
    if causal_only:
        argv[2] = ",".join(sorted(causal_only))
        assert cli.main([*argv, "--causal", "--out", str(tmp_path / "causal")]) == 0
        causal_rows = ResultStore(tmp_path / "causal").latest().values()
        assert {row["attention"]: row["status"] for row in causal_rows} == dict.fromkeys(causal_only | {"full"}, "ok")
    per_head = 2 * (2 * 16 * 16 * 8) + 4 * 16 * 16 * 8  # E K, F V and the two products, k = min(256, n) = 16
    assert rows["linformer"]["flops"] == 2 * per_head


# --- tables, FLOPs, targets ---------------------------------------------------------------------------


def fixture_rows() -> list[dict]:
    """Full attention and Linformer k=128/256 at n = 512..2048, timed and max-batch searched."""
    times = {"full": {512: 1.0, 1024: 4.0, 2048: 16.0}, 128: {512: 2.0, 1024: 2.0, 2048: 4.0}, 256: {1024: 4.0}}
    memory = {"full": 54.0, 128: 41.0, 256: 81.0}
    batches = {"full": {512: 10, 1024: 4, 2048: 1}, 128: {512: 17, 1024: 12, 2048: 6}, 256: {1024: 8}}
    rows = []
    for config, per_n in times.items():
        attention, options = ("full", {}) if config == "full" else ("linformer", {"k": config})
        for n, ms in per_n.items():
            case = core_case(attention, options, n=n, heads=8, dim_head=64)
            rows.append(row_of(case, time_ms_median=ms, peak_mb=memory[config], flops=None))
            search = dataclasses.replace(case, batch=None, kind="max_batch")
            batch = batches[config][n]
            rows.append(row_of(search, max_batch=batch, limited_by="memory", ms_per_sequence_at_max_batch=ms / batch))
    rows.append(row_of(core_case("linformer", {"k": 256}, n=2048, heads=8, dim_head=64), status="oom"))
    return rows


def test_nystromformer_layout_from_fixture():
    table = bench_tables.nystromformer_table(fixture_rows())
    assert "| self-attention | n=512 memory (MB) | n=512 time (ms) | n=1024 memory (MB) |" in table
    assert "| full | 54 (1.0x) | 1 (1.0x) | 54 (1.0x) | 4 (1.0x) | 54 (1.0x) | 16 (1.0x) |" in table
    assert "| linformer:k=128 | 41 (1.3x) | 2 (0.5x) | 41 (1.3x) | 2 (2.0x) | 41 (1.3x) | 4 (4.0x) |" in table
    assert "| linformer:k=256 | - | - | 81 (0.67x) | 4 (1.0x) | oom | oom |" in table


def test_linformer_table3_layout_from_fixture():
    text = bench_tables.linformer_table(fixture_rows())
    by_max_batch, at_fixed_batch = text.split("#### linformer vs full")[1:]
    assert "largest batch" in by_max_batch
    # time per sequence at each one's largest batch: full 1/10 vs 2/17 ms at n=512, 16/1 vs 4/6 at 2048
    assert "| 512 | 0.85x | - |" in by_max_batch and "| 2048 | 24x | - |" in by_max_batch
    assert "| 512 | 1.7x | - |" in by_max_batch and "| 1024 | 3.0x | 2.0x |" in by_max_batch
    assert "a bound" not in by_max_batch  # every search in the fixture stopped at the memory limit
    assert "| 1024 | 2.0x | 1.0x |" in at_fixed_batch and "| 2048 | 4.0x | oom |" in at_fixed_batch


def test_crossover_is_where_a_mechanism_stays_faster():
    base = {n: {"status": "ok", "time_ms_median": float(n)} for n in (512, 1024, 2048)}
    mech = lambda *ms: {n: {"status": "ok", "time_ms_median": t} for n, t in zip((512, 1024, 2048), ms, strict=True)}
    assert bench_tables.crossover(mech(600, 900, 1000), base) == "1024"
    assert bench_tables.crossover(mech(100, 2000, 1000), base) == "2048"
    assert bench_tables.crossover(mech(100, 200, 300), base) == "<= 512"
    assert bench_tables.crossover(mech(600, 2000, 3000), base) == "> 2048"
    table = bench_tables.crossover_table(fixture_rows())
    assert (
        "| linformer:k=128 | core · fwd+bwd · float32 · cpu · B=1 · H=8 · D=64 · 1 thread | 1024 | 2048 | 4.0x |"
        in (table)
    )


def test_flops_formulas():
    case = core_case(n=100, batch=3, heads=2, dim_head=8)
    assert case_flops(case) == 3 * 4 * 3 * 2 * 100**2 * 8  # fwd+bwd = 3x the forward
    assert case_flops(dataclasses.replace(case, mode="fwd")) == 4 * 3 * 2 * 100**2 * 8
    assert case_flops(core_case("no_such_attention")) is None
    # gated_deltanet: the paper's recurrence, 8 d^2 per position and head; causal only
    recurrent = core_case("gated_deltanet", n=100, batch=3, heads=2, dim_head=8, causal=True, mode="fwd")
    assert case_flops(recurrent) == 3 * 2 * 8 * 100 * 8**2
    assert case_flops(dataclasses.replace(recurrent, causal=False)) is None
    # nsa: 4 d per (query, key) pair of its three branches, here at n = 8 with blocks of 2 (stride 2), selected
    # blocks of 2 (3 of them), a window of 3: per query 0..7, compressed 0,1,1,2,2,3,3,4; selected 1,2,3,4,5,6,5,6;
    # window 1,2,3,3,3,3,3,3
    sparse = dataclasses.replace(recurrent, attention="nsa", seq_len=8, batch=1, heads=1,
                                 options={"compress_block": 2, "compress_stride": 2, "select_block": 2,
                                          "select_count": 3, "window": 3})  # fmt: skip
    assert case_flops(sparse) == 4 * 8 * ((0 + 1 + 1 + 2 + 2 + 3 + 3 + 4) + 32 + 21)


def test_pattern_flops_count_the_papers_pairs():
    # Child et al.'s strided pattern, by its definition: |i - j| <= l or (i - j) mod l = 0 (causal: and j <= i)
    n, stride = 50, 6
    for causal in (False, True):
        pairs = sum(
            1
            for i in range(n)
            for j in range(n)
            if (abs(i - j) <= stride or (i - j) % stride == 0) and (j <= i or not causal)
        )
        case = core_case("sparse", n=n, batch=2, heads=3, dim_head=8, causal=causal, mode="fwd",
                         options={"pattern": "strided", "stride": stride})  # fmt: skip
        assert case_flops(case) == 2 * 3 * 4 * 8 * pairs
    # BigBird: at least its window and global blocks, at most every pair
    bigbird = core_case("bigbird", n=64, batch=1, heads=1, dim_head=8, mode="fwd",
                        options={"block_size": 4, "random_blocks": 1})  # fmt: skip
    assert 4 * 8 * 64 * 3 * 4 < case_flops(bigbird) < 4 * 8 * 64 * 64


def test_window_pair_count_matches_the_dense_pattern():
    patterns = pytest.importorskip("attention_zoo.sparse.mask_mods")
    i, j = torch.arange(40)[:, None], torch.arange(40)[None]
    for window, globals_ in ((8, 0), (8, 3), (100, 2)):
        allowed = patterns.generate_longformer(window, globals_)(0, 0, i, j)
        assert _window_pairs(40, window // 2, globals_, False) == int(allowed.sum())
        assert _window_pairs(40, window // 2, globals_, True) == int((allowed & (j <= i)).sum())


def test_outputs_from_fixture(tmp_path):
    store = ResultStore(tmp_path)
    for row in fixture_rows():
        store.append(row | {"machine": {"device": "cpu", "torch": "x"}})
    paths = write_outputs(store)
    assert paths["markdown"].read_text().count("Linformer Table 3 layout") == 1
    assert len(paths["plots"]) == 1 and paths["plots"][0].stat().st_size > 0
    assert "linformer" in paths["csv"].read_text()


def test_targets_table_reads_the_protocol_rows():
    names = {"linformer"} if "linformer" in az.list_attentions() else None
    cases = targets.target_cases(names, threads=1)
    assert cases[0] == targets.protocol_case("full", {}, 4096, 1)
    rows = {c.key(): row_of(c, time_ms_min=1000.0 if c.attention == "full" else c.seq_len / 20) for c in cases}
    console = Console(file=io.StringIO(), width=200)
    console.print(targets.targets_table(rows, names, threads=1))
    text = console.file.getvalue()
    assert all(t.attention in text for t in targets.selected(names))
    if names:  # linformer: 1000 ms / (4096 / 20) ms, and t(8192) / t(2048) = 4 <= 5
        assert f"{1000 / (4096 / 20):.2f}x" in text and "4.00" in text and "yes" in text


@pytest.mark.parametrize(
    ("allocated", "resident", "shown", "met"),
    [((30.0, 119.0), (28.0, 130.0), "3.97 (rss 4.64)", "yes"), ((30.0, 126.0), (30.0, 110.0), "4.20 (rss 3.67)", "NO"),
     (None, (30.0, 110.0), "3.67", "yes"), (None, (28.0, 130.0), "4.64", "NO")],
)  # fmt: skip
def test_memory_growth_is_checked_on_the_allocated_peak(allocated, resident, shown, met, monkeypatch):
    """A target that asks only for memory growth: its cell and verdict follow the allocated peak where a row has one."""
    monkeypatch.setattr(targets, "TARGETS", (targets.Target("linear", max_memory_growth=4.0),))
    rows = {}
    for case in targets.target_cases({"linear"}, threads=1):
        memory = {}
        if case.seq_len in (2048, 8192):
            i = (2048, 8192).index(case.seq_len)
            memory = {"peak_mb": resident[i]} | ({"allocated_peak_mb": allocated[i]} if allocated else {})
        rows[case.key()] = row_of(case, time_ms_min=1000.0 if case.attention == "full" else case.seq_len / 20, **memory)
    console = Console(file=io.StringIO(), width=300)
    console.print(targets.targets_table(rows, {"linear"}, threads=1))
    line = next(line for line in console.file.getvalue().splitlines() if "linear" in line)
    assert shown in line and line.rstrip(" │").endswith(met)


@pytest.mark.parametrize(("fraction", "met"), [(0.45, "yes"), (0.35, "NO"), (None, "NO")])
def test_a_peak_fraction_target_uses_the_fastest_repeat(fraction, met):
    cases = targets.target_cases({"local"}, threads=1)
    rows = {}
    for case in cases:  # local: 2000 / 204.8 ms = 9.8x >= 4x, time grows 4x from 2048 to 8192
        ms = 2000.0 if case.attention == "full" else case.seq_len / 20
        # FLOPs that take ``fraction`` of a 0.1 TFLOP/s peak at the minimum time; the median twice as slow
        flops = None if fraction is None else fraction * 0.1e12 * ms / 1e3
        rows[case.key()] = {"status": "ok", "time_ms_min": ms, "time_ms_median": 2 * ms, "flops": flops}
        rows[case.key()] |= {"device_peak_tflops": 0.1, "peak_fraction": None if flops is None else fraction / 2}
    console = Console(file=io.StringIO(), width=300)
    console.print(targets.targets_table(rows, {"local"}, threads=1))
    line = next(line for line in console.file.getvalue().splitlines() if "local" in line)
    assert "9.77x" in line and ">= 40%" in line and ("n/a" if fraction is None else f"{fraction:.0%}") in line
    assert line.rstrip(" │").endswith(met)


def test_peak_fraction_is_achieved_over_the_measured_matmul_peak(tmp_path, monkeypatch):
    # no timing here: the matmul timer reports 20 ms for the CPU peak's 1024 x 1024 x 1024 product (the peak
    # is the best call), then the case is given times from the one at exactly that peak rate upwards
    monkeypatch.setattr(bench_measure, "time_calls", lambda step, warmup, repeats, device: [0.5, 0.02, 0.03])
    peak_tflops = 2 * 1024**3 / 0.02 / 1e12  # a product of n x n matrices is n^3 multiply-adds, 2 FLOPs each
    runner = Runner(BenchConfig(isolation="none"), ResultStore(tmp_path), "cpu")
    n, d, heads, batch = 256, 8, 2, 1
    flops = 3 * 4 * n**2 * d * heads * batch  # fwd+bwd = 3 forwards; full: Q K^T and P V, 2 n^2 d each, per head
    at_peak_ms = flops / (peak_tflops * 1e12) * 1e3
    for slowdown in (1, 4, 1000):
        stats = runner.throughput(core_case(n=n, dim_head=d, heads=heads, batch=batch), time_ms=slowdown * at_peak_ms)
        assert stats["flops"] == flops and stats["device_peak_tflops"] == pytest.approx(peak_tflops)
        assert stats["gflops_per_s"] == pytest.approx(flops / (slowdown * at_peak_ms / 1e3) / 1e9)
        fraction = stats["peak_fraction"]
        assert 0 < fraction <= 1 + 1e-12 and fraction == pytest.approx(1 / slowdown)
        assert fraction == pytest.approx(stats["gflops_per_s"] / (stats["device_peak_tflops"] * 1e3))


def test_paired_ratio_times_full_and_each_mechanism_round_after_round(tmp_path, capsys):
    from experiments.bench import paired_ratio

    out = tmp_path / "ratios.csv"
    assert paired_ratio.main(["--seq-len", "32", "--heads", "2", "--dim-head", "8", "--rounds", "2", "--blocks", "2",
                              "--attentions", "linear,local:window=8", "--causal", "--out", str(out)]) == 0  # fmt: skip
    with out.open() as file:
        rows = list(csv.DictReader(file))
    assert [r["attention"] for r in rows] == ["full", "linear", "local"] and all(r["causal"] == "True" for r in rows)
    full = float(rows[0]["ms_min"])
    for row in rows:
        assert float(row["ms_max"]) >= float(row["ms_min"]) > 0
        assert float(row["speedup"]) == pytest.approx(full / float(row["ms_min"]))
    assert paired_ratio.main(["--seq-len", "32", "--attentions", "nope"]) == 2
    assert "unknown attention 'nope'" in capsys.readouterr().err
    assert paired_ratio.main(["--seq-len", "32", "--attentions", "linear", "--rounds", "6", "--blocks", "4"]) == 2
    assert "--blocks must be >= 1 and divide --rounds 6, got 4" in capsys.readouterr().err
    for row in rows:  # each round a pair: the geometric mean of its ratios lies in its own interval
        assert float(row["paired_low"]) <= float(row["paired"]) <= float(row["paired_high"])
        assert row["verdict"] == ""  # no target at n = 32


def test_interleaved_rounds_rewarm_each_timed_call_with_one_of_its_own():
    from experiments.bench.paired_ratio import interleaved_seconds

    calls = []
    steps = [lambda: calls.append("a"), lambda: calls.append("b")]
    seconds = interleaved_seconds(steps, 2, rewarm=True)
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 2 and [len(times) for times in seconds] == [2, 2]
    calls.clear()
    interleaved_seconds(steps, 2, on_round=lambda: calls.append("round"))
    assert calls == ["a", "b"] + ["a", "b", "round"] * 2


def test_paired_interval_is_students_t_on_the_log_ratios():
    from experiments.bench.paired_ratio import paired_interval

    full, mechanism = [10.0, 12.0, 16.0], [5.0, 4.8, 5.0]  # ratios 2, 2.5, 3.2
    logs = [math.log(2.0), math.log(2.5), math.log(3.2)]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, 2 degrees of freedom), from the tables
    got = paired_interval(full, mechanism)
    assert got == pytest.approx((math.exp(mean), math.exp(mean - half), math.exp(mean + half)), rel=1e-9)
    assert paired_interval([3.0, 6.0], [1.0, 2.0]) == pytest.approx((3.0, 3.0, 3.0), rel=1e-12)  # no spread
    point, low, high = paired_interval([3.0], [1.0])
    assert point == pytest.approx(3.0) and math.isnan(low) and math.isnan(high)
    # batch means: 6 rounds in 3 blocks of 2, the interval on the 3 blocks' mean log ratios
    full, mechanism = [10.0, 11.0, 14.0, 15.0, 9.0, 8.0], [5.0, 5.0, 5.0, 5.0, 4.0, 4.0]
    logs = [math.log(a / b) for a, b in zip(full, mechanism, strict=True)]
    means = [(logs[0] + logs[1]) / 2, (logs[2] + logs[3]) / 2, (logs[4] + logs[5]) / 2]
    mean = sum(means) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in means) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)
    got = paired_interval(full, mechanism, blocks=3)
    assert got == pytest.approx((math.exp(mean), math.exp(mean - half), math.exp(mean + half)), rel=1e-9)
    with pytest.raises(ValueError, match="divide the 6 rounds, got 4"):
        paired_interval(full, mechanism, blocks=4)


@pytest.mark.parametrize(
    ("low", "high", "bound", "want"),
    [
        (2.6, 2.9, {"at_least": 2.5}, "met"),
        (2.4, 2.6, {"at_least": 2.5}, "inconclusive"),
        (2.1, 2.4, {"at_least": 2.5}, "missed"),
        (4.1, 4.4, {"at_most": 4.5}, "met"),
        (4.4, 4.7, {"at_most": 4.5}, "inconclusive"),
        (4.6, 4.9, {"at_most": 4.5}, "missed"),
        (math.nan, math.nan, {"at_least": 2.5}, "inconclusive"),
    ],
)
def test_a_paired_verdict_needs_the_whole_interval_on_one_side(low, high, bound, want):
    from experiments.bench.paired_ratio import verdict

    assert verdict(low, high, **bound) == want


def test_paired_ratio_finds_the_target_and_judges_speedups_at_4096_and_scalings(tmp_path, capsys):
    from experiments.bench import paired_ratio
    from experiments.bench.paired_ratio import target_for, verdict

    assert target_for("moba", {"block_size": 128, "top_k": 4}, True).min_speedup == 2.5
    assert target_for("moba", {"block_size": 64, "top_k": 4}, True) is None
    out = tmp_path / "speed.csv"
    assert paired_ratio.main(["--seq-len", "4096", "--heads", "1", "--dim-head", "4", "--rounds", "2", "--blocks", "2",
                              "--attentions", "linear", "--causal", "--out", str(out)]) == 0  # fmt: skip
    with out.open() as file:
        linear = list(csv.DictReader(file))[1]
    low, high = float(linear["paired_low"]), float(linear["paired_high"])
    assert float(linear["target"]) == 8.0 and linear["verdict"] == verdict(low, high, at_least=8.0)
    out = tmp_path / "scaling.csv"
    entries = "linear,local:window=8,lsh:bucket_size=64"
    assert paired_ratio.main(["--scaling", "--heads", "1", "--dim-head", "4", "--rounds", "2", "--blocks", "2",
                              "--attentions", entries, "--out", str(out)]) == 0  # fmt: skip
    with out.open() as file:
        rows = list(csv.DictReader(file))
    assert [r["attention"] for r in rows] == ["linear", "local", "lsh"] and rows[0]["seq_lens"] == "2048/8192"
    for row in rows:
        assert float(row["scaling"]) == pytest.approx(float(row["ms_min_long"]) / float(row["ms_min_short"]))
        assert float(row["paired_low"]) <= float(row["paired"]) <= float(row["paired_high"])
    assert float(rows[0]["target"]) == 4.5 and rows[0]["verdict"] in ("met", "missed", "inconclusive")
    assert rows[1]["target"] == "" and rows[1]["verdict"] == ""  # local's target is for window 256
    assert rows[2]["target"] == ""  # LSH (k = q: its one projection) has a speed target only
    assert "target 4.5" in capsys.readouterr().out


def test_paired_targets_group_each_target_by_its_bound_and_causality():
    from experiments.bench.paired_targets import entries

    moba, performer = {"block_size": 128, "top_k": 4}, {"nb_features": 256}
    causal = [("moba", moba), ("performer", performer), ("linear", {}), ("gated_deltanet", {}), ("nsa", {})]
    assert entries(list(targets.TARGETS), "speed", True) == causal
    assert entries(list(targets.TARGETS), "scaling", True) == causal
    speed, scaling = (entries(list(targets.TARGETS), kind, False) for kind in ("speed", "scaling"))
    assert ("lsh", {"n_hashes": 4, "bucket_size": 64}) in speed and all(name != "lsh" for name, _ in scaling)
    assert len(speed) == 8 and len(scaling) == 7


def test_paired_targets_measure_each_group_once_and_resume_from_the_file(tmp_path, monkeypatch):
    from experiments.bench import paired_ratio, paired_targets

    chosen = [targets.Target("linear", {}, min_speedup=25.0, max_scaling=4.5)]
    path = tmp_path / "targets" / paired_targets.PAIRED_FILE
    tiny = dict(rounds=2, blocks=2, heads=1, dim_head=4)
    rows = paired_targets.run(chosen, path, **tiny)
    assert sorted(row["kind"] for row in rows) == ["scaling", "speed"]
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["attention"]) for r in written] == [
        ("speed", "full"),
        ("speed", "linear"),
        ("scaling", "linear"),
    ]
    for row in rows:
        assert row["attention"] == "linear" and (row["rounds"], row["blocks"]) == (2, 2)
        assert row["paired_low"] <= row["paired"] <= row["paired_high"] and row["verdict"] in paired_ratio.VERDICTS

    def refuse(*args, **kwargs):
        raise AssertionError("a group already in the file was measured again")

    monkeypatch.setattr(paired_ratio, "measure", refuse)
    monkeypatch.setattr(paired_ratio, "measure_scaling", refuse)
    assert paired_targets.run(chosen, path, **tiny) == rows  # both groups read back, nothing timed
    with pytest.raises(AssertionError, match="measured again"):  # other rounds: measured anew
        paired_targets.run(chosen, path, **(tiny | {"rounds": 4}))
    with pytest.raises(ValueError, match="multiple of the blocks"):
        paired_targets.run(chosen, path, **(tiny | {"rounds": 3}))
    other = [row | {"rounds": 4} for row in written]  # rows of other rounds, written later, hide nothing
    with path.open("a") as file:
        file.writelines(json.dumps(row) + "\n" for row in other)
    assert paired_targets.run(chosen, path, **tiny) == rows
    assert {row["rounds"] for row in paired_targets.read_rows(path)} == {4}  # the report: the last row of a key


def test_paired_targets_table_gives_each_bound_its_interval_and_verdict():
    from experiments.bench import paired_targets

    chosen = [targets.Target("linear", {}, min_speedup=25.0, max_scaling=4.5),
              targets.Target("lsh", {"n_hashes": 4}, min_speedup=2.0)]  # fmt: skip
    rows = [{"kind": "speed", "causal": False, "attention": "linear", "options": {}, "rounds": 12, "blocks": 4,
             "paired": 26.0, "paired_low": 25.5, "paired_high": 26.6, "verdict": "met"}]  # fmt: skip
    console = Console(record=True, width=250)
    console.print(paired_targets.table(rows, chosen))
    text = console.export_text()
    linear, lsh = (line for line in text.splitlines() if line.startswith(("│ linear", "│ lsh")))
    assert "26.00 [25.50, 26.60]" in linear and "met" in linear and "not measured" in linear  # no scaling row
    assert "not measured" in lsh and "<=" not in lsh  # LSH has no scaling bound
    assert "12 rounds in 4 blocks" in text


def test_zoo_targets_report_shows_the_paired_rows_its_folder_holds(tmp_path, capsys):
    from experiments.bench import command, paired_targets

    out = tmp_path / "targets"
    out.mkdir()
    row = {"kind": "scaling", "causal": True, "attention": "linear", "options": {}, "rounds": 24, "blocks": 8,
           "paired": 4.27, "paired_low": 4.02, "paired_high": 4.55, "verdict": "inconclusive"}  # fmt: skip
    (out / paired_targets.PAIRED_FILE).write_text(json.dumps(row) + "\n")
    assert command.targets_main(["--report-only", "--attentions", "linear", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "24 rounds in 8 blocks" in text and "4.27 [4.02, 4.55]" in text and "inconclusive" in text


def test_zoo_targets_refuses_paired_rounds_it_cannot_split_before_writing_anything(tmp_path, capsys):
    from experiments.bench import command

    out = tmp_path / "targets"
    assert command.targets_main(["--paired-rounds", "6", "--paired-blocks", "4", "--out", str(out)]) == 2
    assert "--paired-rounds must be >= 0 and a multiple of --paired-blocks" in capsys.readouterr().err
    assert command.main(["--paired-rounds", "4", "--out", str(out)]) == 2
    assert "--paired-rounds and --paired-keep-freed go with --check-targets" in capsys.readouterr().err
    assert not out.exists()


def test_keep_freed_memory_makes_glibc_reuse_a_freed_block_of_64_mib_without_page_faults(tmp_path):
    # in a child process (the setting lasts for the process's life), malloc and free called directly: torch's own
    # allocations between its tensors' would make which block comes back depend on the heap's layout
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc only")
    script = tmp_path / "faults.py"
    script.write_text(
        textwrap.dedent("""
        import ctypes, resource, sys
        from experiments.bench.allocator import keep_freed_memory
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        if sys.argv[1] == "keep":
            keep_freed_memory()
        faults = []
        for _ in range(4):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            block = libc.malloc(64 * 2**20)
            libc.memset(block, 1, 64 * 2**20)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            libc.free(block)
        print(*faults)
    """)
    )
    pages = 64 * 2**20 // 4096
    faults = {}
    for mode in ("default", "keep"):
        run = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, check=True)
        faults[mode] = [int(f) for f in run.stdout.split()]
    # above glibc's largest mmap threshold: mapped and faulted in afresh at every allocation
    assert all(f >= pages * 0.9 for f in faults["default"])
    assert faults["keep"][0] >= pages * 0.9 and all(f < pages * 0.05 for f in faults["keep"][1:])  # reused, resident


def test_paired_ratio_keep_freed_says_so_in_its_rows(tmp_path):
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc only")
    out = tmp_path / "kept.csv"
    tiny = ["--seq-len", "32", "--heads", "1", "--dim-head", "4", "--rounds", "2", "--blocks", "2"]
    command = [sys.executable, "-m", "experiments.bench.paired_ratio", "--keep-freed", *tiny, "--attentions", "linear",
               "--out", str(out)]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)  # its own process: the setting lasts for its life
    with out.open() as file:
        assert [row["allocator"] for row in csv.DictReader(file)] == ["keep-freed", "keep-freed"]  # full, linear


def test_paired_targets_keep_freed_rows_apart_from_the_default_allocators(tmp_path, monkeypatch):
    from experiments.bench import paired_targets

    chosen = [targets.Target("linear", {}, min_speedup=25.0)]
    path = tmp_path / paired_targets.PAIRED_FILE
    tiny = dict(rounds=2, blocks=2, heads=1, dim_head=4)
    calls = []
    monkeypatch.setattr(paired_targets, "keep_freed_memory", lambda: calls.append("kept"))  # not in the test process
    (default,) = paired_targets.run(chosen, path, **tiny)
    assert default["allocator"] == "default" and calls == []
    (kept,) = paired_targets.run(chosen, path, keep_freed=True, **tiny)
    assert kept["allocator"] == "keep-freed" and calls == ["kept"] and len(path.read_text().splitlines()) == 4
    assert paired_targets.run(chosen, path, keep_freed=True, **tiny) == [kept] and calls == ["kept"]  # resumed
    rows = paired_targets.read_rows(path)
    console = Console(record=True, width=250)
    console.print(paired_targets.table(rows, chosen, "keep-freed"))
    text = console.export_text()
    assert "glibc keeping freed memory" in text and f"{kept['paired']:.2f}" in text


def test_band_profile_times_the_kernels_own_products_at_each_tile(tmp_path):
    from experiments.bench import band_profile

    out = tmp_path / "band.jsonl"
    assert band_profile.main(["--lengths", "64", "--windows", "16", "--tiles", "4", "8", "--rounds", "1",
                              "--out", str(out)]) == 0  # fmt: skip
    (case,) = [json.loads(line) for line in out.read_text().splitlines()]
    tile, slots = case["tile"], case["key_slots"]
    assert set(case["tile_ms"]) == {"4", "8", str(tile)} and case["kernel_ms"] == case["tile_ms"][str(tile)]
    assert slots % tile == 0 and slots >= tile + 16 and case["executed_over_useful"] == pytest.approx(slots / 17, 1e-3)
    tiles = band_profile.HEADS * -(-64 // tile)
    shapes = sorted(tuple(product["shape"]) for product in case["products"].values())
    d = band_profile.DIM_HEAD
    assert shapes == sorted([(tiles, tile, d, slots), (tiles, tile, slots, d), (tiles, slots, tile, d)] * 2)
    rounding = 0.5e-4 * (len(case["products"]) + 1)  # the record rounds every value, the sum and its terms, to 4 places
    assert case["products_ms"] == pytest.approx(sum(p["ms"] for p in case["products"].values()), abs=rounding)
    assert "aten::bmm" in case["profile"] and 0 < sum(case["profile"].values()) <= 1.0001
    with pytest.raises(SystemExit, match="--windows must be positive, got 0"):
        band_profile.main(["--windows", "0"])
