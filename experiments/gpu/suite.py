"""``zoo gpu-suite``: everything a GPU machine must show, in one command, under a time budget.

    zoo gpu-suite --out OUT [--budget-min 8] [--steps environment,speed,...] [--smoke]

Steps, in the order of their value; each is timed and recorded with its status, and a failing, cut or
skipped step never loses the others' results:

1. ``environment``: device, driver, CUDA, torch, triton and xformers versions, SM count, and the two
   ceilings measured in the run: a bf16 matrix product's rate and a device-to-device copy's bandwidth.
2. ``speed``: each mechanism at the speed of its mechanism (:mod:`experiments.gpu.speed`): the ``cuda``-marked
   tests, the GPU paths' first, then every core against ``full``
   (``auto``) at n = 8192 and 16384, its multiple of its floor, MoBA's host synchronisations and the SDPA
   kernel of ``full``; run alone (``--steps environment,speed --budget-min 6``) it fits six minutes.
3. ``targets``: the GPU targets (:mod:`experiments.gpu.targets`), each against SDPA-flash in this process.
4. ``conformance``: ``tests/attention_zoo/test_device_conformance.py`` and
   ``tests/attention_zoo/test_sparse_flex.py`` with ``ZOO_TEST_DEVICE=cuda`` (every mechanism in fp32, bf16
   and fp16 against float64), then every test marked ``cuda``.
5. ``compare``: ``zoo compare`` on the embedded default task, one seed, on the GPU: training, throughput
   and peak memory (``max_memory_allocated``) as its runs log them.
6. ``grids``: :mod:`experiments.gpu.grids` (per-mechanism floors, Nystromformer-table crossovers against
   flash, Linformer Table 3), each length only while the budget lasts.
7. ``lra``, only when named (``--steps lra``, best alone): the next batch of the reference-scale Long Range Arena
   suite, several runs at once (:mod:`experiments.gpu.lra`); it adds ``lra.tar.gz`` and ``lra-resume.tar.gz``.

What comes back is at most 7 files, flat under ``--out``: ``report.md``, ``results.jsonl`` (one line per
measurement, target verdict and step), ``env.json``, ``pytest.log``, ``compare.log``, ``compare.tar.gz``
(the comparison's summary, plots and TensorBoard logs, no checkpoints) and ``plots.tar.gz``. The report is
rewritten after every step, so a run killed at its limit still hands back what it finished. The files name no
folder of the machine (:func:`experiments.gpu.environment.relative_paths`): paths in the checkout are
repository-relative, the interpreter's packages ``<site-packages>/``, the suite's scratch folder ``<work>/``; a log
is rewritten so when each command ends.

A rerun with the same ``--out`` appends to its ``results.jsonl``; ``--report-only`` rewrites ``report.md`` from it.
A half-written last line (a run killed mid-line) is reported and skipped (and cut off before a rerun appends);
any other line that is not a row of the suite is refused, naming the file and line, before anything runs.

``--smoke`` runs every step at tiny sizes on whatever device is present (CPU here), with a subset of the
conformance tests: the harness's own test (``tests/experiments/test_gpu_suite.py``). Without it the suite needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from experiments.gpu import environment, grids, report, speed, targets
from experiments.gpu.measure import RAW_SDPA_FLASH, Workload, measure
from experiments.subcommands import ZooArgumentParser

ROOT = Path(__file__).resolve().parents[2]
#: the steps of a run without --steps, in their order
STEPS = ("environment", "speed", "targets", "conformance", "compare", "grids")
#: every step, in its order: lra spans many GPU windows and runs only when named
ALL_STEPS = (*STEPS, "lra")
#: the largest share of the whole budget one subprocess step may take
STEP_SHARE = {"conformance": 0.35, "compare": 0.3, "speed": 0.75}
#: the share of the ``speed`` step's time its tests may take; the timings get the rest
SPEED_TESTS_SHARE = 0.45
CONFORMANCE_FILES = ("tests/attention_zoo/test_device_conformance.py", "tests/attention_zoo/test_sparse_flex.py")
SMOKE_CONFORMANCE = ("-k", "float32 and (full or local)")
SMOKE_COMPARE_ARGS = [
    "--data.seq_len=64", "--data.train_size=32", "--data.val_size=16", "--data.test_size=16",
    "--data.batch_size=8", "--model.dim=16", "--model.warmup_steps=1", "--trainer.max_steps=2",
    "--trainer.val_check_interval=2", "--trainer.log_every_n_steps=1",
]  # fmt: skip
SMOKE_ATTENTIONS = "full,local:window=8"


class StepFailed(Exception):
    """A step that ran to its end but failed (a test failed, a run crashed); its results are kept."""


class StepCut(Exception):
    """A step that the budget ended before its end; what it measured is kept."""


class Budget:
    def __init__(self, minutes: float) -> None:
        self.seconds, self.start = minutes * 60, time.monotonic()

    def remaining(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


class Suite:
    def __init__(self, out: Path, budget: Budget, smoke: bool, device: str) -> None:
        self.out, self.budget, self.smoke, self.device = out, budget, smoke, device
        self.results = open(out / "results.jsonl", "a")  # noqa: SIM115 (held for the whole run, flushed per row)
        self.work = Path(tempfile.mkdtemp(prefix="zoo-gpu-suite-"))
        self.rows: list[dict[str, Any]] = []
        self.env: dict[str, Any] = {}
        self.base = (
            Workload(RAW_SDPA_FLASH, 128, dtype="float32", device=device, batch=1, heads=2, dim_head=16)
            if smoke
            else Workload(RAW_SDPA_FLASH, 8192, device=device)
        )
        self.warmup, self.repeats = (1, 2) if smoke else (3, 10)

    def record(self, row: dict[str, Any]) -> None:
        line = environment.relative_paths(json.dumps(row, default=str), self.work)
        self.rows.append(json.loads(line))
        self.results.write(line + "\n")
        self.results.flush()

    def run_step(self, name: str, step: Callable[[float], str]) -> None:
        remaining = self.budget.remaining()
        allotted = min(remaining, STEP_SHARE.get(name, 1.0) * self.budget.seconds)
        begin = time.monotonic()
        if remaining <= 0:
            status, detail = "skipped", "budget spent"
        else:
            print(f"[gpu-suite] {name} (up to {allotted:.0f} s)", flush=True)
            try:
                status, detail = "ok", step(allotted)
            except StepFailed as exc:
                status, detail = "failed", str(exc)
            except StepCut as exc:
                status, detail = "cut", str(exc)
            except Exception as exc:  # a failing step never stops the others
                status, detail = "failed", f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        seconds = time.monotonic() - begin
        self.record({"kind": "step", "step": name, "status": status, "seconds": round(seconds, 1), "detail": detail})
        print(f"[gpu-suite] {name}: {status} in {seconds:.0f} s {detail}", flush=True)
        report.write(self.out, self.env, self.rows, self.smoke)

    def environment(self, allotted: float) -> str:
        self.env = environment.describe(self.device)
        dtype = torch.float32 if self.smoke else torch.bfloat16
        size, nbytes = (256, 2**23) if self.smoke else (8192, 2**31)
        self.env["gemm_dtype"], self.env["gemm_size"] = str(dtype).removeprefix("torch."), size
        self.env["peak_tflops"] = environment.gemm_peak_tflops(self.device, dtype, size)
        self.env["copy_gbs"] = environment.copy_bandwidth_gbs(self.device, nbytes)
        if self.device == "cuda":
            torch.cuda.empty_cache()
        text = environment.relative_paths(json.dumps(self.env, indent=2, default=str), self.work)
        (self.out / "env.json").write_text(text + "\n")
        return f"{self.env.get('name')}: {self.env['peak_tflops']:.1f} TFLOP/s, {self.env['copy_gbs']:.0f} GB/s"

    def _measure(self, workload: Workload, grid: str) -> dict[str, Any]:
        repeats = self.repeats * (2 if grid == "targets" else 1)
        row = measure(workload, warmup=self.warmup, repeats=repeats, peak_tflops=self.env.get("peak_tflops"),
                      bandwidth_gbs=self.env.get("copy_gbs"))  # fmt: skip
        row = {"kind": "measure", "grid": grid} | row
        self.record(row)
        return row

    def speed(self, allotted: float) -> str:
        deadline = time.monotonic() + allotted
        env = os.environ | {"ZOO_TEST_DEVICE": self.device, "PYTHONPATH": _pythonpath()}
        if self.smoke:  # the GPU paths' CPU tests stand in for their CUDA ones
            args = [*speed.PATH_TESTS[:2], "-k", "auto"]
        else:
            args = ["-m", "cuda", *speed.cuda_test_order(_files_with_cuda_tests())]
        with open(self.out / "pytest.log", "a") as log:
            options = ["-q" if self.smoke else "-v", "-rfE", "--durations=10", "-p", "no:cacheprovider"]
            command = [sys.executable, "-m", "pytest", *options, *args]
            outcomes = [_run_logged(command, env, log, SPEED_TESTS_SHARE * allotted, self.work)]
        met, measured = speed.run(
            lambda workload: self._measure(workload, "speed"), self.record, self.base, self.smoke, self.env,
            lambda: min(self.budget.remaining(), deadline - time.monotonic()),
        )  # fmt: skip
        total = len(speed.SPEED_CORES) * len(speed.MIN_SPEEDUP)
        detail = "; ".join([text for _, text in outcomes] + [f"{met} of {measured} speed targets met"])
        detail += " (smoke sizes: not a claim)" * self.smoke
        _raise_unless_ok([status for status, _ in outcomes], detail)
        if measured < total:
            raise StepCut(f"{detail}; {total - measured} of {total} left out by the budget")
        return detail

    def targets(self, allotted: float) -> str:
        met = []
        for target in targets.TARGETS:
            if self.budget.remaining() <= 0:
                raise StepCut(f"budget spent after {len(met)} of {len(targets.TARGETS)} targets")
            reference = self._measure(targets.baseline(target, self.base, self.smoke), "targets")
            row = self._measure(target.workload(self.base, self.smoke), "targets")
            verdict = targets.evaluate(target, row, reference)
            self.record({"kind": "target", "smoke": self.smoke} | verdict)
            met.append(verdict["met"])
        return f"{sum(m is True for m in met)} of {len(met)} met" + (" (smoke sizes: not a claim)" * self.smoke)

    def conformance(self, allotted: float) -> str:
        deadline = time.monotonic() + allotted
        env = os.environ | {"ZOO_TEST_DEVICE": self.device, "PYTHONPATH": _pythonpath()}
        runs = [[*CONFORMANCE_FILES, *SMOKE_CONFORMANCE]] if self.smoke else [list(CONFORMANCE_FILES)]
        if not self.smoke:
            runs.append(["-m", "cuda", *_files_with_cuda_tests()])
        outcomes = []
        with open(self.out / "pytest.log", "a") as log:
            for args in runs:
                verbosity = "-q" if self.smoke else "-v"  # -v: a run stopped by the budget still names each result
                options = [verbosity, "-rfE", "--durations=10", "-p", "no:cacheprovider"]
                command = [sys.executable, "-m", "pytest", *options, *args]
                outcomes.append(_run_logged(command, env, log, deadline - time.monotonic(), self.work))
        detail = "; ".join(text for _, text in outcomes)
        _raise_unless_ok([status for status, _ in outcomes], detail)
        return detail

    def compare(self, allotted: float) -> str:
        command = [sys.executable, "-m", "experiments.cli", "compare", "--seeds", "1",
                   "--experiment", "gpu-compare", "--runs-dir", str(self.work / "runs")]  # fmt: skip
        if self.smoke:
            command += ["--attentions", SMOKE_ATTENTIONS, "--fit-args", json.dumps(SMOKE_COMPARE_ARGS)]
        env = os.environ | {"PYTHONPATH": _pythonpath(), "ZOO_CACHE": str(self.work / "cache")}
        with open(self.out / "compare.log", "a") as log:
            status, summary = _run_logged(command, env, log, allotted, self.work)
        experiment = self.work / "runs" / "gpu-compare"
        if experiment.exists():
            _relative_paths_in(experiment, self.work)
            with tarfile.open(self.out / "compare.tar.gz", "w:gz") as archive:
                archive.add(experiment, arcname="gpu-compare", filter=_no_checkpoints)
            summary_md = experiment / "summary.md"
            if summary_md.exists():
                self.record({"kind": "compare", "summary_md": summary_md.read_text()})
        _raise_unless_ok([status], summary)
        return summary

    def grids(self, allotted: float) -> str:
        done = cut = 0
        for grid in grids.grids(self.smoke):
            slow: set[tuple[str, str, str]] = set()  # (label, mode): stopped at a length that failed
            for workload in grid.workloads(self.base, self.smoke):
                key = (workload.label, workload.mode, workload.dtype)
                if self.budget.remaining() <= 0:
                    cut += 1
                    continue
                if key in slow:
                    continue
                row = self._measure(workload, grid.name)
                done += 1
                if row["status"] != "ok":
                    slow.add(key)  # an OOM at n never succeeds at 2n
        figures = report.plot_grids(self.rows, self.work / "plots")
        if figures:
            with tarfile.open(self.out / "plots.tar.gz", "w:gz") as archive:
                for figure in figures:
                    archive.add(figure, arcname=figure.name)
        if cut:
            raise StepCut(f"{done} workloads measured, {cut} left out by the budget")
        return f"{done} workloads measured"

    def lra(self, allotted: float) -> str:
        from experiments.gpu import lra

        suite = lra.smoke_suite(self.work) if self.smoke else lra.SUITES / "reference.yaml"
        return lra.run_batch(
            self.out, self.work, seconds=allotted, suite_path=suite, concurrency=2 if self.smoke else 4,
            committed=self.work / "no-committed" if self.smoke else lra.COMMITTED,  # a smoke batch starts bare
            device=str(self.env.get("name") or self.device), record=self.record,
        )  # fmt: skip

    def close(self) -> None:
        self.results.close()
        report.write(self.out, self.env, self.rows, self.smoke)
        shutil.rmtree(self.work, ignore_errors=True)


def _allow_recompiles(limit: int = 64) -> None:
    """The grids call the compiled FlexAttention kernel with many patterns, lengths and dtypes in one process;
    past dynamo's recompile limit (8) it would fall back to the eager dense path and time that instead."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(limit, getattr(torch._dynamo.config, name)))


