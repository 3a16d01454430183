"""Running a sweep: each case in a fresh worker process (by default; forked from a server that imported torch and the
zoo once), bounded in time, its result appended to the store the moment it is known; a rerun skips every case the
store already holds.

Statuses: ``ok``; ``oom`` (an allocation failed, the memory budget included, or the worker was
SIGKILLed, most likely by the kernel's OOM killer); ``unsupported`` (unknown mechanism, causal asked of
a non-causal core, a config the mechanism rejects at this size, a dtype the device lacks);
``timeout``; ``error`` (anything else; ``detail`` says what).

Max batch (Linformer Table 3's method): double the batch from 1 until a case fails or exceeds the
budget, then bisect between the last batch that fit and the first that did not; each probe is one call
(no warm-up) in a fresh process, the whole search bounded by ``search_timeout_s``. The largest batch is
then timed like any case (``ms_per_sequence_at_max_batch``: the paper's throughput comparison).
``limited_by`` says what stopped it: ``memory``, ``time`` (a probe or the search ran out of time),
``cap`` (``max_batch_cap`` fit) or ``error``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import attention_zoo as az
from experiments import preload
from experiments.bench.cases import DECODE_MODES, BenchConfig, Case
from experiments.bench.flops import case_flops
from experiments.bench.measure import RESULT_MARKER, measure_case, measure_peak_tflops
from experiments.bench.store import ResultStore, case_of, code_fingerprint, machine_info, now
from experiments.console import console

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CPU_BUDGET_GB = 8.0


def precheck(case: Case) -> dict[str, str] | None:
    """The result of a case that cannot run, decided without running it; None if it may run."""
    if case.attention not in az.list_attentions():
        known = ", ".join(az.list_attentions())
        return {"status": "unsupported", "detail": f"unknown attention {case.attention!r} (registered: {known})"}
    cls = az.get_attention_class(case.attention)
    unknown = sorted(set(case.options) - {s.name for s in az.attention_options(cls)})
    if unknown:
        return {"status": "error", "detail": f"{case.attention} has no option(s) {unknown}"}
    if case.causal and not cls.supports_causal:
        return {"status": "unsupported", "detail": f"{case.attention} does not support causal attention"}
    if not case.causal and cls.causal_only and case.mode not in DECODE_MODES and case.mode != "decode-step":
        return {"status": "unsupported", "detail": f"{case.attention} is causal only: time it with --causal"}
    if (case.mode in DECODE_MODES or case.mode == "decode-step") and not cls.supports_causal:
        detail = f"{case.attention} is not causal (a decoder would use {cls.causal_counterpart or 'another core'})"
        return {"status": "unsupported", "detail": detail}
    return None


def run_worker(job: dict[str, Any], *, threads: int, timeout_s: float) -> dict[str, Any]:
    """One job in a fresh process, forked from the preloaded forkserver of :mod:`experiments.preload`
    (its imports are done once, not per case) or, where there is none, a ``python -m experiments.bench.measure``;
    its result, or why there is none."""
    if preload.available():
        return _forked_worker(job, threads=threads, timeout_s=timeout_s)
    env = os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "experiments.bench.measure"]
    try:
        proc = subprocess.run(
            command, input=json.dumps(job), capture_output=True, text=True, timeout=timeout_s, env=env
        )
    except subprocess.TimeoutExpired:
        return _timed_out(timeout_s)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    return _no_result(proc.returncode, proc.stderr)


def _forked_worker(job: dict[str, Any], *, threads: int, timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zoo-bench-") as folder:
        log = Path(folder) / "worker.log"
        receive, send = multiprocessing.Pipe(duplex=False)
        process = preload.start_function(_worker, (job, threads, send, str(log)))
        send.close()  # the worker holds the only writer: its exit ends the pipe
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join()
            return _timed_out(timeout_s)
        if receive.poll():
            with contextlib.suppress(EOFError):
                return receive.recv()
        return _no_result(process.exitcode, log.read_text() if log.exists() else "")


def _worker(job: dict[str, Any], threads: int, send: Connection, log: str) -> None:
    """The forked worker: its output to ``log``, ``threads`` torch threads, the job's result to ``send``."""
    preload.output_to(log)
    os.environ |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    import torch

    from experiments.bench.measure import run_job

    torch.set_num_threads(threads)  # the forkserver imported torch before this worker's thread count was known
    send.send(run_job(job))
    send.close()


