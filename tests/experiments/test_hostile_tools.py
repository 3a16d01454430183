"""Hostile input to the tools that write and read results (``zoo targets``, ``zoo gpu-suite``, ``zoo study
<name> --replot``, the translation report): an ``--out`` that cannot be a results folder, damaged records, flags
the command would ignore. Each ends in one error line naming the file (and line), exit code 2, or, for the
half-written last line a killed run leaves, a one-line note and the rest of the record; and what the tools write
names no folder of the machine they ran on."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from experiments import cli
from experiments.bench import command, paired_targets, targets
from experiments.bench.cases import BenchConfig
from experiments.bench.runner import Runner
from experiments.bench.store import ResultStore
from experiments.gpu import environment, report, suite
from experiments.studies import translation_report, translation_verdicts
from experiments.studies.common import repo_path
from tests.experiments.test_studies import write_run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread_and_private_cache")


def one_error_line(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """The command's stderr: one line, holding every needle."""
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def machine_folders() -> list[str]:
    """Folders of this machine that no written file may name."""
    return [str(ROOT), sys.prefix, sys.base_prefix, os.path.realpath(sys.executable), tempfile.gettempdir() + "/"]


def assert_no_machine_path(text: str) -> None:
    """No folder of :func:`machine_folders` starts a path in ``text`` (a relative ``../tmp/x`` names none)."""
    named = [folder for folder in machine_folders() if re.search(r"(?<![\w.~/-])" + re.escape(folder), text)]
    assert not named, f"{named} in {text[:2000]}"


def cut_line(path: Path, number: int) -> None:
    """Cut line ``number`` (from 1) of ``path`` in half, keeping its line end: a corrupt line, not a truncated file."""
    lines = path.read_text().splitlines()
    lines[number - 1] = lines[number - 1][: len(lines[number - 1]) // 2]
    path.write_text("\n".join(lines) + "\n")


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# ---- zoo targets -------------------------------------------------------------------------------------------


@pytest.fixture
def targets_folder(tmp_path: Path) -> Path:
    """A ``zoo targets`` folder of two real (tiny) measurements and one paired row."""
    out = tmp_path / "targets"
    cases = [dataclasses.replace(targets.protocol_case("full", {}, n, 1), heads=2, dim_head=8) for n in (16, 32)]
    Runner(BenchConfig(isolation="none", repeats=1, warmup=0), ResultStore(out), "cpu").run(cases)
    row = {"kind": "speed", "causal": False, "attention": "linear", "options": {}, "rounds": 4, "blocks": 2,
           "paired": 26.0, "paired_low": 25.5, "paired_high": 26.6, "verdict": "met"}  # fmt: skip
    (out / paired_targets.PAIRED_FILE).write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    return out


def test_targets_refuses_an_out_that_cannot_be_a_results_folder(tmp_path, capsys):
    plain = tmp_path / "file"
    plain.write_text("x")
    assert command.targets_main(["--report-only", "--out", str(plain)]) == 2
    one_error_line(capsys, "zoo targets: error:", str(plain), "is a file, not a folder")
    assert command.targets_main(["--attentions", "linear", "--out", str(plain / "sub")]) == 2
    one_error_line(capsys, "cannot create the folder", "Not a directory")
    assert command.targets_main(["--report-only", "--out", str(tmp_path / "none")]) == 2
    one_error_line(capsys, "holds no results.jsonl")
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("record", ["results.jsonl", paired_targets.PAIRED_FILE])
def test_targets_report_refuses_a_corrupt_line_naming_it(targets_folder, capsys, record):
    cut_line(targets_folder / record, 2)
    assert command.targets_main(["--report-only", "--out", str(targets_folder)]) == 2
    one_error_line(capsys, f"{targets_folder / record} line 2: not JSON")


def test_targets_report_refuses_a_row_that_is_not_a_result(targets_folder, capsys):
    with open(targets_folder / "results.jsonl", "a") as file:
        file.write('{"attention": "full"}\n')
    assert command.targets_main(["--report-only", "--out", str(targets_folder)]) == 2
    one_error_line(capsys, "results.jsonl line 3: not a zoo bench result: no options")
    (targets_folder / "results.jsonl").write_text("[1, 2]\n")
    assert command.targets_main(["--report-only", "--out", str(targets_folder)]) == 2
    one_error_line(capsys, "results.jsonl line 1: expected a JSON object")


@pytest.mark.parametrize("record", ["results.jsonl", paired_targets.PAIRED_FILE])
def test_targets_report_skips_a_half_written_last_line_and_says_so_in_one_line(targets_folder, capsys, record):
    with open(targets_folder / record, "a") as file:
        file.write('{"kind": "speed", "causal": fal')  # a run killed while writing its last line
    assert command.targets_main(["--report-only", "--out", str(targets_folder)]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"zoo targets: note: {targets_folder / record}: "
        + ("dropping" if record == "results.jsonl" else "skipping")
        + " a half-written last line (31 bytes)"
    ]
    if record == paired_targets.PAIRED_FILE:
        assert "26.00 [25.50, 26.60]" in captured.out  # the whole rows are still reported


@pytest.mark.parametrize(
    "flags", [["--seq-lens", "512"], ["--heads", "4", "--dim-head", "32"], ["--mode", "fwd", "--batch", "2"]]
)
def test_targets_refuse_the_shape_flags_they_would_ignore(tmp_path, capsys, flags):
    out = tmp_path / "targets"
    assert command.targets_main(["--report-only", *flags, "--out", str(out)]) == 2
    named = [flag if flag != "--mode" else "--modes" for flag in flags if flag.startswith("--")]
    one_error_line(capsys, "zoo targets: error:", *named, "fixed shapes", "zoo bench times other shapes")
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({"seq_lens": [128], "repeats": 2}))
    assert command.targets_main(["--report-only", "--config", str(config), "--out", str(out)]) == 2
    one_error_line(capsys, "--seq-lens: not settings of the performance targets")
    assert not out.exists()


