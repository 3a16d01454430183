"""``--launcher ray`` for ``zoo compare`` and ``zoo bench`` (``experiments/ray_launcher.py``,
``experiments/compare/ray_runs.py``, ``experiments/bench/ray_runs.py``), and one training run over two "nodes"
under torchrun (gloo on CPU).

Without Ray: ``--launcher ray`` is a one-line error naming the extra, and ``--launcher local`` never imports
Ray. With Ray (tests marked ``ray``; skipped where Ray is not installed, ``-m 'not ray'`` deselects them): one
local Ray for the whole module (2 CPUs, one bench slot), so its start-up is paid once; a tiny compare of 2
mechanisms x 2 seeds writes what the local launcher writes; an interrupted experiment resumes with only its
missing runs, a crashing run recorded; ``zoo bench`` writes the local path's rows.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import cli
from experiments.bench.store import ResultStore
from tests.experiments.tiny_recall import RECALL, ROOT, fit_args, read_csv

TINY_FIT_ARGS = fit_args()
TINY_BENCH = ["bench", "--attentions", "full", "--seq-lens", "32,64", "--heads", "2", "--dim-head", "8"]
TINY_BENCH += ["--repeats", "2", "--device", "cpu"]


def compare_argv(runs: Path, experiment: str, attentions: str = "full,local:window=8", seeds: int = 2) -> list[str]:
    return [
        "compare", "--task-config", RECALL, "--attentions", attentions, "--seeds", str(seeds),
        "--runs-dir", str(runs), "--experiment", experiment, "--fit-args", json.dumps(TINY_FIT_ARGS),
    ]  # fmt: skip


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))


# --- without Ray ----------------------------------------------------------------------------------------


def test_launcher_ray_without_ray_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails, as where it is not installed
    assert cli.main([*compare_argv(tmp_path / "runs", "x"), "--launcher", "ray"]) == 2
    assert cli.main([*TINY_BENCH, "--out", str(tmp_path / "bench"), "--launcher", "ray"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[0] for line in errors] == ["zoo compare", "zoo bench"]
    assert all('pip install -e ".[ray]"' in line for line in errors)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "bench").exists()


def test_ray_settings_without_launcher_ray_are_refused(tmp_path, capsys):
    assert cli.main([*compare_argv(tmp_path / "runs", "x"), "--ray-address", "auto"]) == 2
    assert capsys.readouterr().err == "zoo compare: error: --ray-address go with --launcher ray\n"
    assert cli.main([*TINY_BENCH, "--out", str(tmp_path / "bench"), "--run-cpus", "2"]) == 2
    assert "go with --launcher ray" in capsys.readouterr().err


@pytest.mark.slow
def test_local_launcher_never_imports_ray(tmp_path):
    """A finder that records every attempt to import ray, in a fresh interpreter (this one may hold Ray)."""
    program = f"""
import importlib.abc, sys
tried = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            tried.append(name)
        return None