def _timed_out(timeout_s: float) -> dict[str, Any]:
    return {"status": "timeout", "detail": f"no result within {timeout_s:g} s (worker killed)"}


def _no_result(returncode: int | None, stderr: str) -> dict[str, Any]:
    if returncode == -signal.SIGKILL:
        return {"status": "oom", "detail": "worker SIGKILLed, most likely by the kernel's OOM killer"}
    last = (stderr.strip().splitlines() or ["no output"])[-1][:300]
    return {"status": "error", "detail": f"worker exited with code {returncode}: {last}"}


class Runner:
    def __init__(self, config: BenchConfig, store: ResultStore | None, device: str) -> None:
        self.config = config
        self.store = store
        self.machine = machine_info(device)
        budget_gb = config.memory_budget_gb
        if budget_gb is None and device == "cpu":
            budget_gb = DEFAULT_CPU_BUDGET_GB
        self.budget_bytes = None if budget_gb is None else int(budget_gb * 2**30)
        self._peaks: dict[tuple[str, str, int], float] = {}

    def measure(self, case: Case, *, repeats: int, warmup: int, timeout_s: float | None = None) -> dict[str, Any]:
        if (result := precheck(case)) is not None:
            return result
        if self.config.isolation == "none":
            return measure_case(case, repeats=repeats, warmup=warmup)
        job = {
            "case": dataclasses.asdict(case),
            "repeats": repeats,
            "warmup": warmup,
            "memory_budget_bytes": self.budget_bytes,
        }
        return run_worker(
            job, threads=case.threads, timeout_s=self.config.case_timeout_s if timeout_s is None else timeout_s
        )

    def peak_tflops(self, case: Case) -> float | None:
        """The device's matmul peak for the case's dtype and threads, measured once per run."""
        key = (case.device, case.dtype, case.threads)
        if key not in self._peaks:
            if self.config.isolation == "none":
                self._peaks[key] = measure_peak_tflops(*key)
            else:
                job = {"peak": {"device": case.device, "dtype": case.dtype, "threads": case.threads}}
                self._peaks[key] = run_worker(job, threads=case.threads, timeout_s=120).get("peak_tflops")
        return self._peaks[key]

    def time_case(self, case: Case) -> dict[str, Any]:
        result = self.measure(case, repeats=self.config.repeats, warmup=self.config.warmup)
        row: dict[str, Any] = {"repeats": self.config.repeats, "warmup": self.config.warmup, **result}
        if result["status"] == "ok":
            row |= self.throughput(case, result["time_ms_median"])
        return row

    def throughput(self, case: Case, time_ms: float) -> dict[str, Any]:
        flops = case_flops(case)
        if flops is None:
            return {"flops": None, "gflops_per_s": None, "device_peak_tflops": None, "peak_fraction": None}
        achieved = flops / (time_ms / 1e3)
        peak = self.peak_tflops(case)
        return {
            "flops": flops,
            "gflops_per_s": achieved / 1e9,
            "device_peak_tflops": peak,
            "peak_fraction": achieved / (peak * 1e12) if peak else None,
        }

    def search_max_batch(self, case: Case) -> dict[str, Any]:
        deadline = time.monotonic() + self.config.search_timeout_s
        budget_mb = None if self.budget_bytes is None else self.budget_bytes / 2**20
        cap = self.config.max_batch_cap
        probes: dict[int, dict[str, Any]] = {}

        def fits(batch: int) -> bool:
            left = deadline - time.monotonic()
            result = self.measure(
                case.with_batch(batch), repeats=1, warmup=0, timeout_s=min(left, self.config.case_timeout_s)
            )
            if result["status"] == "ok" and budget_mb is not None and result["total_mb"] > budget_mb:
                result = {"status": "oom", "detail": f"{result['total_mb']:.0f} MB > budget {budget_mb:.0f} MB"}
            probes[batch] = result
            return result["status"] == "ok"

        good, bad = 0, None  # the largest batch that fit, the smallest that did not
        while time.monotonic() < deadline:
            if bad is None and good < cap:
                batch = min(max(1, 2 * good), cap)
            elif bad is not None and bad - good > 1:
                batch = (good + bad) // 2
            else:
                break
            good, bad = (batch, bad) if fits(batch) else (good, batch)
        if not good:
            first = probes.get(1, {"status": "timeout", "detail": "the search ran out of time"})
            return {"status": first["status"], "detail": first["detail"], "max_batch": 0}
        if bad is None:
            limited_by = "cap" if good >= cap else "time"
        elif bad - good > 1:
            limited_by = "time"
        else:
            limited_by = {"oom": "memory", "timeout": "time"}.get(probes[bad]["status"], "error")
        timed = self.measure(case.with_batch(good), repeats=self.config.repeats, warmup=self.config.warmup)
        if timed["status"] != "ok":  # it fit once; time it by its probe rather than lose the search
            timed = probes[good]
        return {
            "status": "ok",
            "detail": "",
            "max_batch": good,
            "limited_by": limited_by,
            "probes": {str(b): r["status"] for b, r in sorted(probes.items())},
            "time_ms_at_max_batch": timed["time_ms_median"],
            "ms_per_sequence_at_max_batch": timed["time_ms_median"] / good,
            "total_mb_at_max_batch": timed["total_mb"],
            "memory_budget_mb": budget_mb,
        }

    def case_row(self, case: Case, code: str) -> dict[str, Any]:
        """Measure one case: its result row, as stored."""
        started = time.monotonic()
        result = self.search_max_batch(case) if case.kind == "max_batch" else self.time_case(case)
        row = dataclasses.asdict(case) | result
        row |= {
            "machine": self.machine,
            "code": code,
            "finished_at": now(),
            "wall_s": round(time.monotonic() - started, 2),
        }
        row["load_avg_1m"] = os.getloadavg()[0]  # other work on the machine skews times: say so
        return row

    def run(self, cases: list[Case], *, retry_failed: bool = False) -> int:
        """Measure every case the store lacks; returns how many measurements ran. A case that fails is not
        measured again in the later rounds."""
        pending, code = pending_cases(self.store, cases, retry_failed=retry_failed, rounds=self.config.rounds)
        out = console()
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        failed: set[str] = set()
        ran = 0
        with Progress(*columns, console=out) as progress:
            task = progress.add_task("bench", total=len(pending))
            for case in pending:
                progress.advance(task)
                if case.key() in failed:
                    continue
                progress.update(task, description=describe(case))
                row = self.case_row(case, code)
                self.store.append(row)
                ran += 1
                progress.console.print(f"{describe(case)}: {summary(row)}")
                if row["status"] != "ok":
                    failed.add(case.key())
        return ran


