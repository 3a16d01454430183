"""One flag is enough: ``zoo fit -c <config> --model.attention NAME`` builds and trains, with no attention
option, for every task config in ``configs/`` (and the LRA lite ones of ListOps, Text and Retrieval) and every
registered mechanism (each option has a default).

Each config is parsed once by the real CLI parser at its own sizes (the real ``max_seq_len``, vocabulary and
model), then every mechanism is built from that config with only ``attention`` changed and takes one
training step (forward, backward, optimizer) on a batch of one sequence of the config's full length.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import attention_zoo as az
from tasks.base import EncoderTask
from tasks.cli import build

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("compare"))
#: the Long Range Arena tasks at their lite scale (the reference lengths, up to 2 x 4000, would take minutes here)
CONFIGS += [ROOT / "configs" / "lra" / "lite" / f"{task}.yaml" for task in ("listops", "text", "retrieval")]


def config_id(path: Path) -> str:
    return "-".join(path.relative_to(ROOT / "configs").with_suffix("").parts)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "reviews.csv"
    path.write_text("text,label\n" + "\n".join(f"review number {i},{'pos' if i % 2 else 'neg'}" for i in range(20)))
    return path


@pytest.fixture(scope="module")
def aan_folder(tmp_path_factory) -> Path:
    """The LRA release's AAN pair files (label, id1, id2, text1, text2; texts as bytes literals), one pair each."""
    folder = tmp_path_factory.mktemp("tsv_data")
    for split in ("train", "eval", "test"):
        (folder / f"new_aan_pairs.{split}.tsv").write_text("1\tP1\tP2\tb'a first paper'\tb'a second paper'\n")
    return folder


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_every_mechanism_trains_with_the_attention_flag_alone(config, text_file, aan_folder, monkeypatch, tmp_path):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    extra = {
        "text": ["--data.data_dir", "null", "--data.train_file", str(text_file)],
        "translation": ["--data.source", "synthetic"],  # the installed catalogs are not needed to build the model
        "retrieval": ["--data.data_dir", str(aan_folder)],
    }.get(config.stem, [])
    task, data = build(["-c", str(config), *extra])
    accepted = inspect.signature(type(task).__init__).parameters
    settings = {k: v for k, v in task.hparams.items() if k in accepted}
    torch.manual_seed(0)
    if data.target == "translation":
        source_len, target_len = data.max_source_len, data.max_target_len
        batch = {
            "source": torch.randint(6, data.vocab_size, (1, source_len)),
            "source_mask": torch.ones(1, source_len, dtype=torch.bool),
            "target_in": torch.randint(6, data.vocab_size, (1, target_len)),
            "target_out": torch.randint(6, data.vocab_size, (1, target_len)),
            "target_mask": torch.ones(1, target_len, dtype=torch.bool),
        }
        n = f"{source_len}+{target_len}"
        step = lambda model: model.loss(model(batch), batch["target_out"])
    else:
        n = data.max_seq_len
        shape = (1, 2, n) if data.target == "pair" else (1, n)  # a pair of documents, each of the full length
        tokens = torch.randint(1, data.vocab_size, shape)
        mask = torch.ones(shape, dtype=torch.bool)
        labels = torch.randint(0, data.num_classes, (1, n) if data.target == "token" else (1,))
        step = lambda model: model.loss(model(tokens, mask), labels)
    failures = []
    for name in az.list_attentions():
        cls = az.get_attention_class(name)
        if not cls.supports_mask:
            continue
        given = settings | {"attention": name, "attention_options": {}}
        if cls.causal_only:  # a bidirectional model refuses it (test_conformance); an encoder task runs it causal
            if not isinstance(task, EncoderTask):
                continue
            given |= {"causal": True}
        try:
            model = type(task)(**given)
            loss = step(model)
            loss.backward()
            assert torch.isfinite(loss), f"loss {loss}"
            assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        except Exception as error:  # noqa: BLE001 (collect every mechanism's failure, then report them all)
            failures.append(f"{name}: {type(error).__name__}: {error}")
    assert not failures, f"{config.name} at n={n}:\n" + "\n".join(failures)
