"""SpeedAndMemory's summary reads the memory of the device the run trained on."""

from types import SimpleNamespace

import torch

from tasks.callbacks import SpeedAndMemory


def test_the_summary_reads_the_device_trained_on_after_teardown_moved_the_module_to_the_cpu(monkeypatch):
    # Lightning calls on_fit_end (where RunRecord reads the summary) after its teardown has moved the module to
    # the CPU: a summary that asked the module for its device reported a CUDA run's process resident set.
    mib = 2**20
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * mib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 77 * mib)
    trainer = SimpleNamespace(world_size=1)
    callback = SpeedAndMemory()
    callback.on_fit_start(trainer, SimpleNamespace(device=torch.device("cuda", 0)))
    summary = callback.summary(trainer, SimpleNamespace(device=torch.device("cpu")))
    assert summary["peak_mem_mb"] == 77.0
    assert summary["fit_start_mem_mb"] == 3.0
