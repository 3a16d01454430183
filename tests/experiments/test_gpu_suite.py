"""``zoo gpu-suite``: the smoke run (every step at tiny sizes on the CPU) and the budget that keeps a cut run's
results; the pure parts (targets' verdicts, crossovers, the byte estimate) against hand-worked numbers."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

import attention_zoo as az
from experiments.gpu import report, speed, suite, targets
from experiments.gpu.measure import RAW_SDPA, RAW_SDPA_FLASH, Workload

#: what a remote GPU run can hand back
MAX_FILES, MAX_BYTES = 8, 16 * 2**20


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp("gpu-suite")
    return suite.main(["--smoke", "--out", str(out), "--budget-min", "10"]), out


@pytest.mark.slow
def test_smoke_runs_every_step_and_hands_back_a_small_flat_result(smoke):
    code, out = smoke
    assert code == 0
    files = list(out.iterdir())
    assert 0 < len(files) <= MAX_FILES and all(f.is_file() and f.stat().st_size < MAX_BYTES for f in files)
    steps = {r["step"]: r for r in rows_of(out) if r["kind"] == "step"}
    assert list(steps) == list(suite.STEPS)
    assert {name: r["status"] for name, r in steps.items()} == dict.fromkeys(suite.STEPS, "ok"), steps
    env = json.loads((out / "env.json").read_text())
    assert env["peak_tflops"] > 0 and env["copy_gbs"] > 0 and env["torch"]


@pytest.mark.slow
def test_smoke_measures_every_target_and_every_registered_mechanism(smoke):
    _, out = smoke
    rows = rows_of(out)
    verdicts = [r for r in rows if r["kind"] == "target"]
    assert [v["attention"] for v in verdicts] == [t.spec.name for t in targets.TARGETS]
    assert all(v["speedup"] > 0 and v["met"] in (True, False) and v["smoke"] for v in verdicts)
    registry = {r["attention"]: r["status"] for r in rows if r["kind"] == "measure" and r["grid"] == "registry"}
    assert registry == {RAW_SDPA: "ok"} | dict.fromkeys(az.list_attentions(), "ok")
    report_md = (out / "report.md").read_text()
    for heading in ("## Environment", "## Steps", "## Targets", "## Compare", "## Grid: registry"):
        assert heading in report_md
    assert "smoke" in report_md.splitlines()[0]


@pytest.mark.slow
def test_smoke_times_every_speed_core_at_both_lengths_against_full(smoke):
    _, out = smoke
    rows = rows_of(out)
    verdicts = [r for r in rows if r["kind"] == "speed"]
    names = [core.spec.name for core in speed.SPEED_CORES]
    earlier = [core.spec.name for core in speed.EARLIER_PATHS]
    assert [v["attention"] for v in verdicts] == names * 2 + earlier
    assert all(v["full_ms"] > 0 and v["speedup"] > 0 for v in verdicts)
    assert [v["met"] in (True, False) for v in verdicts] == [True] * 2 * len(names) + [False] * len(earlier)
    assert {v["attention"] for v in verdicts if v.get("of_floor") is not None} == set(names)  # every one has FLOPs
    assert [r["operators"] for r in rows if r["kind"] == "sdpa_kernel"] != [[]]
    assert "## Each mechanism at the speed of its mechanism" in (out / "report.md").read_text()


@pytest.mark.slow
def test_smoke_runs_the_conformance_subset_and_a_comparison(smoke):
    _, out = smoke
    log = (out / "pytest.log").read_text()
    assert " passed" in log and " failed" not in log and " error" not in log.lower()
    with tarfile.open(out / "compare.tar.gz") as archive:
        names = archive.getnames()
    assert "gpu-compare/summary.md" in names and "gpu-compare/runs.csv" in names
    assert not any(name.endswith(".ckpt") for name in names)
    with tarfile.open(out / "plots.tar.gz") as archive:
        assert {"nystromformer_fwd.png", "linformer_fwd.png"} <= set(archive.getnames())


def test_a_spent_budget_skips_the_rest_and_still_writes_the_report(tmp_path):
    code = suite.main(["--smoke", "--out", str(tmp_path), "--budget-min", "0.0001", "--steps", "targets,grids"])
    assert code == 0
    steps = [r for r in rows_of(tmp_path) if r["kind"] == "step"]
    assert [s["step"] for s in steps] == ["targets", "grids"]
    assert steps[0]["status"] in ("cut", "skipped") and steps[1]["status"] == "skipped"
    assert f"| targets | {steps[0]['status']} |" in (tmp_path / "report.md").read_text()


def test_bad_arguments_are_refused_with_what_is_allowed(tmp_path, capsys):
    assert suite.main(["--smoke", "--out", str(tmp_path), "--steps", "targets,warp"]) == 2
    assert "warp" in capsys.readouterr().err
    assert suite.main(["--smoke", "--out", str(tmp_path), "--budget-min", "0"]) == 2
    assert "--budget-min" in capsys.readouterr().err


def test_target_verdicts():
    full, window, lsh = (next(t for t in targets.TARGETS if t.spec.name == a) for a in ("full", "local", "lsh"))
    assert targets.window_target(16384, 1024) == pytest.approx(0.75 * 16384 / 1152)
    reference = {"status": "ok", "time_ms": 100.0}
    assert targets.evaluate(full, {"status": "ok", "time_ms": 104.9, "seq_len": 8}, reference)["met"]
    assert not targets.evaluate(full, {"status": "ok", "time_ms": 105.1, "seq_len": 8}, reference)["met"]
    assert not targets.evaluate(window, {"status": "ok", "time_ms": 10.0, "seq_len": 8}, reference)["met"]  # 10x
    assert targets.evaluate(window, {"status": "ok", "time_ms": 9.0, "seq_len": 8}, reference)["met"]  # 11.1x
    assert not targets.evaluate(lsh, {"status": "ok", "time_ms": 100.5, "seq_len": 8}, reference)["met"]
    oom = targets.evaluate(lsh, {"status": "oom", "label": "lsh", "detail": "x"}, reference)
    assert oom["met"] is None and "oom" in oom["detail"]


def test_speed_verdicts():
    full = {"status": "ok", "time_ms": 10.0}
    row = {"status": "ok", "attention": "moba", "seq_len": 8192, "time_ms": 9.0}
    assert speed.verdict(row, full, 1.0, floor_ms=2.5)["met"]  # faster, 3.6x its floor
    assert not speed.verdict(row, full, 1.0, floor_ms=2.0)["met"]  # 4.5x its floor
    assert speed.verdict(row | {"attention": "local"}, full, 1.0, floor_ms=1.0)["met"]  # no floor target for local
    assert not speed.verdict(row | {"seq_len": 16384}, full, 2.0, floor_ms=None)["met"]  # 1.1x < 2x
    assert speed.verdict(row | {"seq_len": 16384, "time_ms": 5.0}, full, 2.0, floor_ms=None)["met"]
    assert speed.verdict(row | {"time_ms": 50.0}, full, None, floor_ms=2.5)["met"] is None  # an earlier path
    failed = speed.verdict({"status": "oom", "attention": "lsh", "seq_len": 8192, "label": "lsh"}, full, 1.0, None)
    assert failed["met"] is None and "oom" in failed["detail"]
    # the floor counts the inputs and outputs only: fwd+bwd reads q, k, v, out, dout and writes dq, dk, dv...
    work = Workload(az.AttentionSpec("full"), 1024, batch=1, heads=1, dim_head=64, device="cpu")
    memory_ms = 12 * 1024 * 64 * 2 / 1e9 * 1e3  # bf16, 1 GB/s
    compute_ms = 3 * 4 * 1024**2 * 64 / 1e12 * 1e3  # 1 TFLOP/s
    assert speed.io_floor_ms(work, 1.0, 1.0) == pytest.approx(max(memory_ms, compute_ms))
    assert speed.io_floor_ms(work, None, 1.0) is None


def test_the_gpu_paths_cuda_tests_run_first():
    files = suite._files_with_cuda_tests()
    ordered = speed.cuda_test_order(files)
    assert sorted(ordered) == sorted(files) and ordered[: len(speed.PATH_TESTS)] == list(speed.PATH_TESTS)
    assert all("mark.cuda" in (suite.ROOT / f).read_text() for f in speed.PATH_TESTS)


def test_crossover_is_the_length_from_which_a_mechanism_stays_faster():
    def row(label: str, n: int, ms: float) -> dict:
        return {"kind": "measure", "grid": "g", "status": "ok", "label": label, "mode": "fwd", "seq_len": n,
                "time_ms": ms}  # fmt: skip

    flash = RAW_SDPA_FLASH.label
    rows = [row(flash, n, ms) for n, ms in ((512, 1.0), (1024, 2.0), (2048, 4.0), (4096, 8.0))]
    rows += [row("a", n, ms) for n, ms in ((512, 0.5), (1024, 3.0), (2048, 3.0), (4096, 4.0))]  # dips, then stays
    rows += [row("b", n, ms) for n, ms in ((512, 2.0), (1024, 4.0), (2048, 8.0), (4096, 16.0))]
    table = {r[0]: r for r in report.crossovers(rows, "g")}
    assert table["a"][2] == 2048 and table["a"][4] == pytest.approx(2.0)
    assert table["b"][2] == "none up to 4096"
    assert flash not in table


def test_byte_estimate_counts_each_input_and_output_once():
    workload = Workload(az.AttentionSpec("full"), 1024, dtype="bfloat16", batch=2, heads=3, dim_head=64)
    elements = 2 * 3 * 1024 * 64
    assert workload.io_bytes() == 12 * elements * 2  # q k v out dout read/written, dq dk dv written
    assert (
        Workload(az.AttentionSpec("full"), 1024, mode="fwd", dtype="float32", batch=2, heads=3).io_bytes()
        == 4 * elements * 4
    )