def _raise_unless_ok(statuses: list[str], detail: str) -> None:
    if "failed" in statuses:
        raise StepFailed(detail)
    if "cut" in statuses:
        raise StepCut(detail)


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def _files_with_cuda_tests() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.cuda" in p.read_text())


def _no_checkpoints(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if info.name.endswith(".ckpt") else info


def _relative_paths_in(folder: Path, work: Path) -> None:
    """Rewrite the text files under ``folder`` (logs, configs, summaries; not the binary event files) with
    :func:`environment.relative_paths`."""
    for path in (p for p in folder.rglob("*") if p.is_file()):
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if "\0" not in text and (new := environment.relative_paths(text, work)) != text:
            path.write_text(new, encoding="utf-8")


def _run_logged(command: list[str], env: dict[str, str], log: Any, timeout: float, work: Path) -> tuple[str, str]:
    """Run ``command`` in the repository, its output streamed into ``log`` (a run stopped at its time limit
    keeps what it printed, with this machine's paths rewritten when it ends): ``ok``, ``failed`` (exit code not 0)
    or ``cut`` (the budget), and its last line."""
    log.write(environment.relative_paths(f"$ {' '.join(command)}\n", work))
    log.flush()
    if timeout <= 0:
        return "cut", "not run: budget spent"
    start = log.tell()
    try:
        code = subprocess.run(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
        ).returncode
    except subprocess.TimeoutExpired:
        log.write(f"\n[gpu-suite] stopped after {timeout:.0f} s (budget)\n")
        return "cut", f"stopped after {timeout:.0f} s (budget)"
    finally:
        log.flush()
        with open(log.name, encoding="utf-8", errors="replace") as output:
            output.seek(start)
            text = environment.relative_paths(output.read(), work)
        log.truncate(start)  # the log is opened to append: what follows is written at its new end
        log.write(text)
        log.flush()
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    return "ok" if code == 0 else "failed", f"exit {code}: {last.strip('= ')}"


def _note(text: str) -> None:
    print(f"zoo gpu-suite: note: {text}", file=sys.stderr)


#: the examples of ``--help``
EXAMPLES = (
    "zoo gpu-suite --out gpu-results --budget-min 8",
    "zoo gpu-suite --out smoke --smoke --steps environment,compare",
)


def build_parser() -> argparse.ArgumentParser:
    """The command's parser: plain help with :data:`EXAMPLES`, a usage error in one line with the closest flag."""
    parser = ZooArgumentParser("zoo gpu-suite", __doc__.split("\n\n")[0], EXAMPLES)
    parser.add_argument("--out", required=True, type=Path, help="results folder (at most 7 files, flat)")
    parser.add_argument("--budget-min", type=float, default=8.0, help="minutes for the whole suite (default 8)")
    parser.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"comma-separated subset of {','.join(ALL_STEPS)} (default: all but lra)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on whatever device is present")
    parser.add_argument("--report-only", action="store_true", help="only rewrite report.md from --out's results")
    return parser


