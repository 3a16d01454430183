"""Machine translation with an encoder-decoder Transformer (:class:`attention_zoo.seq2seq.Seq2SeqTransformer`),
the experiment of M. Pampaloni's WMT14 Linformer report ("Evaluating Linformer's performance on the WMT14 EN-DE
machine translation task", 2024; no arXiv number) at the zoo's scale.

Training: teacher forcing (decoder input BOS y_1 .. y_m, targets y_1 .. y_m EOS), label-smoothed
cross-entropy (Szegedy et al. 2016; PyTorch's form: the target distribution is (1 - eps) one-hot + eps / V
uniform, eps = ``label_smoothing``, 0.1 as in Vaswani et al. 2017), averaged over real target tokens.

Metrics (``val/`` and ``test/``):
- ``loss``: the smoothed loss, token-weighted over the split (every target token counts once).
- ``ppl``: exp of the token-weighted negative log-likelihood *without* smoothing (fairseq's valid ppl,
  the report's "PPL (dev)"), from torchmetrics' ``Perplexity``.
- ``val/bleu``: sacreBLEU (13a, detokenised) of greedy translations of the first ``bleu_sentences``
  validation pairs (a fixed subset: the loader is not shuffled), at every validation run once at least
  ``bleu_every_n_steps`` training steps have passed since the last one (None: at every validation run;
  never in Lightning's sanity check). Sample translations go to TensorBoard's Text tab (``val/samples``).
- ``test/bleu``, ``test/chrf``: beam search (``beam_size``, GNMT length penalty ``length_penalty``) over
  the whole test split; ``test/copy_bleu``, ``test/copy_chrf``: the "copy the source" baseline on it.
- ``test/{greedy,beam}_{cached,recomputed}_sentences_per_s``: decoding speed on the first
  ``speed_sentences`` test sentences, in the loader's batches, after one untimed batch per mode; with
  the decoding cache and recomputing the decoder over the prefix at every step. Only meaningful on an
  otherwise idle machine.

``zoo test`` also writes every test translation, with its source and reference, to
``test_translations.jsonl`` in the run directory: what a paired significance test between two runs needs
(``experiments/studies/translation_verdicts.py``).

The run record (``run.json``) also holds the resolved decoder self-attention and why
(:func:`attention_zoo.seq2seq.resolve_decoder_attention`), the cross-attention, the data module's
``corpus_summary()`` and the copy baseline of the validation subset and the test split.
Batches are those of :mod:`tasks.data.translation` (``source``, ``source_mask``, ``target_in``,
``target_out``, ``target_mask``, ``index``). A packed batch (``--data.pack true``: training only) also carries
``source_segments`` and ``target_segments``, which reach the model, so that each pair's target attends only to
itself and, across, to its own source; its loss is the same mean over the same target tokens. Decoding is not
packed: validation and test refuse packed batches (the data module keeps them padded).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torchmetrics.text import Perplexity

from attention_zoo.decoding.search import beam_search, greedy_search
from attention_zoo.seq2seq import Seq2SeqTransformer
from tasks.base import ConfigError, ZooTask
from tasks.data.base import IGNORE_INDEX
from tasks.translation_metrics import copy_baseline, corpus_scores

#: the test translations of a run, JSON lines in its run directory (``zoo test``)
TEST_TRANSLATIONS = "test_translations.jsonl"

EvalStage = Literal["val", "test"]


class TranslationTask(ZooTask):
    """Train and evaluate a translation model; see the module docstring for the metrics.

    Args:
        vocab_size: the (joint) vocabulary (linked from ``data.vocab_size``).
        max_source_len: longest source, EOS included (linked from the data module).
        max_target_len: longest decoder input, BOS included (linked from the data module).
        decoder_attention, decoder_attention_options: decoder self-attention; None: the decoder rule
            (``attention`` if causal, else its ``causal_counterpart``; see :mod:`attention_zoo.seq2seq`), with
            ``decoder_attention_options`` if given.
        cross_attention, cross_attention_options: decoder-to-encoder attention (``full`` or ``linformer``).
        decoder_depth: decoder layers; None: ``depth``, as many as the encoder.
        label_smoothing: eps of the smoothed loss.
        bleu_sentences: validation pairs translated (greedily) for ``val/bleu``; 0 turns it off.
        bleu_every_n_steps: least training steps between two ``val/bleu``; None: every validation run.
        samples: sample translations written to TensorBoard at each ``val/bleu`` and at test.
        beam_size, length_penalty: beam search of the test split (4 and alpha 0.6: Vaswani et al.).
        extra_len: a translation has at most source length + ``extra_len`` tokens (capped by max_target_len).
        speed_sentences: test sentences timed per decoding mode; 0 skips the measurement.
        **shared: the model's flags (the encoder's ``attention`` and ``attention_options``, ``dim``, ``depth``,
            ...) and the optimizer's of :class:`tasks.base.ZooTask`.
    """

    target: ClassVar[str] = "translation"
    hparam_metrics = ("val/bleu", "val/ppl", "test/bleu", "test/chrf", *ZooTask.hparam_metrics)

    def __init__(
        self,
        vocab_size: int,
        max_source_len: int,
        max_target_len: int,
        *,
        decoder_attention: str | None = None,
        decoder_attention_options: dict[str, Any] | None = None,
        cross_attention: str = "full",
        cross_attention_options: dict[str, Any] | None = None,
        decoder_depth: int | None = None,
        label_smoothing: float = 0.1,
        bleu_sentences: int = 200,
        bleu_every_n_steps: int | None = None,
        samples: int = 5,
        beam_size: int = 4,
        length_penalty: float = 0.6,
        extra_len: int = 50,
        speed_sentences: int = 64,
        **shared: Any,
    ) -> None:
        super().__init__(**shared)
        sizes = {"vocab_size": vocab_size, "max_source_len": max_source_len, "max_target_len": max_target_len}
        missing = [name for name, value in sizes.items() if not isinstance(value, int)]
        if missing:
            raise ConfigError(
                f"TranslationTask needs {', '.join(missing)} from its data module, which has none; pair it with "
                "tasks.data.translation.TranslationDataModule"
            )
        if not 0.0 <= label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if beam_size < 1 or length_penalty < 0:
            raise ConfigError(f"beam_size must be >= 1 and length_penalty >= 0, got {beam_size}, {length_penalty}")
        # specs as {name, options}, which the config checks; a decoder_attention_options without a
        # decoder_attention is for whichever core the decoder rule picks
        named = decoder_attention is not None
        self.model = self.build_model(
            Seq2SeqTransformer,
            "translation model",
            vocab_size=vocab_size,
            max_seq_len=max_source_len,
            max_target_len=max_target_len,
            decoder_depth=decoder_depth,
            decoder_attention={"name": decoder_attention, "options": decoder_attention_options} if named else None,
            decoder_attention_options=None if named else decoder_attention_options,
            cross_attention={"name": cross_attention, "options": cross_attention_options},
        )
        rule = self.model.decoder_rule
        options = f" {rule.options}" if rule.options else ""
        rank_zero_info(f"decoder self-attention: {rule.attention}{options} ({rule.reason})")
        # one metric object per stage ("train" cannot be a ModuleDict key: it is nn.Module.train)
        self.perplexity = nn.ModuleDict({f"{s}_ppl": Perplexity(ignore_index=IGNORE_INDEX) for s in ("val", "test")})
        self.special_ids: dict[str, int] = {}  # bos_id, eos_id, pad_id: the data module's, read in setup
        self._translations: dict[int, list[int]] = {}
        self._score_bleu = False
        self._last_bleu_step: int | None = None
        self._speed_batches: list[tuple[Tensor, Tensor]] = []

    # --- data ------------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            self.special_ids = {name: int(getattr(datamodule, name)) for name in ("bos_id", "eos_id", "pad_id")}

    def real_tokens(self, batch: dict[str, Tensor]) -> int:
        """Source and target tokens (padding excluded, packed or padded): both pass through the model."""
        return int(batch["source_mask"].sum()) + int(batch["target_mask"].sum())

    def describe_run(self) -> dict[str, Any]:
        rule, hparams = self.model.decoder_rule, self.hparams
        record: dict[str, Any] = {
            "decoder_attention": {"attention": rule.attention, "options": rule.options, "rule": rule.reason},
            "cross_attention": {
                "attention": hparams.cross_attention,
                "options": hparams.cross_attention_options or {},
            },
        }
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            record["corpus"] = datamodule.corpus_summary()
            record["copy_baseline"] = {
                "val_bleu_subset": _short(copy_baseline(datamodule, "val", hparams.bleu_sentences)),
                "test": _short(copy_baseline(datamodule, "test")),
            }
        return record

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if isinstance(self.logger, TensorBoardLogger) and self.trainer.is_global_zero:
            rule = self.model.decoder_rule
            text = f"`{rule.attention}` {rule.options or ''}: {rule.reason}"
            self.logger.experiment.add_text("decoder_attention", text)

    # --- training --------------------------------------------------------------------------------------

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """Teacher-forced logits (B, T, V); a packed batch's rows (R, T, V)."""
        packed = {}
        if "source_segments" in batch:
            packed = {name: batch[name] for name in ("source_segments", "target_segments")}
        return self.model(batch["source"], batch["source_mask"], batch["target_in"], batch["target_mask"], **packed)

    def loss(self, logits: Tensor, target_out: Tensor) -> Tensor:
        # b: batch, t: target positions, v: vocabulary
        return F.cross_entropy(
            rearrange(logits, "b t v -> (b t) v"),
            rearrange(target_out, "b t -> (b t)"),
            ignore_index=IGNORE_INDEX,
            label_smoothing=self.hparams.label_smoothing,
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(self(batch), batch["target_out"])
        tokens = int((batch["target_out"] != IGNORE_INDEX).sum())
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=tokens)
        return loss

    def _evaluate(self, batch: dict[str, Tensor], stage: EvalStage) -> None:
        logits = self(batch)
        tokens = int((batch["target_out"] != IGNORE_INDEX).sum())
        loss = self.loss(logits, batch["target_out"])
        # token-weighted: Lightning averages the epoch's values weighted by batch_size
        self.log(f"{stage}/loss", loss, prog_bar=True, on_epoch=True, batch_size=tokens, sync_dist=True)
        perplexity = self.perplexity[f"{stage}_ppl"]
        perplexity(logits.float() if logits.dtype != torch.float64 else logits, batch["target_out"])
        self.log(f"{stage}/ppl", perplexity, prog_bar=True, on_epoch=True)

    # --- validation: loss, ppl, greedy BLEU on a fixed subset ------------------------------------------

    def on_validation_epoch_start(self) -> None:
        every, last = self.hparams.bleu_every_n_steps, self._last_bleu_step
        due = every is None or last is None or self.global_step - last >= every
        self._score_bleu = self.hparams.bleu_sentences > 0 and not self.trainer.sanity_checking and due
        self._translations = {}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")
        if self._score_bleu:
            _refuse_packed(batch, "val")
            chosen = batch["index"] < self.hparams.bleu_sentences
            if bool(chosen.any()):
                decoded = self._greedy(batch["source"][chosen], batch["source_mask"][chosen])
                self._collect(batch["index"][chosen], decoded)

    def on_validation_epoch_end(self) -> None:
        if not self._score_bleu:
            return
        self._last_bleu_step = self.global_step
        scores = self._score_translations("val")
        self.log("val/bleu", scores["bleu"], prog_bar=True)
        self.log("val/chrf", scores["chrf"])

    # --- test: loss, ppl, beam-search BLEU and chrF, the copy baseline, decoding speed -----------------

    def on_test_epoch_start(self) -> None:
        self._translations, self._speed_batches = {}, []

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        _refuse_packed(batch, "test")
        self._evaluate(batch, "test")
        decoded = self._beam(batch["source"], batch["source_mask"])
        self._collect(batch["index"], decoded)
        kept = sum(s.shape[0] for s, _ in self._speed_batches)
        if kept < self.hparams.speed_sentences:
            take = self.hparams.speed_sentences - kept
            self._speed_batches.append((batch["source"][:take], batch["source_mask"][:take]))

    def on_test_epoch_end(self) -> None:
        scores = self._score_translations("test", keep=TEST_TRANSLATIONS)
        baseline = copy_baseline(self.trainer.datamodule, "test")
        self.log_dict(
            {
                "test/bleu": scores["bleu"],
                "test/chrf": scores["chrf"],
                "test/copy_bleu": baseline["bleu"],
                "test/copy_chrf": baseline["chrf"],
            }
        )
        if self._speed_batches:
            self.log_dict({f"test/{mode}_sentences_per_s": rate for mode, rate in self.decoding_speed().items()})

    def decoding_speed(self) -> dict[str, float]:
        """Sentences per second of greedy and beam search, cached and recomputed, on the kept test batches."""
        rates = {}
        for search in ("greedy", "beam"):
            for use_cache in (True, False):
                decode = self._greedy if search == "greedy" else self._beam
                decode(*self._speed_batches[0], use_cache=use_cache)  # untimed: allocator and kernel warm-up
                _synchronize(self.device)
                started = time.perf_counter()
                for source, mask in self._speed_batches:
                    decode(source, mask, use_cache=use_cache)
                _synchronize(self.device)
                sentences = sum(s.shape[0] for s, _ in self._speed_batches)
                mode = f"{search}_{'cached' if use_cache else 'recomputed'}"
                rates[mode] = sentences / max(time.perf_counter() - started, 1e-9)
        return rates

    # --- decoding and scoring --------------------------------------------------------------------------

    def _greedy(self, source: Tensor, source_mask: Tensor, *, use_cache: bool = True) -> Tensor:
        self._check_special_ids()
        return greedy_search(
            self.model, source, source_mask, extra_len=self.hparams.extra_len, use_cache=use_cache, **self.special_ids
        ).tokens

    def _beam(self, source: Tensor, source_mask: Tensor, *, use_cache: bool = True) -> Tensor:
        self._check_special_ids()
        return beam_search(
            self.model,
            source,
            source_mask,
            beam_size=self.hparams.beam_size,
            alpha=self.hparams.length_penalty,
            extra_len=self.hparams.extra_len,
            use_cache=use_cache,
            **self.special_ids,
        ).tokens

    def _check_special_ids(self) -> None:
        if not self.special_ids:
            raise ConfigError("decoding needs the data module's bos_id, eos_id and pad_id: run it through a Trainer")

    def _collect(self, index: Tensor, tokens: Tensor) -> None:
        for i, row in zip(index.tolist(), tokens.tolist(), strict=True):
            self._translations[i] = row

    def _score_translations(self, split: EvalStage, keep: str | None = None) -> dict[str, Any]:
        """BLEU and chrF of the collected translations (gathered from every rank), samples to TensorBoard;
        ``keep``: also write every (index, source, reference, translation) as JSON lines to that file of the
        run directory (what a paired significance test between runs needs)."""
        translations = self._translations
        if self.trainer.world_size > 1:
            gathered: list[dict[int, list[int]] | None] = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(gathered, translations)
            translations = {i: t for part in gathered for i, t in (part or {}).items()}
        datamodule = self.trainer.datamodule
        sources, references = datamodule.texts(split)
        order = sorted(translations)
        hypotheses = [datamodule.decode(translations[i]) for i in order]
        scores = corpus_scores(hypotheses, [references[i] for i in order])
        self._log_samples(split, [(sources[i], references[i], h) for i, h in zip(order, hypotheses, strict=True)])
        if keep is not None and self.trainer.is_global_zero and self.trainer.log_dir is not None:
            rows = (
                {"index": i, "source": sources[i], "reference": references[i], "translation": h}
                for i, h in zip(order, hypotheses, strict=True)
            )
            text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
            (Path(self.trainer.log_dir) / keep).write_text(text, encoding="utf-8")
        return scores

    def _log_samples(self, split: EvalStage, triples: list[tuple[str, str, str]]) -> None:
        if not isinstance(self.logger, TensorBoardLogger) or not self.trainer.is_global_zero:
            return
        escape = lambda text: text.replace("|", "\\|").replace("\n", " ")
        rows = [f"| {escape(s)} | {escape(r)} | {escape(h)} |" for s, r, h in triples[: self.hparams.samples]]
        if rows:
            table = "| source | reference | translation |\n|---|---|---|\n" + "\n".join(rows)
            self.logger.experiment.add_text(f"{split}/samples", table, self.global_step)


def _refuse_packed(batch: dict[str, Tensor], stage: EvalStage) -> None:
    # a packed row holds several sources; decoding it would translate their concatenation
    if "source_segments" in batch:
        raise ConfigError(
            f"{stage} decodes its sources, which cannot be packed; give {stage} padded batches "
            "(TranslationDataModule packs the training batches only)"
        )


def _short(scores: dict[str, Any]) -> dict[str, Any]:
    return {key: scores[key] for key in ("bleu", "chrf", "sentences")}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
