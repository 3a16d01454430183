"""What ``zoo study approx`` measures: each approximation's output for one head, and its error.

For one head (q, k, v: (n, d), float64) the exact output is P V with P = softmax(q k^T / sqrt(d)) (Linformer
eq. 2, from :meth:`attention_zoo.full.FullAttention.attention_probs`). Two error measures:

- relative: ||out - P V||_F / ||P V||_F, the question "how close to softmax attention is it";
- lemma-normalised: the RMS over entries (i, j) of |out_ij - (P V)_ij| / (||P_i|| ||V_j||), P_i a row of P and
  V_j a column of V. This is the normalisation of the JL lemma the Linformer proofs rest on (eq. 12:
  |x R^T R y - x y| <= eps ||x|| ||y||) and of Theorem 2 (eq. 8: eps ||softmax(w)|| ||V||), so Theorem 1's
  construction has lemma-normalised error ~ 1/sqrt(k) whatever n. For diffuse attention and zero-mean V,
  ||P_i|| ||V_j|| is ~sqrt(n) times |P_i V_j|, which is why the relative error of the same construction grows
  like sqrt(n / k) (``tests/attention_zoo/test_linformer.py``).

Constructions that are not cores (they need P, so they are references, not mechanisms):

- ``svd``: P_k V with P_k the best rank-k approximation of P (Eckart-Young-Mirsky; Linformer eq. 6).
  ||P_k - P||_F <= ||P~ - P||_F for every rank-k P~, so it is the floor of the matrix error of any rank-k
  method; for the output it is the floor in expectation when V is isotropic and independent of P~ (Gaussian
  inputs), not for every V (with k >= d, P V V^+ has rank d and reproduces P V exactly).
  P_k = P W_k W_k^T with W_k the top-k eigenvectors of P^T P (its right singular vectors).
- ``jl``: P R^T R V with R in R^{k x n}, i.i.d. N(0, 1/k): Theorem 1's P~ (eqs. 5, 16).

Linformer with fixed projections, both eq. 7 through the ``linformer`` core with ``projection="random"``:
``linformer-random`` is the library's option, E = F = R; ``linformer-theorem2`` is the construction in the
proof of Theorem 2 (Appendix B): E = delta R, F = e^{-delta} R with a small delta = Theta(1/n), here 1/n. With
delta -> 0, softmax(x E^T) tends to the uniform distribution over the k slots, whatever x.

Mechanisms are the registered cores, built for one head in float64 with their budget option set. A core
whose exact limit is not softmax attention over (q, k) says so with ``reference``: LSH attends with shared
QK (keys = queries, normalised) and never to itself when it has another key, so it is compared with its own
exact limit, one bucket and one chunk (``n_buckets=1, chunk_size=n``), on the same (q, q, v).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from attention_zoo import MultiHeadAttention, attention_options, create_attention, get_attention_class, list_attentions
from attention_zoo.core import AttentionCore

K_BUDGETS = (16, 32, 64, 128, 256, 512, 1024)
LANDMARKS = (8, 16, 32, 64, 128, 256, 512)


def lsh_exact(n: int) -> dict[str, Any]:
    """LSH's exact limit at length n: one bucket, one chunk (shared-QK attention with the self-mask)."""
    return {"n_hashes": 1, "n_buckets": 1, "chunk_size": n}


@dataclass(frozen=True)
class Method:
    """One curve: ``attention`` (a registered core, or None for ``svd`` / ``jl``) with ``knob`` set to each
    of ``budgets`` up to ``limit(n)``, the other options ``fixed``; ``reference(n)`` gives the options under
    which the same core is exact, when its exact limit is not softmax attention."""

    name: str
    attention: str | None
    knob: str
    budgets: tuple[int, ...]
    fixed: dict[str, Any] = field(default_factory=dict)
    limit: Callable[[int], int] = lambda n: n
    reference: Callable[[int], dict[str, Any]] | None = None
    #: changes the built core before it runs (e.g. scales its fixed matrices), given the length n
    adjust: Callable[[AttentionCore, int], None] | None = None

    def budgets_at(self, n: int) -> list[int]:
        return [b for b in self.budgets if b <= self.limit(n)]


def theorem2_scaling(core: AttentionCore, n: int) -> None:
    """E = delta R and F = e^{-delta} R with one R (Theorem 2's proof), delta = 1/n."""
    delta = 1.0 / n
    with torch.no_grad():
        draw = core.key_projection.weight.clone()
        core.key_projection.weight.copy_(delta * draw)
        core.value_projection.weight.copy_(math.exp(-delta) * draw)