# ---- zoo gpu-suite -----------------------------------------------------------------------------------------


def suite_rows() -> list[dict]:
    return [
        {"kind": "step", "step": "environment", "status": "ok", "seconds": 1.0, "detail": "cpu"},
        {"kind": "target", "target": ">= 6x", "attention": "linformer", "met": True, "options": {"k": 32},
         "seq_len": 128, "time_ms": 1.0, "sdpa_flash_ms": 2.0, "speedup": 2.0, "smoke": True},
        {"kind": "measure", "grid": "registry", "label": "full", "mode": "fwd", "seq_len": 128, "status": "ok",
         "time_ms": 1.5},
        {"kind": "step", "step": "targets", "status": "ok", "seconds": 2.0, "detail": "1 of 1 met"},
    ]  # fmt: skip


@pytest.fixture
def suite_folder(tmp_path: Path) -> Path:
    out = tmp_path / "gpu"
    out.mkdir()
    (out / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in suite_rows()))
    (out / "env.json").write_text(json.dumps({"name": "cpu", "torch": "x"}))
    return out


def test_gpu_suite_refuses_an_out_a_budget_and_steps_it_cannot_use(tmp_path, capsys):
    plain = tmp_path / "file"
    plain.write_text("x")
    assert suite.main(["--smoke", "--out", str(plain)]) == 2
    one_error_line(capsys, "zoo gpu-suite: error: --out", "is a file, not a folder")
    assert suite.main(["--smoke", "--steps", "environment", "--out", str(plain / "sub")]) == 2
    one_error_line(capsys, "cannot write there (Not a directory)")
    assert suite.main(["--report-only", "--out", str(plain)]) == 2
    one_error_line(capsys, "is a file, not a folder")
    out = tmp_path / "out"
    for budget in ("nan", "inf", "-1"):
        assert suite.main(["--smoke", "--steps", "environment", "--budget-min", budget, "--out", str(out)]) == 2
        one_error_line(capsys, "--budget-min must be a finite number of minutes > 0", budget)
    for steps in (",", " , "):
        assert suite.main(["--smoke", "--steps", steps, "--out", str(out)]) == 2
        one_error_line(capsys, "names no step; choose from environment, speed, targets")
    assert not out.exists()


