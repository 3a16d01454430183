"""Drop-in swap of zoo mechanisms into a trained Hugging Face GPT-2, without and with brief fine-tuning.

Trains a tiny GPT-2 (transformers' ``GPT2LMHeadModel``: 2 layers, dim 128, 4 heads, 256 positions) as a
byte-level causal LM on the Python standard library's sources with ``full`` attention (``use_attention``), then
for every causal-capable mechanism: swaps it in with :func:`attention_zoo.integrations.transformers.use_attention`
and measures the held-out loss as is, fine-tunes every weight (zoo parameters included) for a few steps and
measures again. ``full`` gets the same fine-tuning, as the control. Last, the greedy generation time with
transformers' KV cache (64 new tokens after 192) per mechanism.

Resumable: the trained base model and every finished mechanism are kept in ``--work_dir``; a rerun skips them.
Results: ``results.json`` and ``results.md`` in ``--out``.

    OMP_NUM_THREADS=1 python results/hf_dropin/run.py
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import attention_zoo as az
from attention_zoo.integrations.transformers import use_attention
from experiments.machine_paths import shown_path
from tasks.data.mlm import default_corpus_dir, list_corpus_files, split_stream

SEQ_LEN, VOCAB = 256, 256  # bytes
#: (row label, registry name, options): sized for n = 256, so that every approximation engages
MECHANISMS: list[tuple[str, str, dict[str, Any]]] = [
    ("full", "full", {}),
    ("linear", "linear", {}),
    ("performer (m = 64)", "performer", {"nb_features": 64}),
    ("cosformer", "cosformer", {}),
    ("local (w = 64)", "local", {"window": 64}),
    ("longformer (w = 64, 4 global)", "longformer", {"window": 64, "global_tokens": 4}),
    ("sparse strided (stride 16)", "sparse", {"pattern": "strided", "stride": 16}),
    ("bigbird (block 16)", "bigbird", {"block_size": 16, "window_blocks": 3, "random_blocks": 2}),
    ("moba (block 32, top-k 2)", "moba", {"block_size": 32, "top_k": 2}),
    ("linformer -> linformer_causal (block 64, k_c 16)", "linformer", {"k": 64}),
]
DECODER_OPTIONS = {"linformer": {"block_size": 64, "block_k": 16}}


def corpus(max_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    """Byte streams (uint8 as long) of the train and val parts of the standard library's ``*.py`` files."""
    files = list_corpus_files(default_corpus_dir(), "*.py")
    random.Random(seed).shuffle(files)
    documents, size = [], 0
    for path in files:
        if size >= max_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        documents.append(text)
        size += len(text)
    parts = split_stream(documents, {"train": 0.95, "val": 0.05, "test": 0.0})
    return {split: torch.tensor(list("".join(parts[split]).encode("utf-8")), dtype=torch.long) for split in parts}


