"""Where the CUDA peak of a ``zoo fit`` comes from: the allocator's peak read at each Lightning hook, and every
allocation over 32 MiB in the allocator's history with its Python frames (none were found).

    python3 results/gpu-h100/memory_probe.py -c configs/recall.yaml --model.attention full \
        --trainer.logger.init_args.save_dir runs/probe --trainer.enable_progress_bar false
"""

import sys

import lightning.pytorch as pl
import torch

from tasks import callbacks as cb
from tasks.cli import run_fit

HOOKS = [
    "on_fit_start",
    "on_sanity_check_end",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_batch_end",
    "on_validation_end",
    "on_save_checkpoint",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
]


def make(hook):
    def f(self, trainer, *a, **k):
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated() / 2**20
            if peak > getattr(self, "_last", -1) + 1 or hook not in ("on_train_batch_end", "on_validation_batch_end"):
                now = torch.cuda.memory_allocated() / 2**20
                print(f"[probe] step {trainer.global_step} {hook}: peak {peak:.0f} MB, now {now:.0f} MB", flush=True)
            self._last = peak

    return f


Probe = type("Probe", (pl.Callback,), {h: make(h) for h in HOOKS})
cb.SpeedAndMemory.on_fit_end = make("speed_on_fit_end")
orig_fit_start = cb.SpeedAndMemory.on_fit_start


def fit_start(self, trainer, pl_module):
    orig_fit_start(self, trainer, pl_module)
    trainer.callbacks.append(Probe())
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=200000)


cb.SpeedAndMemory.on_fit_start = fit_start
rc = run_fit(sys.argv[1:])
if torch.cuda.is_available():
    snap = torch.cuda.memory._snapshot()
    allocs = []
    for trace in snap["device_traces"]:
        for e in trace:
            if e["action"] == "alloc" and e["size"] > 32 * 2**20:
                allocs.append(e)
    allocs.sort(key=lambda e: -e["size"])
    for e in allocs[:6]:
        print(f"[probe] alloc {e['size'] / 2**20:.0f} MB at:")
        for fr in e["frames"][:40]:
            if "python" in fr["filename"] or fr["filename"].endswith(".py"):
                print(f"    {fr['filename']}:{fr['line']} {fr['name']}")
sys.exit(rc)