def test_gpu_suite_report_refuses_a_corrupt_line_or_env_naming_it(suite_folder, capsys):
    results = suite_folder / "results.jsonl"
    intact = results.read_text()
    cut_line(results, 2)
    assert suite.main(["--report-only", "--out", str(suite_folder)]) == 2
    one_error_line(capsys, f"{results} line 2: not JSON")
    results.write_text(intact + '{"kind": "step", "step": "grids"}\n')
    assert suite.main(["--report-only", "--out", str(suite_folder)]) == 2
    one_error_line(capsys, f"{results} line 5: a step row without status, seconds, detail")
    results.write_text(intact + '{"kind": "warp"}\n')
    assert suite.main(["--report-only", "--out", str(suite_folder)]) == 2
    one_error_line(capsys, "line 5: kind 'warp'; a row of zoo gpu-suite is one of step, target")
    results.write_text(intact)
    cut_in_half(suite_folder / "env.json")
    assert suite.main(["--report-only", "--out", str(suite_folder)]) == 2
    one_error_line(capsys, f"{suite_folder / 'env.json'}: not JSON")


def test_gpu_suite_report_skips_a_half_written_last_line_and_a_rerun_appends_whole_lines(suite_folder, capsys):
    results = suite_folder / "results.jsonl"
    with open(results, "a") as file:
        file.write('{"kind": "step", "step": "gri')
    assert suite.main(["--report-only", "--out", str(suite_folder)]) == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"zoo gpu-suite: note: {results}: skipping a half-written last line (29 bytes)"
    ]
    text = (suite_folder / "report.md").read_text()
    assert "| environment | ok |" in text and "| targets | ok |" in text and "| linformer |" in text
    assert report.read_rows(results, repair=True, note=lambda _: None) == suite_rows()  # the fragment is cut off
    with open(results, "a") as file:  # as a rerun appends
        file.write(json.dumps(suite_rows()[0]) + "\n")
    assert report.read_rows(results) == [*suite_rows(), suite_rows()[0]]


def test_gpu_suite_files_name_no_machine_folder(tmp_path):
    out = tmp_path / "out"
    assert suite.main(["--smoke", "--steps", "environment", "--budget-min", "2", "--out", str(out)]) == 0
    env = json.loads((out / "env.json").read_text())
    assert env["executable"] == Path(sys.executable).name and env["torch"] and env["cpu_count"]
    for name in ("env.json", "results.jsonl", "report.md"):
        assert_no_machine_path((out / name).read_text())


def test_gpu_suite_logs_name_no_machine_folder(tmp_path):
    work = tmp_path / "zoo-gpu-suite-x"
    work.mkdir()
    script = f"import json, yaml; print(json.__file__); print(yaml.__file__); print({str(work / 'runs')!r})"
    log_path = tmp_path / "step.log"
    with open(log_path, "a") as log:
        status, last = suite._run_logged([sys.executable, "-c", script], dict(os.environ), log, 120, work)
    text = log_path.read_text()
    assert status == "ok" and last == "exit 0: <work>/runs"
    assert text.startswith(f"$ {Path(sys.executable).name} -c ")
    assert "<python>/json/__init__.py" in text and "<site-packages>/yaml/__init__.py" in text
    assert_no_machine_path(text)