def _problem(args: argparse.Namespace, steps: list[str]) -> str | None:
    """What makes the command line unusable, or None; nothing has run or been written yet."""
    if args.out.exists() and not args.out.is_dir():
        return f"--out {args.out} is a file, not a folder"
    if args.report_only:
        return None if (args.out / "results.jsonl").is_file() else f"--out {args.out} holds no results.jsonl"
    unknown = [s for s in steps if s not in ALL_STEPS]
    if unknown or not steps:
        given = f"unknown step(s) {', '.join(unknown)}" if unknown else f"--steps {args.steps!r} names no step"
        return f"{given}; choose from {', '.join(ALL_STEPS)}"
    if not (math.isfinite(args.budget_min) and args.budget_min > 0):
        return f"--budget-min must be a finite number of minutes > 0, got {args.budget_min}"
    if not args.smoke and not torch.cuda.is_available():
        return "CUDA is not available here; --smoke runs the suite at tiny sizes on CPU"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    problem = _problem(args, steps)
    if problem:
        print(f"zoo gpu-suite: error: {problem}", file=sys.stderr)
        return 2
    results = args.out / "results.jsonl"
    try:  # a damaged results.jsonl (and, for a report, env.json) is refused before anything runs or is written
        if results.is_file() and not args.report_only:
            report.read_rows(results, repair=True, note=_note)
        if args.report_only:
            report.rebuild(args.out, note=_note)
            return 0
    except ValueError as error:
        print(f"zoo gpu-suite: error: {error}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        suite = Suite(args.out, Budget(args.budget_min), args.smoke, device)
    except OSError as error:
        print(f"zoo gpu-suite: error: --out {args.out}: cannot write there ({error.strerror})", file=sys.stderr)
        return 2
    _allow_recompiles()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a killed run still writes its report
    try:
        if "environment" not in steps:
            suite.env = environment.describe(device)
        for name in (s for s in ALL_STEPS if s in steps):
            suite.run_step(name, getattr(suite, name))
    except KeyboardInterrupt:
        print("[gpu-suite] interrupted: writing the report of what finished", flush=True)
        return 130
    finally:
        suite.close()
        signal.signal(signal.SIGTERM, previous)
    return 0
