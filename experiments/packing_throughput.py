"""Real tokens per second of a translation training step, packed against padded, on a corpus's own lengths.

    python -m experiments.packing_throughput -c configs/translation.yaml --json results/translation/packing.json

The pairs are drawn at random (``--seed``) from the training split of the config's data module, so the batches
have the corpus's length distribution; each batch of ``batch_size`` pairs is collated twice, padded (the data
module's collate) and packed (``pack=True``'s collate: first-fit decreasing rows, :mod:`tasks.data.packing`). One
step is the config's model (:class:`tasks.translation.TranslationTask`, training mode) forward and backward on one
batch, through the task's loss; the optimizer update is left out (its cost does not depend on the layout). Both
arms run in one process, interleaved: each repeat times one pass over all the batches per arm, the arm that goes
first alternating between repeats, after one untimed pass of each. Real tokens are the task's ``real_tokens``
(source and target tokens, padding excluded), the same in both arms. Printed and written (``--json``): per arm
the rows and positions computed, the tokens/s of every repeat and their median, and the median over repeats of
the paired ratio packed / padded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from torch import Tensor

from experiments.bench.store import machine_info
from tasks.data.translation import TranslationDataModule
from tasks.translation import TranslationTask

#: the translation config of the repository, the default ``--config``
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "translation.yaml"
Arm = Literal["padded", "packed"]
ARMS: tuple[Arm, Arm] = ("padded", "packed")
Batch = dict[str, Tensor]


def section_options(config: Path, section: Literal["data", "model"], overrides: Sequence[str]) -> dict[str, Any]:
    """The ``init_args`` of a LightningCLI config's ``section``, with ``name=value`` overrides (YAML values)."""
    loaded = yaml.safe_load(config.read_text()) or {}
    options = dict((loaded.get(section) or {}).get("init_args") or {})
    for override in overrides:
        name, sep, value = override.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--{'set' if section == 'data' else 'model'} expects name=value, got {override!r}")
        options[name.strip()] = yaml.safe_load(value)
    return options


def draw_batches(dm: TranslationDataModule, batches: int, seed: int) -> dict[Arm, list[Batch]]:
    """``batches`` batches of ``dm.batch_size`` training pairs drawn without replacement, each padded and packed."""
    dataset = dm.make_dataset("train", dm.load_split("train"))
    wanted = batches * dm.batch_size
    if wanted > len(dataset):
        raise ValueError(
            f"{batches} batches of {dm.batch_size} need {wanted} pairs; the training split has {len(dataset)}"
        )
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:wanted].tolist()
    groups = [[dataset[i] for i in order[b : b + dm.batch_size]] for b in range(0, wanted, dm.batch_size)]
    padded, packed = dm.collate(), dm.packed_collate()
    return {"padded": [padded(items) for items in groups], "packed": [packed(items) for items in groups]}


def training_step(task: TranslationTask) -> Callable[[Batch], None]:
    """Forward and backward of one batch through the task's loss, gradients cleared first."""

    def step(batch: Batch) -> None:
        task.zero_grad(set_to_none=True)
        task.loss(task(batch), batch["target_out"]).backward()

    return step


def time_pass(step: Callable[[Batch], None], batches: list[Batch], device: torch.device) -> float:
    """Seconds of one step per batch, in order."""
    _synchronize(device)
    started = time.perf_counter()
    for batch in batches:
        step(batch)
    _synchronize(device)
    return time.perf_counter() - started


def measure(task: TranslationTask, arms: dict[Arm, list[Batch]], repeats: int, device: torch.device) -> dict[str, Any]:
    """Per arm the layout's size and the tokens/s of every repeat; the paired ratio packed / padded."""
    arms = {arm: [{k: v.to(device) for k, v in batch.items()} for batch in batches] for arm, batches in arms.items()}
    step = training_step(task.to(device).train())
    for arm in ARMS:  # untimed: allocator and kernels warm
        time_pass(step, arms[arm], device)
    seconds: dict[Arm, list[float]] = {arm: [] for arm in ARMS}
    for repeat in range(repeats):
        for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
            seconds[arm].append(time_pass(step, arms[arm], device))
    result: dict[str, Any] = {"arms": {}}
    for arm in ARMS:
        tokens = sum(task.real_tokens(batch) for batch in arms[arm])
        rates = [tokens / max(s, 1e-9) for s in seconds[arm]]
        result["arms"][arm] = {
            "rows": sum(batch["source"].shape[0] for batch in arms[arm]),
            "positions": sum(batch["source"].numel() + batch["target_in"].numel() for batch in arms[arm]),
            "real_tokens": tokens,
            "seconds": seconds[arm],
            "tokens_per_s": rates,
            "tokens_per_s_median": statistics.median(rates),
        }
    ratios = [p / q for p, q in zip(result["arms"]["packed"]["tokens_per_s"], result["arms"]["padded"]["tokens_per_s"],
                                    strict=True)]  # fmt: skip
    result["ratios"], result["ratio_median"] = ratios, statistics.median(ratios)
    return result


def markdown(result: dict[str, Any]) -> str:
    """One row per arm (rows, positions computed, real tokens, their share, median tokens/s), then the ratio."""
    lines = ["| arm | rows | positions | real tokens | real share | tokens/s (median) |", "|---|---|---|---|---|---|"]
    for arm, row in result["arms"].items():
        share = row["real_tokens"] / row["positions"]
        lines.append(
            f"| {arm} | {row['rows']} | {row['positions']} | {row['real_tokens']} | {share:.1%} | "
            f"{row['tokens_per_s_median']:.0f} |"
        )
    lines.append(
        f"\npacked / padded tokens/s, median of {len(result['ratios'])} paired repeats: {result['ratio_median']:.2f}"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", type=Path, default=CONFIG,
                        help="a translation LightningCLI config (default configs/translation.yaml)")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a data option (repeatable)")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=VALUE",
                        help="a model option (repeatable)")  # fmt: skip
    parser.add_argument("--batches", type=int, default=20, help="batches drawn, timed per arm and repeat (default 20)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per arm (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pairs drawn and of the model (default 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the steps run (default cpu)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    if min(args.batches, args.repeats, args.threads) < 1:
        parser.error(
            f"--batches, --repeats and --threads must be >= 1; got {args.batches}, {args.repeats}, {args.threads}"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    try:
        data = section_options(args.config, "data", args.set)
        model = section_options(args.config, "model", args.model)
        dm = TranslationDataModule(**data)
        batches = draw_batches(dm, args.batches, args.seed)
    except (ValueError, TypeError, FileNotFoundError) as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    task = TranslationTask(dm.vocab_size, dm.max_source_len, dm.max_target_len, **model)
    result = measure(task, batches, args.repeats, torch.device(args.device))
    print(markdown(result), end="")
    if args.json:
        record = {
            "command": " ".join(
                ["python -m experiments.packing_throughput", *(argv if argv is not None else sys.argv[1:])]
            ),
            "config": str(args.config),
            "data": data,
            "model": model,
            "batches": args.batches,
            "batch_size": dm.batch_size,
            "repeats": args.repeats,
            "seed": args.seed,
            "threads": args.threads,
            "machine": machine_info(args.device),
        } | result
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    raise SystemExit(main())
