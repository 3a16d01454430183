"""Greedy and beam search for encoder-decoder models, batched, with or without a decoding cache.

Beam search as in Wu et al. 2016 (GNMT), "Google's Neural Machine Translation System", arXiv:1609.08144,
section 7, with the length penalty that Vaswani et al. 2017 (arXiv:1706.03762, section 6.1: beam 4,
alpha 0.6) use: a finished hypothesis Y of source X is ranked by

    s(Y, X) = log P(Y | X) / lp(Y),    lp(Y) = ((5 + |Y|) / (5 + 1)) ** alpha

with |Y| its number of tokens, EOS included (GNMT's coverage penalty is not used: beta = 0). Each step,
every live hypothesis of a source is extended by every token and the extensions are ranked by
log P(Y | X); those among the best ``beam_size`` that end in EOS are finished, and the best
``beam_size`` that do not end in EOS are the next live hypotheses. A source is done when it has
``beam_size`` finished hypotheses, or when its maximum length is reached (the best ``beam_size``
extensions at that step are then finished as they are, without EOS). Its result is the finished
hypothesis with the highest s(Y, X). With ``beam_size=1`` this is greedy search (same tokens). PAD and
BOS are never generated (their log-probabilities are set to -inf, as fairseq does for PAD).

Maximum length: a source of L real tokens (its EOS included) gets at most L + ``extra_len`` target tokens
(50 by default; fairseq's ``max_len_b``), capped by the decoder's ``max_target_len``
(its positions: BOS plus n - 1 generated tokens are fed to produce n tokens) and by ``max_len`` if given.

The model is anything with ``max_target_len`` and ``start_decoding(source, source_mask, *,
hypotheses_per_source, use_cache)`` returning a :class:`DecodingSession` (see
:meth:`attention_zoo.seq2seq.Seq2SeqTransformer.start_decoding`). The search always passes the whole
prefix; a cached session feeds only its new tokens, a recomputing one (``use_cache=False``) all of them.
Every source keeps its ``beam_size`` rows until the whole batch is done (finished rows are fed PAD and
ignored), so a batch costs as many steps as its longest output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


class DecodingSession(Protocol):
    def next_log_probs(self, prefix: Tensor) -> Tensor:
        """(R, t) token prefixes (BOS first) -> (R, V) log-probabilities of the next token."""
        ...

    def reorder(self, index: Tensor) -> None:
        """Row r continues as old row ``index[r]`` (within its source's rows)."""
        ...


class Decodable(Protocol):
    max_target_len: int

    def start_decoding(
        self, source: Tensor, source_mask: Tensor | None, *, hypotheses_per_source: int, use_cache: bool
    ) -> DecodingSession: ...


@dataclass
class Decoded:
    """``tokens`` (B, L): the output of each source without BOS, EOS included where generated, then
    ``pad_id``; ``scores`` (B,): log P(Y | X) / lp(Y) (greedy: alpha = 0, the log-probability)."""

    tokens: Tensor
    scores: Tensor


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


def max_lengths(
    source: Tensor, source_mask: Tensor | None, max_target_len: int, extra_len: int = 50, max_len: int | None = None
) -> Tensor:
    """Per source: at most L + ``extra_len`` tokens (L real source tokens), capped by ``max_target_len`` and
    ``max_len``; (B,) long, >= 1."""
    lengths = (
        source_mask.sum(dim=1) if source_mask is not None else torch.full_like(source[:, 0], source.shape[1])
    ).long()
    cap = max_target_len if max_len is None else min(max_len, max_target_len)
    return (lengths + extra_len).clamp(min=1, max=cap)


@torch.no_grad()
def greedy_search(
    model: Decodable,
    source: Tensor,
    source_mask: Tensor | None,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
    extra_len: int = 50,
    max_len: int | None = None,
    use_cache: bool = True,
) -> Decoded:
    """The most probable next token at every step until EOS or the source's maximum length."""
    # b: source, t: generated positions
    limits = max_lengths(source, source_mask, model.max_target_len, extra_len, max_len)
    session = model.start_decoding(source, source_mask, hypotheses_per_source=1, use_cache=use_cache)
    batch = source.shape[0]
    prefix = torch.full((batch, 1), bos_id, dtype=torch.long, device=source.device)
    scores = torch.zeros(batch, dtype=torch.float64, device=source.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=source.device)
    for step in range(int(limits.max()) if batch else 0):
        best, token = _allowed(session.next_log_probs(prefix), bos_id, pad_id).max(dim=-1)
        token = token.masked_fill(finished, pad_id)
        scores += best.double().masked_fill(finished, 0.0)
        prefix = torch.cat([prefix, token[:, None]], dim=1)
        finished |= (token == eos_id) | (step + 1 >= limits)
        if bool(finished.all()):
            break
    return Decoded(prefix[:, 1:], scores)


@torch.no_grad()
def beam_search(
    model: Decodable,
    source: Tensor,
    source_mask: Tensor | None,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
    beam_size: int = 4,
    alpha: float = 0.6,
    extra_len: int = 50,
    max_len: int | None = None,
    use_cache: bool = True,
) -> Decoded:
    """Beam search with GNMT's length penalty (module docstring); ``beam_size`` 4 and ``alpha`` 0.6 are
    Vaswani et al.'s settings."""
    # b: source, k: beam, v: vocabulary, c: candidate (2 k per source, best first)
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0 (0: no length penalty), got {alpha}")
    limits = max_lengths(source, source_mask, model.max_target_len, extra_len, max_len).tolist()
    session = model.start_decoding(source, source_mask, hypotheses_per_source=beam_size, use_cache=use_cache)
    batch, k, device = source.shape[0], beam_size, source.device
    prefix = torch.full((batch * k, 1), bos_id, dtype=torch.long, device=device)
    scores = torch.zeros(batch, k, dtype=torch.float64, device=device)
    scores[:, 1:] = float("-inf")  # the k rows of a source start as one hypothesis, not k copies of it
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    done = [False] * batch
    first_row = torch.arange(batch, device=device)[:, None] * k
    for step in range(max(limits, default=0)):
        length = step + 1  # tokens in every candidate of this step
        log_probs = _allowed(session.next_log_probs(prefix).double(), bos_id, pad_id)
        vocab = log_probs.shape[-1]
        candidates = (scores[:, :, None] + log_probs.view(batch, k, vocab)).view(batch, k * vocab)
        top_scores, top_index = candidates.topk(min(2 * k, k * vocab), dim=-1)
        top_beam, top_token = top_index // vocab, top_index % vocab
        ends = top_token == eos_id
        _finish(finished, done, limits, length, alpha, prefix, first_row, top_scores, top_beam, top_token, ends, k)
        if all(done):
            break
        # the best k candidates that do not end in EOS live on (there are >= k: at most one EOS per beam)
        keep = torch.argsort(ends.to(torch.int8), dim=-1, stable=True)[:, :k]
        scores = top_scores.gather(1, keep)
        rows = (first_row + top_beam.gather(1, keep)).view(-1)
        token = top_token.gather(1, keep).view(-1, 1)
        prefix = torch.cat([prefix[rows], token], dim=1)
        session.reorder(rows)
    tokens, best_scores = [], []
    for hypotheses in finished:
        score, hypothesis = max(hypotheses, key=lambda h: h[0])
        tokens.append(hypothesis)
        best_scores.append(score)
    width = max((len(t) for t in tokens), default=0)
    out = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
    for b, hypothesis in enumerate(tokens):
        out[b, : len(hypothesis)] = torch.tensor(hypothesis, dtype=torch.long)
    return Decoded(out, torch.tensor(best_scores, dtype=torch.float64, device=device))


def _allowed(log_probs: Tensor, bos_id: int, pad_id: int) -> Tensor:
    return log_probs.index_fill(-1, torch.tensor([bos_id, pad_id], device=log_probs.device), float("-inf"))


def _finish(
    finished: list[list[tuple[float, list[int]]]],
    done: list[bool],
    limits: list[int],
    length: int,
    alpha: float,
    prefix: Tensor,
    first_row: Tensor,
    top_scores: Tensor,
    top_beam: Tensor,
    top_token: Tensor,
    ends: Tensor,
    k: int,
) -> None:
    """Record this step's finished hypotheses of every source not yet done: the EOS candidates among its
    best k, or all of its best k at its maximum length; mark sources done."""
    penalty = length_penalty(length, alpha)
    at_limit = torch.tensor([length >= limit for limit in limits], device=ends.device)
    closing = (ends[:, :k] | at_limit[:, None]) & torch.isfinite(top_scores[:, :k])
    if not bool(closing.any()):
        return
    rows = (first_row + top_beam)[:, :k]
    for b, c in closing.nonzero().tolist():
        if done[b]:
            continue
        hypothesis = prefix[rows[b, c], 1:].tolist() + [int(top_token[b, c])]
        finished[b].append((float(top_scores[b, c]) / penalty, hypothesis))
    for b in range(len(done)):
        done[b] = done[b] or len(finished[b]) >= k or length >= limits[b]
