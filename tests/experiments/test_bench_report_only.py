"""``zoo bench --report-only`` reports what ``--out`` holds, not the cases a default sweep would run.

A tiny sweep (full and linear at n = 32, in-process) is stored, then reported with no sweep setting named: every
stored mechanism is in the tables. Settings named with ``--report-only`` narrow the report to the stored cases they
select (checked on rows built here, so that each selection is known without measuring).
"""

from __future__ import annotations

import dataclasses

from experiments.bench import command, report, targets
from experiments.bench.cases import load_config
from experiments.bench.store import selected_rows

NO_OTHER = "no mechanism besides full was measured"


def test_report_only_lists_every_stored_mechanism(tmp_path, capsys, monkeypatch):
    # the printed tables are under test, not the plots and TensorBoard logs drawn beside them
    monkeypatch.setattr(report, "write_plots", lambda rows, folder: [])
    monkeypatch.setattr(report, "write_tensorboard", lambda rows, folder: folder)
    sweep = ["--attentions", "full,linear", "--seq-lens", "32", "--mode", "fwd", "--heads", "2", "--dim-head", "8"]
    sweep += ["--repeats", "1", "--warmup", "0", "--isolation", "none", "--out", str(tmp_path)]
    assert command.main(sweep) == 0
    stored = (tmp_path / "results.jsonl").read_text()
    capsys.readouterr()

    assert command.main(["--out", str(tmp_path), "--report-only"]) == 0
    out = capsys.readouterr().out
    assert "linear" in out and NO_OTHER not in out, out
    assert (tmp_path / "results.jsonl").read_text() == stored  # nothing measured

    # one setting named (not the sweep's n): the stored cases of that mechanism, at the n they were measured at
    assert command.main(["--out", str(tmp_path), "--report-only", "--attentions", "linear"]) == 0
    out = capsys.readouterr().out
    assert "linear" in out and NO_OTHER not in out, out

    assert command.main(["--out", str(tmp_path), "--report-only", "--attentions", "performer"]) == 0
    captured = capsys.readouterr()
    assert "select no stored case" in captured.err and "holds linear" in captured.err, captured.err


def row(attention: str, options: dict, n: int, **changes) -> dict:
    case = dataclasses.replace(targets.protocol_case(attention, options, n, threads=1), **changes)
    return dataclasses.asdict(case) | {"status": "ok", "detail": ""}


def test_named_settings_select_stored_rows():
    rows = [
        row(name, options, n)
        for name, options in [("full", {}), ("linear", {}), ("linformer", {"k": 8}), ("linformer", {"k": 16})]
        for n in (32, 64)
    ]
    rows.append(row("linear", {}, 32, mode="fwd"))

    def chosen(**overrides) -> set[tuple[str, int, str]]:
        config = load_config(None, overrides)
        picked = selected_rows(rows, config, set(overrides))
        return {(f"{r['attention']}{r['options'].get('k', '')}", r["seq_len"], r["mode"]) for r in picked}

    everything = {(f"{r['attention']}{r['options'].get('k', '')}", r["seq_len"], r["mode"]) for r in rows}
    assert chosen() == everything
    full = {("full", 32, "fwd+bwd"), ("full", 64, "fwd+bwd")}
    linformers = {(f"linformer{k}", n, "fwd+bwd") for k in (8, 16) for n in (32, 64)}
    assert chosen(attentions="linformer") == full | linformers
    assert chosen(attentions="linformer:k=16", seq_lens=[64]) == {
        ("full", 64, "fwd+bwd"),
        ("linformer16", 64, "fwd+bwd"),
    }
    assert chosen(modes=["fwd"]) == {("linear", 32, "fwd")}
    assert chosen(repeats=3, device="auto") == everything  # how to measure, and no device in particular
