"""The MQAR pilots of README.md, as they were run: the library's encoder, init and MQAR generator in a plain torch
loop (AdamW, linear warm-up then cosine, gradient clipping at 1, as ``zoo fit``), validation accuracy every
``--eval`` steps on 512 held-out sequences. ``--conv K`` adds a causal depthwise convolution of kernel K to the
embeddings before the first layer: the pilot form of ``--model.short_convolution K``
(``attention_zoo/short_convolution.py``, which also zeroes padding; these sequences have none).

    python results/mqar_pilots/mqar_pilot.py --n 64 --pairs 8 --vocab 128 --conv 3 --steps 1000
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F

from attention_zoo.config import ModelConfig
from attention_zoo.init import init_linear_
from attention_zoo.spec import AttentionSpec
from attention_zoo.transformer import TransformerEncoder
from tasks.data.recall import generate_mqar

#: every option and its default; the type is the default's (a string default takes any string)
OPTIONS = dict(
    n=128, pairs=8, vocab=128, power_a=1.0, placement="random", dim=64, depth=2, heads=2, lr=3e-3, wd=0.01,
    batch=32, steps=1000, warmup=50, eval=100, pos="learned", causal=0, attn="full", opts="", emb_std=0.0, seed=0,
    ff=2, train=40000, sched="cosine", conv=0
)  # fmt: skip
p = argparse.ArgumentParser()
for name, default in OPTIONS.items():
    p.add_argument(f"--{name}", type=type(default), default=default)
a = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(a.seed)
X, Y = generate_mqar(
    a.train, seq_len=a.n, num_kv_pairs=a.pairs, vocab_size=a.vocab, power_a=a.power_a, seed=1, kv_placement=a.placement
)
Xv, Yv = generate_mqar(
    512, seq_len=a.n, num_kv_pairs=a.pairs, vocab_size=a.vocab, power_a=a.power_a, seed=2, kv_placement=a.placement
)
attention = AttentionSpec.parse(f"{a.attn}:{a.opts}" if a.opts else a.attn)  # --opts: "k=v,k=v", typed as --attentions
config = ModelConfig(
    vocab_size=a.vocab, max_seq_len=a.n, dim=a.dim, depth=a.depth, heads=a.heads, ff_mult=a.ff, positional=a.pos,
    attention=attention,
)  # fmt: skip
enc = TransformerEncoder(config, causal=bool(a.causal))
head = torch.nn.Linear(a.dim, a.vocab)
init_linear_(head)
if a.conv:
    conv = torch.nn.Conv1d(a.dim, a.dim, a.conv, groups=a.dim, padding=a.conv - 1)
    head.conv = conv
    embed0 = enc.embed

    def embed(tokens, start=0):
        x = embed0(tokens, start)
        return x + conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)

    enc.embed = embed
if a.emb_std:
    torch.nn.init.normal_(enc.token_embedding.weight, std=a.emb_std / math.sqrt(a.dim))
params = list(enc.parameters()) + list(head.parameters())
decay = [q for q in params if q.ndim > 1]
nod = [q for q in params if q.ndim <= 1]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": nod, "weight_decay": 0}], lr=a.lr)


def lr_at(s):
    if s < a.warmup:
        return (s + 1) / a.warmup
    if a.sched == "constant":
        return 1.0
    return 0.5 * (1 + math.cos(math.pi * (s - a.warmup) / max(1, a.steps - a.warmup)))


sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
g = torch.Generator().manual_seed(a.seed)


def evaluate():
    enc.eval()
    c = t = 0
    with torch.no_grad():
        for i in range(0, len(Xv), 128):
            lo = head(enc(Xv[i : i + 128]))
            y = Yv[i : i + 128]
            m = y != -100
            c += (lo.argmax(-1)[m] == y[m]).sum().item()
            t += m.sum().item()
    enc.train()
    return c / t


t0 = time.time()
out = []
perm = torch.randperm(len(X), generator=g)
pos = 0
for s in range(a.steps):
    if pos + a.batch > len(X):
        perm = torch.randperm(len(X), generator=g)
        pos = 0
    idx = perm[pos : pos + a.batch]
    pos += a.batch
    lo = head(enc(X[idx]))
    loss = F.cross_entropy(lo.flatten(0, 1), Y[idx].flatten(), ignore_index=-100)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    if (s + 1) % a.eval == 0:
        out.append(f"{s + 1}:{evaluate():.3f}")
        print(" ".join(out), f"loss={loss.item():.3f} t={time.time() - t0:.0f}s", flush=True)
print("FINAL", vars(a), out[-1], f"{time.time() - t0:.0f}s", flush=True)