def build_model() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=128, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def train(model: GPT2LMHeadModel, stream: torch.Tensor, steps: int, lr: float, batch: int, seed: int) -> list[float]:
    """AdamW (weight decay 0.01), linear warm-up over 5 % of the steps then cosine decay to 10 %, clip 1.0."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - SEQ_LEN, (batch,), generator=generator)
        ids = torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def held_out_loss(model: GPT2LMHeadModel, stream: torch.Tensor, sequences: int) -> float:
    """Mean next-byte cross-entropy (nats) over ``sequences`` evenly spaced windows of the val stream."""
    model.eval()
    starts = torch.linspace(0, len(stream) - SEQ_LEN - 1, sequences).long().tolist()
    ids = torch.stack([stream[s : s + SEQ_LEN] for s in starts])
    return sum(model(input_ids=chunk, labels=chunk).loss.item() for chunk in ids.split(16)) / len(ids.split(16))


@torch.no_grad()
def generation_seconds(model: GPT2LMHeadModel, stream: torch.Tensor) -> float:
    prompt = stream[:192][None]
    start = time.perf_counter()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--work_dir", type=Path, default=Path("runs/hf_dropin"))
    parser.add_argument("--pretrain_steps", type=int, default=1000)
    parser.add_argument("--pretrain_lr", type=float, default=2e-3)
    parser.add_argument("--finetune_steps", type=int, default=200)
    parser.add_argument("--finetune_lr", type=float, default=3e-4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--val_sequences", type=int, default=64)
    parser.add_argument("--max_bytes", type=int, default=4_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data = corpus(args.max_bytes, args.seed)
    print(f"corpus: {len(data['train']):,} train bytes, {len(data['val']):,} val bytes", flush=True)

    base_path, results_path = args.work_dir / "base.pt", args.work_dir / "results.json"
    torch.manual_seed(args.seed)
    base = use_attention(build_model(), "full")
    if base_path.exists():
        base.load_state_dict(torch.load(base_path, weights_only=True))
    else:
        t0 = time.perf_counter()
        losses = train(base, data["train"], args.pretrain_steps, args.pretrain_lr, args.batch, args.seed)
        torch.save(base.state_dict(), base_path)
        print(f"pretrained {args.pretrain_steps} steps in {time.perf_counter() - t0:.0f} s, mean train loss of the "
              f"last 50 steps {sum(losses[-50:]) / len(losses[-50:]):.3f}", flush=True)  # fmt: skip
    weights = {k: v for k, v in base.state_dict().items() if "zoo_core" not in k}
    base_loss = held_out_loss(base, data["val"], args.val_sequences)
    print(f"base (full): held-out loss {base_loss:.4f}", flush=True)

    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() else {}
    for label, name, options in MECHANISMS:
        if label in results:
            continue
        t0 = time.perf_counter()
        torch.manual_seed(args.seed)  # the same fresh zoo parameters (E/F, features) on every run
        model = build_model()
        model.load_state_dict(weights, strict=False)
        model.eval()
        use_attention(model, name, decoder_options=DECODER_OPTIONS.get(name), **options)
        core = model.transformer.h[0].attn.zoo_core
        swapped = held_out_loss(model, data["val"], args.val_sequences)
        train(model, data["train"], args.finetune_steps, args.finetune_lr, args.batch, args.seed + 1)
        tuned = held_out_loss(model, data["val"], args.val_sequences)
        results[label] = {
            "core": core.name,
            "options": options,
            "decoder_options": DECODER_OPTIONS.get(name),
            "zoo_parameters": sum(p.numel() for n, p in model.named_parameters() if "zoo_core" in n),
            "swapped_loss": swapped,
            "finetuned_loss": tuned,
            "generate_64_s": generation_seconds(model, data["val"]),
            "seconds": time.perf_counter() - t0,
        }
        results_path.write_text(json.dumps(results, indent=1))
        print(f"{label}: swapped {swapped:.4f} ({swapped - base_loss:+.4f}), fine-tuned {tuned:.4f} "
              f"({tuned - base_loss:+.4f}) [{time.perf_counter() - t0:.0f} s]", flush=True)  # fmt: skip

    arguments = {k: shown_path(str(v)) if isinstance(v, Path) else str(v) for k, v in vars(args).items()}
    summary = {"base_loss": base_loss, "args": arguments, "mechanisms": results}
    summary["torch"], summary["attention_zoo_mechanisms"] = torch.__version__, az.list_attentions()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    (args.out / "results.md").write_text(table(base_loss, results, args))
    print(f"wall time of this invocation: {time.perf_counter() - started:.0f} s")


def table(base_loss: float, results: dict[str, Any], args: argparse.Namespace) -> str:
    control = results.get("full", {}).get("finetuned_loss", base_loss)
    lines = [
        f"Held-out loss (nats per byte) of the trained GPT-2, base {base_loss:.4f} with full attention; fine-tuning: "
        f"{args.finetune_steps} steps, AdamW lr {args.finetune_lr} (warm-up + cosine), batch {args.batch} x {SEQ_LEN}.",
        "",
        "| mechanism (core run) | zoo params | swapped, no training | change | fine-tuned | change vs full fine-tuned "
        "| generate 64 tokens (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r['zoo_parameters']:,} | {r['swapped_loss']:.4f} | {r['swapped_loss'] - base_loss:+.4f} "
            f"| {r['finetuned_loss']:.4f} | {r['finetuned_loss'] - control:+.4f} | {r['generate_64_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