def test_gpu_suite_archive_texts_are_rewritten_and_binaries_left_alone(tmp_path):
    work = tmp_path / "work"
    run = work / "runs" / "gpu-compare" / "full" / "seed-0"
    run.mkdir(parents=True)
    (run / "compare.yaml").write_text(f"runs_dir: {work / 'runs'}\nconfig: {ROOT / 'configs' / 'mqar.yaml'}\n")
    binary = b"\0events " + str(ROOT).encode()
    (run / "events.out.tfevents.1").write_bytes(binary)
    suite._relative_paths_in(work / "runs" / "gpu-compare", work)
    assert (run / "compare.yaml").read_text() == "runs_dir: <work>/runs\nconfig: configs/mqar.yaml\n"
    assert (run / "events.out.tfevents.1").read_bytes() == binary


def test_relative_paths_keeps_what_only_looks_like_a_machine_folder():
    kept = f"{ROOT}x/a runs/tmp/y https://example.org{tempfile.gettempdir()}/a"  # not the checkout, relative, a URL
    assert environment.relative_paths(f"{ROOT} and {kept}") == f". and {kept}"


# ---- zoo study ... --replot --------------------------------------------------------------------------------


@pytest.fixture
def mlm_study(tmp_path: Path) -> Path:
    """A ``zoo study mlm`` folder over two experiments of tiny runs: 8 expected runs, 6 finished."""
    configs, runs_dir = tmp_path / "configs", tmp_path / "runs"
    configs.mkdir()
    for experiment, n in (("tiny-a", 32), ("tiny-b", 64)):
        config = {"experiment": experiment, "seed": 0, "seeds": 2, "attentions": "full,linformer:k=8",
                  "fit_args": [f"--data.max_seq_len={n}"]}  # fmt: skip
        (configs / f"{experiment}.yaml").write_text(yaml.safe_dump(config))
        for label, seed, final in (("full", 0, 5.0), ("full", 1, 5.2), ("linformer", 0, 6.0)):
            directory = runs_dir / experiment / label / f"seed-{seed}"
            writer = SummaryWriter(str(directory))
            writer.add_scalar("val/ppl", final, 9)
            writer.close()
            record = {"status": "finished", "step": 10, "max_steps": 10, "metrics": {"val/ppl": final}}
            (directory / "run.json").write_text(json.dumps(record))
    out = tmp_path / "mlm"
    assert cli.main(["study", "mlm", "--configs", str(configs), "--runs_dir", str(runs_dir), "--out", str(out)]) == 0
    return out


def test_mlm_study_names_its_inputs_relative_to_the_repository(mlm_study, tmp_path):
    saved = json.loads((mlm_study / "mlm.json").read_text())
    assert saved["expected_runs"] == {"tiny-a": 4, "tiny-b": 4}
    for key, path in (("configs", tmp_path / "configs"), ("runs_dir", tmp_path / "runs")):
        assert not Path(saved[key]).is_absolute() and (ROOT / saved[key]).resolve() == path.resolve()
    runs = (mlm_study / "runs.csv").read_text()
    assert_no_machine_path(runs + (mlm_study / "mlm.json").read_text())
    assert repo_path(tmp_path / "runs" / "tiny-a" / "full" / "seed-0") in runs


def test_mlm_replot_refuses_a_runs_csv_cut_in_half_or_short_of_rows(mlm_study, capsys):
    assert cli.main(["study", "mlm", "--replot", str(mlm_study)]) == 0
    assert "Coverage: 6 of 8 expected runs finished." in (mlm_study / "table.md").read_text()
    runs = mlm_study / "runs.csv"
    intact = runs.read_bytes()
    cut_in_half(runs)
    capsys.readouterr()
    assert cli.main(["study", "mlm", "--replot", str(mlm_study)]) == 2
    one_error_line(capsys, "zoo study mlm: error:", f"{runs} line ", "a truncated")
    runs.write_bytes(b"".join(intact.splitlines(keepends=True)[:-2]))  # cut at a line end: two whole rows gone
    assert cli.main(["study", "mlm", "--replot", str(mlm_study)]) == 2
    one_error_line(capsys, f"{runs}: 2 runs of tiny-b, {mlm_study / 'mlm.json'} says the study expected 4")
    assert "Coverage: 6 of 8" in (mlm_study / "table.md").read_text()  # the report of the intact file stays


