"""The translation task (``tasks/translation.py``) end to end through ``zoo fit`` / ``zoo test`` on the
synthetic pair at tiny sizes, its loss and metrics against their definitions, and the copy baseline."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchmetrics.text import Perplexity

from attention_zoo.seq2seq import causal_cores
from experiments import cli
from tasks.base import ConfigError
from tasks.classification import SequenceClassification
from tasks.cli import LINKED, build, linked_sizes
from tasks.token_prediction import TokenPrediction
from tasks.translation import TranslationTask
from tasks.translation_metrics import copy_baseline, corpus_scores

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "translation.yaml"
#: the synthetic pair at a size that builds in well under a second (sources <= 13 tokens with EOS)
TINY_DATA = [
    "--data.source", "synthetic", "--data.synthetic_pairs", "300", "--data.synthetic_words", "32",
    "--data.bpe_vocab_size", "1000", "--data.max_source_len", "16", "--data.max_target_len", "20",
    "--data.overlong", "error", "--data.batch_size", "8",
]  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread_and_private_cache")


def tiny_args(runs: Path) -> list[str]:
    return ["-c", str(CONFIG), *TINY_DATA] + [
        "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
        "--trainer.limit_test_batches", "2", "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.accelerator", "cpu", "--trainer.logger.init_args.save_dir", str(runs),
        "--model.dim", "16", "--model.depth", "1", "--model.heads", "2", "--model.warmup_steps", "1",
        "--model.bleu_sentences", "8", "--model.speed_sentences", "4", "--model.samples", "2",
    ]  # fmt: skip


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


DECODER = {"full": "full", "linformer": "linformer_causal", "nystrom": "full"}


@pytest.mark.parametrize("attention", ["full", "linformer", "nystrom"])
def test_fit_then_test_with_one_attention_flag(attention, tmp_path, capsys, caplog):
    """``zoo fit -c configs/translation.yaml --model.attention NAME`` trains with no other flag (the decoder
    rule picks the decoder's self-attention), and ``zoo test --ckpt_path last`` reports BLEU."""
    runs = tmp_path / "runs"
    args = tiny_args(runs) + ["--model.attention", attention]
    assert cli.main(["fit", *args]) == 0
    run_dir = runs / "translation" / attention / "version_0"
    fitted = record(run_dir)
    assert fitted["status"] == "finished" and fitted["step"] == 4
    assert fitted["decoder_attention"]["attention"] == DECODER[attention]
    assert attention in fitted["decoder_attention"]["rule"]
    assert fitted["cross_attention"] == {"attention": "full", "options": {}}
    assert fitted["corpus"]["source"] == "synthetic" and fitted["corpus"]["pairs"]["test"] > 0
    assert 0 <= fitted["copy_baseline"]["test"]["bleu"] <= 100
    metrics = fitted["metrics"]
    # vocabulary 1000, 4 steps: no worse than at initialisation, where the tied output's logits have unit variance
    # (attention_zoo.init), so softmax over 1000 random N(0, 1) logits has perplexity about 1000 * e^(1/2)
    assert 0 <= metrics["val/bleu"] <= 100 and 1 < metrics["val/ppl"] < 1000 * math.exp(0.5)
    assert fitted["tokens_per_s"] > 0
    assert f"decoder self-attention: {DECODER[attention]} (" in caplog.text

    assert cli.main(["test", *args, "--ckpt_path", "last"]) == 0
    assert "test/bleu" in capsys.readouterr().out
    # "last" names the newest run's last.ckpt: tested beside it, in its test/ folder, not in a new version_1
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["version_0"] and (run_dir / "test").is_dir()
    tested = record(run_dir)["metrics"]  # the fitted run's own record, updated in place
    assert 0 <= tested["test/bleu"] <= 100 and 0 <= tested["test/chrf"] <= 100
    assert tested["test/copy_bleu"] == pytest.approx(fitted["copy_baseline"]["test"]["bleu"], rel=1e-6)
    for search in ("greedy", "beam"):
        for cache in ("cached", "recomputed"):
            assert tested[f"test/{search}_{cache}_sentences_per_s"] > 0
    assert tested["val/bleu"] == metrics["val/bleu"]  # the fit's metrics stay
    # the test translations, kept for paired tests between runs: every test pair once, and exactly what was scored
    (kept,) = (runs / "translation" / attention).glob("version_*/test/test_translations.jsonl")
    rows = [json.loads(line) for line in kept.read_text(encoding="utf-8").splitlines()]
    assert sorted(row["index"] for row in rows) == list(range(fitted["corpus"]["pairs"]["test"]))
    rescored = corpus_scores([r["translation"] for r in rows], [r["reference"] for r in rows])["bleu"]
    assert rescored == pytest.approx(tested["test/bleu"], abs=1e-6)
    # a checkpoint *file* (what zoo compare --test passes): LightningCLI feeds its saved hyperparameters back to
    # __init__, so sizes linked for other tasks (num_classes, max_seq_len) must not be among them
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    assert not {"num_classes", "max_seq_len"} & set(torch.load(checkpoint, weights_only=True)["hyper_parameters"])
    assert cli.main(["test", *args, "--ckpt_path", str(checkpoint)]) == 0

    if attention == "full":
        events = EventAccumulator(str(run_dir))
        events.Reload()
        tags = set(events.Tags()["tensors"])
        assert {"val/samples/text_summary", "decoder_attention/text_summary"} <= tags
        assert {"val/bleu", "val/ppl", "val/loss", "train/loss"} <= set(events.Tags()["scalars"])


def test_non_causal_decoder_attention_fails_before_training(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert cli.main(["fit", *tiny_args(runs), "--model.decoder_attention", "linformer"]) == 2
    error = capsys.readouterr().err
    assert "zoo fit: error:" in error and "decoder_attention 'linformer' is not causal" in error
    assert all(name in error for name in causal_cores())
    assert not any(runs.rglob("*.ckpt")) and not any(runs.rglob("events.*"))


FIXTURES = ROOT / "tests" / "fixtures" / "translation"
FRACTIONS = ["--data.val_fraction", "0.2", "--data.test_fraction", "0.2"]  # no split of the 24 pairs is empty


def empty_train(folder: Path) -> list[str]:
    (folder / "empty.tsv").write_text("\t\n \t \n")
    return ["--data.train_data", str(folder / "empty.tsv")]


def empty_val(folder: Path) -> list[str]:
    (folder / "val.tsv").write_text("")
    return ["--data.train_data", str(FIXTURES / "tiny.tsv"), "--data.val_data", str(folder / "val.tsv")]


def overlong_pair(folder: Path) -> list[str]:
    return ["--data.train_data", str(FIXTURES / "tiny.tsv"), "--data.max_source_len", "8", *FRACTIONS]


def long_line(folder: Path) -> list[str]:
    line = "".join(random.Random(0).choices("abcdefghijklmnopqrstuvwxyz", k=100_000))  # no spaces, no period
    (folder / "long.tsv").write_text((FIXTURES / "tiny.tsv").read_text() + f"{line}\tkurz\n")
    return ["--data.train_data", str(folder / "long.tsv"), *FRACTIONS]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (empty_train, "the train split is empty (0 training pairs"),
        (empty_val, "the val split is empty: val_data "),
        (overlong_pair, "pairs are longer than max_source_len=8 (source + <eos>)"),
        (long_line, "pairs are longer than max_source_len=16 (source + <eos>) or max_target_len=20 (target + <bos>) "
                    "tokens by their length alone"),
    ],
    ids=["empty-train", "empty-val", "overlong", "long-line"],
)  # fmt: skip
def test_a_data_error_while_preparing_the_data_is_one_line(data, message, tmp_path, capsys):
    """Raised inside the Trainer (prepare_data): one error line and exit code 2, no traceback, no run folder."""
    runs = tmp_path / "runs"
    assert cli.main(["fit", *tiny_args(runs), "--data.source", "files", *data(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    lines = [line for line in error.splitlines() if "error" in line.lower()]  # not Lightning's INFO lines
    assert len(lines) == 1 and lines[0].startswith("zoo fit: error: ") and message in lines[0], error
    assert not any(runs.rglob("events.*"))


def test_a_task_is_linked_only_the_sizes_its_init_takes(tmp_path):
    """LightningCLI saves every size linked into the model as a hyperparameter, and ``--ckpt_path FILE`` passes
    them back to ``__init__``: a size the task does not take must not be linked into it."""
    encoder_sizes = ("vocab_size", "max_seq_len", "num_classes")
    assert linked_sizes(TokenPrediction) == linked_sizes(SequenceClassification) == encoder_sizes
    assert linked_sizes(TranslationTask) == ("vocab_size", "max_source_len", "max_target_len")
    model, _ = build(tiny_args(tmp_path / "runs"))
    linked = {name: value for name, value in model.hparams.items() if name in LINKED}
    assert linked == {"vocab_size": 1000, "max_source_len": 16, "max_target_len": 20}


def test_task_without_translation_sizes_says_which_data_it_needs():
    with pytest.raises(ConfigError, match="needs max_source_len, max_target_len from its data module"):
        TranslationTask(1000, None, None)


def test_copy_baseline_command(tmp_path, capsys):
    assert cli.main(["copy-baseline", "-c", str(CONFIG), *TINY_DATA, "--split", "val"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["split"] == "val" and printed["sentences"] > 0 and 0 <= printed["bleu"] <= 100
    assert "tok:13a" in printed["bleu_signature"] and printed["corpus"]["source"] == "synthetic"


# --- metrics against their definitions --------------------------------------------------------------


REFERENCES = ["Die Datei „%s“ wurde nicht gefunden.", "Öffnen, Speichern & Schließen", "Fehler: 3 von 5 Tests!"]


def test_bleu_of_the_references_against_themselves_is_100():
    scores = corpus_scores(REFERENCES, REFERENCES)
    assert scores["bleu"] == pytest.approx(100.0) and scores["chrf"] == pytest.approx(100.0)
    assert scores["sentences"] == 3 and "tok:13a" in scores["bleu_signature"]
    assert corpus_scores(["x y z q"] * 3, REFERENCES)["bleu"] == 0.0
    with pytest.raises(ValueError, match="2 hypotheses for 3 references"):
        corpus_scores(REFERENCES[:2], REFERENCES)


def test_copy_baseline_scores_the_sources():
    class Texts:
        def texts(self, split):
            return {"test": (REFERENCES, REFERENCES), "val": (["ganz anders"] * 3, REFERENCES)}[split]

    assert copy_baseline(Texts(), "test")["bleu"] == pytest.approx(100.0)
    assert copy_baseline(Texts(), "val")["bleu"] == 0.0
    assert copy_baseline(Texts(), "test", limit=2)["sentences"] == 2


def test_label_smoothed_loss_matches_its_definition():
    """(1 - eps) (-log p_y) + eps * mean over the vocabulary of (-log p_v), averaged over real tokens
    (Szegedy et al. 2016, section 7, with u uniform over the V classes)."""
    task = TranslationTask(11, 8, 8, dim=16, depth=1, heads=2, label_smoothing=0.1)
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 11, dtype=torch.float64)
    target = torch.tensor([[3, 5, 2, -100], [7, 2, -100, -100]])
    log_p = logits - logits.exp().sum(-1, keepdim=True).log()
    real = target != -100
    nll = -log_p.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    expected = ((0.9 * nll + 0.1 * -log_p.mean(-1)) * real).sum() / real.sum()
    torch.testing.assert_close(task.loss(logits, target), expected)


def test_perplexity_is_exp_of_the_token_weighted_nll_without_smoothing():
    """Batches of different token counts: every token counts once (not the mean of batch means)."""
    torch.manual_seed(0)
    metric = Perplexity(ignore_index=-100)
    batches = [
        (torch.randn(1, 6, 9), torch.tensor([[1, 2, 3, 4, 5, 6]])),
        (torch.randn(1, 6, 9), torch.tensor([[7, -100, -100, -100, -100, -100]])),
    ]
    total, count = 0.0, 0
    for logits, target in batches:
        metric.update(logits, target)
        real = target != -100
        total += float(F.cross_entropy(logits[real], target[real], reduction="sum"))
        count += int(real.sum())
    assert float(metric.compute()) == pytest.approx(math.exp(total / count), rel=1e-5)