sys.meta_path.insert(0, Watch())
from experiments import cli
assert cli.main({compare_argv(tmp_path / "runs", "local", "full", seeds=1)!r}) == 0
assert cli.main({[*TINY_BENCH, "--out", str(tmp_path / "bench"), "--isolation", "none"]!r}) == 0
assert not tried and "ray" not in sys.modules, tried
"""
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


# --- with Ray -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for this module: 2 CPUs (two runs at once), one bench slot."""
    ray = pytest.importorskip("ray")
    from experiments.ray_launcher import BENCH_SLOT

    ray.init(num_cpus=2, include_dashboard=False, resources={BENCH_SLOT: 1}, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_ray_compare_writes_what_the_local_launcher_writes(ray_cluster, tmp_path, capsys):
    runs = tmp_path / "runs"
    assert cli.main(compare_argv(runs, "local")) == 0
    assert cli.main([*compare_argv(runs, "ray"), "--launcher", "ray", "--run-cpus", "1"]) == 0
    output = capsys.readouterr().out
    assert "on Ray: 4 task(s), 1 CPU and 0 GPU each; runs write into the experiment directory" in output
    for name in ("runs.csv", "summary.csv"):
        local_columns, local_rows = read_csv(runs / "local" / name)
        ray_columns, ray_rows = read_csv(runs / "ray" / name)
        assert ray_columns == local_columns and len(ray_rows) == len(local_rows)
    _, ray_runs = read_csv(runs / "ray" / "runs.csv")
    assert [(r["mechanism"], r["seed"], r["status"]) for r in ray_runs] == [
        ("full", "0", "ok"), ("local", "0", "ok"), ("full", "1", "ok"), ("local", "1", "ok"),
    ]  # fmt: skip
    for row in ray_runs:
        run_dir = runs / "ray" / row["mechanism"] / f"seed-{row['seed']}"
        assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
        assert any(run_dir.glob("events.out.tfevents.*")) and (run_dir / "config.yaml").is_file()
    for name in ("summary.md", "accuracy_vs_throughput.png", "peak_memory.png"):
        assert (runs / "ray" / name).is_file()
    assert "runs as Ray tasks" in (runs / "ray" / "summary.md").read_text()


@pytest.mark.ray
@pytest.mark.slow
def test_ray_resume_runs_only_the_missing_runs_and_records_a_crash(ray_cluster, tmp_path, capsys):
    """A cluster address (here the module's Ray, as 'auto'): each run's files come back to the driver. Then an
    interruption is simulated: one run never happened, one died leaving a damaged checkpoint and no result."""
    runs = tmp_path / "runs"
    argv = [*compare_argv(runs, "resume", "full", seeds=3), "--launcher", "ray", "--ray-address", "auto"]
    assert cli.main(argv) == 0
    assert "run files come back to this machine" in capsys.readouterr().out
    experiment = runs / "resume"
    for seed in range(3):  # written by the driver from what each task sent back
        run_dir = experiment / "full" / f"seed-{seed}"
        assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
        assert any(run_dir.glob("events.out.tfevents.*")) and (run_dir / "checkpoints" / "last.ckpt").is_file()
    kept = (experiment / "full" / "seed-0" / "run.json").read_text()
    shutil.rmtree(experiment / "full" / "seed-1")
    crashed = experiment / "full" / "seed-2"
    (crashed / "run.json").unlink()
    (crashed / "checkpoints" / "last.ckpt").write_bytes(b"half a checkpoint")

    assert cli.main(argv) == 0  # some runs are ok: the sweep completes
    output = capsys.readouterr().out
    assert "3 runs, 1 finished earlier" in output and "on Ray: 2 task(s)" in output
    assert (experiment / "full" / "seed-0" / "run.json").read_text() == kept  # not run again
    _, rows = read_csv(experiment / "runs.csv")
    assert [(r["seed"], r["status"]) for r in rows] == [("0", "ok"), ("1", "ok"), ("2", "failed")]
    assert "zoo fit: error: --ckpt_path" in rows[2]["reason"] and "not a readable checkpoint" in rows[2]["reason"]
    assert json.loads((experiment / "full" / "seed-1" / "run.json").read_text())["status"] == "finished"
    assert (experiment / "summary.csv").is_file()


@pytest.mark.ray
def test_ray_bench_writes_the_rows_the_local_path_writes(ray_cluster, tmp_path, capsys):
    assert cli.main([*TINY_BENCH, "--out", str(tmp_path / "local")]) == 0
    assert cli.main([*TINY_BENCH, "--out", str(tmp_path / "ray"), "--launcher", "ray"]) == 0
    local, ray = ResultStore(tmp_path / "local").latest(), ResultStore(tmp_path / "ray").latest()
    assert set(ray) == set(local) and len(ray) == 2
    for key, row in ray.items():
        assert set(row) == set(local[key]) and row["status"] == local[key]["status"] == "ok"
        assert row["time_ms_median"] > 0 and row["machine"]["device"] == "cpu"
    capsys.readouterr()
    assert cli.main([*TINY_BENCH, "--out", str(tmp_path / "ray"), "--launcher", "ray"]) == 0
    assert "resuming: 2 of 2 cases" in capsys.readouterr().out
    assert len((tmp_path / "ray" / "results.jsonl").read_text().splitlines()) == 2


@pytest.mark.ray
def test_bench_on_a_cluster_without_bench_slots_is_refused(ray_cluster, monkeypatch):
    from experiments.ray_launcher import RayLauncherError, connect

    monkeypatch.setattr(ray_cluster, "cluster_resources", lambda: {"CPU": 8.0})
    with pytest.raises(RayLauncherError, match="no zoo_bench_slot resource.*ray start .*--resources"):
        connect(None, bench_device="cpu")
    with pytest.raises(RayLauncherError, match="no GPU"):
        connect(None, bench_device="cuda")


@pytest.mark.ray
def test_an_address_where_nothing_listens_fails_at_once(ray_cluster):
    from experiments.ray_launcher import RayLauncherError, connect

    for address in (f"127.0.0.1:{free_port()}", f"ray://127.0.0.1:{free_port()}"):
        with pytest.raises(RayLauncherError, match=f"nothing answers at --ray-address {address}.*ray start --head"):
            connect(address)


# --- one run on two nodes (torchrun, gloo) -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_ddp_over_two_nodes_under_torchrun(tmp_path):
    """The multi-node recipe of the README, both "nodes" on this machine: two torchrun agents, node_rank 0
    and 1, one process each, meeting at MASTER_ADDR:MASTER_PORT; Lightning reads the torchrun environment."""
    runs, port = tmp_path / "runs", free_port()
    fit = [
        "fit", "-c", RECALL, *TINY_FIT_ARGS, "--trainer.max_steps=6", "--trainer.limit_val_batches=2",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.logger.init_args.save_dir", str(runs), "--trainer.logger.init_args.version", "two-nodes",
        "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.num_nodes", "2",
        "--trainer.devices", "1",
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agents = []
    for node_rank in (0, 1):
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
            "-m", "experiments.cli", *fit,
        ]  # fmt: skip
        log = open(tmp_path / f"node-{node_rank}.log", "w")  # noqa: SIM115 (the child holds it)
        agents.append(subprocess.Popen(torchrun, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [agent.wait(timeout=180) for agent in agents]
    except subprocess.TimeoutExpired:
        codes = None  # the agents' logs say where they were
    finally:
        for agent in agents:
            agent.kill()
    logs = "\n".join((tmp_path / f"node-{rank}.log").read_text()[-2000:] for rank in (0, 1))
    assert codes == [0, 0], logs
    record = json.loads((runs / "recall" / "two-nodes" / "run.json").read_text())
    assert record["status"] == "finished" and record["world_size"] == 2 and record["step"] == 6, logs
