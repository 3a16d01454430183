"""Is the MLM study's plateau (val ppl about 18 after 600 updates) the library's model, or the task at this scale?

Trains, on the same batches of the study's data module (n = 512, batch 2, byte-level MLM on the standard
library), two models of the same size (dim 128, depth 4, 4 heads, ff 512, no dropout, pre-LayerNorm):

- ``library``: ``attention_zoo.TransformerEncoder`` with full attention + a linear head (the study's model), in the
  library's initialisation (``attention_zoo.init``);
- ``reference``: ``torch.nn.TransformerEncoder`` (PyTorch's own attention and layers, norm_first) with learned
  token and position embeddings + a linear head: nothing of the library but the data.

Same optimiser and schedule as the study (AdamW, lr 1e-3, weight decay 0.01, linear warm-up then cosine to 0,
gradient clip 1.0). Prints validation perplexity (over the masked tokens of the first 16 validation batches) for
both at every ``--every`` updates, and the unigram perplexity of the labels as the no-context baseline.

    OMP_NUM_THREADS=1 python -m experiments.studies.mlm_independent_check --steps 600
    (output: results/linformer_paper/mlm_independent_check.txt)
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from attention_zoo import ModelConfig, TransformerEncoder
from attention_zoo.init import init_linear_
from tasks.data.mlm import MaskedLMDataModule

IGNORE = -100


class Reference(nn.Module):
    def __init__(self, vocab: int, dim: int, depth: int, heads: int, n: int, activation: str = "relu") -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(n, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, activation=activation, batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
        return self.norm(self.layers(x, src_key_padding_mask=~mask))


class Library(nn.Module):
    def __init__(self, vocab: int, dim: int, depth: int, heads: int, n: int) -> None:
        super().__init__()
        config = ModelConfig(vocab_size=vocab, max_seq_len=n, dim=dim, depth=depth, heads=heads, ff_mult=4, dropout=0.0)
        self.encoder = TransformerEncoder(config)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(tokens, mask)


def schedule(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--val_batches", type=int, default=16)
    parser.add_argument("--activation", default="relu", choices=["relu", "gelu"], help="reference FF (library: gelu)")
    parser.add_argument("--seed", type=int, default=0, help="seed of both models' initialisation (data: seed 0)")
    parser.add_argument("--models", default="both", choices=["both", "library"], help="library: skip the reference")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = MaskedLMDataModule(max_seq_len=args.n, batch_size=args.batch, seed=0)
    data.prepare_data()
    data.setup("fit")
    val = [b for _, b in zip(range(args.val_batches), data.val_dataloader(), strict=False)]
    labels = torch.cat([b["labels"][b["labels"] != IGNORE] for b in val])
    share = torch.bincount(labels, minlength=data.vocab_size).double() / len(labels)
    unigram = math.exp(-(share * share.clamp_min(1e-30).log()).sum().item())
    print(
        f"val masked tokens: {len(labels)}; unigram perplexity of the val labels (their own frequencies: "
        f"the best no-context predictor, optimistic): {unigram:.2f}"
    )

    models = {}
    for name, cls in (("library", Library), ("reference", Reference))[: 1 if args.models == "library" else 2]:
        torch.manual_seed(args.seed)
        extra = {"activation": args.activation} if cls is Reference else {}
        body = cls(data.vocab_size, 128, 4, 4, args.n, **extra)
        head = nn.Linear(128, data.num_classes)
        if cls is Library:
            init_linear_(head)
        params = list(body.parameters()) + list(head.parameters())
        optimiser = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        models[name] = (body, head, params, optimiser)

    def evaluate(body: nn.Module, head: nn.Module) -> float:
        body.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for b in val:
                logits = head(body(b["tokens"], b["mask"]))
                total += F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE,
                                         reduction="sum").item()  # fmt: skip
                count += int((b["labels"] != IGNORE).sum())
        body.train()
        return math.exp(total / count)

    started = time.perf_counter()
    loader = iter(data.train_dataloader())
    for step in range(args.steps):
        batch = next(loader)
        for body, head, params, optimiser in models.values():
            for group in optimiser.param_groups:
                group["lr"] = 1e-3 * schedule(step, args.warmup, args.steps)
            logits = head(body(batch["tokens"], batch["mask"]))
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
        if (step + 1) % args.every == 0:
            ppl = {name: evaluate(m[0], m[1]) for name, m in models.items()}
            print(f"step {step + 1}: val ppl " + ", ".join(f"{k} {v:.3f}" for k, v in ppl.items())
                  + f"  ({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