@pytest.mark.parametrize("study", ["mlm", "spectrum", "approx"])
def test_replot_of_a_missing_or_empty_folder_is_one_line(tmp_path, capsys, study):
    missing = tmp_path / "nowhere"
    assert cli.main(["study", study, "--replot", str(missing)]) == 2
    one_error_line(capsys, f"zoo study {study}: error: --replot {missing}: no such folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    first = {"mlm": "runs.csv", "spectrum": "spectrum.csv", "approx": "summary.csv"}[study]
    assert cli.main(["study", study, "--replot", str(empty)]) == 2
    one_error_line(capsys, f"{empty} has no {first}: not the folder of a zoo study {study}")


def test_spectrum_replot_refuses_a_header_only_or_incomplete_spectrum(tmp_path, capsys):
    out = tmp_path / "spectrum"
    checkpoint = write_run(tmp_path / "run")
    argv = ["study", "spectrum", "--checkpoint", str(checkpoint), "--sequences", "2", "--k", "4", "--out", str(out)]
    assert cli.main(argv) == 0
    saved = json.loads((out / "spectrum.json").read_text())
    assert (ROOT / saved["checkpoint"]).resolve() == checkpoint.resolve()
    assert (ROOT / saved["config"]).resolve() == (tmp_path / "run" / "config.yaml").resolve()
    assert_no_machine_path((out / "spectrum.json").read_text())
    spectrum = out / "spectrum.csv"
    lines = spectrum.read_text().splitlines(keepends=True)
    spectrum.write_text("".join(lines[:-1]))  # one row short, cut at a line end
    capsys.readouterr()
    assert cli.main(["study", "spectrum", "--replot", str(out)]) == 2
    one_error_line(capsys, f"{spectrum}: {len(lines) - 2} rows, a spectrum of 2 model(s) x 2 layers x 2 heads")
    spectrum.write_text(lines[0])
    assert cli.main(["study", "spectrum", "--replot", str(out)]) == 2
    one_error_line(capsys, f"{spectrum}: no rows, only a header")
    spectrum.write_text("".join(lines))
    (out / "spectrum.json").write_text('{"k": ')
    assert cli.main(["study", "spectrum", "--replot", str(out)]) == 2
    one_error_line(capsys, f"{out / 'spectrum.json'}: not JSON")


def test_approx_replot_refuses_a_header_only_summary(tmp_path, capsys):
    from experiments.studies.approx import SUMMARY_COLUMNS

    (tmp_path / "summary.csv").write_text(",".join(SUMMARY_COLUMNS) + "\n")
    assert cli.main(["study", "approx", "--replot", str(tmp_path)]) == 2
    one_error_line(capsys, f"{tmp_path / 'summary.csv'}: no rows, only a header")


def test_translation_report_replot_refuses_a_truncated_curves_csv(tmp_path, capsys):
    (tmp_path / "curves.csv").write_text("label,tag,step,value\r\nfull/seed-0,val/bleu,10,1.5\r\nfull/seed-0,val/b")
    with pytest.raises(SystemExit) as exit_:
        translation_report.main(["--replot", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"{tmp_path / 'curves.csv'} line 3: 2 fields, the header has 4" in capsys.readouterr().err


def test_translation_verdicts_refuse_a_half_written_translation_file(tmp_path):
    from tasks.translation import TEST_TRANSLATIONS

    row = {"index": 0, "translation": "a", "reference": "b"}
    (tmp_path / TEST_TRANSLATIONS).write_text(json.dumps(row) + "\n" + json.dumps(row)[:10])
    with pytest.raises(ValueError, match="last line is half-written"):
        translation_verdicts.translations(tmp_path)
