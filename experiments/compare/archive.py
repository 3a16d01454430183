"""Keep the finished runs of a ``zoo compare`` experiment beside its results, without their checkpoints.

    python -m experiments.compare.archive runs/linformer_paper/mlm2-n512 results/linformer_paper/runs
    python -m experiments.compare.archive --restore \
        results/linformer_paper/runs/mlm2-n512 runs/linformer_paper

A study that runs across sittings needs its finished runs to outlive the machine's ``runs/`` folder (git-ignored).
Each finished run (``run.json`` says ``finished``; with ``--tested``, also evaluated by ``zoo test``) is copied to
``DEST/<experiment>/<attention>/seed-<s>/`` with everything but ``checkpoints/``: its record, config, log,
TensorBoard events and test outputs, which is all that ``zoo compare``'s resume, ``zoo report`` and the studies
read. Unfinished runs are left out (their progress lives in a checkpoint), and so are the experiment's own
summaries, which ``zoo compare`` writes again. ``--restore`` copies an archived experiment back under a runs
folder, where a rerun of the same ``zoo compare`` command skips the restored runs and runs the rest.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from experiments.compare.runs import RUN_RECORD, is_finished, is_tested

CHECKPOINTS = "checkpoints"


def finished_runs(experiment: Path, *, tested: bool) -> list[Path]:
    """Run folders (``<attention>/seed-<s>``) of ``experiment`` that are finished (and tested, if asked)."""
    runs = sorted(path.parent for path in experiment.glob(f"*/seed-*/{RUN_RECORD}"))
    return [run for run in runs if is_finished(run) and (not tested or is_tested(run))]


def archive(experiment: Path, destination: Path, *, tested: bool = False) -> list[Path]:
    """Copy the finished runs of ``experiment`` (without checkpoints) to ``destination / experiment.name``, with
    the experiment's ``compare.yaml``; a run archived before is replaced. Returns the archived run folders."""
    if not (experiment / "compare.yaml").is_file():
        raise FileNotFoundError(f"{experiment} is not a zoo compare experiment (it has no compare.yaml)")
    target = destination / experiment.name
    copied = []
    for run in finished_runs(experiment, tested=tested):
        copy = target / run.relative_to(experiment)
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(run, copy, ignore=shutil.ignore_patterns(CHECKPOINTS))
        copied.append(copy)
    if copied:
        shutil.copy2(experiment / "compare.yaml", target / "compare.yaml")
    return copied


def restore(archived: Path, runs_dir: Path) -> list[Path]:
    """Copy an archived experiment's runs back to ``runs_dir / archived.name``; a run that is already there and
    finished is kept as it is, anything else there is replaced. Returns the restored run folders."""
    target = runs_dir / archived.name
    restored = []
    for run in finished_runs(archived, tested=False):
        copy = target / run.relative_to(archived)
        if (copy / RUN_RECORD).is_file() and is_finished(copy):
            continue
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(run, copy)
        restored.append(copy)
    if restored and not (target / "compare.yaml").is_file():
        shutil.copy2(archived / "compare.yaml", target / "compare.yaml")
    return restored


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the experiment folder (with --restore: its archived copy)")
    parser.add_argument("destination", type=Path, help="the archive folder (with --restore: the runs folder)")
    parser.add_argument("--restore", action="store_true", help="copy an archived experiment back")
    parser.add_argument("--tested", action="store_true", help="archive only runs that zoo test has evaluated")
    args = parser.parse_args(argv)
    if not args.source.is_dir():
        print(f"error: {args.source} is not a folder", file=sys.stderr)
        return 2
    try:
        if args.restore:
            done = restore(args.source, args.destination)
        else:
            done = archive(args.source, args.destination, tested=args.tested)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    verb = "restored" if args.restore else "archived"
    print(f"{verb} {len(done)} run(s)" + "".join(f"\n  {path}" for path in done))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