def pending_cases(
    store: ResultStore, cases: list[Case], *, retry_failed: bool, rounds: int = 1
) -> tuple[list[Case], str]:
    """The measurements the store lacks (with this code), round by round: round r holds the cases measured at
    most r times so far, none that failed (unless ``retry_failed``); and this code's fingerprint. Says what it
    skips."""
    code = code_fingerprint()
    measured: dict[str, int] = {}
    failed: set[str] = set()  # cases whose last measurement with this code failed
    for row in store.rows:
        if row.get("code") != code:
            continue
        key = case_of(row).key()
        if row["status"] == "ok":
            measured[key] = measured.get(key, 0) + 1
            failed.discard(key)
        else:
            failed.add(key)
    done = set() if retry_failed else failed  # a case that failed is done with, in every round
    pending = [c for r in range(rounds) for c in cases if c.key() not in done and measured.get(c.key(), 0) <= r]
    if len(pending) < rounds * len(cases):
        what = "cases" if rounds == 1 else f"measurements ({len(cases)} cases x {rounds} rounds)"
        console().print(
            f"resuming: {rounds * len(cases) - len(pending)} of {rounds * len(cases)} {what} already in {store.path} "
            f"(measured with this code, {code}; results of other code are measured again)"
        )
    return pending, code


def describe(case: Case) -> str:
    batch = "max batch" if case.kind == "max_batch" else f"B={case.batch}"
    return f"{case.label} n={case.seq_len} {case.level} {case.mode} {case.dtype} {batch} t={case.threads}"


def summary(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']} {row.get('detail', '')}".strip()
    if row["kind"] == "max_batch":
        return f"max batch {row['max_batch']} (limited by {row['limited_by']})"
    return f"{row['time_ms_median']:.2f} ms (min {row['time_ms_min']:.2f}), peak {row['peak_mb']:.1f} MB"
