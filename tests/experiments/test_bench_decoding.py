"""``zoo bench``'s decoding modes (greedy decoding with the cache vs recomputation) on tiny sizes: they
run, refuse what they cannot run, and render their table. No timing asserts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import attention_zoo as az
from experiments.bench import measure as bench_measure
from experiments.bench import tables as bench_tables
from experiments.bench.cases import BenchConfig, Case, expand, load_config
from experiments.bench.flops import case_flops
from experiments.bench.measure import measure_case
from experiments.bench.runner import precheck

ROOT = Path(__file__).resolve().parents[2]


def tiny_config(**changes) -> BenchConfig:
    fields = dict(
        attentions=[az.AttentionSpec("full")],
        levels=["seq2seq"],
        modes=["decode", "decode-recompute"],
        seq_lens=[8],
        batch=[2],
        heads=[2],
        dim_head=[8],
        dim=16,
        depth=1,
        vocab_size=50,
    )
    return BenchConfig(**(fields | changes))


@pytest.mark.parametrize("attention", [az.AttentionSpec("full"), az.AttentionSpec("local", {"window": 4})])
def test_decode_modes_run_on_tiny_sizes(attention):
    cases = expand(tiny_config(attentions=[attention]), "cpu")
    assert [c.mode for c in cases] == ["decode", "decode-recompute"]
    for case in cases:
        assert precheck(case) is None
        result = measure_case(case, repeats=1, warmup=0)
        assert result["status"] == "ok", result
        assert result["time_ms_median"] > 0 and case_flops(case) is None


def test_seq2seq_teacher_forcing_runs_too():
    case = expand(tiny_config(modes=["fwd+bwd"]), "cpu")[0]
    assert measure_case(case, repeats=1, warmup=0)["status"] == "ok"


def test_decode_modes_need_the_seq2seq_level_and_a_causal_mechanism():
    with pytest.raises(ValueError, match="add level seq2seq"):
        BenchConfig(modes=["decode"], levels=["core"])
    mixed = expand(tiny_config(levels=["core", "seq2seq"], modes=["fwd", "decode"]), "cpu")
    assert sorted((c.level, c.mode) for c in mixed) == [("core", "fwd"), ("seq2seq", "decode"), ("seq2seq", "fwd")]
    linformer = expand(tiny_config(attentions=[az.AttentionSpec("linformer", {"k": 4})]), "cpu")[0]
    result = precheck(linformer)
    assert result["status"] == "unsupported" and "linformer_causal" in result["detail"]


def test_the_decoding_sweep_is_the_issues_setting():
    config = load_config(ROOT / "configs" / "bench" / "decoding.yaml", {})
    assert (config.seq_lens, config.batch, config.threads, config.levels) == ([64], [32], [1], ["seq2seq"])
    assert set(config.modes) == {"decode", "decode-recompute"} and config.device == "cpu"


def row(case: Case, **result) -> dict:
    return dataclasses.asdict(case) | {"status": "ok", "detail": ""} | result


def test_decoding_table_gives_the_cache_speedup_per_mechanism():
    config = tiny_config(attentions=[az.AttentionSpec("full"), az.AttentionSpec("local", {"window": 4})])
    case = {(c.attention, c.mode): c for c in expand(config, "cpu")}
    cached_full, recomputed_full = case["full", "decode"], case["full", "decode-recompute"]
    cached_local, recomputed_local = case["local", "decode"], case["local", "decode-recompute"]
    rows = [
        row(cached_full, time_ms_median=10.0),
        row(recomputed_full, time_ms_median=70.0),
        row(cached_local, status="error", detail="boom"),
        row(recomputed_local, time_ms_median=50.0),
    ]
    table = bench_tables.decoding_table(rows)
    assert "greedy decoding" in table and "B=2" in table
    assert "| full | 8 | 10 | 70 | 7.0x |" in table
    assert "| local:window=4 | 8 | error | 50 | error |" in table
    assert bench_tables.decoding_table([row(cached_full, mode="fwd", time_ms_median=1.0)]) == ""


@pytest.mark.parametrize("attention", ["full", "linear", "local"])
def test_decode_step_mode_times_one_step_after_a_prefill(attention, monkeypatch):
    config = tiny_config(
        attentions=[az.AttentionSpec(attention)], levels=["core"], modes=["decode-step"], seq_lens=[16]
    )
    (case,) = expand(config, "cpu")
    assert (case.level, case.mode) == ("core", "decode-step") and precheck(case) is None
    calls = []
    decode = az.AttentionCore.decode

    def counting(core, q, k, v, state, *, mask=None):
        calls.append((q.shape[-2], state.length))
        return decode(core, q, k, v, state, mask=mask)

    monkeypatch.setattr(az.AttentionCore, "decode", counting)
    monkeypatch.setattr(bench_measure, "DECODE_STEPS_PER_CALL", 3)
    result = measure_case(case, repeats=2, warmup=1)
    assert result["status"] == "ok", result and case_flops(case) is None
    # a prefill of n positions, then one position per step, 3 steps per call (warm-up, repeats, the resident-memory
    # call, the allocated-peak call)
    assert calls == [(16, 0)] + [(1, 16 + i) for i in range(5 * 3)]


def test_decode_step_time_is_per_step_not_per_call(monkeypatch):
    config = tiny_config(attentions=[az.AttentionSpec("linear")], levels=["core"], modes=["decode-step"], seq_lens=[16])
    (case,) = expand(config, "cpu")
    monkeypatch.setattr(bench_measure, "time_calls", lambda step, warmup, repeats, device: [0.032, 0.048])
    result = measure_case(case, repeats=2, warmup=0)
    steps = bench_measure.DECODE_STEPS_PER_CALL
    assert result["time_ms_min"] == pytest.approx(32 / steps) and result["time_ms_max"] == pytest.approx(48 / steps)


def test_decode_step_needs_the_core_level_and_a_causal_core():
    with pytest.raises(ValueError, match="add level core"):
        BenchConfig(modes=["decode-step"], levels=["seq2seq"])
    (case,) = expand(
        tiny_config(attentions=[az.AttentionSpec("nystrom")], levels=["core"], modes=["decode-step"]), "cpu"
    )
    assert precheck(case)["status"] == "unsupported"