#: the budget knob of each mechanism; every other registered core is measured at its defaults
METHODS: tuple[Method, ...] = (
    Method("svd", None, "k", K_BUDGETS, limit=lambda n: n - 1),
    Method("jl", None, "k", K_BUDGETS),
    Method("linformer-random", "linformer", "k", K_BUDGETS, {"projection": "random", "sharing": "kv"}),
    Method(
        "linformer-theorem2", "linformer", "k", K_BUDGETS, {"projection": "random", "sharing": "headwise"},
        adjust=theorem2_scaling,
    ),
    Method("nystrom", "nystrom", "num_landmarks", LANDMARKS),
    Method("nystrom-exact-pinv", "nystrom", "num_landmarks", LANDMARKS, {"pinv": "exact"}),
    Method(
        "nystrom-pinv-iterations", "nystrom", "pinv_iterations", (1, 2, 3, 4, 6, 8, 12, 20), {"num_landmarks": 64},
        limit=lambda n: 20 if n >= 64 else 0,
    ),  # fmt: skip
    Method("performer", "performer", "nb_features", (16, 32, 64, 128, 256, 512, 1024)),
    Method("lsh-hashes", "lsh", "n_hashes", (1, 2, 4, 8), {"bucket_size": 64}, lambda n: 8, lsh_exact),
    Method(
        "lsh-bucket-size", "lsh", "bucket_size", (16, 32, 64, 128, 256, 512), {"n_hashes": 4}, lambda n: n // 2,
        lsh_exact,
    ),
    Method("local", "local", "window", (16, 32, 64, 128, 256, 512, 1024, 2048), limit=lambda n: 2 * n),
    Method("moba", "moba", "top_k", (0, 1, 2, 4, 8, 16, 32), {"block_size": 64}, lambda n: n // 64 - 1),
)  # fmt: skip
DEFAULTS_KNOB = "defaults"


def methods(selected: list[str] | None = None) -> tuple[list[Method], list[str]]:
    """The methods to run (the table's, then every other registered core except ``full`` at its defaults),
    restricted to ``selected`` if given: a method's name selects it, any other name every method of that
    attention (``nystrom`` is one method, ``lsh`` both LSH curves); and the reasons for those left out."""
    registered = set(list_attentions())
    chosen, left_out = [], []
    covered = {m.attention for m in METHODS}
    defaults = [Method(name, name, DEFAULTS_KNOB, (0,)) for name in sorted(registered - covered - {"full"})]
    every = (*METHODS, *defaults)
    names = {m.name for m in every}
    by_attention = set(selected or []) - names
    unknown = sorted(by_attention - {m.attention for m in every})
    left_out += [f"{name}: no method or attention of that name" for name in unknown]
    for method in every:
        if selected and method.name not in selected and method.attention not in by_attention:
            continue
        if method.attention is not None and method.attention not in registered:
            left_out.append(f"{method.name}: attention {method.attention!r} is not registered here")
            continue
        chosen.append(method)
    return chosen, left_out


def build_core(
    attention: str, options: dict[str, Any], *, dim_head: int, n: int, seed: int, seed_option: bool = True
) -> AttentionCore:
    """One head of ``attention`` in float64, eval mode; ``seed`` seeds torch's global generator (which e.g.
    Linformer's random R is drawn from) and, with ``seed_option``, the core's own ``seed`` option where it
    has one (Performer's features, LSH's rotations), so each sample gets its own draw."""
    cls = get_attention_class(attention)
    if seed_option and "seed" in {spec.name for spec in attention_options(cls)}:
        options = {"seed": seed} | options
    torch.manual_seed(seed)
    core = create_attention(attention, dim_head=dim_head, heads=1, max_seq_len=n, **options)
    return core.to(torch.float64).eval()


def run_core(core: AttentionCore, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``core`` on one head's (n, d) tensors; cores with shared QK get the queries as keys."""
    q4, k4, v4 = (t[None, None] for t in (q, k, v))
    if core.needs_shared_qk:
        k4 = q4
    with torch.no_grad():
        return core(q4, k4, v4)[0, 0]


class Head:
    """One head's q, k, v (n, d) in float64 and what several methods share: P, P V, the SVD basis of P."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, index: int) -> None:
        self.q, self.k, self.v = (t.double() for t in (q, k, v))
        self.index = index
        self.n, self.dim_head = q.shape
        self.references: dict[tuple, Tensor] = {}

    @cached_property
    def probs(self) -> Tensor:
        """P = softmax(q k^T / sqrt(d)) from the ``full`` core's ``math`` path, (n, n)."""
        core = create_attention("full", dim_head=self.dim_head, heads=1, backend="math")
        return core.attention_probs(self.q[None, None], self.k[None, None])[0, 0]

    @cached_property
    def exact(self) -> Tensor:
        return self.probs @ self.v

    @cached_property
    def right_singular_vectors(self) -> Tensor:
        """Right singular vectors of P, by decreasing singular value: eigenvectors of P^T P, (n, n)."""
        _, vectors = torch.linalg.eigh(self.probs.mT @ self.probs)
        return vectors.flip(-1)

    def low_rank(self, rank: int) -> Tensor:
        """P_k V with P_k = P W_k W_k^T the best rank-k approximation of P."""
        basis = self.right_singular_vectors[:, :rank]
        return (self.probs @ basis) @ (basis.mT @ self.v)

    def reference(self, method: Method) -> Tensor:
        """What ``method`` is compared with: P V, or its core's own exact limit on this head."""
        if method.reference is None:
            return self.exact
        options = method.reference(self.n)
        key = (method.attention, tuple(sorted(options.items())))
        if key not in self.references:
            core = build_core(method.attention, options, dim_head=self.dim_head, n=self.n, seed=0)
            self.references[key] = run_core(core, self.q, self.k, self.v)
        return self.references[key]

    def errors(self, out: Tensor, method: Method) -> tuple[float, float | None]:
        """(relative, lemma-normalised) error of ``out``; the second only against softmax attention."""
        reference = self.reference(method)
        difference = out - reference
        relative = (difference.norm() / reference.norm()).item()
        if method.reference is not None:
            return relative, None
        scale = self.probs.norm(dim=1, keepdim=True) * self.v.norm(dim=0, keepdim=True)
        return relative, (difference / scale).pow(2).mean().sqrt().item()


def jl_output(head: Head, k: int, seed: int) -> Tensor:
    """Theorem 1's P R^T R V, R ~ N(0, 1/k) of shape (k, n)."""
    generator = torch.Generator().manual_seed(seed)
    projection = torch.randn(k, head.n, generator=generator, dtype=torch.float64) / math.sqrt(k)
    return (head.probs @ projection.mT) @ (projection @ head.v)


def method_output(method: Method, budget: int, head: Head, seed: int) -> Tensor:
    """The output of ``method`` at ``budget`` on ``head``."""
    if method.name == "svd":
        return head.low_rank(budget)
    if method.name == "jl":
        return jl_output(head, budget, seed)
    if method.knob == DEFAULTS_KNOB:  # as registered: not even a seed is set (some patterns refuse one)
        core = build_core(method.attention, {}, dim_head=head.dim_head, n=head.n, seed=seed, seed_option=False)
    else:
        options = method.fixed | {method.knob: budget}
        core = build_core(method.attention, options, dim_head=head.dim_head, n=head.n, seed=seed)
        if method.adjust is not None:
            method.adjust(core, head.n)
    return run_core(core, head.q, head.k, head.v)


# ---- Linformer with learned projections --------------------------------------------------------------------


class LearnedProjections:
    """The E_i, F_i (k x n) of every layer and head of a trained Linformer model, applied one head at a time
    by a fresh ``linformer`` core (so the study runs the library's eq. 7, with the checkpoint's matrices)."""

    def __init__(self, encoder: torch.nn.Module, label: str) -> None:
        self.label = label
        self.cores = [m.core for m in encoder.modules() if isinstance(m, MultiHeadAttention)]
        first = self.cores[0]
        if first.name != "linformer" or first.projection != "linear":
            raise ValueError(
                f"{label}: learned projections need a linformer model with projection='linear', got "
                f"{first.name!r}" + (f" with projection={first.projection!r}" if first.name == "linformer" else "")
            )
        self.k, self.n, self.sharing = first.k, first.max_seq_len, first.sharing
        if any(core.k != self.k for core in self.cores):
            raise ValueError(f"{label}: per-layer k {[c.k for c in self.cores]} is not supported here")

    @property
    def method(self) -> Method:
        suffix = "" if self.sharing == "headwise" else f"-{self.sharing}"
        return Method(f"linformer-learned{suffix}", "linformer", "k", (self.k,))

    def matrices(self, layer: int, head: int) -> tuple[Tensor, Tensor]:
        """(E, F) of ``layer`` and ``head``, each (k, n)."""
        core = self.cores[layer]
        pick = lambda w: (w[head] if w.ndim == 3 else w).detach()
        return pick(core.key_projection.weight), pick(core.value_projection.weight)

    def output(self, head: Head, layer: int, head_index: int) -> Tensor:
        if head.n > self.n:
            raise ValueError(f"{self.label}: E, F cover n <= {self.n}, the input has n = {head.n}")
        key, value = self.matrices(layer, head_index)
        core = create_attention("linformer", dim_head=head.dim_head, heads=1, max_seq_len=self.n, k=self.k)
        core = core.to(torch.float64).eval()
        with torch.no_grad():
            core.key_projection.weight.copy_(key)
            core.value_projection.weight.copy_(value)
        return run_core(core, head.q, head.k, head.v)
